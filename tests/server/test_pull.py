"""Pulls, download jobs, variants and delete on both hosts, against the local hub of ``tests/support/hub_server.py``.

Each host gets its own lemonkit cache and HF cache and ``HF_ENDPOINT`` pointing at the hub (the Jupyter host
in-process, with huggingface_hub's offline flag lifted; the standalone one through its environment). Tests that
need a download to be caught mid-way make the hub hold at a known byte, then poll the job's state.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from lemonkit.catalog.registry import Registry
from lemonkit.downloads import Job
from tests.support.hosts import API_KEY, Host, Standalone
from tests.support.hub_server import HubServer
from tests.support.waiting import until

TOKEN = "hf_lemonkit_test_token"
PLAIN = "tiny-Q4_K_M.gguf"
SHARDS = ("Q8_0/tiny-Q8_0-00001-of-00002.gguf", "Q8_0/tiny-Q8_0-00002-of-00002.gguf")
MMPROJ = "mmproj-tiny-f16.gguf"
_ids = itertools.count()


def fresh(prefix: str) -> str:
    """A name no other test (or host run) of this session uses."""
    return f"{prefix}{os.getpid() % 1000}-{next(_ids)}"


def env_for(hub: HubServer | str, root: Path) -> dict[str, str]:
    return {
        "HF_ENDPOINT": hub if isinstance(hub, str) else hub.url,
        "HF_HUB_OFFLINE": "0",
        "HF_TOKEN": TOKEN,
        "LEMONADE_CACHE_DIR": str(root / "cache"),
        "HF_HUB_CACHE": str(root / "hub"),
        "LEMONKIT_UPDATE_CHECK_INTERVAL": "0",
        "LEMONKIT_ALLOWED_DIRS": str(root / "allowed"),
    }


@dataclass
class Env:
    host: Host
    hub: HubServer
    root: Path
    files: dict[str, Path]

    @property
    def hf_cache(self) -> Path:
        return self.root / "hub"

    def client(self) -> httpx.AsyncClient:
        return self.host.client()

    def registry(self) -> Registry:
        return Registry(self.root / "cache", hf_cache=self.hf_cache)

    def repo(self, **kwargs: Any) -> str:
        repo = fresh("lemonkit/tiny-") + "-GGUF"
        self.hub.add_repo(repo, self.files, **kwargs)
        return repo

    def storage(self, repo: str) -> Path:
        return self.hf_cache / ("models--" + repo.replace("/", "--"))

    def partial(self, repo: str, path: str) -> Path:
        return self.storage(repo) / "blobs" / f"{self.hub.file(repo, path).sha256}.incomplete"


@pytest.fixture(scope="module")
def pull_standalone(module_hub: HubServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Host, Path]]:
    root = tmp_path_factory.mktemp("standalone")
    server = Standalone({**env_for(module_hub, root), "LEMONADE_API_KEY": API_KEY})
    yield Host("standalone", server.root, API_KEY), root
    server.stop()


@pytest.fixture(params=["jupyter", "standalone"])
def env(
    request: pytest.FixtureRequest,
    module_hub: HubServer,
    repo_files: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> Iterator[Env]:
    """A host whose pulls reach the test hub; the hub starts without faults."""
    if request.param == "jupyter":
        from huggingface_hub import constants

        for key, value in env_for(module_hub, tmp_path).items():
            monkeypatch.setenv(key, value)  # read when the extension makes its settings and registry
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        host, root = request.getfixturevalue("jupyter_host"), tmp_path
    else:
        host, root = request.getfixturevalue("pull_standalone")
    module_hub.reset()
    yield Env(host, module_hub, root, repo_files)
    module_hub.reset()
    if host.kind == "standalone":
        httpx.post(host.api + "/unload", headers=host.headers, timeout=60).raise_for_status()


async def job_of(client: httpx.AsyncClient, name: str) -> dict[str, Any] | None:
    jobs = (await client.get("downloads")).json()
    return next((j for j in jobs if j["model_name"] == name), None)


async def wait_job(client: httpx.AsyncClient, name: str, check: Callable[[dict[str, Any]], bool], what: str) -> dict:
    async def probe() -> dict[str, Any] | None:
        job = await job_of(client, name)
        return job if job is not None and check(job) else None

    return await until(probe, what)


def assert_error(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "code"} and error["code"] == code, error
    return error


async def sse(response: httpx.Response) -> list[tuple[str, dict[str, Any]]]:
    events, name = [], "message"
    async for line in response.aiter_lines():
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            events.append((name, json.loads(line[6:])))
            name = "message"
    return events


def registration(repo: str, variant: str = "Q4_K_M", **extra: Any) -> dict[str, Any]:
    return {"checkpoint": f"{repo}:{variant}", "recipe": "llamacpp", **extra}


async def model(client: httpx.AsyncClient, name: str) -> dict[str, Any]:
    response = await client.get(f"models/{name}")
    assert response.status_code == 200, response.text
    return response.json()


async def loaded(client: httpx.AsyncClient) -> set[str]:
    return {m["model_name"] for m in (await client.get("health")).json()["all_models_loaded"]}


def saved_jobs(root: Path) -> dict[str, Any]:
    """The jobs ``downloads.json`` holds now (``{}`` while it is not there)."""
    try:
        return json.loads((root / "cache" / "downloads.json").read_text())["jobs"]
    except (OSError, ValueError, KeyError):
        return {}


async def until_saved(root: Path, name: str, check: Callable[[dict[str, Any]], bool], what: str) -> None:
    """Wait until ``downloads.json`` holds ``name``'s job as ``check`` wants it (it is written off the loop)."""

    async def probe() -> bool:
        entry = saved_jobs(root).get(f"model:{name}")
        return entry is not None and check(entry)

    await until(probe, what)


# -- pull in every mode ------------------------------------------------------------------------------------------


async def test_register_and_install_then_chat(env: Env) -> None:
    repo = env.repo()
    name = fresh("user.vision-")
    body = {"model_name": name, **registration(repo), "mmproj": MMPROJ, "vision": True, "reasoning": True}
    async with env.client() as client:
        response = await client.post("pull", json=body)
        assert response.json() == {"status": "success", "message": f"Installed model: {name}"}
        obj = await model(client, name)
        assert obj["downloaded"] and obj["labels"] == ["chat", "reasoning", "vision"]
        assert obj["checkpoints"] == {"main": f"{repo}:Q4_K_M", "mmproj": f"{repo}:{MMPROJ}"}
        assert all(s["present"] for s in obj["checkpoint_status"])
        assert name in {m["id"] for m in (await client.get("models")).json()["data"]}
        rows = json.loads((env.root / "cache" / "user_models.json").read_text())
        assert rows[name.removeprefix("user.")]["checkpoint"] == f"{repo}:Q4_K_M"
        # the files are the hub's, in the HF cache layout, and they load
        snapshot = env.storage(repo) / "snapshots" / env.hub.head(repo)
        assert (snapshot / PLAIN).read_bytes() == env.files[PLAIN].read_bytes()
        assert (snapshot / PLAIN).resolve().name == env.hub.file(repo, PLAIN).sha256
        assert (env.storage(repo) / "refs" / "main").read_text() == env.hub.head(repo)
        chat = {"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert (await client.post("chat/completions", json=chat)).status_code == 200
    # the sharded quant was not fetched
    assert not env.hub.served(SHARDS[0], repo)


async def test_pull_registered_model_by_name(env: Env) -> None:
    repo = env.repo()
    name = fresh("user.sharded-")
    env.registry().register(name, registration(repo, "Q8_0"))
    async with env.client() as client:
        assert not (await model(client, name))["downloaded"]
        response = await client.post("pull", json={"model_name": name})
        assert response.json()["status"] == "success"
        assert (await model(client, name))["downloaded"]
    assert [len(env.hub.served(s, repo)) for s in SHARDS] == [1, 1]  # every shard, once


async def test_pull_catalog_model(env: Env, tmp_path: Path) -> None:
    # the catalog's Qwen3-0.6B-GGUF names unsloth/Qwen3-0.6B-GGUF:Q4_0; the hub serves a tiny stand-in
    repo = "unsloth/Qwen3-0.6B-GGUF"
    if env.hub._lookup(repo) is None:
        env.hub.add_repo(repo, {"Qwen3-0.6B-Q4_0.gguf": env.files[PLAIN], "Qwen3-0.6B-Q8_0.gguf": b"GGUF" + bytes(99)})
    async with env.client() as client:
        response = await client.post("pull", json={"model_name": "qwen3:0.6b"})  # an alias
        assert response.status_code == 200, response.text
        obj = await model(client, "Qwen3-0.6B-GGUF")
        assert obj["downloaded"] and obj["update_available"] is False


async def test_bundled_model_pulls_without_the_hub(env: Env) -> None:
    async with env.client() as client:
        response = await client.post("pull", json={"model_name": "Gemma-3-270m-GGUF"})
        assert response.json()["status"] == "success"
        assert_error(await client.post("delete", json={"model_name": "Gemma-3-270m-GGUF"}), 400, "model_not_deletable")


async def test_registration_errors_register_nothing(env: Env) -> None:
    repo = env.repo()
    user_models = env.root / "cache" / "user_models.json"
    before = user_models.read_text() if user_models.exists() else None
    name = fresh("user.bad-")
    async with env.client() as client:
        two_modes = {"model_name": name, **registration(repo), "embedding": True, "reranking": True}
        assert (
            "deployment modes"
            in assert_error(await client.post("pull", json=two_modes), 400, "invalid_argument")["message"]
        )
        bad_recipe = {"model_name": name, "checkpoint": f"{repo}:Q4_K_M", "recipe": "no-such-recipe"}
        assert_error(await client.post("pull", json=bad_recipe), 400, "invalid_argument")
        outside = {"model_name": "Phi-Mini", **registration(repo)}
        assert (
            "user namespace"
            in assert_error(await client.post("pull", json=outside), 400, "invalid_argument")["message"]
        )
        no_recipe = {"model_name": name, "checkpoint": f"{repo}:Q4_K_M"}
        assert_error(await client.post("pull", json=no_recipe), 400, "missing_argument")
        missing_repo = {"model_name": name, **registration("lemonkit/no-such-repo")}
        assert_error(await client.post("pull", json=missing_repo), 404, "model_not_found")
        missing_quant = {"model_name": name, **registration(repo, "Q3_K_S")}
        assert_error(await client.post("pull", json=missing_quant), 404, "model_not_found")
        streamed = await client.post("pull", json={**missing_quant, "stream": True})
        assert_error(streamed, 404, "model_not_found")  # found before the stream opens: a plain error
        assert_error(await client.post("pull", json={"model_name": "user.nobody"}), 404, "model_not_found")
        assert_error(await client.post("pull", content=b"{"), 400, "invalid_json")
        assert_error(await client.post("pull", json={"stream": True}), 400, "missing_argument")
        assert (await client.get("models", params={"show_all": "true"})).status_code == 200
        assert name not in {m["id"] for m in (await client.get("models", params={"show_all": 1})).json()["data"]}
    assert (user_models.read_text() if user_models.exists() else None) == before


async def test_gated_repo_uses_hf_token(env: Env) -> None:
    gated = env.repo(token=TOKEN, cdn=True)  # LFS files also go through the "CDN" host
    other = env.repo(token="hf_someone_else")
    async with env.client() as client:
        response = await client.post("pull", json={"model_name": fresh("user.gated-"), **registration(gated)})
        assert response.status_code == 200, response.text
        denied = await client.post("pull", json={"model_name": fresh("user.denied-"), **registration(other)})
        assert "HF_TOKEN" in assert_error(denied, 404, "model_not_found")["message"]
    downloads = env.hub.served(PLAIN, gated)
    assert downloads and all(s.path.startswith("/_cdn/") and not s.auth for s in downloads)  # no token off the hub


async def test_collection_pulls_missing_components(env: Env) -> None:
    repo = env.repo()
    first, second, kit = fresh("user.part-"), fresh("user.part-"), fresh("user.Kit-")
    registry = env.registry()
    registry.register(first, registration(repo))
    registry.register(second, registration(repo, "Q8_0", labels=["reasoning"]))
    async with env.client() as client:
        missing = {"model_name": kit, "recipe": "collection.omni", "components": [first, "user.not-there"]}
        assert "not-there" in assert_error(await client.post("pull", json=missing), 400, "invalid_argument")["message"]
        assert_error(
            await client.post("pull", json={"model_name": kit, "recipe": "collection.omni"}), 400, "missing_argument"
        )
        body = {"model_name": kit, "recipe": "collection.omni", "components": [first, second]}
        assert (await client.post("pull", json=body)).json()["status"] == "success"
        obj = await model(client, kit)
        assert obj["downloaded"] and obj["recipe"] == "collection.omni"
        assert obj["components"] == [first, second] and [m["id"] for m in obj["models"]] == [first, second]
        assert (await model(client, first))["downloaded"] and (await model(client, second))["downloaded"]
        # deleting the collection forgets it; its components stay on disk
        assert (await client.post("delete", json={"model_name": kit})).json()["status"] == "success"
        assert_error(await client.get(f"models/{kit}"), 404, "model_not_found")
        assert (await model(client, first))["downloaded"] and (await model(client, second))["downloaded"]


# -- progress ----------------------------------------------------------------------------------------------------


async def test_stream_progress_reaches_100(env: Env) -> None:
    repo = env.repo()
    name = fresh("user.stream-")
    env.hub.throttle = 4_000_000  # a few progress events, not one
    async with env.client() as client:
        body = {"model_name": name, **registration(repo, "Q8_0"), "mmproj": MMPROJ, "stream": True}
        async with client.stream("POST", "pull", json=body) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            events = await sse(response)
    names = [e for e, _ in events]
    assert names[-1] == "complete" and set(names[:-1]) == {"progress"}, names
    progress = [d for e, d in events if e == "progress"]
    assert len(progress) >= 3
    for event in progress:
        assert set(event) >= {"file", "file_index", "total_files", "bytes_downloaded", "bytes_total", "percent"}
        assert event["total_files"] == 3 and event["total_download_size"] > 0
    percents = [e["percent"] for e in progress]
    assert percents == sorted(percents) and percents[-1] == 100
    assert [e["file"] for e in progress if e["bytes_downloaded"] == e["bytes_total"]][-1] == MMPROJ
    assert events[-1][1] == {"file_index": 3, "total_files": 3, "percent": 100}


async def test_subscribe_false_returns_a_snapshot_then_polls(env: Env) -> None:
    repo = env.repo()
    name = fresh("user.owned-")
    env.hub.hold(at=200_000, path=PLAIN)
    async with env.client() as client:
        body = {"model_name": name, **registration(repo), "stream": True, "subscribe": False}
        snapshot = (await client.post("pull", json=body)).json()
        assert snapshot["id"] == f"model:{name}" and snapshot["type"] == "model"
        assert snapshot["status"] == "downloading" and snapshot["running"] is True and snapshot["complete"] is False
        fields = {
            "file", "file_index", "total_files", "bytes_downloaded", "bytes_total", "total_download_size",
            "bytes_previously_downloaded", "completed_files_bytes", "cumulative_bytes_downloaded",
            "overall_bytes_downloaded", "percent", "model_name",
        }  # fmt: skip
        assert set(snapshot) >= fields
        held = await wait_job(client, name, lambda j: j["bytes_downloaded"] == 200_000, "the hold")
        assert held["file"] == PLAIN and held["bytes_total"] == env.hub.file(repo, PLAIN).size
        assert held["cumulative_bytes_downloaded"] == held["overall_bytes_downloaded"] == 200_000
        assert not (await model(client, name))["downloaded"]  # registered, not yet downloaded
        env.hub.release()
        done = await wait_job(client, name, lambda j: j["status"] == "completed", "completion")
        assert done["complete"] and done["percent"] == 100 and not done["running"]
        assert (await model(client, name))["downloaded"]
        assert await job_of(client, name) is not None  # completed jobs stay visible for a while


# -- pause, cancel, remove ---------------------------------------------------------------------------------------


async def test_pause_then_resume_refetches_nothing(env: Env) -> None:
    repo = env.repo()
    name = fresh("user.paused-")
    size = env.hub.file(repo, PLAIN).size
    env.hub.hold(at=300_000, path=PLAIN)
    async with env.client() as client:
        body = {"model_name": name, **registration(repo), "stream": True, "subscribe": False}
        await client.post("pull", json=body)
        await wait_job(client, name, lambda j: j["bytes_downloaded"] == 300_000, "the hold")
        paused = (await client.post("downloads/control", json={"id": f"model:{name}", "action": "pause"})).json()
        assert paused["status"] == "paused" and paused["bytes_downloaded"] == 300_000
        # the worker was blocked on a read of a held response: the pause must still unwind it
        stopped = await wait_job(client, name, lambda j: not j["running"], "the worker to stop")
        assert stopped["status"] == "paused" and not (await model(client, name))["downloaded"]
        assert env.partial(repo, PLAIN).stat().st_size == 300_000
        env.hub.release()
        resumed = (await client.post("pull", json={"model_name": name, "stream": True, "subscribe": False})).json()
        assert resumed["status"] == "downloading"
        await wait_job(client, name, lambda j: j["status"] == "completed", "completion")
        assert (await model(client, name))["downloaded"]
    first, second = env.hub.served(PLAIN, repo)
    assert (first.range_start, first.sent) == (None, 300_000)
    assert (second.range_start, second.sent) == (300_000, size - 300_000)
    assert first.sent + second.sent - size == 0  # bytes re-fetched


async def test_cancel_and_remove(env: Env) -> None:
    repo = env.repo()
    name = fresh("user.cancelled-")
    job_id = f"model:{name}"
    env.hub.hold(at=100_000, path=PLAIN)
    async with env.client() as client:
        await client.post("pull", json={"model_name": name, **registration(repo), "stream": True, "subscribe": False})
        await wait_job(client, name, lambda j: j["bytes_downloaded"] == 100_000, "the hold")
        cancelled = (await client.post("downloads/control", json={"id": job_id, "action": "cancel"})).json()
        assert cancelled["status"] == "cancelled"
        await wait_job(client, name, lambda j: not j["running"], "the worker to stop")
        assert not env.partial(repo, PLAIN).exists()  # a cancelled download leaves no partial file
        assert not (await model(client, name))["downloaded"]
        assert (await client.post("downloads/control", json={"id": job_id, "action": "remove"})).json() == {
            "status": "ok"
        }
        assert await job_of(client, name) is None
        again = await client.post("downloads/control", json={"id": job_id, "action": "remove"})
        assert again.json() == {"status": "ok", "missing": True}
        assert_error(
            await client.post("downloads/control", json={"id": job_id, "action": "pause"}), 404, "download_not_found"
        )
        assert_error(
            await client.post("downloads/control", json={"id": job_id, "action": "stop"}), 400, "invalid_argument"
        )
        assert_error(await client.post("downloads/control", json={"id": job_id}), 400, "missing_argument")

        # remove on a running job cancels it and drops it once the worker is gone
        env.hub.release()
        env.hub.hold(at=100_000, path=PLAIN)
        await client.post("pull", json={"model_name": name, "stream": True, "subscribe": False})
        await wait_job(client, name, lambda j: j["bytes_downloaded"] == 100_000, "the hold")
        removed = await client.post("downloads/control", json={"id": job_id, "action": "remove"})
        assert removed.json() == {"status": "ok"}

        async def gone() -> bool:
            return await job_of(client, name) is None

        await until(gone, "the removed job to go")
        assert not (await model(client, name))["downloaded"]


async def test_subscribed_pull_paused_by_control_reports_an_error_event(env: Env) -> None:
    repo = env.repo()
    name = fresh("user.sse-paused-")
    env.hub.hold(at=50_000, path=PLAIN)
    async with env.client() as client:
        body = {"model_name": name, **registration(repo), "stream": True}
        async with client.stream("POST", "pull", json=body) as response:
            await asyncio.to_thread(env.hub.held.wait, 30)
            control = await client.post("downloads/control", json={"id": f"model:{name}", "action": "pause"})
            assert control.json()["status"] == "paused"
            events = await sse(response)
        assert events[-1][0] == "error" and "paused" in events[-1][1]["error"]
        waiting = asyncio.create_task(client.post("pull", json={"model_name": name}))
        env.hub.release()
        assert (await waiting).json()["status"] == "success"  # resumed by a plain pull


async def test_a_subscribed_pull_stops_when_its_client_leaves(env: Env) -> None:
    repo = env.repo()
    name = fresh("user.left-")
    size = env.hub.file(repo, PLAIN).size
    env.hub.hold(at=150_000, path=PLAIN)
    async with env.client() as client:
        body = {"model_name": name, **registration(repo), "stream": True}
        async with client.stream("POST", "pull", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():  # leave once the worker has everything the hub sent
                if line.startswith("data: ") and json.loads(line[6:]).get("bytes_downloaded") == 150_000:
                    break
        # nobody owns the job (subscribe was not false) and nobody listens: it pauses, keeping what it fetched

        async def partial_kept() -> bool:
            path = env.partial(repo, PLAIN)
            return path.exists() and path.stat().st_size == 150_000 and not (await model(client, name))["downloaded"]

        await until(partial_kept, "the partial file", timeout=5)  # well before the worker's 10 s read timeout
        env.hub.release()
        assert (await client.post("pull", json={"model_name": name})).json()["status"] == "success"
    first, second = env.hub.served(PLAIN, repo)
    assert first.sent == 150_000 and (second.range_start, second.sent) == (150_000, size - 150_000)


async def test_two_concurrent_pulls_share_one_job(env: Env) -> None:
    repo = env.repo()
    name = fresh("user.shared-")
    env.hub.hold(at=100_000, path=PLAIN)
    async with env.client() as client:

        async def subscribed() -> list[tuple[str, dict[str, Any]]]:
            body = {"model_name": name, **registration(repo), "stream": True}
            async with client.stream("POST", "pull", json=body) as response:
                return await sse(response)

        first = asyncio.create_task(subscribed())
        await asyncio.to_thread(env.hub.held.wait, 30)
        body = {"model_name": name, **registration(repo), "stream": True, "subscribe": False}
        second = (await client.post("pull", json=body)).json()
        assert second["id"] == f"model:{name}" and second["running"]
        await wait_job(client, name, lambda j: j["bytes_downloaded"] == 100_000, "the shared job's progress")
        third = asyncio.create_task(client.post("pull", json={"model_name": name}))
        env.hub.release()
        assert (await first)[-1][0] == "complete"
        assert (await third).json()["status"] == "success"
    assert len(env.hub.served(PLAIN, repo)) == 1  # one download for three pulls


async def test_dropped_connection_resumes_where_it_broke(env: Env) -> None:
    repo = env.repo()
    size = env.hub.file(repo, PLAIN).size
    env.hub.drop(after=123_456, path=PLAIN)
    async with env.client() as client:
        response = await client.post("pull", json={"model_name": fresh("user.flaky-"), **registration(repo)})
        assert response.json()["status"] == "success"
    first, second = env.hub.served(PLAIN, repo)
    assert first.sent == 123_456 and (second.range_start, second.sent) == (123_456, size - 123_456)


async def test_corrupt_file_is_fetched_again(env: Env) -> None:
    repo = env.repo()
    name = fresh("user.corrupt-")
    async with env.client() as client:
        await client.post("pull", json={"model_name": name, **registration(repo)})
        blob = (env.storage(repo) / "snapshots" / env.hub.head(repo) / PLAIN).resolve()
        data = bytearray(blob.read_bytes())
        data[:4] = b"JUNK"  # bad magic, same size
        blob.write_bytes(bytes(data))
        assert (await client.post("pull", json={"model_name": name})).json()["status"] == "success"
        assert blob.read_bytes() == env.files[PLAIN].read_bytes()
        assert len(env.hub.served(PLAIN, repo)) == 2
        # a third pull finds everything intact and fetches nothing
        assert (await client.post("pull", json={"model_name": name})).json()["status"] == "success"
        assert len(env.hub.served(PLAIN, repo)) == 2


async def test_bad_partial_and_ignored_range_are_caught(env: Env) -> None:
    repo = env.repo()
    name = fresh("user.bad-partial-")
    size = env.hub.file(repo, PLAIN).size
    async with env.client() as client:
        for fault in ("corrupt partial", "range ignored"):
            env.hub.hold(at=200_000, path=PLAIN)
            await client.post(
                "pull", json={"model_name": name, **registration(repo), "stream": True, "subscribe": False}
            )
            await wait_job(client, name, lambda j: j["bytes_downloaded"] == 200_000, "the hold")
            await client.post("downloads/control", json={"id": f"model:{name}", "action": "pause"})
            await wait_job(client, name, lambda j: not j["running"], "the worker to stop")
            env.hub.release()
            if fault == "corrupt partial":
                with open(env.partial(repo, PLAIN), "r+b") as f:
                    f.write(b"JUNK")  # the resumed file cannot match the hub's sha256
            else:
                env.hub.ignore_range = True
            assert (await client.post("pull", json={"model_name": name})).json()["status"] == "success"
            blob = (env.storage(repo) / "snapshots" / env.hub.head(repo) / PLAIN).resolve()
            assert blob.read_bytes() == env.files[PLAIN].read_bytes()
            await client.post("delete", json={"model_name": name})
            env.hub.ignore_range = False
    served = [(s.range_start, s.sent, s.status) for s in env.hub.served(PLAIN, repo)]
    assert served == [
        (None, 200_000, 200),  # corrupt partial: paused at 200 000
        (200_000, size - 200_000, 206),  # resumed; the whole file fails its sha256 check...
        (None, size, 200),  # ...so it is fetched once more
        (None, 200_000, 200),  # range ignored: paused at 200 000
        (None, size, 200),  # the resume got the whole file (200): written from the start
    ]


# -- the hub's view ----------------------------------------------------------------------------------------------


async def test_variants(env: Env) -> None:
    extra = {
        "tiny-Q2_K.gguf": b"GGUF" + bytes(10),
        "tiny-IQ4_XS.gguf": b"GGUF" + bytes(11),
        "tiny-UD-Q4_K_XL.gguf": b"GGUF" + bytes(12),
        "tiny-Q4_0.gguf": b"GGUF" + bytes(13),
        "tiny-F16.gguf": b"GGUF" + bytes(14),
    }
    repo = fresh("lemonkit/tiny-embed-") + "-GGUF"
    env.hub.add_repo(repo, {**env.files, **extra})
    async with env.client() as client:
        response = await client.get("pull/variants", params={"checkpoint": repo})
        assert response.status_code == 200, response.text
        result = response.json()
        assert result["checkpoint"] == repo and result["recipe"] == "llamacpp"
        assert result["suggested_name"] == repo.split("/")[1]
        assert result["suggested_labels"] == ["vision", "embeddings"]
        assert result["mmproj_files"] == [MMPROJ]
        variants = result["variants"]
        assert [v["name"] for v in variants] == ["Q4_K_M", "UD-Q4_K_XL", "Q8_0", "Q4_0", "F16"]
        q8 = variants[2]
        assert q8 == {
            "name": "Q8_0",
            "primary_file": SHARDS[0],
            "files": list(SHARDS),
            "sharded": True,
            "size_bytes": sum(env.files[s].stat().st_size for s in SHARDS),
        }
        assert variants[0]["files"] == [PLAIN] and not variants[0]["sharded"]
        assert variants[0]["size_bytes"] == env.files[PLAIN].stat().st_size

        assert_error(await client.get("pull/variants"), 400, "missing_argument")
        assert_error(await client.get("pull/variants", params={"checkpoint": "no-owner"}), 400, "invalid_argument")
        for bad in ("../../x", "lemonkit/..", "o/%2e%2e", "o/r\\x"):
            assert_error(await client.get("pull/variants", params={"checkpoint": bad}), 400, "invalid_argument")
        assert_error(await client.get("pull/variants", params={"checkpoint": "lemonkit/none"}), 404, "model_not_found")
        env.hub.fail(500, times=10)
        assert_error(await client.get("pull/variants", params={"checkpoint": repo}), 500, "hub_error")


async def test_update_available(env: Env) -> None:
    repo = env.repo()
    name = fresh("user.update-")
    async with env.client() as client:
        await client.post("pull", json={"model_name": name, **registration(repo)})
        assert (await model(client, name))["update_available"] is False
        env.hub.commit(repo, {"README.md": b"# tiny, revised\n"})

        async def flag(expected: bool) -> bool:
            return (await model(client, name))["update_available"] is expected

        await until(lambda: flag(True), "update_available")  # refreshed in the background, never inline
        assert (await client.post("pull", json={"model_name": name})).json()["status"] == "success"
        assert (env.storage(repo) / "refs" / "main").read_text() == env.hub.head(repo)
        await until(lambda: flag(False), "update_available to clear")


# -- load installs what it needs --------------------------------------------------------------------------------


async def test_load_pulls_a_registered_model_first(env: Env) -> None:
    repo = env.repo()
    name = fresh("user.lazy-")
    env.registry().register(name, registration(repo))
    chat = {"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with env.client() as client:
        response = await client.post("load", json={"model_name": name})
        assert response.json() == {"status": "success", "message": f"Loaded model: {name}"}
        assert name in await loaded(client)
        assert (await model(client, name))["downloaded"]
        snapshot = env.storage(repo) / "snapshots" / env.hub.head(repo)
        assert (snapshot / PLAIN).read_bytes() == env.files[PLAIN].read_bytes()
        assert (snapshot / PLAIN).resolve().name == env.hub.file(repo, PLAIN).sha256
        assert (env.storage(repo) / "refs" / "main").read_text() == env.hub.head(repo)
        assert (await client.post("chat/completions", json=chat)).status_code == 200
        assert await job_of(client, name) is None  # the load's job went with the load
        assert (await client.post("load", json={"model_name": name})).status_code == 200
    assert len(env.hub.served(PLAIN, repo)) == 1  # the second load fetched nothing


async def test_first_use_downloads_the_model(env: Env) -> None:
    repo = env.repo()
    name, broken = fresh("user.first-use-"), fresh("user.first-use-broken-")
    env.registry().register(name, registration(repo))
    env.registry().register(broken, registration(fresh("lemonkit/no-such-repo-")))
    async with env.client() as client:
        # "downloading and loading the model if it is not loaded", on every inference route
        completion = {"model": name, "prompt": "one", "max_tokens": 3}
        response = await client.post("completions", json=completion)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 3
        assert (await model(client, name))["downloaded"] and name in await loaded(client)
        # a download that fails answers as the inference routes' table says
        failed = assert_error(
            await client.post(
                "chat/completions", json={"model": broken, "messages": [{"role": "user", "content": "x"}]}
            ),
            500,
            "model_load_error",
        )
        assert broken in failed["message"]
        assert not (await model(client, broken))["downloaded"] and broken not in await loaded(client)
    assert len(env.hub.served(PLAIN, repo)) == 1


async def test_a_first_use_download_pauses_when_its_client_leaves(env: Env) -> None:
    repo = env.repo()
    name = fresh("user.first-use-leaving-")
    env.registry().register(name, registration(repo))
    size = env.hub.file(repo, PLAIN).size
    env.hub.hold(at=100_000, path=PLAIN)
    async with env.client() as client:
        leaver = env.client()
        chat = {"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}
        leaving = asyncio.create_task(leaver.post("chat/completions", json=chat))
        job = await wait_job(client, name, lambda j: j["bytes_downloaded"] == 100_000, "the chat's download")
        assert job["status"] == "downloading"
        leaving.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await leaving
        await leaver.aclose()

        async def stopped() -> bool:
            return await job_of(client, name) is None

        await until(stopped, "the abandoned download to stop")
        assert env.partial(repo, PLAIN).stat().st_size == 100_000
        env.hub.release()
        chat["stream"] = False
        assert (await client.post("chat/completions", json=chat)).status_code == 200  # resumes it
    first, second = env.hub.served(PLAIN, repo)
    assert (first.range_start, first.sent) == (None, 100_000)
    assert (second.range_start, second.sent) == (100_000, size - 100_000)


async def test_load_answers_a_failed_download_as_pull_does(env: Env) -> None:
    repo = env.repo()
    gone, flaky = fresh("user.gone-"), fresh("user.flaky-load-")
    registry = env.registry()
    registry.register(gone, registration(fresh("lemonkit/no-such-repo-")))
    registry.register(flaky, registration(repo))
    async with env.client() as client:
        missing = assert_error(await client.post("load", json={"model_name": gone}), 404, "model_not_found")
        assert missing == assert_error(await client.post("pull", json={"model_name": gone}), 404, "model_not_found")
        answers = []
        for route in ("load", "pull"):
            env.hub.fail(500, times=20)
            answers.append(await client.post(route, json={"model_name": flaky}))
        env.hub.fail(500, times=0)
        failed, pulled = (assert_error(r, 502, "download_error") for r in answers)
        assert failed["type"] == pulled["type"]
        # what the load would refuse fails before a byte is fetched
        rocm = {"model_name": flaky, "llamacpp_backend": "rocm"}
        assert_error(await client.post("load", json=rocm), 400, "invalid_argument")
        assert not env.hub.served(PLAIN, repo)
        assert not (await model(client, flaky))["downloaded"]
        assert not await loaded(client) & {gone, flaky}
        assert await job_of(client, flaky) is None


async def test_a_loads_download_is_listed_and_pauses_when_its_client_leaves(env: Env) -> None:
    repo, other_repo = env.repo(), env.repo()
    name, left = fresh("user.waiting-"), fresh("user.leaving-")
    registry = env.registry()
    registry.register(name, registration(repo))
    registry.register(left, registration(other_repo))
    size = env.hub.file(other_repo, PLAIN).size
    env.hub.hold(at=100_000, path=PLAIN)
    async with env.client() as client:
        loading = asyncio.create_task(client.post("load", json={"model_name": name}))
        job = await wait_job(client, name, lambda j: j["bytes_downloaded"] == 100_000, "the load's download")
        assert (job["status"], job["running"], job["file"]) == ("downloading", True, PLAIN)
        assert not loading.done() and name not in await loaded(client)
        env.hub.release()
        assert (await loading).json() == {"status": "success", "message": f"Loaded model: {name}"}
        assert name in await loaded(client)

        # its client leaves: nobody wants the download any more, so it pauses and keeps what it fetched
        env.hub.hold(at=100_000, path=PLAIN)
        leaver = env.client()
        leaving = asyncio.create_task(leaver.post("load", json={"model_name": left}))
        await wait_job(client, left, lambda j: j["bytes_downloaded"] == 100_000, "the load's download")
        leaving.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await leaving
        await leaver.aclose()

        async def stopped() -> bool:  # a stopped job nobody owns leaves the list
            return await job_of(client, left) is None

        await until(stopped, "the abandoned download to stop")
        assert env.partial(other_repo, PLAIN).stat().st_size == 100_000
        assert not (await model(client, left))["downloaded"] and left not in await loaded(client)
        env.hub.release()
        assert (await client.post("load", json={"model_name": left})).status_code == 200  # resumes it
    first, second = env.hub.served(PLAIN, other_repo)
    assert (first.range_start, first.sent) == (None, 100_000)
    assert (second.range_start, second.sent) == (100_000, size - 100_000)


async def test_load_of_a_collection_pulls_its_missing_components(env: Env) -> None:
    have_repo, missing_repo = env.repo(), env.repo()
    have, missing, temporary = fresh("user.have-"), fresh("user.missing-"), fresh("user.temporary-")
    kit, broken = fresh("user.LoadKit-"), fresh("user.BrokenKit-")
    registry = env.registry()
    registry.register(have, registration(have_repo))
    registry.register(missing, registration(missing_repo))
    registry.register(temporary, registration(missing_repo))
    registry.register(kit, {"recipe": "collection.omni", "components": [have, missing]})
    registry.register(broken, {"recipe": "collection.omni", "components": [have, temporary]})
    registry.unregister(temporary)
    async with env.client() as client:
        assert (await client.post("pull", json={"model_name": have})).json()["status"] == "success"
        assert not (await model(client, kit))["downloaded"]
        response = await client.post("load", json={"model_name": kit})
        assert response.json() == {"status": "success", "message": f"Loaded model: {kit}"}
        assert (await model(client, missing))["downloaded"] and (await model(client, kit))["downloaded"]
        assert missing in await loaded(client)  # the components load in turn: the last one holds the LLM slot
        error = assert_error(await client.post("load", json={"model_name": broken}), 400, "invalid_argument")
        assert "gone" in error["message"]
    assert len(env.hub.served(PLAIN, have_repo)) == 1  # the component already there was not fetched again
    assert len(env.hub.served(PLAIN, missing_repo)) == 1


# -- delete ------------------------------------------------------------------------------------------------------


async def test_delete_frees_only_that_models_files(env: Env) -> None:
    repo = env.repo()
    plain, sharded = fresh("user.del-a-"), fresh("user.del-b-")
    async with env.client() as client:
        await client.post("pull", json={"model_name": plain, **registration(repo), "mmproj": MMPROJ})
        await client.post("pull", json={"model_name": sharded, **registration(repo, "Q8_0"), "mmproj": MMPROJ})
        assert (await client.post("load", json={"model_name": plain})).status_code == 200
        snapshot = env.storage(repo) / "snapshots" / env.hub.head(repo)
        plain_blob = (snapshot / PLAIN).resolve()

        response = await client.post("delete", json={"model_name": plain})
        assert response.json() == {"status": "success", "message": f"Deleted model: {plain}"}
        assert (await client.get("health")).json()["all_models_loaded"] == []  # unloaded first
        assert not (snapshot / PLAIN).exists() and not plain_blob.exists()
        assert (snapshot / MMPROJ).is_file()  # the other model uses it
        assert (await model(client, sharded))["downloaded"]
        assert_error(await client.get(f"models/{plain}"), 404, "model_not_found")
        assert plain.removeprefix("user.") not in json.loads((env.root / "cache" / "user_models.json").read_text())

        await client.post("delete", json={"model_name": sharded})
        assert not env.storage(repo).exists()  # nothing of the repo is left
        assert_error(await client.post("delete", json={"model_name": sharded}), 404, "model_not_found")
        assert_error(await client.post("delete", json={}), 400, "missing_argument")


async def test_delete_during_a_download_cancels_it(env: Env) -> None:
    repo = env.repo()
    name = fresh("user.del-running-")
    env.hub.hold(at=100_000, path=PLAIN)
    async with env.client() as client:
        await client.post("pull", json={"model_name": name, **registration(repo), "stream": True, "subscribe": False})
        await wait_job(client, name, lambda j: j["bytes_downloaded"] == 100_000, "the hold")
        assert (await client.post("delete", json={"model_name": name})).json()["status"] == "success"
        assert await job_of(client, name) is None
        assert not env.partial(repo, PLAIN).exists()
        assert_error(await client.get(f"models/{name}"), 404, "model_not_found")


async def test_ollama_pull_streams_the_job_and_delete_frees_it(env: Env) -> None:
    import ollama

    repo = env.repo()
    name = fresh("user.ollama-")
    rows_path = env.root / "cache" / "user_models.json"  # registered, not downloaded: as a catalog entry is
    rows = json.loads(rows_path.read_text()) if rows_path.exists() else {}
    rows[name.removeprefix("user.")] = {**registration(repo), "labels": ["chat"]}
    rows_path.parent.mkdir(parents=True, exist_ok=True)
    rows_path.write_text(json.dumps(rows))
    client = ollama.AsyncClient(host=env.host.root.rstrip("/"), headers=env.host.headers, timeout=120)
    lines = [line async for line in await client.pull(name, stream=True)]
    assert lines[0].status == "pulling manifest" and lines[-1].status == "success"
    progress = [line for line in lines if line.completed is not None]
    assert progress and all(line.digest and line.total for line in progress)
    assert progress[-1].completed == progress[-1].total == env.files[PLAIN].stat().st_size
    async with env.client() as http:  # the bytes it took off the network, in /metrics
        metrics = (await http.get(env.host.root + "metrics")).text
    assert f'lemonkit_download_bytes_total{{model="{name}"}} {float(env.files[PLAIN].stat().st_size)}' in metrics
    assert f"{name}:latest" in {m.model for m in (await client.list()).models}
    assert (await client.pull(name)).status == "success"  # downloaded already: nothing to do
    answer = await client.chat(name, messages=[{"role": "user", "content": "hi"}], options={"num_predict": 2})
    assert answer.done
    snapshot = env.storage(repo) / "snapshots" / env.hub.head(repo)
    await client.delete(name)
    assert not (snapshot / PLAIN).exists() and f"{name}:latest" not in {m.model for m in (await client.list()).models}
    with pytest.raises(ollama.ResponseError) as missing:
        await client.pull("user.no-such-model")
    assert missing.value.status_code == 404


# -- a killed server ---------------------------------------------------------------------------------------------


async def test_killed_server_resumes_after_restart(
    module_hub: HubServer, repo_files: dict[str, Path], tmp_path: Path
) -> None:
    env = Env(Host("standalone", "", API_KEY), module_hub, tmp_path, repo_files)
    repo = env.repo()
    name = fresh("user.killed-")
    size = module_hub.file(repo, PLAIN).size
    server_env = {**env_for(module_hub, tmp_path), "LEMONADE_API_KEY": API_KEY}
    server = Standalone(server_env)
    try:
        module_hub.hold(at=400_000, path=PLAIN)
        async with Host("standalone", server.root, API_KEY).client() as client:
            body = {"model_name": name, **registration(repo), "stream": True, "subscribe": False}
            await client.post("pull", json=body)
            await wait_job(client, name, lambda j: j["bytes_downloaded"] == 400_000, "the hold")
        await until_saved(tmp_path, name, lambda e: e["plan"] is not None, "the planned job in downloads.json")
        server.process.kill()
        server.process.wait(30)
    finally:
        server.stop()
        module_hub.release()
    assert env.partial(repo, PLAIN).stat().st_size == 400_000
    server = Standalone(server_env)
    try:
        async with Host("standalone", server.root, API_KEY).client() as client:
            # the new server lists the job it never ran: paused, its progress read from the partial file
            restored = await job_of(client, name)
            assert restored is not None, "the interrupted job is not listed after the restart"
            assert restored["status"] == "paused" and restored["running"] is False and not restored["complete"]
            assert (restored["file"], restored["file_index"], restored["total_files"]) == (PLAIN, 1, 1)
            assert restored["bytes_downloaded"] == restored["bytes_previously_downloaded"] == 400_000
            assert restored["cumulative_bytes_downloaded"] == 400_000
            assert restored["bytes_total"] == restored["total_download_size"] == size
            assert restored["percent"] == 400_000 * 100 // size
            obj = await model(client, name)  # registered before the first byte moved
            assert obj["downloaded"] is False
            assert (await client.post("pull", json={"model_name": name})).json()["status"] == "success"
            assert (await model(client, name))["downloaded"]
            done = await job_of(client, name)
            assert done is not None and done["status"] == "completed" and done["complete"]
    finally:
        server.stop()
    _, second = module_hub.served(PLAIN, repo)
    assert (second.range_start, second.sent) == (400_000, size - 400_000)


async def test_jobs_survive_restarts_and_cancel_and_remove_still_apply(
    module_hub: HubServer, repo_files: dict[str, Path], tmp_path: Path
) -> None:
    env = Env(Host("standalone", "", API_KEY), module_hub, tmp_path, repo_files)
    kept_repo, dropped_repo = env.repo(), env.repo()
    kept, dropped = fresh("user.kept-"), fresh("user.dropped-")
    size = module_hub.file(kept_repo, PLAIN).size
    server_env = {**env_for(module_hub, tmp_path), "LEMONADE_API_KEY": API_KEY}

    def client_of(server: Standalone) -> httpx.AsyncClient:
        return Host("standalone", server.root, API_KEY).client()

    module_hub.hold(at=100_000, path=PLAIN)
    try:
        server = Standalone(server_env)
        try:
            async with client_of(server) as client:
                for name, repo in ((kept, kept_repo), (dropped, dropped_repo)):
                    body = {"model_name": name, **registration(repo), "stream": True, "subscribe": False}
                    await client.post("pull", json=body)
                    await wait_job(client, name, lambda j: j["bytes_downloaded"] == 100_000, "the hold")
                await client.post("downloads/control", json={"id": f"model:{kept}", "action": "pause"})
                await wait_job(client, kept, lambda j: not j["running"], "the pause")
            await until_saved(tmp_path, kept, lambda e: e["status"] == "paused", "the paused job on disk")
            await until_saved(tmp_path, dropped, lambda e: e["plan"] is not None, "the running job on disk")
            server.process.kill()  # one job paused, one running
            server.process.wait(30)
        finally:
            server.stop()

        server = Standalone(server_env)
        try:
            async with client_of(server) as client:
                jobs = {j["model_name"]: j for j in (await client.get("downloads")).json()}
                assert set(jobs) == {kept, dropped}
                for job in jobs.values():
                    assert (job["status"], job["running"], job["bytes_downloaded"]) == ("paused", False, 100_000)
                cancel = {"id": f"model:{dropped}", "action": "cancel"}
                cancelled = (await client.post("downloads/control", json=cancel)).json()
                assert cancelled["status"] == "cancelled" and cancelled["running"] is False
                assert not env.partial(dropped_repo, PLAIN).exists()  # cancel discards the partial file
                assert env.partial(kept_repo, PLAIN).stat().st_size == 100_000
                listed = await job_of(client, dropped)
                assert listed is not None and listed["status"] == "cancelled"
                remove = {"id": f"model:{dropped}", "action": "remove"}
                assert (await client.post("downloads/control", json=remove)).json() == {"status": "ok"}
                assert await job_of(client, dropped) is None
        finally:
            server.stop()  # a clean stop: the removal is on disk before the process ends

        server = Standalone(server_env)
        try:
            async with client_of(server) as client:
                assert [j["model_name"] for j in (await client.get("downloads")).json()] == [kept]
                module_hub.release()
                assert (await client.post("pull", json={"model_name": kept})).json()["status"] == "success"
                assert (await model(client, kept))["downloaded"]
                assert not (await model(client, dropped))["downloaded"]
        finally:
            server.stop()
    finally:
        module_hub.release()
    _, resumed = module_hub.served(PLAIN, kept_repo)
    assert (resumed.range_start, resumed.sent) == (100_000, size - 100_000)
    assert len(module_hub.served(PLAIN, dropped_repo)) == 1  # never resumed


async def test_a_registration_stopped_before_its_row_was_saved_resumes(
    module_hub: HubServer, repo_files: dict[str, Path], tmp_path: Path
) -> None:
    # a registration's row is saved once the hub has listed its files: a server that dies while the job plans
    # leaves the job's entry (written when it started) for a model the registry does not know yet
    env = Env(Host("standalone", "", API_KEY), module_hub, tmp_path, repo_files)
    repo = env.repo()
    name = fresh("user.unsaved-")
    row = registration(repo)
    started = Job(env.registry().preview(name, row), asyncio.get_running_loop(), owned=True, register=row)
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "downloads.json").write_text(json.dumps({"jobs": {started.id: started.record()}}))
    server = Standalone({**env_for(module_hub, tmp_path), "LEMONADE_API_KEY": API_KEY})
    try:
        async with Host("standalone", server.root, API_KEY).client() as client:
            job = await job_of(client, name)
            assert job is not None and (job["status"], job["running"], job["total_files"]) == ("paused", False, 0)
            assert_error(await client.get(f"models/{name}"), 404, "model_not_found")
            response = await client.post("pull", json={"model_name": name})  # by name: the job knows the row
            assert response.json() == {"status": "success", "message": f"Installed model: {name}"}
            assert (await model(client, name))["downloaded"]
    finally:
        server.stop()
    rows = json.loads((tmp_path / "cache" / "user_models.json").read_text())
    assert rows[name.removeprefix("user.")] == row


# -- names never escape ----------------------------------------------------------------------------------------

ESCAPE_REPO = "lemonkit/escape-GGUF"
SECRET = "secret.gguf"
UP = "../../../../"  # from a snapshot of ESCAPE_REPO to the host's root, where SECRET is
UNREACHABLE = "http://127.0.0.1:9"


def plant(root: Path, files: dict[str, Path]) -> None:
    """A cached snapshot of ESCAPE_REPO, a file outside the cache a bad name could reach, and an allowed dir."""
    snapshot = root / "hub" / f"models--{ESCAPE_REPO.replace('/', '--')}" / "snapshots" / ("e" * 40)
    snapshot.mkdir(parents=True, exist_ok=True)
    if not (snapshot / PLAIN).exists():
        (snapshot / PLAIN).write_bytes(files[PLAIN].read_bytes())
        (root / SECRET).write_bytes(files[PLAIN].read_bytes())  # a loadable model: an escape would load it
        (root / "allowed").mkdir()
        (root / "allowed" / "ok.gguf").write_bytes(files[PLAIN].read_bytes())
        (root / "allowed" / "link.gguf").symlink_to(root / SECRET)
        (root / "allowed" / "up").symlink_to(root)


def bad_registrations(root: Path) -> list[dict[str, Any]]:
    """Pull bodies whose checkpoint or mmproj names a file outside the cache (or outside the allowed dir)."""
    repo, back = ESCAPE_REPO, "..\\" * 4
    checkpoints = [
        f"{repo}:{UP}{SECRET}",
        f"{repo}:{'%2e%2e/' * 4}{SECRET}",
        f"{repo}:{'%2E%2E%2F' * 4}{SECRET}",
        f"{repo}:{back}{SECRET}",
        f"{repo}:{SECRET}\0",
        f"{repo}:Q4_K_M/\0",
        f"{repo}:/etc/passwd",
        f"{repo}:{root / SECRET}",
        f"{repo}:a//{SECRET}",
        f"lemonkit/..:{SECRET}",
        f"../../{SECRET}",
        str(root / SECRET),
        f"{root}/allowed/../{SECRET}",
        str(root / "allowed" / "link.gguf"),
        f"{root}/allowed/up/{SECRET}",
        f"{root}/allowed/ok.gguf\0",
    ]
    mmprojs = [
        f"{UP}{SECRET}",
        f"{'%2e%2e/' * 4}{SECRET}",
        f"{back}{SECRET}",
        "mmproj\0.gguf",
        f"{repo}:{UP}{SECRET}",
        str(root / SECRET),
        str(root / "allowed" / "link.gguf"),
    ]
    bodies = [{"checkpoint": c} for c in checkpoints]
    bodies += [{"checkpoint": f"{repo}:Q4_K_M", "mmproj": m} for m in mmprojs]
    return [{"model_name": fresh("user.escape-"), "recipe": "llamacpp", **body} for body in bodies]


async def assert_refused_and_nothing_registered(host: Host, root: Path) -> None:
    user_models = root / "cache" / "user_models.json"
    before = user_models.read_bytes() if user_models.exists() else None
    secret = (root / SECRET).read_bytes()
    async with host.client() as client:
        for body in bad_registrations(root):
            for stream in ({}, {"stream": True}, {"stream": True, "subscribe": False}):
                response = await client.post("pull", json={**body, **stream})
                error = assert_error(response, 400, "invalid_argument")
                assert "checkpoint" in error["message"] or "mmproj" in error["message"], error
            assert_error(await client.get(f"models/{body['model_name']}"), 404, "model_not_found")
            assert_error(await client.get(f"models/{body['model_name']}/files"), 404, "model_not_found")
            assert await job_of(client, body["model_name"]) is None
        listed = {m["id"] for m in (await client.get("models", params={"show_all": "true"})).json()["data"]}
        assert not any(name.startswith("user.escape-") for name in listed)
    assert (user_models.read_bytes() if user_models.exists() else None) == before
    assert (root / SECRET).read_bytes() == secret


async def test_names_that_escape_are_refused_before_the_hub(env: Env) -> None:
    plant(env.root, env.files)
    asked = len(env.hub.log)
    await assert_refused_and_nothing_registered(env.host, env.root)
    assert not [s.path for s in env.hub.log[asked:] if "escape" in s.path]  # refused before any request


@pytest.fixture(scope="module")
def unreachable_standalone(
    tmp_path_factory: pytest.TempPathFactory, repo_files: dict[str, Path]
) -> Iterator[tuple[Host, Path]]:
    root = tmp_path_factory.mktemp("unreachable")
    plant(root, repo_files)
    server = Standalone({**env_for(UNREACHABLE, root), "LEMONADE_API_KEY": API_KEY})
    yield Host("standalone", server.root, API_KEY), root
    server.stop()


@pytest.fixture(params=["jupyter", "standalone"])
def unreachable(
    request: pytest.FixtureRequest, repo_files: dict[str, Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> tuple[Host, Path]:
    """A host whose HF_ENDPOINT answers nothing (connection refused)."""
    if request.param == "standalone":
        return request.getfixturevalue("unreachable_standalone")
    from huggingface_hub import constants

    for key, value in env_for(UNREACHABLE, tmp_path).items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    plant(tmp_path, repo_files)
    return request.getfixturevalue("jupyter_host"), tmp_path


async def test_names_that_escape_are_refused_with_the_hub_unreachable(unreachable: tuple[Host, Path]) -> None:
    host, root = unreachable
    await assert_refused_and_nothing_registered(host, root)
    async with host.client() as client:  # the hub is unreachable indeed: a good name fails to download
        good = {"model_name": fresh("user.unreached-"), "checkpoint": "lemonkit/elsewhere-GGUF", "recipe": "llamacpp"}
        assert_error(await client.post("pull", json=good), 502, "download_error")
        # and a model already in the cache installs without it
        cached = {"model_name": fresh("user.cached-"), "checkpoint": f"{ESCAPE_REPO}:Q4_K_M", "recipe": "llamacpp"}
        assert (await client.post("pull", json=cached)).json()["status"] == "success"


async def test_server_local_files_only_inside_the_allowed_dir(env: Env) -> None:
    plant(env.root, env.files)
    allowed = env.root / "allowed"
    name = fresh("user.local-")
    async with env.client() as client:
        body = {"model_name": name, "checkpoint": str(allowed / "ok.gguf"), "recipe": "llamacpp"}
        assert (await client.post("pull", json=body)).json()["status"] == "success"
        obj = await model(client, name)
        assert obj["downloaded"] and obj["source"] == "local_path"
        [entry] = (await client.get(f"models/{name}/files", params={"include_paths": "true"})).json()["files"]
        assert entry["path"] == str(allowed / "ok.gguf") and entry["exists"]
        # a symlink inside the allowed dir that leads out of it is refused (one case of the table above)
        link = {"model_name": fresh("user.local-"), "checkpoint": str(allowed / "link.gguf"), "recipe": "llamacpp"}
        assert "outside" in assert_error(await client.post("pull", json=link), 400, "invalid_argument")["message"]


def tree(base: Path) -> set[Path]:
    return set(base.rglob("*"))


@pytest.mark.parametrize(
    ("names", "etag"),
    [
        (["../x-Q4_K_M.gguf"], None),
        (["a/../../x-Q4_K_M.gguf"], None),
        ([f"{UP}x-Q4_K_M.gguf", PLAIN], None),
        ([PLAIN], "../../y"),
        ([PLAIN], f"{UP}../y"),
    ],
    ids=["dotdot", "inner-dotdot", "deep-dotdot", "etag", "deep-etag"],
)
async def test_a_hostile_hub_writes_nothing_outside_the_cache(
    env: Env, tmp_path_factory: pytest.TempPathFactory, names: list[str], etag: str | None
) -> None:
    repo = fresh("evil/hub-") + "-GGUF"
    env.hub.add_repo(repo, {n: env.files[PLAIN] for n in names}, etag=etag)
    name = fresh("user.hostile-")
    base = tmp_path_factory.getbasetemp()
    before = tree(base)
    async with env.client() as client:
        body = {"model_name": name, **registration(repo)}
        error = assert_error(await client.post("pull", json=body), 502, "download_error")
        assert "ETag" in error["message"] if etag else "listing" in error["message"], error
        if etag:  # the listing was sound: the model was registered, and a streamed pull ends in an error event
            async with client.stream("POST", "pull", json={"model_name": name, "stream": True}) as response:
                assert response.status_code == 200
                events = await sse(response)
            assert events[-1][0] == "error" and events[-1][1]["code"] == "download_error", events
            assert not (await model(client, name))["downloaded"]
        else:  # refused with the listing: registered nothing
            assert_error(await client.get(f"models/{name}"), 404, "model_not_found")
    new = tree(base) - before
    storage, locks, state = env.storage(repo), env.hf_cache / ".locks", env.root / "cache"
    assert all(p.is_relative_to(storage) or p.is_relative_to(locks) or p.is_relative_to(state) for p in new), new
    assert not [p for p in new if p.name.startswith(("x-Q4_K_M", "y"))], new
    assert not (storage / "snapshots").exists()  # nothing was linked


# -- offline (the session's hosts) -------------------------------------------------------------------------------


async def test_offline_pull(host: Host) -> None:
    async with host.client() as client:
        # already downloaded: installed without asking the hub
        assert (await client.post("pull", json={"model_name": "user.tiny-llama"})).json()["status"] == "success"
        error = assert_error(await client.post("pull", json={"model_name": "Qwen3-1.7B-GGUF"}), 503, "download_error")
        assert "HF_HUB_OFFLINE" in error["message"]
        assert (await model(client, "user.tiny-llama"))["update_available"] is False


# -- the CLI -----------------------------------------------------------------------------------------------------


async def test_cli_commands(pull_standalone: tuple[Host, Path], module_hub: HubServer, repo_files: dict) -> None:
    host, _ = pull_standalone
    repo = fresh("lemonkit/cli-") + "-GGUF"
    module_hub.add_repo(repo, repo_files)
    cli_env = {**os.environ, "LEMONKIT_URL": host.root, "LEMONADE_API_KEY": API_KEY}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "lemonkit.cli", *args], env=cli_env, capture_output=True, text=True, timeout=120
        )

    variants = await asyncio.to_thread(cli, "variants", repo)
    assert variants.returncode == 0 and "Q4_K_M" in variants.stdout and "2 shards" in variants.stdout
    name = "user." + repo.split("/")[1]
    pulled = await asyncio.to_thread(cli, "pull", repo)  # owner/repo: the top variant, labels and mmproj from the hub
    assert pulled.returncode == 0, pulled.stderr
    assert pulled.stdout.strip() == f"Installed model: {name}" and "100%" in pulled.stderr  # the tqdm bar
    async with host.client() as client:
        obj = await model(client, name)
        assert obj["downloaded"] and obj["checkpoints"]["mmproj"] == f"{repo}:{MMPROJ}" and "vision" in obj["labels"]
    listed = await asyncio.to_thread(cli, "list")
    assert any(line.startswith(name) and " yes " in line for line in listed.stdout.splitlines())
    assert (await asyncio.to_thread(cli, "load", name)).stdout.strip() == f"Loaded model: {name}"
    assert (await asyncio.to_thread(cli, "unload")).returncode == 0
    assert (await asyncio.to_thread(cli, "delete", name)).stdout.strip() == f"Deleted model: {name}"
    missing = await asyncio.to_thread(cli, "pull", "user.nothing-here")
    assert missing.returncode == 2 and "404" in missing.stderr
    cli_env["LEMONKIT_URL"] = "http://127.0.0.1:9"
    assert (await asyncio.to_thread(cli, "list")).returncode == 2


# -- Python ------------------------------------------------------------------------------------------------------


async def test_python_pull(pull_standalone: tuple[Host, Path], module_hub: HubServer, repo_files: dict) -> None:
    import io

    import lemonkit

    host, _ = pull_standalone
    repo = fresh("lemonkit/py-") + "-GGUF"
    module_hub.add_repo(repo, repo_files)
    name = "user." + repo.split("/")[1]

    def pull(model: str, **kwargs: Any) -> tuple[dict[str, Any], str]:
        bar = io.StringIO()
        with lemonkit.Client(host.root, token=API_KEY) as client:
            return lemonkit.pull(model, client=client, file=bar, **kwargs), bar.getvalue()

    entry, bar = await asyncio.to_thread(pull, f"{repo}:Q4_K_M")
    assert entry["id"] == name and entry["downloaded"] and "vision" in entry["labels"]
    assert "100%" in bar and name in bar
    explicit, _ = await asyncio.to_thread(pull, "user.py-explicit", checkpoint=f"{repo}:{PLAIN}", reasoning=True)
    assert explicit["downloaded"] and "reasoning" in explicit["labels"]
    with pytest.raises(lemonkit.ModelNotFound):
        await asyncio.to_thread(pull, "user.nothing-here")
    with pytest.raises(lemonkit.ModelNotFound):
        await asyncio.to_thread(pull, "lemonkit/no-such-repo-GGUF")
    # the async client streams the same events
    other = fresh("lemonkit/py-async-") + "-GGUF"
    module_hub.add_repo(other, repo_files)
    async with lemonkit.AsyncClient(host.root, token=API_KEY) as client:
        events = [event async for event in client.pull(f"{other}:Q4_K_M")]
        assert events[-1].name == "complete" and {e.name for e in events[:-1]} == {"progress"}
        assert events[-2].data["percent"] == 100
        assert (await client.model("user." + other.split("/")[1]))["downloaded"]
