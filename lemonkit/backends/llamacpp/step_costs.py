"""How a generation step of k rows should be decoded, from what such steps measured: how many threads, and how many
``llama_decode`` calls.

ggml picks its CPU kernels by batch shape, and a shape can cost more than its parts. On this kind of machine
(AVX-512 with VNNI) llamafile's sgemm, which takes Q4_0/Q5_0/Q8_0 and float matrices from two rows on, decodes two
rows of Gemma 3 270M in 2.3 times the time ggml's one-row kernel takes for one, so two streams went no faster together
than one alone. Three or four rows amortise the sgemm well, K-quant matrices never reach it, and each decode carries
its own sampling and hand-over: no fixed rule fits every model and machine.

ggml's threads meet at a spinning barrier after every operation, and a decode step is hundreds of small operations.
When another process takes one of the cores, a thread that is not scheduled holds up the others at every barrier:
SmolLM2 135M on 2 cores decoded 163 tok/s on 2 threads and 21 while one busy process ran, where one thread decoded
160 and 162. So the thread count is chosen the same way, by what steps measured on this machine now.

With batch-invariant kernels a row's logits are the same bits in any split and on any number of threads, so this
changes only the time a step takes, never an answer.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterator
from typing import NamedTuple

__all__ = ["Step", "StepCosts"]


class Step(NamedTuple):
    """How a generation step is decoded."""

    threads: int
    parts: tuple[int, ...]  # the rows of each decode, in order


class StepCosts:
    """Recent times of generation steps by how they were decoded, and the plan for the next step.

    Args:
        threads: The most threads a decode may take; fewer (halving down to one) are candidates too.
        window: Steps of each plan kept.
        recheck: Steps of a size between two runs of a plan not chosen, times how much slower it last measured, so
            that a machine whose load changes is followed at no more than ``1 / recheck`` of its time.
        margin: A plan must measure below this share of the preferred plan's time (noise must not flip the choice).

    A plan's cost is the median of its steps among the last ``window`` steps of its size, or of its last three when
    fewer are that recent: the plan in use follows a change of load within half a window, a plan only rechecked
    within two rechecks, and one slow step moves neither.
    """

    def __init__(
        self,
        threads: int = 1,
        *,
        window: int = 16,
        recheck: int = 64,
        margin: float = 0.95,
    ) -> None:
        self.threads = max(1, threads)
        self._options = [self.threads >> i for i in range(self.threads.bit_length())]
        self._window = window
        self._recheck = recheck
        self._margin = margin
        self._times: dict[Step, deque[tuple[int, float]]] = {}  # (the step of its size, seconds)
        self._steps: dict[int, int] = {}  # steps planned by size

    def record(self, step: Step, seconds: float) -> None:
        """A step decoded as ``step`` took ``seconds``, sampling included."""
        at = self._steps.get(sum(step.parts), 0)
        self._times.setdefault(step, deque(maxlen=self._window)).append((at, seconds))

    def cost(self, step: Step) -> float | None:
        """The median time of a step decoded as ``step``, once three have been seen."""
        times = self._times.get(step)
        if times is None or len(times) < 3:
            return None
        since = self._steps.get(sum(step.parts), 0) - self._window
        current = [seconds for at, seconds in times if at > since]
        return statistics.median(current if len(current) >= 3 else [seconds for _, seconds in list(times)[-3:]])

    def plan(self, rows: int) -> Step:
        """How to decode a step of ``rows`` generating rows.

        Thread counts are measured from the most down, halving while halving measured faster. On each, a split is
        tried when the whole steps of its parts' sizes add up to less than a whole step of ``rows``. The fastest plan
        measured is kept, more threads and one decode preferred within the margin. Each plan not chosen runs once
        again after ``recheck`` steps times how much slower its last step was than the chosen plan, so a plan far
        slower costs no more than a plan slightly slower.
        """
        count = self._steps[rows] = self._steps.get(rows, 0) + 1
        best: Step | None = None
        best_cost = 0.0
        seen: list[Step] = []
        for threads in self._options:
            level: Step | None = None
            level_cost = 0.0
            for step in self._ways(threads, rows):
                cost = self.cost(step)
                if cost is None:
                    return step  # try it: its own steps decide from here
                seen.append(step)
                if level is None or cost < level_cost * self._margin:
                    level, level_cost = step, cost
            if best is not None and level_cost >= best_cost * self._margin:
                break  # fewer threads did not help: still fewer are not tried
            best, best_cost = level, level_cost
        assert best is not None
        chosen, due = best, 1.0
        for step in seen:
            at, seconds = self._times[step][-1]
            overdue = (count - at) / (self._recheck * max(1.0, seconds / best_cost))
            if step != best and overdue >= due:
                chosen, due = step, overdue  # the most overdue recheck
        return chosen

    def _ways(self, threads: int, rows: int) -> Iterator[Step]:
        whole = Step(threads, (rows,))
        yield whole
        cost = self.cost(whole)
        split = self._split(threads, rows, cost) if cost is not None else None
        if split is not None:
            yield split

    def _split(self, threads: int, rows: int, whole: float) -> Step | None:
        """The fastest split of ``rows`` by the whole steps measured for smaller sizes, if below ``whole``."""
        costs = {j: cost for j in range(1, rows) if (cost := self.cost(Step(threads, (j,)))) is not None}
        best: dict[int, tuple[float, tuple[int, ...]]] = {0: (0.0, ())}
        for m in range(1, rows + 1):
            options = [
                (best[m - j][0] + cost, (*best[m - j][1], j)) for j, cost in costs.items() if j <= m and m - j in best
            ]
            if options:
                best[m] = min(options)
        if rows not in best or best[rows][0] >= whole * self._margin:
            return None
        return Step(threads, best[rows][1])
