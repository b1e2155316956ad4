"""The one check every name passes before it becomes a path, and the cache paths built on it."""

from __future__ import annotations

import json
import logging
from pathlib import Path, PurePosixPath

import pytest

from lemonkit.catalog.hf_cache import (
    HubCache,
    check_checkpoint,
    etag_name,
    hub_hash,
    inside,
    safe_relpath,
)
from lemonkit.catalog.registry import Registry
from lemonkit.downloads.hub_api import RemoteFile

SHA1 = "0123456789abcdef0123456789abcdef01234567"
SHA256 = "0123456789abcdef" * 4

GOOD_NAMES = [
    "model-Q4_K_M.gguf",
    "Q8_0/tiny-Q8_0-00001-of-00002.gguf",
    "a/b/c.json",
    "..hidden",  # a name that starts with dots is a name
    "x..y.gguf",
    "Q4_K_M",
    "caf\u00e9.gguf",
    "100%.gguf",  # a percent that decodes to nothing dangerous
]
BAD_NAMES = [
    "",
    "..",
    ".",
    "../x.gguf",
    "a/../../x",
    "a/..",
    "./x.gguf",
    "/etc/x.gguf",
    "//x",
    "a//b.gguf",
    "a/",
    "..\\x.gguf",
    "a\\b.gguf",
    "x\0.gguf",
    "%2e%2e/x.gguf",
    "%2E%2E/x.gguf",
    "a/%2e%2e/%2e%2e/x",
    "%2fetc/x.gguf",
    "..%2fx.gguf",
    "%5c..%5cx",
    "x%00.gguf",
]


@pytest.mark.parametrize("name", GOOD_NAMES)
def test_safe_relpath_keeps_plain_names(name: str) -> None:
    assert safe_relpath(name, what="file") == PurePosixPath(name)


@pytest.mark.parametrize("name", BAD_NAMES)
def test_safe_relpath_refuses_names_that_could_leave(name: str) -> None:
    with pytest.raises(ValueError, match="file"):
        safe_relpath(name, what="file")


def test_inside_follows_symlinks(tmp_path: Path) -> None:
    base = tmp_path / "base"
    (base / "sub").mkdir(parents=True)
    (tmp_path / "secret").write_text("s")
    (base / "link").symlink_to(tmp_path / "secret")
    (base / "sub" / "ok").symlink_to("../real")
    assert inside(base, "sub/file") == base / "sub" / "file"
    assert inside(base, "sub/ok") == base / "sub" / "ok"  # the link itself, not its target
    for rel in ("link", "../secret", "sub/../../secret"):
        with pytest.raises(ValueError, match="outside"):
            inside(base, rel)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [(SHA256, SHA256), (f'"{SHA256}"', SHA256), (f'W/"{SHA1}"', SHA1), (SHA1, SHA1)],
)
def test_etags_in_the_forms_huggingface_hub_accepts(raw: str, expected: str) -> None:
    assert etag_name(raw, what="ETag") == expected


@pytest.mark.parametrize(
    "raw", ["../../y", '"../../y"', "W/../../y", "", SHA1[:-1], SHA256 + "0", SHA1.upper(), f"{SHA1}/x", "g" * 40]
)
def test_forged_etags_are_refused(raw: str) -> None:
    with pytest.raises(ValueError, match="ETag"):
        etag_name(raw, what="ETag")


def test_hub_hashes() -> None:
    assert hub_hash(SHA1, what="commit") == SHA1
    for bad in ("main", "../" + SHA1, SHA1 + "\0", ""):
        with pytest.raises(ValueError, match="commit"):
            hub_hash(bad, what="commit")


@pytest.mark.parametrize(
    "checkpoint",
    [
        "unsloth/Qwen3-0.6B-GGUF:Q4_0",
        "o/r",
        "o/r:Q8_0/m-00001-of-00002.gguf",
        "o/r:onnx/",
        "gpt2:model.gguf",
        "/models/m.gguf",
        "~/models/m.gguf",
    ],
)
def test_good_checkpoints(checkpoint: str) -> None:
    check_checkpoint(checkpoint, what="checkpoint")


@pytest.mark.parametrize(
    "checkpoint",
    [
        "o/r:../../../../x.gguf",
        "o/r:%2e%2e/x.gguf",
        "o/r:/etc/x.gguf",
        "o/r:..\\x.gguf",
        "o/r:x\0.gguf",
        "/models/x\0.gguf",
        "../../x.gguf",
        "o/..:x.gguf",
        "o/r/x:m.gguf",
        "o--r/x",
        "o/r x",
        "o/%2e%2e",
        ":x.gguf",
    ],
)
def test_bad_checkpoints(checkpoint: str) -> None:
    with pytest.raises(ValueError):
        check_checkpoint(checkpoint, what="checkpoint")


def test_cache_paths_stay_in_the_repo_folder(tmp_path: Path) -> None:
    cache = HubCache(tmp_path)
    storage = tmp_path / "models--o--r"
    assert cache.pointer("o/r", SHA1, "Q8_0/m.gguf") == storage / "snapshots" / SHA1 / "Q8_0" / "m.gguf"
    assert cache.partial("o/r", SHA256) == storage / "blobs" / f"{SHA256}.incomplete"
    for bad in (("o/r", "../" + SHA1, "m.gguf"), ("o/r", SHA1, "../m.gguf"), ("o/../r", SHA1, "m.gguf")):
        with pytest.raises(ValueError):
            cache.pointer(*bad)
    with pytest.raises(ValueError):
        cache.blob("o/r", "../../y")
    with pytest.raises(ValueError):
        cache.set_main_ref("o/r", "../../y")
    assert not any(tmp_path.iterdir())


def test_remote_files_from_the_hub_are_checked() -> None:
    assert RemoteFile("o/r", "m.gguf", SHA1, 3, blob_id=SHA1, sha256=SHA256).checked().path == "m.gguf"
    for bad in (
        RemoteFile("o/r", "../m.gguf", SHA1, 3),
        RemoteFile("o/r", "m.gguf", "../" + SHA1, 3),
        RemoteFile("o/r", "m.gguf", SHA1, 3, blob_id="../x"),
        RemoteFile("o/r", "m.gguf", SHA1, 3, sha256="../../y"),
    ):
        with pytest.raises(ValueError):
            bad.checked()


def test_a_snapshot_link_that_leaves_the_repo_is_not_a_download(tmp_path: Path) -> None:
    hf = tmp_path / "hub"
    snapshot = hf / "models--o--r" / "snapshots" / SHA1
    snapshot.mkdir(parents=True)
    (tmp_path / "secret.gguf").write_bytes(b"GGUF secret")
    (snapshot / "m-Q4_K_M.gguf").symlink_to(tmp_path / "secret.gguf")
    cache = HubCache(hf)
    assert cache.locate("llamacpp", "o/r:Q4_K_M") is None
    assert cache.locate("llamacpp", "o/r:m-Q4_K_M.gguf") is None
    (snapshot / "m-Q4_K_M.gguf").unlink()
    (snapshot / "m-Q4_K_M.gguf").write_bytes(b"GGUF")
    assert cache.locate("llamacpp", "o/r:Q4_K_M") == snapshot / "m-Q4_K_M.gguf"


def test_user_rows_with_escaping_names_are_skipped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    hf = tmp_path / "hub"
    (hf / "models--o--r" / "snapshots" / SHA1).mkdir(parents=True)
    (tmp_path / "secret.gguf").write_bytes(b"GGUF secret")
    rows = {
        "escape": {"checkpoint": "o/r:../../../../secret.gguf", "recipe": "llamacpp"},
        "mmproj-escape": {"checkpoint": "o/r:Q4_K_M", "mmproj": "../../../../secret.gguf", "recipe": "llamacpp"},
        "fine": {"checkpoint": "o/r:Q4_K_M", "recipe": "llamacpp"},
    }
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "user_models.json").write_text(json.dumps(rows))
    with caplog.at_level(logging.ERROR, logger="lemonkit.registry"):
        registry = Registry(tmp_path / "cache", hf_cache=hf)
    ids = {m.id for m in registry.list(show_all=True) if m.user}
    assert ids == {"user.fine"}
    assert "user.escape" in caplog.text and "user.mmproj-escape" in caplog.text and "'..' segment" in caplog.text
