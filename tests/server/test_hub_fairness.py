"""Fairness and isolation between the users of the JupyterHub service, against a real hub (tests/support/hub_process.py)
and the bundled default chat model: one user's batch does not hold another back, a user's rate limit answers 429
without touching the others, and a user sees neither another's log records nor the download jobs others asked for.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import connect as aconnect
from websockets.sync.client import connect

from lemonkit.catalog.config import DEFAULT_CHAT_MODEL
from tests.support.hub_process import JupyterHub

pytestmark = [pytest.mark.hub, pytest.mark.slow]

#: alice's and bob's requests per minute (the fairness test spends 8 of alice's)
RATE = 30
USERS = ("alice", "bob", "admin")


def chat(max_tokens: int, **extra: Any) -> dict[str, Any]:
    prompt = "Write a long story about a lighthouse keeper and the ships she saw."
    return {"model": DEFAULT_CHAT_MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens}


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[JupyterHub]:
    environment = {"LEMONKIT_USER_RATE": str(RATE)}
    with JupyterHub(tmp_path_factory.mktemp("hub"), environment=environment) as running:
        yield running


@pytest.fixture(scope="module")
def headers(hub: JupyterHub) -> dict[str, dict[str, str]]:
    return {user: hub.headers(user) for user in USERS}


def assert_too_many(response: httpx.Response) -> int:
    assert response.status_code == 429, response.text
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limit_exceeded") and error["message"]
    retry_after = int(response.headers["Retry-After"])
    assert 1 <= retry_after <= 60 // RATE
    return retry_after


async def test_one_users_batch_does_not_hold_another_back(hub: JupyterHub, headers: dict[str, dict[str, str]]) -> None:
    finished: list[str] = []  # who finished, in the order their streams ended

    async def stream(client: httpx.AsyncClient, user: str, label: str) -> None:
        body = {**chat(32), "stream": True}
        async with client.stream("POST", "chat/completions", json=body, headers=headers[user]) as response:
            assert response.status_code == 200, await response.aread()
            last = ""
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    last = line
        assert last == "data: [DONE]", last
        finished.append(label)

    async with httpx.AsyncClient(base_url=hub.api + "/", timeout=600) as client:
        for user in ("bob", "alice"):  # bob's request loads the model (alice must not see that record)
            warm = await client.post("chat/completions", json=chat(1), headers=headers[user])
            assert warm.status_code == 200, warm.text  # loaded now: the race below is about turns, not the load
        health = (await client.get("health", headers=headers["bob"])).json()
        (entry,) = [m for m in health["all_models_loaded"] if m["model_name"] == DEFAULT_CHAT_MODEL]
        slots = entry["slots"]["total"]  # requests the model serves at once (llama.cpp: --parallel)
        assert 1 <= slots < 8
        async with asyncio.timeout(300), AsyncLogStream(hub, headers["alice"]) as alice_log:
            batch = [asyncio.ensure_future(stream(client, "alice", f"alice-{i}")) for i in range(8)]
            # her own log says when each request of hers has to wait: all but the ones being served
            await alice_log.until(
                lambda lines: sum(f"alice waits for a turn at {DEFAULT_CHAT_MODEL}" in x for x in lines) == 8 - slots
            )
            await stream(client, "bob", "bob")
            await asyncio.gather(*batch)
    assert sorted(finished) == sorted(["bob", *(f"alice-{i}" for i in range(8))])
    # first come, first served would end bob's stream last; round-robin gives it the first slot one of alice's
    # frees, so only the requests of hers already running when it came can end before it
    assert finished.index("bob") <= slots, finished


class AsyncLogStream:
    """A user's ``/logs/stream`` from now on: the lines of the entries logged after it was opened."""

    def __init__(self, hub: JupyterHub, headers: dict[str, str]) -> None:
        self.url = hub.service_url.replace("http://", "ws://") + "logs/stream"
        self.headers = headers
        self.lines: list[str] = []

    async def __aenter__(self) -> AsyncLogStream:
        self.ws = await aconnect(self.url, additional_headers=self.headers, open_timeout=60).__aenter__()
        await self.ws.send('{"type": "logs.subscribe"}')
        assert json.loads(await self.ws.recv())["type"] == "logs.snapshot"  # the past: not counted
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.ws.close()

    async def until(self, condition: Callable[[list[str]], bool]) -> None:
        while not condition(self.lines):
            message = json.loads(await self.ws.recv())
            if message["type"] == "logs.entry":
                self.lines.append(message["entry"]["line"])


def _log_lines(hub: JupyterHub, headers: dict[str, str]) -> list[str]:
    url = hub.service_url.replace("http://", "ws://") + "logs/stream"
    with connect(url, additional_headers=headers, open_timeout=60) as ws:
        ws.send('{"type": "logs.subscribe"}')
        snapshot = json.loads(ws.recv(timeout=60))
    assert snapshot["type"] == "logs.snapshot"
    return [entry["line"] for entry in snapshot["entries"]]


def test_a_user_sees_only_their_own_log_records(hub: JupyterHub, headers: dict[str, dict[str, str]]) -> None:
    for user in ("alice", "bob"):
        body = {**chat(1), "model": f"{user}-private-model"}
        response = httpx.post(f"{hub.api}/chat/completions", json=body, headers=headers[user], timeout=60)
        assert response.status_code == 404, response.text  # logged, tagged with who asked
    alice = _log_lines(hub, headers["alice"])
    assert any("alice-private-model" in line for line in alice), alice
    assert not any("bob-private-model" in line for line in alice), alice
    assert not any(f"loaded {DEFAULT_CHAT_MODEL}" in line for line in alice)  # bob's first use loaded it
    admin = _log_lines(hub, headers["admin"])
    assert any("alice-private-model" in line for line in admin)
    assert any("bob-private-model" in line for line in admin)


def test_a_user_does_not_see_the_download_jobs_others_asked_for(
    hub: JupyterHub, headers: dict[str, dict[str, str]]
) -> None:
    with httpx.Client(base_url=hub.api + "/", timeout=120) as client:
        body = {"model_name": DEFAULT_CHAT_MODEL, "stream": True, "subscribe": False}
        job = client.post("pull", json=body, headers=headers["admin"])  # bundled: done at once, listed a while
        assert job.status_code == 200, job.text
        job_id = job.json()["id"]
        listed = client.get("downloads", headers=headers["admin"]).json()
        assert job_id in [j["id"] for j in listed]
        for user in ("alice", "bob"):
            assert client.get("downloads", headers=headers[user]).json() == []
            control = client.post("downloads/control", json={"id": job_id, "action": "remove"}, headers=headers[user])
            assert control.status_code == 403 and control.json()["error"]["code"] == "admin_required"
        assert job_id in [j["id"] for j in client.get("downloads", headers=headers["admin"]).json()]


def test_stats_tell_a_user_only_of_their_own_last_request(hub: JupyterHub, headers: dict[str, dict[str, str]]) -> None:
    with httpx.Client(base_url=hub.api + "/", timeout=120) as client:

        def stats(user: str) -> dict[str, Any]:
            response = client.get("stats", headers=headers[user])
            assert response.status_code == 200, response.text
            result: dict[str, Any] = response.json()
            return result

        answer = client.post("chat/completions", json=chat(3), headers=headers["bob"])
        assert answer.status_code == 200, answer.text
        assert stats("bob")["output_tokens"] == answer.json()["usage"]["completion_tokens"]
        assert stats("alice")["output_tokens"] is None  # the last request was bob's: nothing about it
        assert stats("admin")["output_tokens"] == answer.json()["usage"]["completion_tokens"]
        mine = client.post("chat/completions", json=chat(2), headers=headers["alice"])
        assert mine.status_code == 200, mine.text
        assert stats("alice")["output_tokens"] == mine.json()["usage"]["completion_tokens"]
        assert stats("bob")["output_tokens"] is None  # his request is no longer the model's last


# last: it spends alice's requests of the minute
def test_a_users_rate_limit_answers_429_and_spares_the_others(
    hub: JupyterHub, headers: dict[str, dict[str, str]]
) -> None:
    with httpx.Client(base_url=hub.api + "/", timeout=120) as client:
        for _ in range(RATE + 15):  # a minute's worth at once, then one every 60 / RATE seconds
            response = client.post("chat/completions", json=chat(1), headers=headers["alice"])
            if response.status_code != 200:
                break
        assert_too_many(response)
        spared = client.post("chat/completions", json=chat(1), headers=headers["bob"])
        assert spared.status_code == 200, spared.text
        assert client.get("models", headers=headers["alice"]).status_code == 200  # only model requests count
