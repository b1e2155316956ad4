"""The batcher's step planner: a generation step takes fewer threads, or several decodes, only when that measured
faster."""

from __future__ import annotations

import itertools

from lemonkit.backends.llamacpp.step_costs import Step, StepCosts


def _seen(costs: StepCosts, step: Step, ms: float, times: int = 3) -> None:
    for _ in range(times):
        costs.record(step, ms / 1000)


def _run(costs: StepCosts, rows: int, ms: dict[Step, float], steps: int) -> list[Step]:
    """``steps`` steps planned and recorded at the times ``ms`` gives each plan."""
    plans = []
    for _ in range(steps):
        step = costs.plan(rows)
        costs.record(step, ms[step] / 1000)
        plans.append(step)
    return plans


def _gaps(plans: list[Step], step: Step) -> list[int]:
    at = [i for i, planned in enumerate(plans) if planned == step]
    return [b - a for a, b in itertools.pairwise(at)]


def test_a_step_is_decoded_whole_until_its_parts_measured_faster() -> None:
    costs = StepCosts(recheck=8)
    ms = {Step(1, (2,)): 22.0, Step(1, (1, 1)): 19.0}
    assert _run(costs, 2, ms, 6) == [Step(1, (2,))] * 6  # one-row steps not measured yet: nothing to split by
    _seen(costs, Step(1, (1,)), 10.0)
    plans = _run(costs, 2, ms, 43)
    assert plans[:3] == [Step(1, (1, 1))] * 3  # 2 x 10 ms < 22 ms: tried
    assert plans[3:].count(Step(1, (2,))) == 4  # the split kept, the whole step rechecked
    assert _gaps(plans, Step(1, (2,))) == [10, 10, 10]  # every 8 steps x 22/19

    # the split measured slower in practice (each decode carries its own sampling): back to one decode
    ms[Step(1, (1, 1))] = 25.0
    plans = _run(costs, 2, ms, 64)
    assert plans[-32:].count(Step(1, (2,))) >= 28


def test_only_splits_that_beat_the_whole_step_by_the_margin_are_tried() -> None:
    costs = StepCosts()
    _seen(costs, Step(1, (1,)), 10.0)
    _seen(costs, Step(1, (2,)), 22.0)
    _seen(costs, Step(1, (3,)), 28.5)  # 1+1+1 = 30, 1+2 = 32: none below 28.5
    assert costs.plan(3) == Step(1, (3,))
    _seen(costs, Step(1, (4,)), 20.5)  # 2 x 10 = 20 ms, but not 5% below
    assert costs.plan(4) == Step(1, (4,))
    _seen(costs, Step(1, (4,)), 50.0, times=16)
    assert costs.plan(4) == Step(1, (1, 3))  # 38.5 ms: the fastest split of the sizes measured whole
    _seen(costs, Step(1, (3,)), 35.0, times=16)
    assert costs.plan(4) == Step(1, (1, 1, 1, 1))  # 40 ms, against 42 (1+1+2), 44 (2+2) and 45 (1+3)


def test_threads_are_halved_while_halving_measures_faster() -> None:
    costs = StepCosts(threads=4, recheck=8)
    ms = {Step(4, (1,)): 10.0, Step(2, (1,)): 11.0, Step(1, (1,)): 13.0}
    plans = _run(costs, 1, ms, 33)
    assert plans[:6] == [Step(4, (1,))] * 3 + [Step(2, (1,))] * 3
    assert Step(1, (1,)) not in plans  # two threads did not help: one is not tried
    assert _gaps(plans[6:], Step(2, (1,))) == [9, 9]  # rechecked every 8 steps x 11/10

    ms = {Step(4, (1,)): 10.0, Step(2, (1,)): 9.0, Step(1, (1,)): 9.2}  # two threads faster, one not below them
    costs = StepCosts(threads=4, recheck=8)
    plans = _run(costs, 1, ms, 30)
    assert plans[:9] == [Step(4, (1,))] * 3 + [Step(2, (1,))] * 3 + [Step(1, (1,))] * 3
    assert plans[9:].count(Step(2, (1,))) >= 15  # kept (9.2 is within the margin of 9.0), the others rechecked

    costs = StepCosts(threads=4, recheck=8)
    ms = {Step(4, (1,)): 10.0, Step(2, (1,)): 40.0}  # far slower: rechecked far less often, at the same cost
    assert _gaps(_run(costs, 1, ms, 100), Step(2, (1,))) == [1, 1, 32, 32]


def test_a_busy_machine_moves_steps_to_fewer_threads_and_an_idle_one_back() -> None:
    """Another process takes a core: a 2-thread step waits at every barrier for its unscheduled thread."""
    costs = StepCosts(threads=2, recheck=16)
    idle = {Step(2, (1,)): 6.0, Step(1, (1,)): 6.5}
    busy = {Step(2, (1,)): 48.0, Step(1, (1,)): 6.5}
    assert _run(costs, 1, idle, 32)[-16:].count(Step(2, (1,))) == 15  # and one recheck

    plans = _run(costs, 1, busy, 200)
    switched = plans.index(Step(1, (1,)))
    assert switched <= 9  # once half the window of 2-thread steps is slow
    rechecks = [i - switched for i, step in enumerate(plans) if step == Step(2, (1,)) and i > switched]
    assert len(rechecks) == 1 and 110 <= rechecks[0] <= 125  # rechecked after 16 steps x 48/6.5

    threads = [step.threads for step in _run(costs, 1, idle, 160)]
    back = next(i for i in range(160) if threads[i : i + 8] == [2] * 8)
    assert back <= 80  # two rechecks measured two threads idle again, the second 16 steps after the first
    ones = [i for i in range(back, 160) if threads[i] == 1]
    assert all(b - a == 18 for a, b in itertools.pairwise(ones))  # rechecks only: 16 steps x 6.5/6
