"""The llama.cpp engine's batcher on the tiny GGUF: chunked prefill keeps running streams flowing, a full unified
cache ends sequences with "length" instead of failing, and ``info()`` reports the slots.

These drive the engine in-process (each request on its own thread, as the sidecar does): the order of events
between a running stream and a newcomer is only observable without the HTTP hops' latency in between.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lemonkit.backends.llamacpp import LlamaCppEngine
from lemonkit.errors import InvalidArgument
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
