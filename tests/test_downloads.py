"""The download manager without HTTP: job retention, variant naming and ranking."""

from __future__ import annotations

from pathlib import Path

import pytest
from hub_server import HubServer, tiny_gguf_repo

from lemonkit.config import Settings
from lemonkit.downloads import DownloadManager, Listing, RemoteFile, list_variants
from lemonkit.registry import Registry


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
