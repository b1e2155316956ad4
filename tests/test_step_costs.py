"""The batcher's step planner: a generation step takes fewer threads, or several decodes, only when that measured
faster."""

from __future__ import annotations

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


def test_a_step_is_decoded_whole_until_its_parts_measured_faster() -> None:
    costs = StepCosts(recheck=8)
    assert costs.plan(2) == Step(1, (2,))  # nothing measured
    _seen(costs, Step(1, (2,)), 22.0)
    assert costs.plan(2) == Step(1, (2,))  # one-row steps not measured yet
    _seen(costs, Step(1, (1,)), 10.0)
    assert costs.plan(2) == Step(1, (1, 1))  # 2 x 10 ms < 22 ms: tried
    _seen(costs, Step(1, (1, 1)), 19.0)
    plans = [costs.plan(2) for _ in range(16)]
    assert plans.count(Step(1, (2,))) == 2 and plans.count(Step(1, (1, 1))) == 14  # kept, the whole rechecked

    # the split measured slower in practice (each decode carries its own sampling): back to one decode
    _seen(costs, Step(1, (1, 1)), 25.0, times=16)
    plans = [costs.plan(2) for _ in range(16)]
    assert plans.count(Step(1, (1, 1))) == 2 and plans.count(Step(1, (2,))) == 14


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


def test_every_thread_count_is_measured_and_all_threads_kept_unless_fewer_are_faster() -> None:
    costs = StepCosts(threads=4, recheck=8)
    ms = {Step(4, (1,)): 10.0, Step(2, (1,)): 11.0, Step(1, (1,)): 13.0}
    tried = _run(costs, 1, ms, 9)
    assert tried == [Step(4, (1,))] * 3 + [Step(2, (1,))] * 3 + [Step(1, (1,))] * 3  # halving down to one
    plans = _run(costs, 1, ms, 16)
    rechecks = [i for i, step in enumerate(plans) if step != Step(4, (1,))]
    assert len(rechecks) == 2 and rechecks[1] - rechecks[0] == 8  # one every 8th step
    assert {plans[i] for i in rechecks} == {Step(2, (1,)), Step(1, (1,))}  # each other count in turn

    costs = StepCosts(threads=2)
    _seen(costs, Step(2, (1,)), 10.0)
    _seen(costs, Step(1, (1,)), 9.7)  # faster, but within the margin: noise must not flip the choice
    assert costs.plan(1) == Step(2, (1,))


def test_a_busy_machine_moves_steps_to_fewer_threads_and_an_idle_one_back() -> None:
    """Another process takes a core: a 2-thread step waits at every barrier for its unscheduled thread."""
    costs = StepCosts(threads=2, recheck=16)
    idle = {Step(2, (1,)): 6.0, Step(1, (1,)): 6.5}
    busy = {Step(2, (1,)): 48.0, Step(1, (1,)): 6.5}
    assert _run(costs, 1, idle, 32)[-16:].count(Step(2, (1,))) == 15  # and one recheck

    plans = _run(costs, 1, busy, 64)
    switched = plans.index(Step(1, (1,)))
    assert switched <= 9  # once half the window of 2-thread steps is slow
    assert plans[switched:].count(Step(2, (1,))) == 4  # rechecks only

    threads = [step.threads for step in _run(costs, 1, idle, 64)]
    back = next(i for i in range(64) if threads[i : i + 8] == [2] * 8)
    assert back <= 32  # two rechecks measured two threads idle again
    assert threads[back:].count(1) <= 2  # rechecks only
