"""The llama.cpp engine's batcher on the tiny GGUF: chunked prefill keeps running streams flowing, a full unified
cache ends sequences with "length" instead of failing, ``info()`` reports the slots, and answers do not depend on
the batch (batch-invariant kernels, padded single rows, compacted cells) unless ``--no-batch-invariant``.

These drive the engine in-process (each request on its own thread, as the sidecar does): the order of events
between a running stream and a newcomer is only observable without the HTTP hops' latency in between.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import llama_cpp as lc
import pytest

from lemonkit.backends.llamacpp import LlamaCppEngine
from lemonkit.backends.llamacpp.batch import PREFILL_CHUNK
from lemonkit.backends.llamacpp.kernels import attention_build, patched_attention
from lemonkit.backends.llamacpp.prompt_cache import common_prefix
from lemonkit.backends.llamacpp.step_costs import Step, StepCosts
from lemonkit.catalog import llamacpp_builds
from lemonkit.errors import InvalidArgument, ModelLoadError
from lemonkit.testing.tiny_gguf import write_tiny_llama


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-llama.gguf")


def _engine(path: Path, args: str, ctx_size: int = 4096) -> LlamaCppEngine:
    options = {"n_threads": 2, "ctx_size": ctx_size, "llamacpp_args": args}
    return LlamaCppEngine({"model_path": str(path), "type": "llm", "options": options})


@pytest.fixture(scope="module")
def chunked(tiny_path: Path) -> Iterator[LlamaCppEngine]:
    e = _engine(tiny_path, "--parallel 2 -b 32")
    yield e
    e.close()


def _stream(engine: LlamaCppEngine, body: dict[str, Any], stop: threading.Event) -> Iterator[dict[str, Any]]:
    result = engine.complete({"model": "tiny", "stream": True, **body}, cancelled=stop.is_set)
    assert not isinstance(result, dict)
    return result


def test_info_reports_slots(chunked: LlamaCppEngine, tiny_path: Path) -> None:
    assert chunked.info()["slots"] == 2
    with pytest.raises(InvalidArgument, match="parallel"):
        _engine(tiny_path, "--parallel 0")
    with pytest.raises(InvalidArgument, match="batch-size"):
        _engine(tiny_path, "--parallel 4 -b 4")


def test_a_long_prompt_is_evaluated_in_chunks_between_running_tokens(chunked: LlamaCppEngine) -> None:
    """A running stream receives many tokens between a newcomer's submission and the newcomer's first token: its
    prompt (about 40 steps' worth of 32 tokens) is evaluated a chunk per step, next to the running stream's token.
    An engine that evaluated the whole prompt in one go would deliver at most a token or two meanwhile."""
    log: list[str] = []
    lock = threading.Lock()
    stop = threading.Event()
    started = threading.Event()

    def running() -> None:
        for n, _chunk in enumerate(_stream(chunked, {"prompt": "run", "max_tokens": 3500, "temperature": 0}, stop)):
            with lock:
                log.append("running")
            if n == 3:
                started.set()

    thread = threading.Thread(target=running)
    thread.start()
    try:
        assert started.wait(60)
        newcomer = _stream(chunked, {"prompt": "the cache test " * 250, "max_tokens": 1, "temperature": 0}, stop)
        with lock:
            log.append("submitted")
        first = next(newcomer)
        with lock:
            log.append("newcomer")
        rest = list(newcomer)
    finally:
        stop.set()
        thread.join()
    assert first["choices"][0]["text"] or rest
    usage = rest[-1]["usage"]
    assert usage["prompt_tokens"] >= 1200  # 38 steps or more
    between = log[log.index("submitted") : log.index("newcomer")]
    assert between.count("running") >= 20, between


def test_a_measured_budget_of_few_tokens_is_saved_up_into_chunks(tiny_path: Path) -> None:
    """While a stream generates, an ``auto`` budget that allows fewer prompt tokens a step than PREFILL_CHUNK is
    saved up: steps without prompt tokens (the stream's token each), then one step with the chunk. Both answers are
    what they are alone."""
    engine = _engine(tiny_path, "--parallel 2")
    batcher = engine._gen._batcher
    long_body = {"prompt": "the cache test " * 100, "max_tokens": 4, "temperature": 0, "cache_prompt": False}
    stream_body = {"prompt": "run", "max_tokens": 400, "temperature": 0}
    try:
        alone = [_complete(engine, **body) for body in (stream_body, long_body)]
        steps: list[tuple[int, int]] = []  # (prompt tokens, generating rows) of each decode
        run = batcher._run

        def counted(planned: list[Any], n: int, threads: int | None = None) -> bool:
            prompt = sum(len(rows) for slot, rows in planned if slot.last < 0)
            steps.append((prompt, sum(1 for slot, _ in planned if slot.last >= 0)))
            return run(planned, n, threads)

        batcher._run = counted  # type: ignore[method-assign]
        batcher._measured_room = lambda rows: 3  # type: ignore[method-assign]
        stop, started = threading.Event(), threading.Event()
        streamed: list[str] = []

        def running() -> None:
            for n, chunk in enumerate(_stream(engine, stream_body, stop)):
                streamed.append(chunk["choices"][0]["text"] if chunk.get("choices") else "")
                if n == 3:
                    started.set()

        thread = threading.Thread(target=running)
        thread.start()
        assert started.wait(60)
        steps.clear()
        long = _complete(engine, **long_body)
        beside = [(prompt, generating) for prompt, generating in steps if generating and prompt]
        thread.join()
    finally:
        stop.set()
        engine.close()
    n_prompt = long["usage"]["prompt_tokens"]
    assert n_prompt > 3 * PREFILL_CHUNK
    # 3 tokens a step, saved up over the steps of the stream alone until they make a chunk: 22 steps, the last one
    # takes the 66 tokens saved (the prompt's last step its rest), the 21 before it none
    saving = -(-PREFILL_CHUNK // 3)
    assert [prompt for prompt, _ in beside[:-1]] == [3 * saving] * (len(beside) - 1) and beside[-1][0] <= 3 * saving
    between = [i for i, (prompt, generating) in enumerate(steps) if generating and prompt]
    assert len(between) >= 3 and between[0] >= saving - 1  # the stream stepped alone before the prompt came too
    assert all(b - a == saving for a, b in itertools.pairwise(between[:-1]))
    assert long["choices"] == alone[1]["choices"] and "".join(streamed) == alone[0]["choices"][0]["text"]


def test_a_full_cache_ends_the_newest_sequence_with_length(tiny_path: Path) -> None:
    """Two sequences that each may fill the whole (unified) context: both end with "length", none fails."""
    engine = _engine(tiny_path, "--parallel 2", ctx_size=256)
    try:
        results: list[Any] = [None, None]

        def run(i: int) -> None:
            body = {"model": "tiny", "prompt": f"fill {i}", "max_tokens": -1, "temperature": 0}
            results[i] = engine.complete(body, cancelled=lambda: False)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(r["choices"][0]["finish_reason"] == "length" for r in results)
        totals = sorted(r["usage"]["total_tokens"] for r in results)
        # they shared 256 cells: the one ended first had less than the whole context; the other got the cells back
        assert totals[0] < 256 and totals[1] <= 256
        again = engine.complete({"model": "tiny", "prompt": "after", "max_tokens": 4}, cancelled=lambda: False)
        assert again["usage"]["completion_tokens"] == 4
    finally:
        engine.close()


def _complete(engine: LlamaCppEngine, prompt: str, **extra: Any) -> dict[str, Any]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 24, "logprobs": 3, **extra}
    result = engine.complete(body, cancelled=lambda: False)
    assert isinstance(result, dict)
    return result


def _together(engine: LlamaCppEngine, prompts: list[str], **extra: Any) -> list[dict[str, Any]]:
    """The prompts' completions, requested from threads and admitted in one step: the batcher takes no newcomer
    until every request has arrived (on a loaded machine a thread may start after another request has finished)."""
    results: list[Any] = [None] * len(prompts)
    batcher = engine._gen._batcher
    take = batcher._take_newcomers
    arrived = threading.Event()

    def take_all() -> list[Any]:
        if not arrived.is_set() and len(batcher._waiting) < len(prompts):
            return []
        arrived.set()
        return take()

    def run(i: int) -> None:
        results[i] = _complete(engine, prompts[i], **extra)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    batcher._take_newcomers = take_all  # type: ignore[method-assign]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        batcher._take_newcomers = take  # type: ignore[method-assign]
    return results


def test_answers_do_not_depend_on_the_batch_or_on_earlier_requests(tiny_path: Path) -> None:
    """A seeded random answer with its logprobs, from a fresh engine, equals the same request's answer later: beside
    three others whose prompts are evaluated in the same steps, after cache evictions and prefix truncations left
    free cells between sequences (which llama.cpp fills first), and from a cached prefix."""
    engine = _engine(tiny_path, "--parallel 4 -b 64")
    try:
        assert engine.info()["batch_invariant"] is True
        # lemonkit's own attention kernel where the build carries it; CI builds llama-cpp-python with this lemonkit's
        assert engine.info()["invariant_attention"] is (True if os.environ.get("CI") else patched_attention())
        if os.environ.get("CI"):
            assert attention_build() == "current"
        probe = {"temperature": 0.9, "seed": 3}
        target = "the quick brown fox " * 30  # a few chunks of 64
        first = _complete(engine, target, **probe)
        others = ["jumps over the lazy dog " * k for k in (3, 9, 20)]
        for _ in range(2):
            results = _together(engine, [*others, target], **probe)
            assert results[-1]["choices"] == first["choices"]
            # truncate two cached prompts (free cells in the middle of the cache) before the next round
            _together(engine, [others[0][:40] + "cat", others[2][:200] + "bird"], **probe)
        cached = _complete(engine, target, **probe)
        assert cached["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert cached["choices"] == first["choices"]
    finally:
        engine.close()


def test_rows_of_one_template_admitted_together_evaluate_its_instruction_once(tiny_path: Path) -> None:
    """Four prompts sharing a long instruction arrive in one step on four idle slots: the first evaluates the
    instruction (in several chunks), the others wait for it, share its cells and evaluate only their own rows; each
    answer is the one it has alone on a fresh engine."""
    instruction = "Label the sentiment of the review below as positive or negative. " * 8
    rows = [instruction + f"Review {i}: {text}" for i, text in enumerate(("great", "awful", "fine", "boring"))]
    probe = {"temperature": 0.9, "seed": 5}
    alone = _engine(tiny_path, "--parallel 1")
    try:
        expected = [_complete(alone, row, **probe)["choices"] for row in rows]
        tokens = [alone._gen.tokenize(row) for row in rows]
    finally:
        alone.close()
    shared = {common_prefix(a, b) for a in tokens for b in tokens if a is not b}
    assert len(shared) == 1 and next(iter(shared)) > 64  # one instruction, longer than a chunk
    engine = _engine(tiny_path, "--parallel 4 -b 64")
    try:
        results = _together(engine, rows, **probe)
    finally:
        engine.close()
    assert [r["choices"] for r in results] == expected
    cached = sorted(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in results)
    assert cached == [0, *[next(iter(shared))] * 3]
    evaluated = sum(r["timings"]["prompt_n"] for r in results)
    assert evaluated == sum(len(t) for t in tokens) - 3 * next(iter(shared))


class _Forced(StepCosts):
    """Every generation step decoded as ``plan`` says, and each plan counted."""

    def __init__(self, plan: Callable[[int], Step]) -> None:
        super().__init__()
        self._plan = plan
        self.plans: list[Step] = []

    def plan(self, rows: int) -> Step:
        self.plans.append(self._plan(rows))
        return self.plans[-1]


def test_a_step_split_into_several_decodes_or_on_fewer_threads_answers_the_same(tiny_path: Path) -> None:
    """The batcher may decode a step's rows in parts, and on fewer threads than ``-t`` (when that measured faster,
    see StepCosts): each part's rows sample from their own decode's logits, and every answer stays what it is in one
    decode on every thread."""
    engine = _engine(tiny_path, "--parallel 4 -b 64 -t 2")
    try:
        probe = {"temperature": 0.9, "seed": 5}
        prompts = ["the quick brown fox", "jumps over", "the lazy dog " * 5, "a b c"]
        batcher = engine._gen._batcher
        whole = _Forced(lambda rows: Step(2, (rows,)))
        batcher.costs = whole
        expected = [r["choices"] for r in _together(engine, prompts, **probe)]
        assert Step(2, (4,)) in whole.plans
        for plan in (lambda rows: Step(2, (1,) * rows), lambda rows: Step(1, (rows,))):
            forced = batcher.costs = _Forced(plan)
            assert [r["choices"] for r in _together(engine, prompts, **probe)] == expected
            assert plan(4) in forced.plans  # the four were generating together
        assert lc.llama_n_threads(batcher._ctx) == 1  # the last step's threads
        _complete(engine, "the " * 40, max_tokens=1)  # a prompt step: on -t again
        assert lc.llama_n_threads(batcher._ctx) == 2
    finally:
        engine.close()


def test_a_decode_runs_on_the_cores_its_turn_gives(tiny_path: Path) -> None:
    """Other sidecars hold a core: the decode takes the threads it got, and the step, which measured them rather
    than its plan, is not recorded."""
    engine = _engine(tiny_path, "--parallel 2 -t 2")
    try:
        batcher = engine._gen._batcher
        alone = _complete(engine, "the quick brown fox", temperature=0)
        asked: list[int] = []

        @contextlib.contextmanager
        def one_core(threads: int) -> Iterator[int]:
            asked.append(threads)
            yield 1

        batcher.costs = StepCosts(2)
        batcher._turn = one_core
        assert _complete(engine, "the quick brown fox", temperature=0)["choices"] == alone["choices"]
        assert set(asked) == {2}  # each decode asked for its threads
        assert (lc.llama_n_threads(batcher._ctx), lc.llama_n_threads_batch(batcher._ctx)) == (1, 1)
        assert batcher.costs.cost(Step(2, (1,))) is None  # 23 generation steps, none recorded
    finally:
        engine.close()


def test_kernel_choices(tiny_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="--no-batch-invariant"):
        _engine(tiny_path, "--repack")
    engine = _engine(tiny_path, "--no-batch-invariant --repack")
    try:
        assert engine.info()["batch_invariant"] is False
        assert _complete(engine, "hello")["usage"]["completion_tokens"] == 24
    finally:
        engine.close()


def test_without_reference_kernels_a_load_falls_back_or_fails_as_asked(
    tiny_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A llama-cpp-python whose ggml device table was not verified: the default loads on ordinary kernels (with a
    warning and ``batch_invariant: false``); an explicit ``--batch-invariant`` is a load error."""
    import llama_cpp

    monkeypatch.setattr(llama_cpp, "__version__", "9.9.9")
    engine = _engine(tiny_path, "")
    try:
        assert engine.info()["batch_invariant"] is False
        assert "no batch-invariant kernels" in caplog.text and "unverified" in caplog.text
        assert _complete(engine, "hello")["usage"]["completion_tokens"] == 24
    finally:
        engine.close()
    with pytest.raises(ModelLoadError, match=r"--batch-invariant: .*unverified"):
        _engine(tiny_path, "--batch-invariant")


def test_the_prompts_of_one_completion_interleave_and_stop_together(chunked: LlamaCppEngine) -> None:
    """Three prompts on two slots: the second's tokens arrive before the first has ended, each text is the lone
    one, only the last chunk carries the usage; a cancellation stops them all, and closing the stream early too."""
    prompts = ["one", "two two", "three three three"]
    # long enough that the first is still generating when the second is submitted (the tiny model is fast)
    body = {"max_tokens": 200, "temperature": 0.9, "seed": 3}
    never = threading.Event()
    lone = [list(_stream(chunked, {**body, "prompt": p}, never)) for p in prompts]
    alone = [_text(c) for c in lone]
    chunks = list(_stream(chunked, {**body, "prompt": prompts}, never))

    order = [c["choices"][0]["index"] for c in chunks]
    first_end = next(i for i, c in enumerate(chunks) if c["choices"][0]["finish_reason"] and order[i] == 0)
    assert 1 in order[:first_end]
    for i, text in enumerate(alone):
        assert _text(c for c in chunks if c["choices"][0]["index"] == i) == text
    assert [i for i, c in enumerate(chunks) if "usage" in c] == [len(chunks) - 1]
    assert chunks[-1]["usage"]["completion_tokens"] == sum(c[-1]["usage"]["completion_tokens"] for c in lone)

    stop = threading.Event()
    n = 0
    for n, _chunk in enumerate(_stream(chunked, {"prompt": prompts, "max_tokens": 3000, "temperature": 0}, stop)):
        if n == 5:
            stop.set()
    assert n < 5 + 2 * 3  # each running prompt sends at most the token it was sampling
    assert not [t for t in threading.enumerate() if t.name.startswith("prompt-")]

    early = _stream(chunked, {"prompt": prompts, "max_tokens": 3000, "temperature": 0}, never)
    next(early)
    early.close()  # the client left
    assert not [t for t in threading.enumerate() if t.name.startswith("prompt-")]
    assert _text(_stream(chunked, {**body, "prompt": prompts[0]}, never)) == alone[0]  # the slots are free again


def _text(chunks: Iterator[dict[str, Any]]) -> str:
    return "".join(c["choices"][0]["text"] for c in chunks)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny-f32", "smollm2-q4_1"])
def test_a_sequences_logprobs_are_the_same_bits_in_any_batch_and_any_chunking(tiny_path: Path, model: str) -> None:
    """A ~600-token prompt's greedy answer with its top logprobs (functions of the logits: the same floats only from
    the same bits), alone in chunks of 512 prompt tokens, equals the answer with the prompt evaluated 1 (the float
    model; the answer's own steps are one row each), 7 and 64 tokens a step, and beside 1, 2, 7 and 15 other
    sequences (batches of 2, 3, 8 and 16) whose prompts share its steps; on a float model (llamafile's sgemm from
    two rows on) and a quantized one (the bundled SmolLM2, Q4_1). Attention runs over more than 512 cells and more
    than 64 query rows a step: ggml's tiled and split-KV kernels' shapes."""
    from tests.support.llama_cpp_server import smollm2_path

    path = tiny_path if model == "tiny-f32" else smollm2_path()
    target = "the quick brown fox jumps over the lazy dog and " * 60
    probe = {"max_tokens": 4, "temperature": 0, "logprobs": 5}

    def answer(args: str, others: int = 0) -> Any:
        engine = _engine(path, args)
        try:
            assert engine.info()["batch_invariant"] is True
            prompts = [f"{i} jumps over the lazy dog " * (3 + i) for i in range(others)]
            result = (
                _together(engine, [*prompts, target], **probe)[-1] if others else _complete(engine, target, **probe)
            )
            assert result["usage"]["prompt_tokens"] > 512
            return result["choices"]
        finally:
            engine.close()

    alone = answer("--parallel 1 -b 513")
    for chunk in (1, 7, 64) if model == "tiny-f32" else (7, 64):  # one row a step: the answer's own decode steps
        assert answer(f"--parallel 1 -b {chunk + 1}") == alone, f"chunks of {chunk}"  # one row is the padding's
    for others in (1, 2, 7, 15):
        assert answer("--parallel 16 -b 513", others) == alone, f"a batch of {others + 1}"


def test_a_build_of_another_lemonkits_kernel_is_told_apart_and_named_with_its_rebuild(
    tiny_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The build names the kernel source it was made from: one from another lemonkit's is "older" (still lemonkit's
    attention, still invariant), and a load says which commands build this lemonkit's."""
    monkeypatch.setattr(llamacpp_builds, "invariant_attention_sha256", lambda: "0" * 64)
    assert attention_build() == ("older" if patched_attention() else "missing")
    engine = _engine(tiny_path, "--parallel 2")
    try:
        assert engine.info()["batch_invariant"] is True
        assert engine.info()["invariant_attention"] is patched_attention()
    finally:
        engine.close()
    warning = "carries an older lemonkit's" if patched_attention() else "lacks lemonkit's"
    assert warning in caplog.text
    assert "pip cache remove llama_cpp_python" in caplog.text and "--force-reinstall --no-deps" in caplog.text
    assert f"llama-cpp-python=={lc.__version__}" in caplog.text and "llama-cpp-lean.cmake" in caplog.text
