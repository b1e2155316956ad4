"""Fair turns at the models for many users, and per-user limits.

Every model request passes :meth:`FairScheduler.admission` (the user's limits: requests open at once and the
request rate, refused at once with :class:`~lemonkit.errors.TooManyRequests`) and then takes a turn at its model
(:meth:`FairScheduler.turn`): a model serves ``capacity`` requests at once (its sidecar's slots), and the
requests waiting for it are queued per user and granted round-robin across users, so that one user's batch
cannot hold everyone else back. A request whose client leaves while it waits leaves the queue.

A user's limits count, per user and across models:

- *active*: requests admitted and not finished, whether served or waiting for their turn;
- *queued*: those of them waiting for a turn;
- *rate*: requests admitted per minute (a token bucket holding a minute's worth).

``0`` is no limit, the default (a personal server's one user is its owner).

Background requests (a batch's rows, :data:`background`) wait behind every interactive one, and hold at most all but
one of a model's slots: the last is kept for interactive requests, so a chat sent while a batch runs starts at once.
Among background requests the round-robin across users is the same.

Besides, the requests waiting at one model, all users together, are bounded (``max_queue``, back-pressure): one
more is refused at once with :class:`~lemonkit.errors.QueueFull` (503), told to retry once the queue ahead of it
has likely been served, rather than left waiting past its client's own timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from lemonkit.catalog.config import UserLimits
from lemonkit.errors import QueueFull, TooManyRequests

__all__ = ["FairScheduler", "ModelQueue", "TokenBucket", "background"]

log = logging.getLogger("lemonkit.fairness")

#: the seconds a turn is guessed to last before any has been measured
_FIRST_GUESS = 1.0
#: the user whose admitted request the running code serves (tasks it starts inherit it)
_admitted: contextvars.ContextVar[str | None] = contextvars.ContextVar("lemonkit_admitted", default=None)
#: the running code serves background work (a batch's rows): its turns wait behind interactive requests
background: contextvars.ContextVar[bool] = contextvars.ContextVar("lemonkit_background", default=False)


class TokenBucket:
    """``per_minute`` requests a minute: a full minute's worth may come at once, then one every
    ``60 / per_minute`` seconds.

    Args:
        per_minute: Requests allowed per minute (more than 0).
        clock: Seconds, monotonic.
    """

    def __init__(self, per_minute: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity = float(per_minute)
        self.per_second = per_minute / 60.0
        self._clock = clock
        self._tokens = self.capacity
        self._at = clock()

    def take(self) -> float:
        """Take one request's token.

        Returns:
            0 when taken; else the seconds until a token is there (nothing was taken).
        """
        now = self._clock()
        self._tokens = min(self.capacity, self._tokens + (now - self._at) * self.per_second)
        self._at = now
        if self._tokens >= 1:
            self._tokens -= 1
            return 0.0
        return (1 - self._tokens) / self.per_second


class ModelQueue:
    """Turns at one model: ``capacity`` at once; waiting requests queued per user, granted round-robin.

    Args:
        capacity: Requests served at once.
    """

    def __init__(self, capacity: int = 1) -> None:
        self.capacity = max(1, capacity)
        self.in_flight = 0
        #: user -> their waiting requests; a user's place in this order is their place in the round
        self._waiting: dict[str, deque[asyncio.Future[None]]] = {}
        #: the same for background requests, granted only when no interactive request waits
        self._background: dict[str, deque[asyncio.Future[None]]] = {}
        self._last_background: str | None = None
        #: turns held by background requests
        self.behind_in_flight = 0
        self._last: str | None = None
        #: seconds a turn lasts, smoothed: what a refused request is told to wait
        self.typical_turn = _FIRST_GUESS

    @property
    def waiting(self) -> int:
        return sum(len(q) for q in self._waiting.values()) + sum(len(q) for q in self._background.values())

    def retry_after(self) -> float:
        """Seconds until the requests waiting now have likely had their turns (a refused request's
        ``Retry-After``): the queue's depth times the typical turn, over the turns served at once."""
        return self.typical_turn * max(1, self.waiting) / self.capacity

    def health(self) -> dict[str, Any]:
        """The ``/v1/health`` figures: slots busy and idle, requests waiting."""
        busy = min(self.in_flight, self.capacity)
        return {
            "slots": {"total": self.capacity, "busy": busy, "idle": self.capacity - busy},
            "queue_depth": self.waiting,
        }

    def must_wait(self, *, behind: bool | None = None) -> bool:
        """Whether a request arriving now waits for its turn (``behind``: it is a background one; default: whether
        the running code is, :data:`background`)."""
        behind = background.get() if behind is None else behind
        if self.in_flight >= self.capacity or self._waiting:
            return True
        return behind and (bool(self._background) or not self._room_behind())

    def _room_behind(self) -> bool:
        """Whether a background request may take a turn now: all slots but one at most (one slot: that one)."""
        return self.behind_in_flight < max(1, self.capacity - 1)

    def set_capacity(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._grant()

    async def acquire(self, user: str) -> None:
        """Wait for ``user``'s turn (at once when the model has room and nobody waits).

        Raises:
            CancelledError: The request was cancelled meanwhile; it holds no turn.
        """
        behind = background.get()
        if not self.must_wait(behind=behind):
            self._granted(user, behind=behind)
            return
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiting = self._background if behind else self._waiting
        waiting.setdefault(user, deque()).append(turn)
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self.release(behind=behind)  # granted just as it was cancelled: pass the turn on
            else:
                self._forget(waiting, user, turn)
            raise

    def release(self, held: float | None = None, *, behind: bool = False) -> None:
        """End a turn (``held``: the seconds it lasted; ``behind``: a background request's) and grant the next."""
        self.in_flight -= 1
        if behind:
            self.behind_in_flight -= 1
        if held is not None:
            self.typical_turn = 0.8 * self.typical_turn + 0.2 * held
        self._grant()

    def _granted(self, user: str, *, behind: bool = False) -> None:
        self.in_flight += 1
        if behind:
            self.behind_in_flight += 1
            self._last_background = user
        else:
            self._last = user

    def _forget(self, waiting: dict[str, deque[asyncio.Future[None]]], user: str, turn: asyncio.Future[None]) -> None:
        queue = waiting.get(user)
        if queue is not None and turn in queue:
            queue.remove(turn)
            if not queue:
                del waiting[user]
        turn.cancel()

    @staticmethod
    def _next_user(waiting: dict[str, deque[asyncio.Future[None]]], last: str | None) -> str:
        """The first user in the round who was not served last (them only when nobody else waits)."""
        return next((u for u in waiting if u != last), next(iter(waiting)))

    def _grant(self) -> None:
        while self.in_flight < self.capacity and (self._waiting or (self._background and self._room_behind())):
            behind = not self._waiting
            waiting = self._background if behind else self._waiting
            user = self._next_user(waiting, self._last_background if behind else self._last)
            queue = waiting.pop(user)
            turn = queue.popleft()
            if queue:
                waiting[user] = queue  # back to the end of the round
            if turn.done():  # cancelled: its task is unwinding
                continue
            turn.set_result(None)
            self._granted(user, behind=behind)


@dataclass
class _User:
    active: int = 0
    queued: int = 0


class FairScheduler:
    """Per-user admission and fair turns at every model of one server.

    Args:
        limits: Per-user limits (``0``: none).
        clock: Seconds, monotonic (the rate's bucket and the turn times).
        max_queue: Requests of all users that may wait at one model (``0``: no bound).
    """

    def __init__(self, limits: UserLimits, clock: Callable[[], float] = time.monotonic, *, max_queue: int = 0) -> None:
        self.limits = limits
        self.max_queue = max_queue
        self._clock = clock
        self._users: dict[str, _User] = {}
        self._buckets: dict[str, TokenBucket] = {}
        self._queues: dict[str, ModelQueue] = {}

    def queue(self, model: str) -> ModelQueue:
        """The turns at ``model`` (made on first use)."""
        queue = self._queues.get(model)
        if queue is None:
            queue = self._queues[model] = ModelQueue()
        return queue

    def health(self, model: str) -> dict[str, Any]:
        """``model``'s slots and queue, for ``/v1/health`` (what it would have before any request)."""
        return self.queue(model).health()

    def busy(self, model: str) -> bool:
        """Whether ``model`` is serving a request or has some waiting."""
        queue = self._queues.get(model)
        return queue is not None and (queue.in_flight > 0 or queue.waiting > 0)

    def active(self, user: str) -> int:
        """``user``'s requests admitted and not finished."""
        state = self._users.get(user)
        return state.active if state else 0

    @contextlib.asynccontextmanager
    async def admission(self, user: str, model: str, *, metered: bool = True) -> AsyncIterator[None]:
        """Admit one request of ``user`` for ``model`` for as long as the block runs.

        Inside a block already admitted for ``user`` (one request that uses several models, such as a recipe's
        stages, even from tasks it started), the request has counted once: only the queues are checked.

        Args:
            metered: Charge it to the user's request rate (a session's later utterances are not: the session
                was, when it started).

        Raises:
            TooManyRequests: The user has ``max_active`` requests open, or used their rate; nothing was done.
            QueueFull: ``max_queue`` requests wait at the model already; nothing was done.
        """
        if _admitted.get() == user:
            self._check_queued(user, model)
            yield
            return
        limits = self.limits
        if limits.max_active and self.active(user) >= limits.max_active:
            raise TooManyRequests(
                f"You have {self.active(user)} requests under way (at most {limits.max_active} at once): "
                "wait for one to finish",
                retry_after=self.queue(model).typical_turn,
            )
        self._check_queued(user, model)
        if metered and limits.rate:
            bucket = self._buckets.get(user)
            if bucket is None:
                bucket = self._buckets[user] = TokenBucket(limits.rate, self._clock)
            wait = bucket.take()
            if wait:
                raise TooManyRequests(
                    f"You sent {limits.rate} requests in the last minute (the most allowed)",
                    retry_after=math.ceil(wait),
                )
        state = self._users.setdefault(user, _User())  # refused requests leave nothing behind
        state.active += 1
        inside = _admitted.set(user)
        try:
            yield
        finally:
            _admitted.reset(inside)
            state.active -= 1
            if not state.active:
                del self._users[user]

    def _check_queued(self, user: str, model: str) -> None:
        """Refuse a request that would wait where its user, or the model's queue, has no more room."""
        queue, limit = self.queue(model), self.limits.max_queued
        if not queue.must_wait():
            return
        waiting = self._users[user].queued if user in self._users else 0
        if limit and waiting >= limit:
            raise TooManyRequests(
                f"You have {waiting} requests waiting (at most {limit}): wait for one to start",
                retry_after=queue.retry_after(),
            )
        if self.max_queue and queue.waiting >= self.max_queue:
            raise QueueFull(
                f"{queue.waiting} requests are waiting for {model} already (at most {self.max_queue}): "
                "the server is busy, try again later",
                retry_after=queue.retry_after(),
            )

    @contextlib.asynccontextmanager
    async def turn(self, model: str, user: str) -> AsyncIterator[ModelQueue]:
        """Hold a turn at ``model`` for ``user`` (an admitted request) while the block runs.

        Raises:
            TooManyRequests: The request would wait, and the user has ``max_queued`` requests waiting already.
            QueueFull: The request would wait, and ``max_queue`` requests wait at the model already.
            CancelledError: The request was cancelled while it waited; it left the queue.
        """
        queue = self.queue(model)
        self._check_queued(user, model)  # again: a load may have come between admission and turn
        state = self._users.setdefault(user, _User())
        if queue.must_wait():  # in the user's own log stream: why their request has not started yet
            log.info("%s waits for a turn at %s (%d served, %d waiting)", user, model, queue.in_flight, queue.waiting)
        state.queued += 1
        behind = background.get()
        try:
            await queue.acquire(user)
        finally:
            state.queued -= 1
        start = self._clock()
        try:
            yield queue
        finally:
            queue.release(self._clock() - start, behind=behind)
