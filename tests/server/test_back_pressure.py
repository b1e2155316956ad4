"""Back-pressure on both personal hosts, through real HTTP: a model's queue is bounded (``max_queue``: the
Jupyter extension's traitlet, ``lemonkit serve --max-queue``), one more request is answered 503 at once with
``Retry-After``, and ``/v1/health`` shows the model's slots and queue depth meanwhile.

A streamed request holds the model's one slot for as long as the test needs: its client reads the first event,
then stops reading through a small receive buffer, so the server's writes back up and the long generation cannot
finish; closing the stream ends it.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

from lemonkit.client import AsyncClient
from lemonkit.errors import QueueFull
from tests.support.hosts import API_KEY, Host, Standalone
from tests.support.tiny_models import TINY
from tests.support.waiting import until

MAX_QUEUE = 2
CHAT = {"messages": [{"role": "user", "content": "go"}], "temperature": 0}


@pytest.fixture
def jp_server_config() -> dict[str, Any]:
    return {"ServerApp": {"jpserver_extensions": {"lemonkit": True}}, "LemonkitExtension": {"max_queue": MAX_QUEUE}}


@pytest.fixture(params=["jupyter", "standalone"])
def bounded(request: pytest.FixtureRequest) -> Iterator[Host]:
    """A host whose models queue at most ``MAX_QUEUE`` requests."""
    if request.param == "jupyter":
        yield request.getfixturevalue("jupyter_host")
        return
    server = Standalone({"LEMONADE_API_KEY": API_KEY}, args=("--max-queue", str(MAX_QUEUE)))
    try:
        yield Host("standalone", server.root, API_KEY)
    finally:
        server.stop()


async def _entry(client: httpx.AsyncClient) -> dict[str, Any]:
    """TINY's ``/v1/health`` entry."""
    health = (await client.get("health")).json()
    (entry,) = [m for m in health["all_models_loaded"] if m["model_name"] == TINY]
    return entry


class Holder:
    """A streamed chat request that holds TINY's slot: read one event, then read no more until closed."""

    def __init__(self, host: Host) -> None:
        # a tiny receive window: what the server writes backs up after a few events, not after the whole answer
        transport = httpx.AsyncHTTPTransport(socket_options=[(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)])
        self.client = host.client(transport=transport)

    async def __aenter__(self) -> Holder:
        body = {"model": TINY, "max_tokens": 4000, "stream": True, **CHAT}
        self._stream = self.client.stream("POST", "chat/completions", json=body)
        response = await self._stream.__aenter__()
        assert response.status_code == 200
        self._lines: AsyncIterator[str] = response.aiter_lines()
        first = await anext(self._lines)
        assert first.startswith("data: {"), first  # generating: it has its turn
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stream.__aexit__(None, None, None)  # unread: the connection closes, the server stops it
        await self.client.aclose()


def completion(i: int) -> dict[str, Any]:
    return {"model": TINY, "max_tokens": 2, **CHAT, "messages": [{"role": "user", "content": f"request {i}"}]}


async def test_a_full_queue_answers_503_with_retry_after_while_the_queued_complete(bounded: Host) -> None:
    async with bounded.client() as client:
        assert (
            await client.post("load", json={"model_name": TINY, "ctx_size": 4096, "llamacpp_args": "--parallel 1"})
        ).status_code == 200
        assert (await _entry(client))["slots"] == {"total": 1, "busy": 0, "idle": 1}
        async with Holder(bounded):
            queued = [asyncio.ensure_future(client.post("chat/completions", json=completion(i))) for i in range(2)]

            async def full() -> dict[str, Any] | None:
                entry = await _entry(client)
                return entry if entry["queue_depth"] == MAX_QUEUE else None

            entry = await until(full, "both requests to queue behind the held one")
            assert entry["slots"] == {"total": 1, "busy": 1, "idle": 0}
            with pytest.raises(QueueFull) as raised:  # the Python client raises it as its class
                async with AsyncClient(bounded.root, token=bounded.token) as lemonkit_client:
                    await lemonkit_client.request("POST", "chat/completions", json=completion(98))
            assert raised.value.status == 503 and raised.value.retry_after >= 1
            refused = await client.post("chat/completions", json=completion(99))
            assert refused.status_code == 503, refused.text
            assert refused.headers["Content-Type"].startswith("application/json")
            error = refused.json()["error"]
            assert set(error) == {"message", "type", "code"} and error["message"]
            assert (error["type"], error["code"]) == ("server_busy_error", "queue_full")
            assert int(refused.headers["Retry-After"]) >= 1
            assert (await _entry(client))["queue_depth"] == MAX_QUEUE  # the refused one never queued
            assert not any(q.done() for q in queued)
        answers = await asyncio.gather(*queued)
        for answer in answers:
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["message"]["role"] == "assistant"

        async def idle() -> bool:
            entry = await _entry(client)
            return entry["slots"]["busy"] == 0 and entry["queue_depth"] == 0

        await until(idle, "the model to be idle")
        assert (await _entry(client))["slots"] == {"total": 1, "busy": 0, "idle": 1}
        again = await client.post("chat/completions", json=completion(100))  # room again
        assert again.status_code == 200, again.text
