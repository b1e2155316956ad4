"""Turns on the CPU for the llama.cpp decodes of every sidecar of this user on this machine.

ggml's threads spin at the barrier after each operation of a decode. Two sidecars decoding at once with a thread per
core each leave a spinning thread waiting for one that is not scheduled, hundreds of times per token: on 2 cores two
Gemma 3 270M streams in two processes decoded 28-31 tok/s each (2.8 in one run) where one alone decodes 100. So a
decode takes a turn first: ``max(1, cores // threads)`` decodes run at once (lock files under the temporary
directory, ``flock``: a process that dies gives its turn back), and the sidecar's OpenMP workers sleep soon after a
decode instead of spinning for the next (``GOMP_SPINCOUNT``, :func:`lemonkit.backends.sidecar_env`). Measured: 50
tok/s each for two at once, 100 alone as before.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = ["CpuTurns"]


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _private_dir() -> Path:
    """``<tmp>/lemonkit-cpu-<uid>``, made 0700 by this user or refused (another user's could hold the turns)."""
    path = Path(tempfile.gettempdir()) / f"lemonkit-cpu-{os.getuid()}"
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    info = path.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise PermissionError(f"{path} is not a private directory of this user")
    return path


class CpuTurns:
    """The turns a decode of ``threads`` threads takes on this machine's cores.

    Args:
        threads: The decode's threads.
        directory: Where the lock files are (default: a private directory under the temporary directory).
    """

    def __init__(self, threads: int, *, directory: Path | None = None) -> None:
        self.turns = max(1, _cores() // max(1, threads))
        directory = directory or _private_dir()
        self._fds = [
            os.open(directory / f"turn-{i}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            for i in range(self.turns)
        ]

    @contextlib.contextmanager
    def turn(self) -> Iterator[None]:
        """Hold a turn while the block runs: a free one if any, else wait for one."""
        start = random.randrange(self.turns)
        order = self._fds[start:] + self._fds[:start]
        for fd in order:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            held = fd
            break
        else:
            held = order[0]
            fcntl.flock(held, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []
