"""The batcher's step planner: a generation step is split into several decodes only when that measured faster."""

from __future__ import annotations

from lemonkit.backends.llamacpp.step_costs import StepCosts


def _seen(costs: StepCosts, plan: tuple[int, ...], ms: float, times: int = 3) -> None:
    for _ in range(times):
        costs.record(plan, ms / 1000)


def test_a_step_is_decoded_whole_until_its_parts_measured_faster() -> None:
    costs = StepCosts(recheck=8)
    assert costs.plan(2) == (2,)  # nothing measured
    _seen(costs, (2,), 22.0)
    assert costs.plan(2) == (2,)  # one-row steps not measured yet
    _seen(costs, (1,), 10.0)
    assert costs.plan(2) == (1, 1)  # 2 x 10 ms < 22 ms: tried
    _seen(costs, (1, 1), 19.0)
    plans = [costs.plan(2) for _ in range(16)]
    assert plans.count((2,)) == 2 and plans.count((1, 1)) == 14  # kept, with the whole step rechecked every 8th

    # the split measured slower in practice (each decode carries its own sampling): back to one decode
    _seen(costs, (1, 1), 25.0, times=16)
    plans = [costs.plan(2) for _ in range(16)]
    assert plans.count((1, 1)) == 2 and plans.count((2,)) == 14


def test_only_splits_that_beat_the_whole_step_by_the_margin_are_tried() -> None:
    costs = StepCosts()
    _seen(costs, (1,), 10.0)
    _seen(costs, (2,), 22.0)
    _seen(costs, (3,), 28.5)  # 1+1+1 = 30, 1+2 = 32: none below 28.5
    assert costs.plan(3) == (3,)
    _seen(costs, (4,), 20.5)  # 2 x 10 = 20 ms, but not 5% below
    assert costs.plan(4) == (4,)
    _seen(costs, (4,), 50.0, times=16)
    assert costs.plan(4) == (1, 3)  # 38.5 ms: the fastest split of the sizes measured whole
    _seen(costs, (3,), 35.0, times=16)
    assert costs.plan(4) == (1, 1, 1, 1)  # 40 ms, against 42 (1+1+2), 44 (2+2) and 45 (1+3)
