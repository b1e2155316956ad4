"""Turns on the CPU for the llama.cpp decodes of every sidecar of this user on this machine.

ggml's threads spin at the barrier after each operation of a decode. Two sidecars decoding at once with a thread per
core each leave a spinning thread waiting for one that is not scheduled, hundreds of times per token: on 2 cores two
Gemma 3 270M streams in two processes decoded 28-31 tok/s each (2.8 in one run) where one alone decodes 100. So a
decode takes cores first, one lock file per core under the temporary directory (``flock``: a process that dies gives
its cores back): as many as it has threads when they are free, else those that are free (at most half of all when
another decode holds some, so that two sidecars converge on half each), and it decodes on that many threads (at
least one, waiting for a core if none is free). Two sidecars decoding at once share the cores, a thread
each on 2 cores: 73-80 tok/s each for Gemma, where taking whole turns of both cores gave 42-50 each. The sidecar's
OpenMP workers sleep soon after a decode instead of spinning for the next (``GOMP_SPINCOUNT``,
:func:`lemonkit.backends.sidecar_env`). Threads never change an answer (see ``step_costs.py``).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import stat
import tempfile
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path

__all__ = ["CpuTurns", "Turn", "any_cores", "on_cores"]

#: Entered around a decode of ``threads`` threads; yields the threads it may take.
Turn = Callable[[int], AbstractContextManager[int]]


def any_cores(threads: int) -> AbstractContextManager[int]:
    """No turns: a decode takes its threads."""
    return contextlib.nullcontext(threads)


@contextlib.contextmanager
def on_cores(turn: Turn, threads: tuple[int, int]) -> Iterator[tuple[int, int]]:
    """Hold cores for a decode of ``threads`` (llama.cpp's one-token and batch threads) while the block runs.

    Yields:
        The threads the decode may take: ``threads``, each at most the cores its turn gave.
    """
    with turn(max(threads)) as cores:
        yield min(threads[0], cores), min(threads[1], cores)


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
    """The cores this machine's llama.cpp decodes take turns on.

    Args:
        directory: Where the lock files are (default: a private directory under the temporary directory).
    """

    def __init__(self, *, directory: Path | None = None) -> None:
        self.cores = _cores()
        directory = directory or _private_dir()
        self._fds = [
            os.open(directory / f"core-{i}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            for i in range(self.cores)
        ]

    @contextlib.contextmanager
    def turn(self, threads: int) -> Iterator[int]:
        """Hold up to ``threads`` cores while the block runs: those that are free, at most half of them when another
        decode holds some (so that two sidecars converge on half each, not one on all but one), else wait for one.

        Yields:
            How many cores are held: the threads the decode may take.
        """
        start = random.randrange(self.cores)
        order = self._fds[start:] + self._fds[:start]
        held: list[int] = []
        shared = False
        for fd in order:
            if len(held) == threads:
                break
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                shared = True
                continue
            held.append(fd)
        if shared:
            for fd in held[max(1, self.cores // 2) :]:
                fcntl.flock(fd, fcntl.LOCK_UN)
            del held[max(1, self.cores // 2) :]
        if not held:
            fcntl.flock(order[0], fcntl.LOCK_EX)
            held.append(order[0])
        try:
            yield len(held)
        finally:
            for fd in held:
                fcntl.flock(fd, fcntl.LOCK_UN)

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []
