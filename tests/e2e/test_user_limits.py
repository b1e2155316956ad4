"""Per-user limits on both personal hosts, through real HTTP (every request there is the owner's).

Each test gets a host with its own caches, configured with its limits (the Jupyter extension's ``user_*``
traitlets; ``lemonkit serve --user-*`` flags), and a model registered from the local test hub but not downloaded:
its first request downloads it, so a hub hold keeps that request under way for as long as the test needs.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from conftest import API_KEY, Host, Standalone
from hub_server import HubServer, tiny_gguf_repo

T = TypeVar("T")
PLAIN = "tiny-Q4_K_M.gguf"
_ids = itertools.count()

pytestmark = pytest.mark.slow


@dataclass
class Env:
    host: Host
    hub: HubServer
    model: str

    def client(self) -> httpx.AsyncClient:
        return self.host.client()


@pytest.fixture(scope="module")
def module_hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HubServer]:
    with HubServer(root=tmp_path_factory.mktemp("hub-objects")) as hub:
        yield hub


@pytest.fixture(scope="module")
def repo_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return tiny_gguf_repo(tmp_path_factory.mktemp("repo"))


@pytest.fixture
def user_limits() -> dict[str, int]:
    """The limits of the test's host (``max_active``, ``max_queued``, ``rate``); tests parametrize it."""
    return {}


@pytest.fixture
def jp_server_config(user_limits: dict[str, int]) -> dict[str, Any]:
    traitlets = {f"user_{name}": value for name, value in user_limits.items()}
    return {"ServerApp": {"jpserver_extensions": {"lemonkit": True}}, "LemonkitExtension": traitlets}


@pytest.fixture(params=["jupyter", "standalone"])
def env(
    request: pytest.FixtureRequest,
    user_limits: dict[str, int],
    module_hub: HubServer,
    repo_files: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> Iterator[Env]:
    """A host with ``user_limits`` whose one model is registered from the test hub, not yet downloaded."""
    n = f"{os.getpid() % 1000}-{next(_ids)}"
    repo = f"lemonkit/fair-{n}-GGUF"
    module_hub.add_repo(repo, repo_files)
    (tmp_path / "cache").mkdir()
    entry = {"checkpoint": f"{repo}:Q4_K_M", "recipe": "llamacpp", "labels": ["chat"]}
    (tmp_path / "cache" / "user_models.json").write_text(json.dumps({f"fair-{n}": entry}))
    variables = {
        "HF_ENDPOINT": module_hub.url,
        "HF_HUB_OFFLINE": "0",
        "LEMONADE_CACHE_DIR": str(tmp_path / "cache"),
        "HF_HUB_CACHE": str(tmp_path / "hub"),
        "LEMONKIT_UPDATE_CHECK_INTERVAL": "0",
    }
    module_hub.reset()
    if request.param == "jupyter":
        from huggingface_hub import constants

        for key, value in variables.items():
            monkeypatch.setenv(key, value)  # read when the extension makes its settings and registry
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        yield Env(request.getfixturevalue("jupyter_host"), module_hub, f"user.fair-{n}")
    else:
        flags = [arg for name, value in user_limits.items() for arg in ("--user-" + name.replace("_", "-"), str(value))]
        server = Standalone({**variables, "LEMONADE_API_KEY": API_KEY}, args=tuple(flags))
        try:
            yield Env(Host("standalone", server.root, API_KEY), module_hub, f"user.fair-{n}")
        finally:
            server.stop()
    module_hub.reset()


async def until(check: Callable[[], Awaitable[T]], what: str, timeout: float = 60) -> T:
    """Poll ``check`` until it returns something truthy (bounded)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = await check()
        if value:
            return value
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def completion(model: str) -> dict[str, Any]:
    return {"model": model, "prompt": "Once upon a time", "max_tokens": 2}


def assert_too_many(response: httpx.Response) -> int:
    """The spec's 429: the error shape, its code, and a whole number of seconds in ``Retry-After``."""
    assert response.status_code == 429, response.text
    assert response.headers["Content-Type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "code"} and error["message"]
    assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limit_exceeded")
    retry_after = int(response.headers["Retry-After"])
    assert retry_after >= 1
    return retry_after


@pytest.mark.parametrize("user_limits", [{"max_active": 1}])
async def test_a_second_request_at_once_is_refused_with_retry_after(env: Env) -> None:
    env.hub.hold(at=100_000, path=PLAIN)  # the first request stays under way, downloading its model
    async with env.client() as client:
        first = asyncio.ensure_future(client.post("completions", json=completion(env.model)))

        async def held() -> bool:
            jobs = (await client.get("downloads")).json()
            return any(j["model_name"] == env.model and j["bytes_downloaded"] == 100_000 for j in jobs)

        await until(held, "the first request's download to reach the hold")
        assert_too_many(await client.post("completions", json=completion(env.model)))
        chat = {"model": env.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        assert_too_many(await client.post("chat/completions", json=chat))
        assert not first.done()
        env.hub.release()
        answer = await first
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"] is not None
        again = await client.post("completions", json=completion(env.model))  # nothing under way now
        assert again.status_code == 200, again.text


@pytest.mark.parametrize("user_limits", [{"rate": 12}])
async def test_the_rate_limit_answers_429_then_recovers(env: Env) -> None:
    async with env.client() as client:
        served = 0
        while True:  # a minute's worth (12) may come at once, then one every 5 s
            response = await client.post("completions", json=completion(env.model))
            if response.status_code != 200:
                break
            served += 1
            assert served <= 20, "the rate limit never answered"
        retry_after = assert_too_many(response)
        assert served >= 12 and retry_after <= 5
        assert (await client.get("health")).status_code == 200  # routes that run no model are not metered
        await asyncio.sleep(retry_after)  # what the answer asked for: then a token is there again
        recovered = await client.post("completions", json=completion(env.model))
        assert recovered.status_code == 200, recovered.text
