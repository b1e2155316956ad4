"""CPU turns: the llama.cpp decodes of a user's sidecars share the cores instead of spinning against each other."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest

from lemonkit.backends.llamacpp import LlamaCppEngine, cpu_turns
from lemonkit.backends.llamacpp.cpu_turns import CpuTurns
from lemonkit.testing.tiny_gguf import write_tiny_llama


def _held(directory: Path) -> list[str]:
    """The turn files some open file (any process's) holds, found by trying each without waiting."""
    held = []
    for path in sorted(directory.glob("turn-*.lock")):
        fd = os.open(path, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            held.append(path.name)
        finally:
            os.close(fd)
    return held


def test_a_decode_holds_a_turn_and_gives_it_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_turns, "_cores", lambda: 4)
    # each instance opens the files itself, as each sidecar process does
    wide, narrow, other = (CpuTurns(threads, directory=tmp_path) for threads in (4, 2, 2))
    try:
        assert (wide.turns, narrow.turns) == (1, 2)  # as many decodes at once as the cores hold their threads
        for _ in range(8):  # whichever turn each starts from
            with narrow.turn():
                assert len(_held(tmp_path)) == 1
                with other.turn():  # another sidecar's decode of two threads finds the other turn free
                    assert _held(tmp_path) == ["turn-0.lock", "turn-1.lock"]
            assert _held(tmp_path) == []
        with pytest.raises(RuntimeError), wide.turn():
            raise RuntimeError("a failed decode")
        assert _held(tmp_path) == []
    finally:
        for turns in (wide, narrow, other):
            turns.close()


def test_turns_live_in_a_private_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_turns.tempfile, "gettempdir", lambda: str(tmp_path))
    turns = CpuTurns(1)
    turns.close()
    made = tmp_path / f"lemonkit-cpu-{os.getuid()}"
    assert made.stat().st_mode & 0o777 == 0o700
    made.chmod(0o777)  # another user could take or hold the turns
    with pytest.raises(PermissionError, match="not a private directory"):
        CpuTurns(1)


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
