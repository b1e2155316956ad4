"""CPU turns: the llama.cpp decodes of a user's sidecars share the cores instead of spinning against each other."""

from __future__ import annotations

import fcntl
import os
import threading
import time
from pathlib import Path

import pytest

from lemonkit.backends.llamacpp import LlamaCppEngine, cpu_turns
from lemonkit.backends.llamacpp.cpu_turns import CpuTurns
from lemonkit.testing.tiny_gguf import write_tiny_llama


def _held(directory: Path) -> list[str]:
    """The turn files some open file (any process's) holds, found by trying each without waiting."""
    held = []
    for path in sorted(directory.glob("core-*.lock")):
        fd = os.open(path, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            held.append(path.name)
        finally:
            os.close(fd)
    return held


def _waiting(pid: int) -> bool:
    """Whether a process waits in ``flock`` (a blocked waiter in /proc/locks)."""
    with open("/proc/locks") as locks:
        return any("->" in line and line.split()[5] == str(pid) for line in locks)


def test_a_decode_takes_the_free_cores_up_to_its_threads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_turns, "_cores", lambda: 4)
    # each instance opens the files itself, as each sidecar process does
    one, other, third = (CpuTurns(directory=tmp_path) for _ in range(3))
    try:
        for _ in range(8):  # whichever core each starts from
            with one.turn(2) as cores:
                assert cores == 2 and len(_held(tmp_path)) == 2
                with other.turn(4) as more:  # another sidecar's decode gets the cores left
                    assert more == 2 and len(_held(tmp_path)) == 4
            assert _held(tmp_path) == []
        with one.turn(1), other.turn(4) as cores:
            assert cores == 2  # three are free, but another decode runs: half the cores
        with pytest.raises(RuntimeError), one.turn(8) as cores:
            assert cores == 4  # no more threads than cores
            raise RuntimeError("a failed decode")
        assert _held(tmp_path) == []

        got: list[int] = []

        def decode() -> None:
            with third.turn(2) as cores:
                got.append(cores)

        with other.turn(4):
            waiter = threading.Thread(target=decode)
            waiter.start()
            deadline = time.monotonic() + 30
            while not _waiting(os.getpid()):  # no core free: it waits for one
                assert time.monotonic() < deadline, "the decode did not wait for a core"
                time.sleep(0.01)
            assert got == []
        waiter.join(30)
        assert got == [1]  # one core, the one it waited on
    finally:
        for turns in (one, other, third):
            turns.close()


def test_turns_live_in_a_private_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_turns.tempfile, "gettempdir", lambda: str(tmp_path))
    turns = CpuTurns()
    turns.close()
    made = tmp_path / f"lemonkit-cpu-{os.getuid()}"
    assert made.stat().st_mode & 0o777 == 0o700
    made.chmod(0o777)  # another user could take or hold the turns
    with pytest.raises(PermissionError, match="not a private directory"):
        CpuTurns()


def test_an_engine_without_usable_turns_still_serves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(cpu_turns.tempfile, "gettempdir", lambda: str(tmp_path))
    (tmp_path / f"lemonkit-cpu-{os.getuid()}").mkdir(mode=0o755)
    path = write_tiny_llama(tmp_path / "tiny.gguf")
    engine = LlamaCppEngine({"model_path": str(path), "type": "llm", "options": {"llamacpp_args": "-t 1"}})
    try:
        assert "take no CPU turns" in caplog.text and "not a private directory" in caplog.text
        result = engine.complete({"model": "tiny", "prompt": "hello", "max_tokens": 5}, cancelled=lambda: False)
        assert isinstance(result, dict) and result["usage"]["completion_tokens"] == 5
    finally:
        engine.close()
