"""The fair scheduler (lemonkit.serving.fairness), driven by plain asyncio tasks: grant order, limits, cancellation."""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable

import pytest

from lemonkit.catalog.config import UserLimits
from lemonkit.errors import QueueFull, TooManyRequests, error_from_body
from lemonkit.serving.fairness import FairScheduler, ModelQueue, TokenBucket, background

MODEL = "m"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def settle(condition: Callable[[], bool], what: str) -> None:
    """Let the other tasks run until ``condition`` holds (they only need the loop's turns, never time)."""
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"never reached: {what}")


class Run:
    """Requests through one scheduler; each records its turn and, if told to, holds it until released."""

    def __init__(self, scheduler: FairScheduler) -> None:
        self.scheduler = scheduler
        self.order: list[str] = []
        self.gates: dict[str, asyncio.Event] = {}

    def start(
        self, user: str, label: str, *, hold: bool = False, metered: bool = True, behind: bool = False
    ) -> asyncio.Task[None]:
        if hold:
            self.gates[label] = asyncio.Event()
        context = contextvars.copy_context()
        context.run(background.set, behind)  # a batch's row (lemonkit.server.batches sets it in its tasks)
        return asyncio.get_running_loop().create_task(self._request(user, label, metered), context=context)

    async def _request(self, user: str, label: str, metered: bool) -> None:
        async with self.scheduler.admission(user, MODEL, metered=metered):
            async with self.scheduler.turn(MODEL, user):
                self.order.append(label)
                if label in self.gates:
                    await self.gates[label].wait()

    @property
    def queue(self) -> ModelQueue:
        return self.scheduler.queue(MODEL)


def scheduler(max_queue: int = 0, **limits: int) -> FairScheduler:
    return FairScheduler(UserLimits(**limits), max_queue=max_queue)


async def test_one_user_batch_does_not_starve_another() -> None:
    run = Run(scheduler())
    first = run.start("alice", "a0", hold=True)
    await settle(lambda: run.order == ["a0"], "alice's first request served")
    tasks = [run.start("alice", f"a{i}") for i in range(1, 8)]
    await settle(lambda: run.queue.waiting == 7, "alice's batch queued")
    tasks.append(run.start("bob", "b0"))
    await settle(lambda: run.queue.waiting == 8, "bob queued behind alice's batch")
    run.gates["a0"].set()
    await asyncio.gather(first, *tasks)
    assert run.order == ["a0", "b0", "a1", "a2", "a3", "a4", "a5", "a6", "a7"]
    assert run.queue.in_flight == 0 and run.queue.waiting == 0


async def test_users_take_turns_round_robin() -> None:
    run = Run(scheduler())
    holder = run.start("zed", "z", hold=True)
    await settle(lambda: run.order == ["z"], "zed served")
    tasks = [run.start(user, f"{user}{i}") for user in ("a", "b", "c") for i in range(3)]
    await settle(lambda: run.queue.waiting == 9, "everyone queued")
    run.gates["z"].set()
    await asyncio.gather(holder, *tasks)
    assert run.order == ["z", "a0", "b0", "c0", "a1", "b1", "c1", "a2", "b2", "c2"]


async def test_capacity_serves_that_many_at_once() -> None:
    run = Run(scheduler())
    run.queue.set_capacity(2)
    tasks = [run.start("a", f"a{i}", hold=True) for i in range(3)]
    await settle(lambda: len(run.order) == 2 and run.queue.waiting == 1, "two served, one waiting")
    assert run.queue.in_flight == 2
    run.gates[run.order[0]].set()
    await settle(lambda: len(run.order) == 3, "the third served once one ended")
    for gate in run.gates.values():
        gate.set()
    await asyncio.gather(*tasks)
    assert run.queue.in_flight == 0


async def test_raising_the_capacity_grants_waiting_requests() -> None:
    run = Run(scheduler())
    tasks = [run.start("a", f"a{i}", hold=True) for i in range(3)]
    await settle(lambda: run.queue.waiting == 2, "two waiting")
    run.queue.set_capacity(3)
    await settle(lambda: len(run.order) == 3, "all served")
    for gate in run.gates.values():
        gate.set()
    await asyncio.gather(*tasks)


async def test_max_active_refuses_at_once_and_admits_again() -> None:
    sched = scheduler(max_active=2)
    run = Run(sched)
    held = [run.start("alice", f"a{i}", hold=True) for i in range(2)]
    await settle(lambda: sched.active("alice") == 2, "two admitted")
    with pytest.raises(TooManyRequests) as refused:
        async with sched.admission("alice", MODEL):
            pass
    assert refused.value.status == 429 and refused.value.code == "rate_limit_exceeded"
    assert refused.value.retry_after > 0
    async with sched.admission("bob", MODEL):  # another user is not held back by alice's limit
        pass
    run.gates["a0"].set()
    await held[0]
    again = run.start("alice", "a2")
    run.gates["a1"].set()
    await asyncio.gather(held[1], again)
    assert run.order == ["a0", "a1", "a2"] and sched.active("alice") == 0


async def test_max_queued_counts_only_waiting_requests() -> None:
    sched = scheduler(max_queued=2)
    run = Run(sched)
    holder = run.start("bob", "b0", hold=True)
    await settle(lambda: run.order == ["b0"], "bob served")
    waiting = [run.start("alice", f"a{i}") for i in range(2)]
    await settle(lambda: run.queue.waiting == 2, "alice's two queued")
    with pytest.raises(TooManyRequests) as refused:
        async with sched.admission("alice", MODEL):
            pass
    assert "waiting" in refused.value.message and refused.value.retry_after > 0
    assert sched.active("alice") == 2  # the refused one left nothing behind
    run.gates["b0"].set()
    await asyncio.gather(holder, *waiting)
    assert run.order == ["b0", "a0", "a1"]


async def test_rate_refuses_until_the_bucket_refills() -> None:
    clock = Clock()
    sched = FairScheduler(UserLimits(rate=2), clock=clock)
    for _ in range(2):
        async with sched.admission("alice", MODEL):
            pass
    with pytest.raises(TooManyRequests) as refused:
        async with sched.admission("alice", MODEL):
            pass
    assert refused.value.retry_after == 30  # one request every 60 / 2 seconds
    async with sched.admission("bob", MODEL):  # buckets are per user
        pass
    async with sched.admission("alice", MODEL, metered=False):  # a session's utterance is not charged
        pass
    clock.now += 30
    async with sched.admission("alice", MODEL):
        pass
    with pytest.raises(TooManyRequests):
        async with sched.admission("alice", MODEL):
            pass


def test_token_bucket_refill_is_capped_at_a_minute() -> None:
    clock = Clock()
    bucket = TokenBucket(60, clock)
    assert all(bucket.take() == 0 for _ in range(60))
    assert bucket.take() == pytest.approx(1.0)
    clock.now += 3600  # an hour idle still allows one minute's burst only
    assert all(bucket.take() == 0 for _ in range(60))
    assert bucket.take() > 0


async def test_a_cancelled_waiter_leaves_the_queue() -> None:
    sched = scheduler(max_queued=1)
    run = Run(sched)
    holder = run.start("bob", "b0", hold=True)
    await settle(lambda: run.order == ["b0"], "bob served")
    gone = run.start("alice", "a0")
    await settle(lambda: run.queue.waiting == 1, "alice queued")
    gone.cancel()
    await asyncio.gather(gone, return_exceptions=True)
    assert run.queue.waiting == 0 and sched.active("alice") == 0
    after = run.start("alice", "a1")  # her queued slot is free again
    await settle(lambda: run.queue.waiting == 1, "alice queued again")
    run.gates["b0"].set()
    await asyncio.gather(holder, after)
    assert run.order == ["b0", "a1"] and run.queue.in_flight == 0


async def test_a_waiter_cancelled_as_it_is_granted_passes_the_turn_on() -> None:
    run = Run(scheduler())
    holder = run.start("bob", "b0", hold=True)
    await settle(lambda: run.order == ["b0"], "bob served")
    granted_then_gone = run.start("alice", "a0")
    next_one = run.start("carol", "c0")
    await settle(lambda: run.queue.waiting == 2, "both queued")
    run.gates["b0"].set()
    await settle(lambda: holder.done(), "bob done")
    # alice's turn was granted when bob's ended; her task has not run since: it is cancelled now
    assert run.queue.in_flight == 1 and "a0" not in run.order
    granted_then_gone.cancel()
    await asyncio.gather(granted_then_gone, next_one, return_exceptions=True)
    assert granted_then_gone.cancelled()
    assert run.order == ["b0", "c0"] and run.queue.in_flight == 0 and run.queue.waiting == 0


async def test_a_request_that_fails_in_its_turn_releases_it() -> None:
    sched = scheduler(max_active=1)
    with pytest.raises(RuntimeError):
        async with sched.admission("alice", MODEL), sched.turn(MODEL, "alice"):
            raise RuntimeError("the engine failed")
    assert sched.queue(MODEL).in_flight == 0 and sched.active("alice") == 0
    async with sched.admission("alice", MODEL), sched.turn(MODEL, "alice"):
        assert sched.busy(MODEL)
    assert not sched.busy(MODEL)


async def test_one_request_using_several_models_counts_once() -> None:
    """Uses inside an admitted request (also from tasks it starts, also overlapping) count neither toward
    max_active nor toward the rate; another request of the same user meanwhile is refused as before."""
    sched = scheduler(max_active=1, rate=2)
    inner_done = asyncio.Event()

    async def stage(model: str) -> None:
        async with sched.admission("alice", model), sched.turn(model, "alice"):
            await inner_done.wait()

    async with sched.admission("alice", "asr"):
        speaking = asyncio.ensure_future(stage("tts"))  # the voice speaks while the reply is generated
        await settle(lambda: sched.busy("tts"), "the voice's turn")
        async with sched.admission("alice", "chat"), sched.turn("chat", "alice"):
            assert sched.active("alice") == 1
        inner_done.set()
        await speaking

        async def another_request() -> None:
            async with sched.admission("alice", "chat"):
                pass

        other = asyncio.get_running_loop().create_task(another_request(), context=contextvars.Context())
        with pytest.raises(TooManyRequests):
            await other
    assert sched.active("alice") == 0
    async with sched.admission("alice", "chat"):  # the rate had one left: the run took one, not four
        pass
    with pytest.raises(TooManyRequests):
        async with sched.admission("alice", "chat"):
            pass


def test_user_limits_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    assert UserLimits.from_env() == UserLimits(0, 0, 0)
    monkeypatch.setenv("LEMONKIT_USER_MAX_ACTIVE", "2")
    monkeypatch.setenv("LEMONKIT_USER_MAX_QUEUED", "5")
    monkeypatch.setenv("LEMONKIT_USER_RATE", "30")
    assert UserLimits.from_env() == UserLimits(max_active=2, max_queued=5, rate=30)
    assert UserLimits.from_env(rate=0, max_active=None) == UserLimits(max_active=2, max_queued=5, rate=0)
    monkeypatch.setenv("LEMONKIT_USER_RATE", "-1")
    with pytest.raises(ValueError, match="LEMONKIT_USER_RATE"):
        UserLimits.from_env()
    monkeypatch.setenv("LEMONKIT_USER_RATE", "many")
    with pytest.raises(ValueError, match="integer"):
        UserLimits.from_env()


async def test_max_queue_bounds_all_users_waiting_at_a_model() -> None:
    sched = scheduler(max_queue=2)
    run = Run(sched)
    holder = run.start("bob", "b0", hold=True)
    await settle(lambda: run.order == ["b0"], "bob served")
    assert run.queue.health() == {"slots": {"total": 1, "busy": 1, "idle": 0}, "queue_depth": 0}
    waiting = [run.start("alice", "a0"), run.start("carol", "c0")]
    await settle(lambda: run.queue.waiting == 2, "two users' requests queued")
    assert run.queue.health()["queue_depth"] == 2
    with pytest.raises(QueueFull) as refused:  # a third user, with no request of their own yet
        async with sched.admission("dave", MODEL):
            pass
    assert refused.value.status == 503 and refused.value.code == "queue_full"
    # two waiting, one served at a time: two typical turns (the first guess, nothing measured yet)
    assert refused.value.retry_after == pytest.approx(2 * run.queue.typical_turn)
    assert sched.active("dave") == 0  # the refused request left nothing behind
    run.gates["b0"].set()
    await asyncio.gather(holder, *waiting)
    assert sorted(run.order[1:]) == ["a0", "c0"]
    assert run.queue.health() == {"slots": {"total": 1, "busy": 0, "idle": 1}, "queue_depth": 0}
    async with sched.admission("dave", MODEL), sched.turn(MODEL, "dave"):  # room again
        pass


async def test_max_queue_refuses_only_requests_that_would_wait() -> None:
    sched = scheduler(max_queue=1)
    sched.queue(MODEL).set_capacity(2)
    run = Run(sched)
    held = [run.start("alice", f"a{i}", hold=True) for i in range(2)]  # both slots, nobody waits
    await settle(lambda: run.order == ["a0", "a1"], "two served at once")
    queued = run.start("bob", "b0")
    await settle(lambda: run.queue.waiting == 1, "bob queued")
    with pytest.raises(QueueFull) as refused:
        async with sched.admission("carol", MODEL), sched.turn(MODEL, "carol"):
            pass
    assert refused.value.retry_after == pytest.approx(run.queue.typical_turn / 2)  # two slots
    for gate in run.gates.values():
        gate.set()
    await asyncio.gather(*held, queued)
    assert run.order == ["a0", "a1", "b0"]


async def test_no_max_queue_means_no_bound() -> None:
    sched = scheduler()
    run = Run(sched)
    holder = run.start("bob", "b0", hold=True)
    await settle(lambda: run.order == ["b0"], "bob served")
    waiting = [run.start(f"u{i}", f"u{i}") for i in range(100)]
    await settle(lambda: run.queue.waiting == 100, "a hundred queued")
    run.gates["b0"].set()
    await asyncio.gather(holder, *waiting)
    assert len(run.order) == 101


def test_queue_full_is_a_503_the_client_raises() -> None:
    exc = error_from_body(503, QueueFull("busy", retry_after=3).to_dict())
    assert isinstance(exc, QueueFull) and exc.status == 503 and exc.type == "server_busy_error"


def test_max_queue_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    from lemonkit.catalog.config import DEFAULT_MAX_QUEUE, Settings

    assert Settings().max_queue == DEFAULT_MAX_QUEUE
    monkeypatch.setenv("LEMONKIT_MAX_QUEUE", "0")
    assert Settings().max_queue == 0
    monkeypatch.setenv("LEMONKIT_MAX_QUEUE", "-1")
    with pytest.raises(ValueError, match="LEMONKIT_MAX_QUEUE"):
        Settings()


async def test_background_requests_keep_a_slot_free_and_wait_behind_interactive_ones() -> None:
    """A batch's rows take all slots but one; a chat takes that one at once, and goes before the rows still waiting;
    with the chat done, the rows fill the slots they may, round-robin across users."""
    run = Run(scheduler())
    run.queue.set_capacity(3)
    rows = [run.start("alice", f"r{i}", hold=True, behind=True) for i in range(4)]
    await settle(lambda: run.order == ["r0", "r1"] and run.queue.waiting == 2, "two rows served, two waiting")
    assert run.queue.behind_in_flight == 2 and run.queue.in_flight == 2
    chat = run.start("bob", "chat", hold=True)
    await settle(lambda: run.order[-1:] == ["chat"], "the chat served at once, in the kept slot")
    assert run.queue.in_flight == 3
    other = run.start("carol", "c0", behind=True)
    second_chat = run.start("bob", "chat2")
    await settle(lambda: run.queue.waiting == 4, "rows of two users and a chat waiting")
    run.gates["r0"].set()  # a slot frees: the waiting chat goes before every waiting row
    await settle(lambda: run.order[-1:] == ["chat2"], "the second chat before the rows")
    run.gates["chat"].set()  # the chat's slot is kept free: no row takes a third slot
    await settle(lambda: len(run.order) == 5, "one row in the freed row slot")
    assert run.order[-1] == "c0"  # carol's first row before alice's third: round-robin across users
    assert run.queue.behind_in_flight == 2 and run.queue.in_flight == 2
    for gate in run.gates.values():
        gate.set()
    await asyncio.gather(*rows, chat, other, second_chat)
    assert run.order[5:] == ["r2", "r3"]
    assert run.queue.in_flight == 0 and run.queue.behind_in_flight == 0


async def test_a_one_slot_model_serves_background_requests_too() -> None:
    run = Run(scheduler())
    tasks = [run.start("alice", f"r{i}", behind=True) for i in range(3)]
    await asyncio.gather(*tasks)
    assert run.order == ["r0", "r1", "r2"] and run.queue.behind_in_flight == 0
