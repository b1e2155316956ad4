"""The test hub speaks enough of the Hugging Face protocol for huggingface_hub itself."""

from __future__ import annotations

import hashlib
from pathlib import Path

import httpx
import pytest
from huggingface_hub import HfApi, hf_hub_download
from huggingface_hub.errors import GatedRepoError, RemoteEntryNotFoundError, RepositoryNotFoundError
from huggingface_hub.hf_api import RepoFile, RepoFolder

from tests.support.hub_server import HubServer, tiny_gguf_repo

pytestmark = pytest.mark.usefixtures("hf_online")

REPO = "tester/tiny-GGUF"


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    return tiny_gguf_repo(tmp_path / "src")


@pytest.mark.parametrize("cdn", [False, True])
def test_hf_hub_download_every_file(hub: HubServer, files: dict[str, Path], tmp_path: Path, cdn: bool) -> None:
    sha = hub.add_repo(REPO, files, cdn=cdn)
    cache = tmp_path / "cache"
    for name, source in files.items():
        path = Path(hf_hub_download(REPO, name, cache_dir=cache, endpoint=hub.url))
        assert path.read_bytes() == source.read_bytes()
        assert path.parent.name == sha or path.parent.parent.name == sha
        blob = path.resolve()
        expected = hub.file(REPO, name)
        assert blob.name == expected.etag  # LFS: sha256, otherwise the git blob id
    assert (cache / "models--tester--tiny-GGUF" / "refs" / "main").read_text() == sha


def test_model_info_and_tree(hub: HubServer, files: dict[str, Path]) -> None:
    sha = hub.add_repo(REPO, files)
    api = HfApi(endpoint=hub.url)
    info = api.model_info(REPO, files_metadata=True)
    assert info.sha == sha
    siblings = {s.rfilename: s for s in info.siblings or []}
    assert set(siblings) == set(files)
    gguf = siblings["tiny-Q4_K_M.gguf"]
    assert gguf.size == files["tiny-Q4_K_M.gguf"].stat().st_size
    assert (
        gguf.lfs is not None and gguf.lfs.sha256 == hashlib.sha256(files["tiny-Q4_K_M.gguf"].read_bytes()).hexdigest()
    )
    assert siblings["README.md"].lfs is None
    assert api.model_info(REPO, revision=sha).sha == sha

    top = list(api.list_repo_tree(REPO))
    assert {e.path for e in top if isinstance(e, RepoFolder)} == {"Q8_0"}
    assert "Q8_0/tiny-Q8_0-00001-of-00002.gguf" not in {e.path for e in top}
    every = {e.path: e for e in api.list_repo_tree(REPO, recursive=True) if isinstance(e, RepoFile)}
    assert set(every) == set(files)
    shard = every["Q8_0/tiny-Q8_0-00002-of-00002.gguf"]
    assert shard.lfs is not None and shard.lfs.size == shard.size
    assert {e.path for e in api.list_repo_tree(REPO, path_in_repo="Q8_0")} == {
        "Q8_0/tiny-Q8_0-00001-of-00002.gguf",
        "Q8_0/tiny-Q8_0-00002-of-00002.gguf",
    }


def test_errors_map_to_huggingface_hub_exceptions(hub: HubServer, files: dict[str, Path], tmp_path: Path) -> None:
    hub.add_repo(REPO, files)
    with pytest.raises(RepositoryNotFoundError):
        HfApi(endpoint=hub.url).model_info("tester/missing")
    with pytest.raises(RepositoryNotFoundError):
        hf_hub_download("tester/missing", "x.gguf", cache_dir=tmp_path, endpoint=hub.url)
    with pytest.raises(RemoteEntryNotFoundError):
        hf_hub_download(REPO, "missing.gguf", cache_dir=tmp_path, endpoint=hub.url)


def test_gated_repo_needs_the_token(hub: HubServer, files: dict[str, Path], tmp_path: Path) -> None:
    hub.add_repo("tester/gated", files, token="hf_secret")
    with pytest.raises(GatedRepoError):
        HfApi(endpoint=hub.url, token=False).model_info("tester/gated")
    assert HfApi(endpoint=hub.url, token="hf_secret").model_info("tester/gated").id == "tester/gated"
    path = hf_hub_download("tester/gated", "README.md", cache_dir=tmp_path, endpoint=hub.url, token="hf_secret")
    assert Path(path).read_text() == "# tiny\n"


def test_range_requests(hub: HubServer, files: dict[str, Path]) -> None:
    hub.add_repo(REPO, files)
    data = files["tiny-Q4_K_M.gguf"].read_bytes()
    url = f"{hub.url}/{REPO}/resolve/main/tiny-Q4_K_M.gguf"
    head = httpx.head(url)
    assert head.headers["X-Linked-Size"] == str(len(data))
    assert head.headers["X-Repo-Commit"] == hub.head(REPO)
    partial = httpx.get(url, headers={"Range": "bytes=100-"})
    assert partial.status_code == 206 and partial.content == data[100:]
    assert partial.headers["Content-Range"] == f"bytes 100-{len(data) - 1}/{len(data)}"
    assert httpx.get(url, headers={"Range": "bytes=10-19"}).content == data[10:20]
    assert httpx.get(url, headers={"Range": "bytes=-5"}).content == data[-5:]
    assert httpx.get(url, headers={"Range": f"bytes={len(data)}-"}).status_code == 416
    assert [s.range_start for s in hub.served("tiny-Q4_K_M.gguf")] == [100, 10, len(data) - 5]


def test_drop_hold_and_throttle(hub: HubServer, files: dict[str, Path], tmp_path: Path) -> None:
    hub.add_repo(REPO, files)
    name = "tiny-Q4_K_M.gguf"
    data = files[name].read_bytes()
    url = f"{hub.url}/{REPO}/resolve/main/{name}"
    hub.drop(after=1000, path=name)
    with pytest.raises(httpx.HTTPError):
        httpx.get(url)
    assert hub.served(name)[-1].sent == 1000
    # huggingface_hub retries a dropped transfer (from 0 here: it buffers 10 MB before writing anything)
    hub.drop(after=5000, path=name)
    path = hf_hub_download(REPO, name, cache_dir=tmp_path, endpoint=hub.url)
    assert Path(path).read_bytes() == data
    assert [s.sent for s in hub.served(name)][-2:] == [5000, len(data)]

    hub.hold(at=4096, path=name)
    with httpx.stream("GET", url) as response:
        chunks = response.iter_bytes()
        got = b""
        while len(got) < 4096:
            got += next(chunks)
        assert hub.held.wait(5) and len(got) == 4096
        hub.release()
        got += b"".join(chunks)
    assert got == data

    hub.throttle = 200_000
    assert httpx.get(url, headers={"Range": "bytes=0-99999"}).content == data[:100_000]
    hub.throttle = None


def test_a_hostile_repo_lists_any_name_and_forges_etags(hub: HubServer) -> None:
    from huggingface_hub import get_hf_file_metadata, hf_hub_url

    hub.add_repo("evil/names", {"../x.gguf": b"GGUF-x", "a/../../x": b"GGUF-a"})
    info = HfApi(endpoint=hub.url).model_info("evil/names", files_metadata=True)
    assert {s.rfilename for s in info.siblings or []} == {"../x.gguf", "a/../../x"}

    hub.add_repo("evil/etag", {"m.gguf": b"GGUF-m"}, etag="../../y")
    meta = get_hf_file_metadata(hf_hub_url("evil/etag", "m.gguf", endpoint=hub.url))
    assert meta.etag == "../../y"
    hub.add_repo("honest/etag", {"m.gguf": b"GGUF-m"})
    meta = get_hf_file_metadata(hf_hub_url("honest/etag", "m.gguf", endpoint=hub.url))
    assert meta.etag == hub.file("honest/etag", "m.gguf").sha256
