"""What a shared server's user may see: log records tagged with their caller, download jobs with who asked."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lemonkit.catalog.config import Settings
from lemonkit.catalog.registry import Registry
from lemonkit.downloads import DownloadManager
from lemonkit.errors import NotFound
from lemonkit.serving import caller
from lemonkit.serving.caller import Caller, CallerTag
from lemonkit.serving.log_store import LogStore, StoreHandler
from tests.support.hub_server import HubServer, tiny_gguf_repo

ALICE = Caller("alice", admin=False, shared=True)
BOB = Caller("bob", admin=False, shared=True)
ADMIN = Caller("admin", admin=True, shared=True)
ROW = {"checkpoint": "o/tiny-GGUF:Q4_K_M", "recipe": "llamacpp"}


def test_own_only_is_set_for_a_shared_servers_users_who_are_not_admins() -> None:
    assert (ALICE.own_only, ADMIN.own_only, caller.OWNER.own_only) == ("alice", None, None)


@pytest.fixture
def store() -> Iterator[tuple[LogStore, logging.Logger]]:
    store = LogStore()
    handler = StoreHandler(store)
    handler.addFilter(CallerTag())
    logger = logging.getLogger("lemonkit.test-isolation")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield store, logger
    logger.removeHandler(handler)


def _lines(entries: list[str]) -> list[str]:
    return [json.loads(e)["line"].rsplit(") ", 1)[1] for e in entries]


async def test_log_records_are_seen_by_their_callers_only(store: tuple[LogStore, logging.Logger]) -> None:
    logs, logger = store

    def as_(who: Caller, message: str) -> None:
        caller.current.set(who)  # this task's context only, as a host's set_caller does for a request
        logger.info(message)

    await asyncio.gather(
        asyncio.to_thread(lambda: logger.info("the server started")),
        asyncio.ensure_future(asyncio.to_thread(as_, ALICE, "alice asked")),
    )
    await asyncio.ensure_future(asyncio.to_thread(as_, BOB, "bob asked"))
    await asyncio.ensure_future(asyncio.to_thread(as_, caller.OWNER, "the owner asked"))
    everything, last = logs.since(None)
    assert sorted(_lines(everything)) == sorted(["the server started", "alice asked", "bob asked", "the owner asked"])
    assert _lines(logs.since(None, only_of="alice")[0]) == ["alice asked"]
    assert _lines(logs.since(None, only_of="bob")[0]) == ["bob asked"]
    assert logs.since(last, only_of="alice") == ([], last)
    fields = {"seq", "timestamp", "severity", "tag", "line"}
    assert all(set(json.loads(e)) == fields for e in everything)  # who asked is not sent to anyone


def _manager(hub: HubServer, tmp_path: Path) -> tuple[DownloadManager, Registry]:
    config = Settings(cache_dir=tmp_path / "cache", hf_endpoint=hub.url)
    registry = Registry(config.cache_dir, hf_cache=tmp_path / "hub")
    return DownloadManager(config, registry), registry


def _entry(name: str, *asked: str) -> dict[str, Any]:
    base = {"model_name": name, "status": "cancelled", "register": None, "error": None, "finished_at": None}
    return {**base, "requested_by": list(asked)}


async def test_jobs_and_their_control_are_the_askers_only(hub: HubServer, tmp_path: Path) -> None:
    downloads, registry = _manager(hub, tmp_path)
    for name in ("user.a", "user.b", "user.both"):
        registry.register(name, ROW)
    jobs = {
        "model:user.a": _entry("user.a", "alice"),
        "model:user.b": _entry("user.b", "bob"),
        "model:user.both": _entry("user.both", "alice", "bob"),
    }
    (tmp_path / "cache").mkdir(parents=True, exist_ok=True)
    (tmp_path / "cache" / "downloads.json").write_text(json.dumps({"jobs": jobs}))
    await downloads.restore()
    assert {j.model_name for j in downloads.jobs()} == {"user.a", "user.b", "user.both"}
    assert {j.model_name for j in downloads.jobs(visible_to="alice")} == {"user.a", "user.both"}
    assert {j.model_name for j in downloads.jobs(visible_to="carol")} == set()
    with pytest.raises(NotFound) as hidden:
        await downloads.control("model:user.b", "cancel", visible_to="alice")
    assert hidden.value.code == "download_not_found"  # answered as if there were no such job
    assert await downloads.control("model:user.b", "remove", visible_to="alice") == {"status": "ok", "missing": True}
    assert downloads.get("model:user.b") is not None  # untouched
    assert (await downloads.control("model:user.b", "remove", visible_to="bob")) == {"status": "ok"}
    assert downloads.get("model:user.b") is None
    await downloads.close()


@pytest.mark.usefixtures("hf_online")
async def test_a_pull_records_everyone_who_asked_and_keeps_it(hub: HubServer, tmp_path: Path) -> None:
    hub.add_repo("o/tiny-GGUF", tiny_gguf_repo(tmp_path / "src"))
    downloads, registry = _manager(hub, tmp_path)
    hub.hold(at=70_000, path="tiny-Q4_K_M.gguf")
    try:
        info = registry.preview("user.t", ROW)
        job = await downloads.pull(info, owned=True, register=ROW, by="alice")
        assert await downloads.pull(info, owned=True, register=ROW, by="bob") is job  # joined
        assert job.requested_by == {"alice", "bob"}
        assert [j.id for j in downloads.jobs(visible_to="bob")] == ["model:user.t"]
        assert downloads.jobs(visible_to="carol") == []
        await downloads.close()
    finally:
        hub.release()
    restarted, _ = _manager(hub, tmp_path)
    await restarted.restore()
    [again] = restarted.jobs(visible_to="alice")
    assert again.requested_by == {"alice", "bob"} and restarted.jobs(visible_to="carol") == []
    await restarted.close()
