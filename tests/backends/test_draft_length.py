"""How long a draft the batcher decodes: the length that yields the most tokens per second by the sequence's
acceptance and what steps of each size measured on this machine, from the step planner's times."""

from __future__ import annotations

import pytest

from lemonkit.backends.llamacpp.drafts import Pacer, SpecSettings, draft_length, expected
from lemonkit.backends.llamacpp.step_costs import StepCosts

#: a step's time by its rows, as ratios of one row's: Gemma 3 270M on 2 threads, measured on two machines
XEON_AMX = {1: 1.0, 2: 1.17, 3: 1.38, 4: 1.55, 5: 2.29, 6: 2.45, 8: 2.31, 12: 2.95, 16: 3.63, 24: 5.16, 32: 6.66}
EPYC_AVX2 = {1: 1.0, 2: 2.0, 4: 4.0, 8: 8.0, 16: 16.0}
#: an EPYC with AVX-512 (VNNI, BF16), measured in-process: 2 to 4 rows cost alike, 8 less than 5
EPYC_AVX512 = {1: 1.0, 2: 2.38, 3: 2.4, 4: 2.49, 5: 5.02, 6: 4.99, 8: 4.36, 12: 4.78, 16: 6.2, 24: 8.22, 32: 11.3}


def _curve(ratios: dict[int, float], upto: int = 64) -> list[float | None]:
    costs = StepCosts(2)
    for rows, ratio in ratios.items():
        for _ in range(3):
            costs.price(rows, ratio * 0.02)
    return costs.curve(upto)


def _rate(acceptance: float, k: int, rows: int, tokens: float, cost: list[float | None]) -> float:
    seconds = cost[rows + k]
    assert seconds is not None
    return (tokens + expected(acceptance, k)) / seconds


@pytest.mark.parametrize("acceptance", [0.3, 0.77, 0.95, 0.999])
def test_the_length_chosen_yields_the_most_tokens_per_second(acceptance: float) -> None:
    cost = _curve(XEON_AMX)
    k = draft_length(acceptance, 40, 1, 1.0, cost)
    assert all(_rate(acceptance, k, 1, 1.0, cost) >= _rate(acceptance, j, 1, 1.0, cost) for j in range(41))


def test_where_rows_cost_their_share_no_draft_pays() -> None:
    cost = _curve(EPYC_AVX2)
    for acceptance in (0.5, 0.9, 0.99):
        assert draft_length(acceptance, 16, 1, 1.0, cost) == 0


def test_cheap_rows_buy_longer_drafts_as_acceptance_rises() -> None:
    cost = _curve(XEON_AMX)
    lengths = [draft_length(a, 40, 1, 1.0, cost) for a in (0.2, 0.5, 0.77, 0.95, 0.999)]
    assert lengths == sorted(lengths) and lengths[0] <= 1 and lengths[-1] >= 16, lengths
    assert draft_length(0.77, 40, 1, 1.0, cost) in (3, 4)  # 5 and 6 rows cost more than 8 here: never 4 or 5
    assert draft_length(0.95, 40, 1, 1.0, cost) not in (4, 5)


def test_rows_already_in_the_step_and_a_draft_models_own_time_shorten_the_draft() -> None:
    cost = _curve(XEON_AMX)
    alone = draft_length(0.9, 16, 1, 1.0, cost)
    assert draft_length(0.9, 16, 8, 8.0, cost) < alone  # beside 7 other streams, rows are dearer
    assert draft_length(0.9, 16, 1, 1.0, cost, per_token=0.01) < alone
    assert draft_length(0.9, 16, 1, 1.0, cost, per_token=0.05) == 0


def test_before_any_step_was_measured_a_draft_at_most_doubles_the_step() -> None:
    assert draft_length(0.5, 12, 1, 1.0, StepCosts(2).curve(64)) == 1
    assert draft_length(0.5, 12, 8, 8.0, StepCosts(2).curve(64)) == 8
    assert draft_length(0.5, 12, 60, 60.0, StepCosts(2).curve(64)) == 4  # the rows the batch has left


@pytest.mark.parametrize(
    ("ratios", "acceptance", "within"),
    [
        (XEON_AMX, 0.9, 0.97),
        (XEON_AMX, 0.6, 0.97),
        (EPYC_AVX2, 0.9, 0.97),
        # its 12 rows cost less than the line from 8 to 16 says, and no draft length lands there to measure them
        (EPYC_AVX512, 0.9, 0.9),
        (EPYC_AVX512, 0.999, 0.95),
    ],
)
def test_drafts_explore_from_one_row_and_settle_on_the_best_length(
    ratios: dict[int, float], acceptance: float, within: float
) -> None:
    """From one-row steps only, the first draft at most doubles the step; each step's decode is priced, drafts grow
    one doubling at a time while that pays, and the length chosen settles where the machine's true costs yield the
    most tokens per second, less what pricing the sizes between measured ones on a line misses."""
    true = _curve(ratios, 128)
    costs = StepCosts(2)
    for _ in range(3):
        costs.price(1, true[1] or 0.0)
    assert draft_length(acceptance, 40, 1, 1.0, costs.curve(64)) <= 1
    chosen = []
    for _ in range(40):
        k = draft_length(acceptance, 40, 1, 1.0, costs.curve(64))
        chosen.append(k)
        costs.price(1 + k, true[1 + k] or 0.0)
    best = max(_rate(acceptance, j, 1, 1.0, true) for j in range(41))
    assert _rate(acceptance, chosen[-1], 1, 1.0, true) >= within * best, chosen


def test_the_curve_interpolates_and_prices_untried_sizes_low() -> None:
    costs = StepCosts(2)
    assert costs.curve(4) == [None] * 5
    costs.price(2, 0.010)
    # below: per row; above, with one point: its time up to twice its rows, then its time per row more each
    assert costs.curve(8) == pytest.approx([None, 0.005, 0.010, 0.010, 0.010, 0.015, 0.020, 0.025, 0.030])
    costs.price(2, 0.012)
    costs.price(2, 0.011)  # three decodes: the median
    for _ in range(3):
        costs.price(6, 0.030)
    curve = costs.curve(8)
    assert curve[2] == 0.011 and curve[4] == pytest.approx(0.0205) and curve[6] == 0.030
    assert curve[8] == 0.030  # up to twice the largest point: its time
    assert costs.curve(16)[14] == pytest.approx(0.030 + 2 * (0.030 - 0.011) / 4)  # then the average row's cost
    costs.price(4, 0.090)  # once, and slow (a decode that reallocated its buffers): the line wins until measured
    assert costs.curve(8)[4] == pytest.approx(0.0205)
    costs.price(5, 0.012)  # once, and fast: tried until measured
    assert costs.curve(8)[5] == 0.012
    for seconds in (0.050, 0.060):
        costs.price(5, seconds)
    assert costs.curve(8)[5] == 0.050


#: SmolLM2 135M Instruct on a Xeon (2 threads): every row costs about the same, 4 ms beside one row's 11.2
SMOLLM2 = {n: 0.0112 + 0.004 * (n - 1) for n in range(1, 13)}


@pytest.mark.parametrize("acceptance", [0.3, 0.47, 0.7, 0.9, 0.999])
def test_past_the_sizes_measured_rows_are_tried_one_doubling_at_a_time(acceptance: float) -> None:
    """Steps of up to 12 rows measured, drafts may reach 48: a size past 24 rows is never drafted before 24 was
    measured, and after at most three steps that try a longer draft (24, 48, 49 rows) the choice is the best there
    is."""
    costs = StepCosts(2)
    for rows, seconds in SMOLLM2.items():
        for _ in range(3):
            costs.price(rows, seconds)
    true = [None, *(0.0112 + 0.004 * (n - 1) for n in range(1, 65))]
    best = max(_rate(acceptance, j, 1, 1.0, true) for j in range(49))
    tried = 0
    for _ in range(8):
        k = draft_length(acceptance, 48, 1, 1.0, costs.curve(64))
        assert 1 + k <= 2 * max(costs._decoded)
        if 1 + k not in costs._decoded:
            tried += 1
        costs.price(1 + k, true[1 + k] or 0.0)
    assert tried <= 3 and _rate(acceptance, k, 1, 1.0, true) >= 0.97 * best, (tried, k)


def test_acceptance_follows_recent_drafts_and_fades_back_when_drafts_are_skipped() -> None:
    pacer = Pacer(SpecSettings(("ngram-simple",)))
    assert pacer.acceptance == 0.5
    for _ in range(6):
        pacer.record(8, 8)
    high = pacer.acceptance
    assert high > 0.9
    pacer.record(8, 0)
    assert pacer.acceptance < high
    for _ in range(9):
        pacer.record(4, 0)
    low = pacer.acceptance
    assert low < 0.5  # ten failures in a row outweigh the 48 tokens accepted before them: those are older
    cost = _curve(XEON_AMX)
    assert draft_length(low, 16, 1, 1.0, cost) < draft_length(high, 16, 1, 1.0, cost)
    for _ in range(8):
        pacer.skipped(0.5)
    assert low < pacer.acceptance < 0.5
    pacer.reset()
    assert pacer.acceptance == 0.5


def test_a_sequence_that_stopped_drafting_drafts_again_where_drafts_pay_only_above_even_odds() -> None:
    """On the EPYC a draft pays only at an acceptance of about 0.7 or more. A sequence whose drafts failed, while the
    model's drafts lately were accepted 85% of the time, fades back towards the model's acceptance as it skips drafts,
    and drafts again within a few dozen steps; fading towards even odds it never would."""
    cost = _curve(EPYC_AVX512)
    assert draft_length(0.6, 32, 1, 1.0, cost) == 0 < draft_length(0.85, 32, 1, 1.0, cost)
    for towards, drafts_again in ((0.85, True), (0.5, False)):
        pacer = Pacer(SpecSettings(("ngram-mod",)))
        pacer.reset(0.85)
        for _ in range(3):
            pacer.record(6, 0)
        assert draft_length(pacer.acceptance, 32, 1, 1.0, cost) == 0
        for _ in range(64):
            if draft_length(pacer.acceptance, 32, 1, 1.0, cost) > 0:
                break
            pacer.skipped(towards)
        assert (draft_length(pacer.acceptance, 32, 1, 1.0, cost) > 0) is drafts_again, towards


def test_a_draft_models_confidence_is_its_pick_among_its_ten_best() -> None:
    """llama-server's draft sampler keeps the top 10 before the softmax that --spec-draft-p-min bounds: a long tail of
    unlikely tokens does not lower the confidence in a pick that leads its ten best."""
    import numpy as np

    from lemonkit.backends.llamacpp.draft_model import greedy_pick

    logits = np.full(50_000, -2.0, dtype=np.float32)  # a long tail, together about as likely as the pick
    logits[:10] = [5.0, 3.0, *([1.0] * 8)]
    token, p = greedy_pick(np, logits)
    top = np.exp(logits[:10] - 5.0)
    assert token == 0 and p == pytest.approx(1 / float(top.sum()), rel=1e-6)
    assert p > 0.75 > 1 / float(np.exp(logits - 5.0).sum())  # over the whole row it would stop the draft
    short = greedy_pick(np, logits[1:5])  # fewer than ten: all of them
    assert short[0] == 0 and short[1] == pytest.approx(1 / float(np.exp(logits[1:5] - 3.0).sum()), rel=1e-6)
