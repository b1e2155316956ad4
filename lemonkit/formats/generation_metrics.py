"""Cumulative figures of a model's generations, kept by its engine and summed by the server for ``/metrics``.

An engine records each generation (:meth:`GenerationTotals.record`); its sidecar answers ``/metrics`` with
:meth:`GenerationTotals.to_dict`; the server adds the totals of sidecars that have exited (so counters only grow
while the server runs) and renders them in Prometheus' text format (:mod:`lemonkit.server.metrics`).
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterable
from typing import Any

__all__ = ["PROMPT_RATE_BUCKETS", "TOKEN_BUCKETS", "TTFT_BUCKETS", "GenerationTotals", "add_totals"]

#: seconds to the first token: a cached prompt on a GPU to a long prompt on a few cores
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
#: seconds per generated token: 1000 tok/s to 1 tok/s
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
#: prompt tokens evaluated per second: a long prompt on a few cores to a GPU's prefill
PROMPT_RATE_BUCKETS = (10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 2500.0, 5000.0, 10000.0, 25000.0)


class _Histogram:
    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last: above every bound
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def to_dict(self) -> dict[str, Any]:
        return {"bounds": list(self.bounds), "counts": list(self.counts), "sum": self.sum}


class GenerationTotals:
    """What a model's engine generated since it loaded (thread-safe: its slots record from their threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.generations = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.generated_tokens = 0
        self._ttft = _Histogram(TTFT_BUCKETS)
        self._token = _Histogram(TOKEN_BUCKETS)
        self._prompt_rate = _Histogram(PROMPT_RATE_BUCKETS)

    def record(
        self,
        *,
        prompt_tokens: int,
        cached_tokens: int,
        ttft: float | None,
        token_times: Iterable[float],
        prompt_seconds: float = 0.0,
    ) -> None:
        """One generation: its prompt (``cached_tokens`` of it reused, the rest evaluated in ``prompt_seconds``), the
        time to its first token (``None`` when it generated none) and the time of each token after."""
        times = list(token_times)
        evaluated = prompt_tokens - cached_tokens
        with self._lock:
            self.generations += 1
            self.prompt_tokens += prompt_tokens
            self.cached_tokens += cached_tokens
            self.generated_tokens += len(times)
            if ttft is not None:
                self._ttft.observe(ttft)
            for t in times:
                self._token.observe(t)
            if evaluated > 0 and prompt_seconds > 0:  # a prompt the cache answered whole has no rate
                self._prompt_rate.observe(evaluated / prompt_seconds)

    def to_dict(self) -> dict[str, Any]:
        with self._lock:
            return {
                "generations": self.generations,
                "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_tokens,
                "generated_tokens": self.generated_tokens,
                "time_to_first_token": self._ttft.to_dict(),
                "time_per_output_token": self._token.to_dict(),
                "prompt_tokens_per_second": self._prompt_rate.to_dict(),
            }


def add_totals(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two :meth:`GenerationTotals.to_dict` figures summed (histograms bucket by bucket; ``{}`` is none)."""
    if not a:
        return b
    if not b:
        return a
    out: dict[str, Any] = {}
    for key in set(a) | set(b):
        x, y = a.get(key), b.get(key)
        if isinstance(x, dict) and isinstance(y, dict) and x.get("bounds") == y.get("bounds"):
            out[key] = {
                "bounds": x["bounds"],
                "counts": [i + j for i, j in zip(x["counts"], y["counts"], strict=True)],
                "sum": x["sum"] + y["sum"],
            }
        elif isinstance(x, int | float) and isinstance(y, int | float):
            out[key] = x + y
        else:
            out[key] = x if x is not None else y
    return out
