"""The log store on its own: retention, ``since``, wake-ups from threads, subprocess line capture."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import threading
from collections import deque

import pytest

from lemonkit.serving import log_store as logs
from lemonkit.serving.log_store import LogStore, StoreHandler


def _seqs(encoded: list[str]) -> list[int]:
    return [json.loads(e)["seq"] for e in encoded]


def test_retention_and_since() -> None:
    store = LogStore(capacity=5)
    assert store.since(None) == ([], 0) and store.since(3) == ([], 0)
    for i in range(8):
        store.add("Info", "t", f"line {i}")
    assert _seqs(store.since(None)[0]) == [4, 5, 6, 7, 8]  # the oldest scrolled out
    assert _seqs(store.since(6)[0]) == [7, 8]
    assert _seqs(store.since(1)[0]) == [4, 5, 6, 7, 8]  # fell behind the window: what is left
    assert store.since(8) == ([], 8)
    assert _seqs(store.since(99)[0]) == [4, 5, 6, 7, 8]  # a seq of an earlier process: everything
    entry = json.loads(store.since(7)[0][0])
    assert entry["line"] == f"{entry['timestamp']} [Info] (t) line 7"


def test_handler_maps_levels_tags_and_tracebacks() -> None:
    store = LogStore()
    logger = logging.getLogger("lemonkit.test-logs")
    handler = StoreHandler(store)
    logger.addHandler(handler)
    logger.setLevel(1)
    try:
        for level in (5, logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR, logging.CRITICAL):
            logger.log(level, "at %s", level)
        try:
            raise ValueError("boom")
        except ValueError:
            logger.exception("failed")
    finally:
        logger.removeHandler(handler)
    entries = [json.loads(e) for e in store.since(None)[0]]
    assert [e["severity"] for e in entries] == ["Trace", "Debug", "Info", "Warning", "Error", "Fatal", "Error"]
    assert {e["tag"] for e in entries} == {"test-logs"}
    assert entries[0]["line"].endswith("(test-logs) at 5")
    assert "ValueError: boom" in entries[-1]["line"]


def test_install_keeps_an_explicit_level() -> None:
    logger = logging.getLogger("lemonkit-install-probe")
    try:
        logs.install("lemonkit-install-probe")
        logs.install("lemonkit-install-probe")
        assert sum(isinstance(h, StoreHandler) for h in logger.handlers) == 1
        assert logger.level == logging.INFO  # nobody set one: Info must reach the stream
        logger.setLevel(logging.WARNING)
        logs.install("lemonkit-install-probe")
        assert logger.level == logging.WARNING
    finally:
        logger.handlers.clear()
        logger.setLevel(logging.NOTSET)


async def test_watchers_wake_from_other_threads() -> None:
    store = LogStore()
    wake = store.watch()
    thread = threading.Thread(target=store.add, args=("Info", "thread", "from a worker"))
    thread.start()
    await asyncio.wait_for(wake.wait(), 5)
    thread.join()
    wake.clear()
    store.add("Info", "loop", "from the loop")  # on the loop: set at once
    assert wake.is_set()
    store.unwatch(wake)
    wake.clear()
    store.add("Info", "loop", "nobody listens")
    assert not wake.is_set()


async def test_capture_reads_lines_of_a_subprocess() -> None:
    script = (
        "import sys; w = sys.stderr.write; w('plain\\n'); w('ERROR: bad\\r\\n'); w('WARNING: careful\\n');"
        "w('\\n'); w('progress 1\\rprogress 2\\r'); w('x' * 20000 + '\\n'); w('no newline at the end')"
    )
    process = await asyncio.create_subprocess_exec(sys.executable, "-c", script, stderr=asyncio.subprocess.PIPE)
    assert process.stderr is not None
    store, tail = LogStore(), deque[str](maxlen=2)
    await logs.capture(process.stderr, "model-x", tail=tail, store=store)
    await process.wait()
    entries = [json.loads(e) for e in store.since(None)[0]]
    lines = [e["line"].split("(model-x) ", 1)[1] for e in entries]
    assert lines[:5] == ["plain", "ERROR: bad", "WARNING: careful", "progress 1", "progress 2"]
    assert [e["severity"] for e in entries[:3]] == ["Info", "Error", "Warning"]
    pieces = [line for line in lines if set(line) == {"x"}]  # one huge line: in pieces, nothing lost
    assert len(pieces) == 3 and sum(map(len, pieces)) == 20000 and all(len(x) <= logs.MAX_LINE for x in pieces)
    assert lines[-1] == "no newline at the end" and list(tail)[-1] == "no newline at the end"


@pytest.mark.parametrize(
    ("line", "severity"),
    [
        ("ERROR: x", "Error"),
        ("[warning] y", "Warning"),
        ("error-free run", "Info"),
        ("Fatal: z", "Fatal"),
        ("ok", "Info"),
    ],
)
def test_line_severity(line: str, severity: str) -> None:
    assert logs.line_severity(line) == severity
