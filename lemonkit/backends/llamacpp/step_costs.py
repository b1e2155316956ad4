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

The same times price a speculative draft (:func:`~lemonkit.backends.llamacpp.drafts.draft_length`): a step of one
sequence's token and ``k`` drafted tokens costs what a decode of ``1 + k`` rows measured (:meth:`StepCosts.curve`).
On Gemma 3 270M (2 threads, batch-invariant kernels) a Xeon with AMX decoded 2 rows in 1.17 times one row's time, 4
in 1.55, 8 in 2.3, 16 in 3.6 and 5 in 2.3 (more than 8), where an EPYC without AVX-512 took twice one row's time for
two: the length worth drafting is a property of the machine, so it is measured, not set.

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
        self._decoded: dict[int, deque[float]] = {}  # rows -> the last decodes of that many rows (price)
        self._curve: list[float | None] | None = None  # curve()'s last answer, until a whole step is recorded

    def record(self, step: Step, seconds: float) -> None:
        """A step decoded as ``step`` took ``seconds``, sampling included."""
        at = self._steps.get(sum(step.parts), 0)
        times = self._times.setdefault(step, deque(maxlen=self._window))
        times.append((at, seconds))

    def price(self, rows: int, seconds: float) -> None:
        """A ``llama_decode`` of ``rows`` generating rows (a sequence's token and its draft count as rows) took
        ``seconds``: the decode alone, for :meth:`curve`. Sampling is left out: a token costs the same to sample
        whether it was drafted or not, so it does not change which draft length is best."""
        self._decoded.setdefault(rows, deque(maxlen=3)).append(seconds)
        self._curve = None

    def curve(self, upto: int) -> list[float | None]:
        """What a decode of ``n`` generating rows is expected to take, for ``n`` from 0 to ``upto`` (index 0 is
        None), from the decodes :meth:`price` was given.

        A size decoded three times or more is the median of its last three, and a size seen once or twice above the
        largest of those its fastest decode: these are the points. Other sizes lie on the straight line between the
        nearest points and below the smallest at its time per row. Past the largest point, sizes up to twice its
        rows cost its time and larger ones add the average row so far (the line from the smallest point through the
        largest; with one point, its time per row): a draft may double the largest step measured on trust, its
        decode is priced, and so drafts explore upwards one doubling at a time while that pays. Both guesses are
        wrong somewhere: on Gemma 3 270M an EPYC with AVX-512 decodes 2 to 4 rows in 2.4 times one row's time, 8 in
        4.4, 16 in 6.2 and 24 in 8.2, so pricing unmeasured rows at the average of the measured ones never drafted
        past one token; SmolLM2 135M's rows each cost about the same, and pricing every unmeasured size at the
        largest one's time drafted 48 tokens a step at 30% acceptance. Doubling costs one step of at most twice the
        rows measured per wrong guess. Within the measured range a size seen once or twice takes the lower of the
        line and its own fastest decode, so one slow decode does not price a size out before it was measured. Every
        entry is None until a decode was priced.
        """
        if self._curve is not None and len(self._curve) > upto:
            return self._curve
        full = sorted((rows, statistics.median(t)) for rows, t in self._decoded.items() if len(t) == t.maxlen)
        seen = {rows: min(t) for rows, t in self._decoded.items() if len(t) != t.maxlen}
        top = full[-1][0] if full else 0
        points = sorted([*full, *((rows, seconds) for rows, seconds in seen.items() if rows > top)])
        beyond = 0.0  # past twice the largest point, per row
        if len(points) > 1:
            (r0, c0), (r1, c1) = points[0], points[-1]
            beyond = max(0.0, (c1 - c0) / (r1 - r0))
        elif points:
            beyond = points[0][1] / points[0][0]
        out: list[float | None] = [None] * (upto + 1)
        i = 0
        for n in range(1, upto + 1) if points else ():
            while i < len(points) and points[i][0] < n:
                i += 1
            if i < len(points) and points[i][0] == n:
                line = points[i][1]
            elif i == 0:
                line = points[0][1] * n / points[0][0]
            elif i == len(points):
                r1, c1 = points[-1]
                line = c1 + beyond * max(0, n - 2 * r1)
            else:
                (r0, c0), (r1, c1) = points[i - 1], points[i]
                line = c0 + (c1 - c0) * (n - r0) / (r1 - r0)
            out[n] = min(line, seen.get(n, line))
        self._curve = out
        return out

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
