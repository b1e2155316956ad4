"""The control plane stays responsive: ``/live`` and ``/v1/health`` never wait on a model, on both personal hosts.

Order-based, never timed: a model is held busy (a streamed generation whose client stops reading, so it cannot
finish) or held loading (its download stops at a known byte on the test hub) for as long as the test wants, and the
probes must answer meanwhile; if they waited on the model, they would not answer until the test let it go, and the
test would time out.

Also: the standalone host answers a plain ``GET /live`` before its application's routing (lemonkit/server/probe.py);
the answer is the same as the application's, nothing else opens with it, and access logs still record it at the
documented level (``--log-level info``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest

from tests.server.test_back_pressure import Holder
from tests.server.test_pull import Env, env, fresh, pull_standalone, registration  # noqa: F401
from tests.support.hosts import API_KEY, Host, Standalone
from tests.support.tiny_models import TINY
from tests.support.waiting import until

PROBES = 40  # probes sent at once while the model is held


async def _probe_all(host: Host, client: httpx.AsyncClient) -> list[httpx.Response]:
    """``/live`` without credentials and ``/v1/health`` with them, :data:`PROBES` of each, all at once."""
    async with httpx.AsyncClient(timeout=60) as bare:
        lives = [bare.get(host.root + "live") for _ in range(PROBES)]
        healths = [client.get("health") for _ in range(PROBES)]
        return list(await asyncio.gather(*lives, *healths))


async def _until_data(lines: AsyncIterator[str]) -> AsyncIterator[str]:
    """Lines up to and including the next ``data:`` one."""
    async for line in lines:
        yield line
        if line.startswith("data: "):
            return


def _loaded(health: dict[str, object]) -> set[str]:
    return {m["model_name"] for m in health["all_models_loaded"]}  # type: ignore[index, attr-defined]


async def test_probes_answer_while_the_model_is_busy_generating(host: Host) -> None:
    async with host.client() as client:
        assert (await client.post("load", json={"model_name": TINY, "ctx_size": 4096})).status_code == 200
        async with Holder(host) as held:  # generating, and it cannot end before the block does
            answers = await _probe_all(host, client)
            assert [a.status_code for a in answers] == [200] * (2 * PROBES), [a.text for a in answers]
            assert all(a.json() == {"status": "ok"} for a in answers[:PROBES])
            entry = next(m for m in answers[-1].json()["all_models_loaded"] if m["model_name"] == TINY)
            assert entry["slots"]["busy"] == 1  # read while the generation holds the model
            # the generation was still going: more of it arrives once the client reads again
            more = [line async for line in _until_data(held._lines)]
            assert more and more[-1].startswith("data: {") and more[-1] != "data: [DONE]", more
        # and it is still served afterwards
        chat = {"model": TINY, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert (await client.post("chat/completions", json=chat)).status_code == 200


async def test_probes_answer_while_a_model_is_loading(env: Env) -> None:  # noqa: F811
    repo = env.repo()
    name = fresh("user.loading-")
    env.registry().register(name, registration(repo))
    env.hub.hold(at=100_000, path="tiny-Q4_K_M.gguf")  # the load's download stops there until released
    async with env.client() as client:
        load = asyncio.ensure_future(client.post("load", json={"model_name": name}))
        try:
            await asyncio.to_thread(env.hub.held.wait, 60)
            answers = await _probe_all(env.host, client)
            assert [a.status_code for a in answers] == [200] * (2 * PROBES), [a.text for a in answers]
            assert name not in _loaded(answers[-1].json())
            assert not load.done()  # the probes came back while the load waits
        finally:
            env.hub.release()
        assert (await load).status_code == 200
        assert name in _loaded((await client.get("health")).json())


# -- the standalone host's fast /live ----------------------------------------------------------------------------


async def test_fast_live_answers_as_the_application_does(standalone: Standalone) -> None:
    async with httpx.AsyncClient(base_url=standalone.root, timeout=60) as client:
        fast = await client.get("live")  # the fast path's answer
        routed = await client.get("live", params={"probe": "1"})  # a query string: the application's
    assert fast.status_code == routed.status_code == 200
    assert fast.content == routed.content == b'{"status": "ok"}'
    for name in ("Content-Type", "Etag", "Content-Length"):
        assert fast.headers[name] == routed.headers[name], name
    assert fast.headers["Server"].startswith("TornadoServer") and "Date" in fast.headers


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "live"),
        ("PUT", "live"),
        ("GET", "live/x"),
        ("GET", "livez"),
        ("GET", "LIVE"),
        ("GET", "live/../api/v1/models"),
        ("GET", "live/%2e%2e/api/v1/models"),
        ("GET", "api/v1/health"),
        ("GET", "v1/health"),
    ],
)
async def test_nothing_but_live_is_open(standalone: Standalone, method: str, path: str) -> None:
    """Next to ``/live``, without credentials: no answer but an error, as before the fast path."""
    async with httpx.AsyncClient(timeout=60) as client:
        request = client.build_request(method, standalone.root + path)
        request.url = request.url.copy_with(raw_path=("/" + path).encode())  # keep the dots as sent
        response = await client.send(request)
    assert response.status_code in (401, 404, 405), (response.status_code, response.text)
    assert set(response.json()["error"]) == {"message", "type", "code"}
    assert "status" not in response.json()


@pytest.fixture
def logged() -> Iterator[Standalone]:
    """A keyed server at ``--log-level info``: the documented way to get access logs."""
    server = Standalone({"LEMONADE_API_KEY": API_KEY}, args=("--log-level", "info"))
    yield server
    server.stop()


async def _logged(server: Standalone, text: str) -> list[str]:
    async def found() -> list[str]:
        assert server.process.poll() is None
        return [line for line in server.log if text in line]

    return await until(found, f"{text!r} in the server's log")


async def test_access_logs_at_info(logged: Standalone) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with httpx.AsyncClient(base_url=logged.root, timeout=60) as client:
        assert (await client.get("live")).status_code == 200
        assert (await client.get("api/v1/health", headers=headers)).status_code == 200
        assert (await client.get("api/v1/models")).status_code == 401
    (live,) = await _logged(logged, "GET /live (127.0.0.1)")
    assert "INFO tornado.access: 200 GET /live" in live
    assert "INFO tornado.access: 200 GET /api/v1/health" in (await _logged(logged, "GET /api/v1/health"))[0]
    refused = await _logged(logged, "401 GET /api/v1/models")
    assert "WARNING tornado.access: 401 GET /api/v1/models" in refused[0]


async def test_no_access_log_of_successes_by_default(standalone: Standalone) -> None:
    async with httpx.AsyncClient(base_url=standalone.root, timeout=60) as client:
        assert (await client.get("live")).status_code == 200
        marker = fresh("no-such-route-")
        assert (await client.get(marker)).status_code == 401  # refused: logged at warning, after the /live
    await _logged(standalone, marker)
    assert not [line for line in standalone.log if "200 GET" in line]
