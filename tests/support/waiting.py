"""Waiting for a condition the server reaches on its own (a download's state, a queued request), bounded."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

__all__ = ["until"]

T = TypeVar("T")


async def until(check: Callable[[], Awaitable[T]], what: str, timeout: float = 60) -> T:
    """Poll ``check`` until it returns something truthy (bounded by ``timeout`` seconds).

    Raises:
        AssertionError: ``check`` was still falsy at the deadline.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = await check()
        if value:
            return value
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)
