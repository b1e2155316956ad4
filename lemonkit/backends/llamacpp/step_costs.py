"""How many ``llama_decode`` calls a generation step of k rows should take, from what such steps measured.

ggml picks its CPU kernels by batch shape, and a shape can cost more than its parts. On this kind of machine
(AVX-512 with VNNI) llamafile's sgemm, which takes Q4_0/Q5_0/Q8_0 and float matrices from two rows on, decodes two
rows of Gemma 3 270M in 2.3 times the time ggml's one-row kernel takes for one, so two streams went no faster together
than one alone. Three or four rows amortise the sgemm well, K-quant matrices never reach it, and each decode carries
its own sampling and hand-over: no fixed rule fits every model and machine. The batcher times whole steps by how they
were decoded and splits a step only when the split measured faster.

With batch-invariant kernels a row's logits are the same bits in any split, so this changes only the time a step
takes, never an answer.
"""

from __future__ import annotations

import statistics
from collections import deque

__all__ = ["StepCosts"]

Plan = tuple[int, ...]  # the rows of each decode of a step, in order


class StepCosts:
    """Recent times of generation steps by how they were decoded, and the plan for the next step.

    Args:
        window: Steps of each plan the median is taken over.
        recheck: Steps of a size between two runs of the plan not chosen, so that a machine whose load changes is
            followed.
        margin: A split must measure below this share of the whole step's time (noise must not flip the plan).
    """

    def __init__(self, *, window: int = 16, recheck: int = 64, margin: float = 0.95) -> None:
        self._window = window
        self._recheck = recheck
        self._margin = margin
        self._times: dict[Plan, deque[float]] = {}
        self._steps: dict[int, int] = {}

    def record(self, plan: Plan, seconds: float) -> None:
        """A step decoded as ``plan`` took ``seconds``, sampling included."""
        self._times.setdefault(plan, deque(maxlen=self._window)).append(seconds)

    def cost(self, plan: Plan) -> float | None:
        """The median time of a step decoded as ``plan``, once three have been seen."""
        times = self._times.get(plan)
        return statistics.median(times) if times is not None and len(times) >= 3 else None

    def plan(self, rows: int) -> Plan:
        """How to decode a step of ``rows`` generating rows: ``(rows,)`` is one decode.

        A split is tried when the whole steps of its parts' sizes add up to less than a whole step of ``rows``, and
        kept while its own steps measure faster.
        """
        whole = self.cost((rows,))
        split = self._split(rows, whole) if whole is not None else None
        if whole is None or split is None:
            return (rows,)
        measured = self.cost(split)
        if measured is None:
            return split  # try it: its own steps decide from here
        best, other = (split, (rows,)) if measured < whole * self._margin else ((rows,), split)
        step = self._steps.get(rows, 0) + 1
        self._steps[rows] = step % self._recheck
        return other if step == self._recheck else best

    def _split(self, rows: int, whole: float) -> Plan | None:
        """The fastest split of ``rows`` by the whole steps measured for smaller sizes, if below ``whole``."""
        costs = {j: cost for j in range(1, rows) if (cost := self.cost((j,))) is not None}
        best: dict[int, tuple[float, Plan]] = {0: (0.0, ())}
        for m in range(1, rows + 1):
            options = [
                (best[m - j][0] + cost, (*best[m - j][1], j)) for j, cost in costs.items() if j <= m and m - j in best
            ]
            if options:
                best[m] = min(options)
        if rows not in best or best[rows][0] >= whole * self._margin:
            return None
        return best[rows][1]
