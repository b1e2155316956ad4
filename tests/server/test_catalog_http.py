"""Lemonade's model names on both hosts: ``show_all`` lists every one, those this machine cannot run carry their
reason and are refused with 404 ``model_not_supported``, and the others pull from a hub by Lemonade's name.

The pulls run against the local hub of ``tests/support/hub_server.py``, serving tiny stand-ins under the repos and file
names Lemonade's rows name.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.server.test_pull import env_for
from tests.support.hosts import API_KEY, Host, Standalone
from tests.support.hub_server import HubServer, tiny_gguf_repo
from tests.support.lemonade_reference import overridden_catalog

#: Lemonade names this machine cannot run (no NPU, no engine, another registry, a registry-backed collection)
UNSUPPORTED = {
    "Qwen2.5-0.5B-Instruct-CPU": "recipe ryzenai-llm needs an AMD NPU (Ryzen AI)",
    "Qwen3.5-0.8B-FP16-vLLM": "recipe vllm needs an AMD GPU with ROCm (vLLM)",
    "Moonshine-Tiny-Streaming": "recipe moonshine (transcription) has no engine in lemonkit yet",
    "OpenMOSS-TTS": "recipe openmoss (tts) has no engine in lemonkit yet",
    "SD-Turbo-GGUF": "recipe sd-cpp (image) has no engine in lemonkit yet",
    "MiniCPM5-1B-GGUF": "its checkpoints download from modelscope",
    "LMX-Omni-5.5B-Lite": "its components are listed in the registry repo lemonade-sdk/LMX-Omni-5.5B-Lite",
}
#: the recipes of Lemonade's catalog that lemonkit has an engine for
RUNS = {"llamacpp", "kokoro", "faster-whisper", "diffusers", "ncnn"}
CHAT = [{"role": "user", "content": "hi"}]
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def assert_error(response: httpx.Response, status: int, code: str) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "code"} and error["code"] == code, error
    message: str = error["message"]
    return message


def by_id(listing: httpx.Response) -> dict[str, dict[str, Any]]:
    assert listing.status_code == 200, listing.text
    return {m["id"]: m for m in listing.json()["data"]}


# -- listing ------------------------------------------------------------------------------------------------------


async def test_show_all_lists_every_lemonade_name(host: Host) -> None:
    lemonade = overridden_catalog()
    async with host.client() as client:
        listed = by_id(await client.get("models", params={"show_all": "true"}))
        downloaded = by_id(await client.get("models"))
    assert set(lemonade) <= set(listed)
    for name, row in lemonade.items():
        obj = listed[name]
        assert (obj["recipe"], obj["size"], obj["suggested"]) == (
            row["recipe"],
            row["size"],
            row.get("suggested", False),
        )
        assert set(obj["labels"]) >= set(row["labels"]), name
        if row.get("checkpoints"):
            assert obj["checkpoints"] == row["checkpoints"], name
        elif row["recipe"] != "collection.omni":
            assert obj["checkpoint"] == row["checkpoint"], name
        assert obj["supported"] is (row["recipe"] in RUNS and row.get("source") != "modelscope"), name
        assert obj["supported"] or obj["unsupported_reason"], name
    for name, reason in UNSUPPORTED.items():
        assert listed[name]["supported"] is False and listed[name]["unsupported_reason"].startswith(reason)
    assert "unsupported_reason" not in listed["Qwen3-0.6B-GGUF"]
    tiny = listed["Tiny-Test-Model-GGUF"]  # the model Lemonade's tests pull: listed, not suggested
    assert tiny["suggested"] is False and tiny["supported"] is True and tiny["downloaded"] is False
    # without show_all: downloaded models that run here (the bundled Gemma, the session's user models)
    assert downloaded and all(m["supported"] and m["downloaded"] for m in downloaded.values())


async def test_one_unsupported_model(host: Host) -> None:
    async with host.client() as client:
        response = await client.get("models/Moonshine-Tiny-Streaming")
    assert response.status_code == 200, response.text
    obj = response.json()
    assert obj["recipe"] == "moonshine" and obj["labels"][0] == "transcription"
    assert obj["supported"] is False and obj["unsupported_reason"] == UNSUPPORTED["Moonshine-Tiny-Streaming"]


# -- refusals -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
async def test_unsupported_model_is_refused(host: Host, name: str) -> None:
    async with host.client() as client:
        before = (await client.get("downloads")).json()
        for route, body in (
            ("pull", {"model_name": name}),
            ("pull", {"model_name": name, "stream": True}),
            ("load", {"model_name": name}),
            ("chat/completions", {"model": name, "messages": CHAT}),
            ("chat/completions", {"model": name, "messages": CHAT, "stream": True}),
        ):
            message = assert_error(await client.post(route, json=body), 404, "model_not_supported")
            assert message.startswith(f"Model {name!r} is not supported on this machine: {UNSUPPORTED[name]}"), route
        assert (await client.get("downloads")).json() == before  # nothing started
        assert name not in {m["model_name"] for m in (await client.get("health")).json()["all_models_loaded"]}
        assert (await client.get(f"models/{name}")).json()["downloaded"] is False


async def test_openai_sdk_sees_model_not_supported(host: Host) -> None:
    async with host.openai() as client:
        with pytest.raises(openai.NotFoundError) as caught:
            await client.chat.completions.create(model="Qwen2.5-0.5B-Instruct-CPU", messages=CHAT)
    assert caught.value.code == "model_not_supported"
    assert "recipe ryzenai-llm needs an AMD NPU" in caught.value.message


async def test_registering_an_unsupported_recipe_registers_nothing(host: Host) -> None:
    name = f"user.npu-{host.kind}"
    body = {"model_name": name, "checkpoint": "amd/some-onnx-model", "recipe": "ryzenai-llm"}
    async with host.client() as client:
        message = assert_error(await client.post("pull", json=body), 404, "model_not_supported")
        assert "recipe ryzenai-llm needs an AMD NPU" in message
        assert_error(await client.get(f"models/{name}"), 404, "model_not_found")


# -- pulling Lemonade's rows from a hub ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lemonade_hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HubServer]:
    """A hub serving tiny stand-ins under the repos three kinds of Lemonade row name."""
    files = tiny_gguf_repo(tmp_path_factory.mktemp("repo"))
    plain, mmproj = files["tiny-Q4_K_M.gguf"], files["mmproj-tiny-f16.gguf"]
    first, second = files["Q8_0/tiny-Q8_0-00001-of-00002.gguf"], files["Q8_0/tiny-Q8_0-00002-of-00002.gguf"]
    with HubServer(root=tmp_path_factory.mktemp("hub-objects")) as hub:
        # "checkpoint": "repo:file.gguf"
        hub.add_repo("unsloth/gemma-3-270m-it-GGUF", {"gemma-3-270m-it-UD-IQ2_M.gguf": plain})
        # "checkpoints": {"main": "repo:Q4_K_M", "draft": "repo:file", "mmproj": "repo:file"}
        hub.add_repo(
            "unsloth/gemma-4-12b-it-GGUF",
            {"gemma-4-12b-it-Q4_K_M.gguf": plain, "mtp-gemma-4-12b-it.gguf": plain, "mmproj-F16.gguf": mmproj},
        )
        # "checkpoint": "repo:*": every GGUF of the repo (here one model in two shards)
        hub.add_repo(
            "ggml-org/gpt-oss-120b-GGUF",
            {"gpt-oss-120b-mxfp4-00001-of-00002.gguf": first, "gpt-oss-120b-mxfp4-00002-of-00002.gguf": second},
        )
        yield hub


@dataclass
class HubHost:
    host: Host
    hf_cache: Path


@pytest.fixture(scope="module")
def hub_standalone(lemonade_hub: HubServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HubHost]:
    root = tmp_path_factory.mktemp("standalone")
    server = Standalone({**env_for(lemonade_hub, root), "LEMONADE_API_KEY": API_KEY})
    yield HubHost(Host("standalone", server.root, API_KEY), root / "hub")
    server.stop()


@pytest.fixture(params=["jupyter", "standalone"])
def hub_host(
    request: pytest.FixtureRequest, lemonade_hub: HubServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> Iterator[HubHost]:
    """A host with its own caches whose pulls reach :func:`lemonade_hub`."""
    if request.param == "standalone":
        standalone: HubHost = request.getfixturevalue("hub_standalone")
        yield standalone
        httpx.post(standalone.host.api + "/unload", headers=standalone.host.headers, timeout=60).raise_for_status()
        return
    from huggingface_hub import constants

    for key, value in env_for(lemonade_hub, tmp_path).items():
        monkeypatch.setenv(key, value)  # read when the extension makes its settings and registry
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    yield HubHost(request.getfixturevalue("jupyter_host"), tmp_path / "hub")


@pytest.mark.parametrize(
    ("name", "roles"),
    [
        ("Tiny-Test-Model-GGUF", ["main"]),
        ("Gemma-4-12B-it-MTP-GGUF", ["main", "draft", "mmproj"]),
        ("gpt-oss-120b-mxfp-GGUF", ["main"]),
    ],
)
async def test_lemonade_rows_pull_from_the_hub(hub_host: HubHost, name: str, roles: list[str]) -> None:
    async with hub_host.host.client() as client:
        assert name not in by_id(await client.get("models"))
        response = await client.post("pull", json={"model_name": name})
        assert response.json() == {"status": "success", "message": f"Installed model: {name}"}, response.text
        obj = by_id(await client.get("models"))[name]  # downloaded now, and it runs here
        assert obj["supported"] is True and obj["downloaded"] is True
        assert [s["type"] for s in obj["checkpoint_status"]] == roles
        assert all(s["present"] for s in obj["checkpoint_status"])
        files = (await client.get(f"models/{name}/files")).json()["files"]
        assert {f["role"] for f in files} == set(roles) and all(f["exists"] for f in files)


async def test_lemonade_test_model_chats_by_name(hub_host: HubHost) -> None:
    name = "Tiny-Test-Model-GGUF"  # what Lemonade's own test suite pulls and chats with
    async with hub_host.host.client() as client:
        assert (await client.post("pull", json={"model_name": name})).status_code == 200
    async with hub_host.host.openai() as sdk:
        answer = await sdk.chat.completions.create(model=name, messages=CHAT, max_tokens=2)
    assert answer.model == name and answer.choices[0].finish_reason in ("stop", "length")
    assert json.loads(answer.model_dump_json())["usage"]["completion_tokens"] <= 2


async def test_unsupported_model_on_disk_is_listed_only_with_show_all(hub_host: HubHost) -> None:
    # Moonshine-Tiny-Streaming's weights in the shared HF cache, as another tool would leave them
    repo = hub_host.hf_cache / "models--UsefulSensors--moonshine-streaming"
    (repo / "snapshots" / COMMIT / "onnx" / "tiny").mkdir(parents=True, exist_ok=True)
    (repo / "snapshots" / COMMIT / "onnx" / "tiny" / "encoder.onnx").write_bytes(b"onnx weights")
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(COMMIT)
    async with hub_host.host.client() as client:
        every = by_id(await client.get("models", params={"show_all": "true"}))
        moonshine = every["Moonshine-Tiny-Streaming"]
        assert moonshine["downloaded"] is True and moonshine["supported"] is False
        assert "Moonshine-Tiny-Streaming" not in by_id(await client.get("models"))
        answer = await client.post("load", json={"model_name": "Moonshine-Tiny-Streaming"})
        assert_error(answer, 404, "model_not_supported")


def test_serve_refuses_to_preload_an_unsupported_model(tmp_path: Path) -> None:
    env = {**os.environ, "LEMONADE_CACHE_DIR": str(tmp_path / "cache"), "LEMONADE_API_KEY": API_KEY}
    result = subprocess.run(
        [sys.executable, "-m", "lemonkit.cli", "serve", "--port", "0", "--load", "Moonshine-Tiny-Streaming"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode != 0 and "lemonkit serving on" not in result.stderr
    reason = UNSUPPORTED["Moonshine-Tiny-Streaming"]
    assert f"Model 'Moonshine-Tiny-Streaming' is not supported on this machine: {reason}" in result.stderr
