"""Several generations of one request at once: each source runs on a thread of its own, so that the decode thread
steps them together, and their items reach the caller as they come."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from lemonkit.backends.protocol import Cancelled

__all__ = ["interleave"]

T = TypeVar("T")

_ITEM, _ERROR, _DONE = range(3)


def interleave(
    sources: Sequence[Callable[[Cancelled], Iterator[T]]], window: int, cancelled: Cancelled
) -> Iterator[tuple[int, T]]:
    """``(index, item)`` of every source, at most ``window`` of them running at once, started in index order.

    Each source is called (on the caller's thread, in index order) with the cancellation it must honour, and
    iterated on a thread of its own. With ``window`` 1 or a single source, everything runs on the caller's thread.
    Closing the iterator, or ``cancelled``, stops every source at its next item; it returns once their threads
    have ended.

    Raises:
        BaseException: The first error a source raised (the others are stopped).
    """
    if window <= 1 or len(sources) <= 1:
        for index, source in enumerate(sources):
            for item in source(cancelled):
                yield index, item
        return
    out: queue.SimpleQueue[tuple[int, int, Any]] = queue.SimpleQueue()
    stop = threading.Event()

    def gone() -> bool:
        return stop.is_set() or cancelled()

    def work(index: int, items: Iterator[T]) -> None:
        try:
            for item in items:
                out.put((index, _ITEM, item))
        except BaseException as exc:
            out.put((index, _ERROR, exc))
        finally:
            out.put((index, _DONE, None))

    threads: list[threading.Thread] = []

    def start() -> None:
        index = len(threads)
        thread = threading.Thread(target=work, args=(index, sources[index](gone)), name=f"prompt-{index}", daemon=True)
        threads.append(thread)
        thread.start()

    running = 0
    try:
        while len(threads) < min(window, len(sources)):
            start()
            running += 1
        while running:
            index, kind, payload = out.get()
            if kind == _ITEM:
                if cancelled():  # what the sources made before they saw it is not sent
                    return
                yield index, payload
            elif kind == _ERROR:
                raise payload
            else:
                running -= 1
                if len(threads) < len(sources) and not gone():
                    start()
                    running += 1
    finally:
        stop.set()
        for thread in threads:
            thread.join()
