"""The download manager without HTTP: job retention, variant naming and ranking."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from lemonkit.catalog.config import Settings
from lemonkit.catalog.registry import Registry
from lemonkit.downloads import DownloadManager, Job, Listing, RemoteFile, list_variants
from tests.support.hub_server import HubServer, tiny_gguf_repo

PLAIN = "tiny-Q4_K_M.gguf"
ROW = {"checkpoint": "o/tiny-GGUF:Q4_K_M", "recipe": "llamacpp"}


def _manager(hub: HubServer, tmp_path: Path, **settings: Any) -> tuple[DownloadManager, Registry]:
    """A download manager over ``tmp_path``'s caches: a new one over the same paths is the next server."""
    config = Settings(cache_dir=tmp_path / "cache", hf_endpoint=hub.url, **settings)
    registry = Registry(config.cache_dir, hf_cache=tmp_path / "hub")
    return DownloadManager(config, registry), registry


def _saved(tmp_path: Path) -> dict[str, Any]:
    try:
        return json.loads((tmp_path / "cache" / "downloads.json").read_text())["jobs"]
    except (OSError, ValueError, KeyError):
        return {}


async def _until(check: Callable[[], bool | Awaitable[bool]], what: str) -> None:
    """Poll ``check`` (the file is written off the loop) until it holds, bounded."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    while True:
        result = check()
        if result if isinstance(result, bool) else await result:
            return
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def _until_progress(job: Job, received: int) -> None:
    while job.snapshot()["bytes_downloaded"] != received:
        async with asyncio.timeout(30):  # no progress: fail rather than hang
            await job.wait_change(job.version)


@pytest.mark.usefixtures("hf_online")
async def test_completed_jobs_expire_after_the_retention(hub: HubServer, tmp_path: Path) -> None:
    hub.add_repo("o/tiny-GGUF", tiny_gguf_repo(tmp_path / "src"))
    settings = Settings(cache_dir=tmp_path / "cache", hf_endpoint=hub.url, download_retention=0)
    registry = Registry(settings.cache_dir, hf_cache=tmp_path / "hub")
    downloads = DownloadManager(settings, registry)
    row = {"checkpoint": "o/tiny-GGUF:Q4_K_M", "recipe": "llamacpp"}
    job = await downloads.pull(registry.preview("user.t", row), owned=True, register=row)
    await job.wait_stopped()
    assert job.snapshot()["status"] == "completed" and registry.is_downloaded(registry.get("user.t"))
    assert downloads.jobs() == []  # retention 0: gone at the next look
    await downloads.close()


def _listing(*paths: str, repo: str = "o/r") -> Listing:
    return Listing(repo, "c" * 40, {p: RemoteFile(repo, p, "c" * 40, size=10) for p in paths})


def test_variant_names_ranking_and_cap() -> None:
    listing = _listing(
        "Model-Q4_K_M.gguf",
        "Model-q8_0.gguf",
        "Model-UD-Q4_K_XL.gguf",
        "BF16/Model-BF16-00001-of-00002.gguf",
        "BF16/Model-BF16-00002-of-00002.gguf",
        "Model-IQ4_XS.gguf",
        "Model-Q4_0.gguf",
        "Model-TQ1_0.gguf",
        "mmproj-BF16.gguf",
        "weird.gguf",
        "README.md",
    )
    result = list_variants("o/r", listing)
    assert [v["name"] for v in result["variants"]] == ["Q4_K_M", "UD-Q4_K_XL", "Q8_0", "Q4_0", "BF16"]
    bf16 = result["variants"][-1]
    assert bf16["sharded"] and bf16["size_bytes"] == 20 and bf16["primary_file"].endswith("00001-of-00002.gguf")
    assert result["mmproj_files"] == ["mmproj-BF16.gguf"] and result["suggested_labels"] == ["vision"]
    # a name without a quant in it is its own variant; past the cap here
    assert [v["name"] for v in list_variants("o/r", _listing("weird.gguf"))["variants"]] == ["weird"]
    assert list_variants("o/rerank-GGUF", _listing("a-Q4_0.gguf", repo="o/rerank-GGUF"))["suggested_labels"] == [
        "reranking"
    ]


# -- downloads.json ----------------------------------------------------------------------------------------------


@pytest.mark.usefixtures("hf_online")
async def test_a_restarted_manager_lists_the_interrupted_job_and_resumes_it(hub: HubServer, tmp_path: Path) -> None:
    hub.add_repo("o/tiny-GGUF", tiny_gguf_repo(tmp_path / "src"))
    size = hub.file("o/tiny-GGUF", PLAIN).size
    first, registry = _manager(hub, tmp_path)
    hub.hold(at=70_000, path=PLAIN)
    try:
        job = await first.pull(registry.preview("user.t", ROW), owned=True, register=ROW)
        await _until_progress(job, 70_000)
        await _until(lambda: (_saved(tmp_path).get("model:user.t") or {}).get("plan") is not None, "the plan")
        # a second manager over the same caches while the first one's worker still runs: a server that died
        second, _ = _manager(hub, tmp_path)
        await second.restore()
        [restored] = second.jobs()
        snap = restored.snapshot()
        assert (snap["id"], snap["status"], snap["running"]) == ("model:user.t", "paused", False)
        assert (snap["file"], snap["file_index"], snap["total_files"]) == (PLAIN, 1, 1)
        assert snap["bytes_downloaded"] == snap["bytes_previously_downloaded"] == 70_000
        assert snap["total_download_size"] == size and snap["percent"] == 70_000 * 100 // size
        await first.close()  # pauses its worker: the partial file stays
    finally:
        hub.release()
    resumed = await second.pull(registry.get("user.t"), owned=False)
    assert resumed is not restored and resumed.owned  # a listed job stays listed when resumed
    await resumed.wait_done()
    assert registry.is_downloaded(registry.get("user.t"))
    await _until(lambda: _saved(tmp_path)["model:user.t"]["status"] == "completed", "the completion on disk")
    await second.close()
    _, again = hub.served(PLAIN, "o/tiny-GGUF")
    assert (again.range_start, again.sent) == (70_000, size - 70_000)


def _entry(name: str, status: str, **extra: Any) -> dict[str, Any]:
    return {
        "model_name": name,
        "status": status,
        "register": None,
        "error": None,
        "finished_at": None,
        "plan": None,
        **extra,
    }


def _write_saved(tmp_path: Path, content: Any) -> None:
    path = tmp_path / "cache" / "downloads.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content if isinstance(content, bytes) else json.dumps(content).encode())


async def test_restored_jobs_keep_their_state_and_completed_ones_expire(hub: HubServer, tmp_path: Path) -> None:
    downloads, registry = _manager(hub, tmp_path, download_retention=60)
    for name in ("user.recent", "user.old", "user.failed", "user.cancelled"):
        registry.register(name, ROW)
    error = {"message": "Hub request for o/tiny-GGUF failed", "status": 502, "type": "server_error", "code": "x"}
    _write_saved(
        tmp_path,
        {
            "jobs": {
                "model:user.recent": _entry("user.recent", "completed", finished_at=time.time() - 5),
                "model:user.old": _entry("user.old", "completed", finished_at=time.time() - 3600),
                "model:user.failed": _entry("user.failed", "error", error=error),
                "model:user.cancelled": _entry("user.cancelled", "cancelled"),
            }
        },
    )
    await downloads.restore()
    snaps = {job.model_name: job.snapshot() for job in downloads.jobs()}
    assert set(snaps) == {"user.recent", "user.failed", "user.cancelled"}
    assert snaps["user.recent"]["complete"] and snaps["user.recent"]["percent"] == 100
    assert (snaps["user.failed"]["status"], snaps["user.failed"]["error"]) == ("error", error["message"])
    assert snaps["user.cancelled"]["status"] == "cancelled" and not snaps["user.cancelled"]["running"]
    assert (await downloads.control("model:user.failed", "remove")) == {"status": "ok"}
    await _until(lambda: "model:user.failed" not in _saved(tmp_path), "the removal on disk")
    assert set(_saved(tmp_path)) == {"model:user.recent", "model:user.cancelled"}  # the expired entry went too
    await downloads.close()


@pytest.mark.parametrize(
    "content",
    [b"{not json", b"\xff\xfe", b"[1, 2]", {"jobs": [1]}, "directory"],
    ids=["broken", "binary", "array", "jobs-not-object", "directory"],
)
@pytest.mark.usefixtures("hf_online")
async def test_an_unreadable_downloads_json_never_stops_the_server(
    hub: HubServer, tmp_path: Path, content: Any, caplog: pytest.LogCaptureFixture
) -> None:
    hub.add_repo("o/tiny-GGUF", tiny_gguf_repo(tmp_path / "src"))
    if content == "directory":
        (tmp_path / "cache" / "downloads.json").mkdir(parents=True)
    else:
        _write_saved(tmp_path, content)
    downloads, registry = _manager(hub, tmp_path)
    with caplog.at_level(logging.WARNING, logger="lemonkit.downloads"):
        await downloads.restore()
    assert downloads.jobs() == [] and "downloads.json" in caplog.text
    job = await downloads.pull(registry.preview("user.t", ROW), owned=True, register=ROW)
    await job.wait_done()  # downloads work all the same
    await downloads.close()
    if content == "directory":  # it cannot be replaced: logged, and the job list lives on in memory
        assert [j.model_name for j in downloads.jobs()] == ["user.t"]
    else:  # replaced by a good one
        assert _saved(tmp_path)["model:user.t"]["status"] == "completed"


async def test_bad_entries_are_skipped_and_dropped(
    hub: HubServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    downloads, registry = _manager(hub, tmp_path)
    for name in ("user.good", "user.escape", "user.etag"):
        registry.register(name, ROW)
    file = {"repo": "o/tiny-GGUF", "path": PLAIN, "commit": "c" * 40, "size": 10, "sha256": "a" * 64}
    _write_saved(
        tmp_path,
        {
            "jobs": {
                "model:user.good": _entry("user.good", "downloading"),
                "model:user.named-otherwise": _entry("user.good", "paused"),
                "model:user.unknown": _entry("user.unknown", "paused"),
                "model:user.weird": _entry("user.weird", "resting"),
                "model:user.escape": _entry(
                    "user.escape", "paused", plan={"files": [{**file, "path": "../../x"}], "commits": {}}
                ),
                "model:user.etag": _entry(
                    "user.etag", "paused", plan={"files": [{**file, "sha256": "../x"}], "commits": {}}
                ),
                "model:user.text": "not an object",
            }
        },
    )
    with caplog.at_level(logging.WARNING, logger="lemonkit.downloads"):
        await downloads.restore()
    [job] = downloads.jobs()
    assert job.id == "model:user.good" and job.snapshot()["status"] == "paused"  # it was running: now paused
    assert caplog.text.count("not restoring the download job") == 6
    assert "'..' segment" in caplog.text and "not a hub commit or hash" in caplog.text
    await downloads.control("model:user.good", "pause")  # a state change: the file is written again
    await _until(lambda: set(_saved(tmp_path)) == {"model:user.good"}, "the bad entries to go")
    await downloads.close()
