"""llama.cpp on a GPU backend for real: the Vulkan build installed through ``POST /v1/install`` and models run on
Mesa's lavapipe, a real Vulkan device on a machine without a GPU, on both hosts.

lavapipe is a CPU-type device, which ggml-vulkan uses only where ``GGML_VK_VISIBLE_DEVICES`` names it: this
module's servers do, as an operator opting in would. Each host has a cache of its own, so each installs the build
itself; they share a wheel cache (``LEMONKIT_BACKEND_WHEELS``) that outlives the session, so only the first install
on a machine compiles (about 7 minutes on 2 cores), the others reuse the wheel.

What the build needs (``glslc``, ``spirv-headers``, the Vulkan loader, ``mesa-vulkan-drivers``, Vulkan headers
1.3.261 or newer: ``scripts/vulkan-headers`` on Debian 12) is installed by ``scripts/test``; where it is missing the
module skips with one line saying what is (and fails in CI).
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import shutil
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from lemonkit.catalog import llamacpp_builds
from lemonkit.catalog.accelerators import detect
from tests.support.hosts import API_KEY, Host, Standalone
from tests.support.jupyter_process import JupyterServer
from tests.support.session import CACHE_DIR
from tests.support.tiny_models import GEMMA4_MTP, TINY, TINY_B

pytestmark = [pytest.mark.vulkan, pytest.mark.slow]

#: Mesa's lavapipe registers itself with the Vulkan loader through this file
LAVAPIPE_ICD = Path(f"/usr/share/vulkan/icd.d/lvp_icd.{platform.machine()}.json")
#: where scripts/vulkan-headers unpacks newer headers, when VULKAN_SDK is not set
DEFAULT_SDK = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "lemonkit" / "vulkan-sdk" / "usr"
#: the wheel cache shared by every session on this machine, so that the build is compiled once
WHEELS = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "lemonkit-tests" / "backend-wheels"
#: generous: lavapipe compiles its pipelines on first use (about 20 s), then decodes a token in about a second
TIMEOUT = httpx.Timeout(600.0)
BUNDLED = "SmolLM2-135M-Instruct-Bundled"


def _unmet(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(reason, pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="module")
def vulkan_env() -> dict[str, str]:
    """The environment of this module's servers: lavapipe opted in, the headers found, the shared wheel cache."""
    if not LAVAPIPE_ICD.exists():
        _unmet(f"no Mesa lavapipe ({LAVAPIPE_ICD}): run `apt-get install mesa-vulkan-drivers` (scripts/test does)")
    devices = detect().get("vulkan", {}).get("devices", [])
    lavapipe = [d for d in devices if d["name"].startswith("llvmpipe")]
    if not lavapipe:
        _unmet(f"the Vulkan loader reports no lavapipe device (it reports {devices})")
    env = {
        "GGML_VK_VISIBLE_DEVICES": str(lavapipe[0]["index"]),
        "VULKAN_SDK": os.environ.get("VULKAN_SDK") or str(DEFAULT_SDK),
        "LEMONKIT_BACKEND_WHEELS": str(WHEELS),
        "LEMONADE_API_KEY": API_KEY,
    }
    missing = llamacpp_builds.plan("vulkan", environ={**os.environ, **env}).missing
    if missing:
        _unmet("the Vulkan build needs: " + "; ".join(map(str, missing)) + " (scripts/test installs them)")
    return env


def _cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A lemonkit cache of its own (its builds), with the session's registered models."""
    cache = tmp_path_factory.mktemp("cache")
    shutil.copy(CACHE_DIR / "user_models.json", cache / "user_models.json")
    return cache


@dataclass(frozen=True)
class Served:
    """One host of this module and the lemonkit cache it keeps its builds in."""

    host: Host
    cache: Path


@pytest.fixture(scope="module")
def vulkan_standalone(vulkan_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    cache = _cache(tmp_path_factory)
    server = Standalone({**vulkan_env, "LEMONADE_CACHE_DIR": str(cache)})
    yield Served(Host("standalone", server.root, API_KEY), cache)
    server.stop()


@pytest.fixture(scope="module")
def vulkan_jupyter(vulkan_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    cache = _cache(tmp_path_factory)
    env = {**os.environ, **vulkan_env, "LEMONADE_CACHE_DIR": str(cache)}
    env.pop("LEMONADE_API_KEY")
    server = JupyterServer(tmp_path_factory.mktemp("jupyter"), {}, env=env)
    yield Served(Host("jupyter", server.base + "lemonkit/", server.token), cache)
    server.stop()


@pytest.fixture(scope="module", params=["standalone", "jupyter"])
def served(request: pytest.FixtureRequest) -> Served:
    """Each host in turn (the module's first test on it installs the Vulkan build through its API)."""
    found: Served = request.getfixturevalue(f"vulkan_{request.param}")
    return found


@pytest.fixture
def vhost(served: Served) -> Host:
    return served.host


@contextlib.asynccontextmanager
async def _client(host: Host) -> AsyncIterator[httpx.AsyncClient]:
    """A client of ``host``; what the test loaded is unloaded after it."""
    async with httpx.AsyncClient(base_url=host.api + "/", headers=host.headers, timeout=TIMEOUT) as c:
        try:
            yield c
        finally:
            await c.post("unload")


def _events(response: httpx.Response) -> list[tuple[str, dict[str, Any]]]:
    events = []
    for block in response.text.strip().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        events.append((fields["event"], json.loads(fields["data"])))
    return events


async def _llamacpp(client: httpx.AsyncClient) -> dict[str, Any]:
    response = await client.get("system-info")
    assert response.status_code == 200, response.text
    recipes: dict[str, Any] = response.json()["recipes"]["llamacpp"]
    return recipes


async def _install(client: httpx.AsyncClient) -> list[tuple[str, dict[str, Any]]]:
    response = await client.post("install", json={"recipe": "llamacpp", "backend": "vulkan", "stream": True})
    assert response.status_code == 200, response.text
    return _events(response)


@pytest.mark.timeout(1800)  # the first install on a machine compiles llama.cpp (about 7 minutes on 2 cores)
async def test_install_the_vulkan_build(vhost: Host) -> None:
    async with _client(vhost) as client:
        before = await _llamacpp(client)
        vulkan = before["backends"]["vulkan"]
        assert vulkan["devices"] == ["vulkan"] and vulkan["state"] in ("installable", "installed"), vulkan
        events = await _install(client)
        *progress, (last, done) = events
        assert last == "complete", events[-3:]
        assert done["state"] == "installed" and done["version"] == llamacpp_builds.own_version()
        assert progress and all(name == "progress" and data["line"] for name, data in progress)
        # the build checked itself: its llama_cpp imported and saw a device to offload to
        assert any(data["line"].endswith(f"{done['version']} True") for _, data in progress), progress[-3:]
        percents = [data["percent"] for _, data in progress]
        assert percents == sorted(percents) and percents[-1] == 100
        after = await _llamacpp(client)
        assert after["backends"]["vulkan"]["state"] == "installed"
        assert after["backends"]["cpu"]["state"] == "installed"  # lemonkit's own, untouched
        assert after["default_backend"] == "cpu"  # lavapipe is slower than the CPU build: never the default


async def _load_on_vulkan(client: httpx.AsyncClient, model: str) -> dict[str, Any]:
    response = await client.post("load", json={"model_name": model, "llamacpp_backend": "vulkan"})
    assert response.status_code == 200, response.text
    health = (await client.get("health")).json()
    (entry,) = [m for m in health["all_models_loaded"] if m["model_name"] == model]
    return entry


async def test_a_model_runs_on_lavapipe_with_every_layer_offloaded(vhost: Host) -> None:
    async with _client(vhost) as client:
        entry = await _load_on_vulkan(client, TINY)
        assert entry["backend"] == "vulkan" and entry["device"] == "gpu"
        assert entry["recipe_options"]["llamacpp_backend"] == "vulkan"
        (device,) = entry["devices"]
        assert device["name"] == "Vulkan0" and device["description"].startswith("llvmpipe")
        offload = entry["offload"]
        assert offload["requested"] == "auto" and offload["layers"] == offload["of"] > 1, offload

        sdk = openai.AsyncOpenAI(base_url=vhost.api, api_key=vhost.token or "x", timeout=600, max_retries=0)
        messages: Any = [{"role": "user", "content": "Say hello."}]
        answer = await sdk.chat.completions.create(model=TINY, messages=messages, max_tokens=6, temperature=0)
        assert answer.choices[0].message.content and answer.usage and answer.usage.completion_tokens > 0
        stream = await sdk.chat.completions.create(
            model=TINY, messages=messages, max_tokens=6, temperature=0, stream=True
        )
        chunks = [c async for c in stream]
        pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
        # a token per chunk (GPU kernels are not batch-invariant: a cached prefix may round to another greedy text)
        assert 1 <= len(pieces) <= 6 and "".join(pieces).strip()
        assert chunks[-1].choices[0].finish_reason in ("length", "stop")
        schema = {
            "type": "object",
            "properties": {"ok": {"type": "boolean"}},
            "required": ["ok"],
            "additionalProperties": False,
        }
        structured = await sdk.chat.completions.create(
            model=TINY,
            messages=messages,
            max_tokens=64,
            temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "flag", "schema": schema, "strict": True}},
        )
        assert structured.choices[0].finish_reason == "stop", structured.choices[0].message.content
        value = json.loads(structured.choices[0].message.content or "")
        assert set(value) == {"ok"} and isinstance(value["ok"], bool)
        stats = (await client.get("stats")).json()
        assert stats["output_tokens"] > 0
        assert (stats["backend"], stats["device"], stats["devices"]) == ("vulkan", "gpu", ["Vulkan0"])
        assert stats["gpu_layers"] == offload["layers"]
        await sdk.close()


async def test_a_draft_model_drafts_on_the_cpu_for_a_target_on_the_gpu(vhost: Host) -> None:
    """The target offloads every layer and its draft model stays on the CPU (on lavapipe a draft model decoding there
    crashed the sidecar): drafts are made, checked and accepted across the two."""
    async with _client(vhost) as client:
        events = await _install(client)  # the wheel an earlier test built: no compile
        assert events[-1][0] == "complete", events[-3:]
        body = {"model_name": TINY, "llamacpp_backend": "vulkan", "llamacpp_args": f"-md {TINY} --spec-draft-p-min 0"}
        response = await client.post("load", json=body)
        assert response.status_code == 200, response.text
        health = (await client.get("health")).json()
        (entry,) = [m for m in health["all_models_loaded"] if m["model_name"] == TINY]
        assert entry["device"] == "gpu" and entry["offload"]["layers"] == entry["offload"]["of"], entry
        request = {"model": TINY, "prompt": "red green blue red green blue", "max_tokens": 24, "temperature": 0}
        response = await client.post("completions", json=request)
        assert response.status_code == 200, response.text
        timings = response.json()["timings"]
        assert timings["draft_n"] > 0 and 0 < timings["draft_n_accepted"] <= timings["draft_n"], timings
        await client.post("unload", json={"model_name": TINY})


async def test_a_gemma4_assistant_drafts_beside_its_target_on_the_gpu(vhost: Host) -> None:
    """Gemma 4's assistant reads the target's cache, so it goes where that cache is: on lavapipe with every target
    layer, its drafts made over the GPU's cells and accepted, and the text the same as without drafts."""
    async with _client(vhost) as client:
        events = await _install(client)  # the wheel an earlier test built: no compile
        assert events[-1][0] == "complete", events[-3:]
        request = {"model": GEMMA4_MTP, "prompt": "red green blue red green blue", "max_tokens": 24, "temperature": 0}
        answers = []
        for args in ("--spec-type none", "--spec-draft-n-min 1"):
            body = {"model_name": GEMMA4_MTP, "llamacpp_backend": "vulkan", "llamacpp_args": args}
            response = await client.post("load", json=body)
            assert response.status_code == 200, response.text
            health = (await client.get("health")).json()
            (entry,) = [m for m in health["all_models_loaded"] if m["model_name"] == GEMMA4_MTP]
            assert entry["device"] == "gpu" and entry["offload"]["layers"] == entry["offload"]["of"], entry
            response = await client.post("completions", json=request)
            assert response.status_code == 200, response.text
            answers.append(response.json())
            await client.post("unload", json={"model_name": GEMMA4_MTP})
    plain, drafted = answers
    assert drafted["choices"][0]["text"] == plain["choices"][0]["text"]
    timings = drafted["timings"]
    assert timings["draft_n"] > 0 and timings["draft_n_accepted"] >= 0.9 * timings["draft_n"], timings
    assert "draft_n" not in plain["timings"]


async def test_a_bundled_model_answers_on_lavapipe(vhost: Host) -> None:
    if vhost.kind != "standalone":
        pytest.skip("one host is enough for the slow real model; the tiny one runs on both")
    async with _client(vhost) as client:
        entry = await _load_on_vulkan(client, BUNDLED)
        assert entry["offload"]["layers"] == entry["offload"]["of"] == 31  # SmolLM2 135M: 30 blocks and the output
        body = {
            "model": BUNDLED,
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 8,
            "temperature": 0,
        }
        response = await client.post("chat/completions", json=body)
        assert response.status_code == 200, response.text
        assert "Paris" in response.json()["choices"][0]["message"]["content"]


async def test_uninstalling_cpu_keeps_the_servers_own_build(vhost: Host) -> None:
    async with _client(vhost) as client:
        # Lemonade's own install test does this: the server's llama-cpp-python must stay, and serve
        response = await client.post("uninstall", json={"recipe": "llamacpp", "backend": "cpu", "stream": True})
        assert response.status_code == 200, response.text
        *lines, (last, done) = _events(response)
        assert last == "complete" and done["state"] == "installed"
        assert any("stays" in data["line"] for _, data in lines)
        assert (await _llamacpp(client))["backends"]["cpu"]["state"] == "installed"
        body = {"model": TINY, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}
        response = await client.post("chat/completions", json=body)  # the default: lemonkit's own CPU build
        assert response.status_code == 200, response.text
        assert (await client.get("health")).json()["all_models_loaded"][0]["backend"] == "cpu"


async def test_uninstall_reinstall_and_a_broken_build(served: Served) -> None:
    async with _client(served.host) as client:
        await _load_on_vulkan(client, TINY)
        response = await client.post("uninstall", json={"recipe": "llamacpp", "backend": "vulkan"})
        assert response.json() == {"status": "success", "recipe": "llamacpp", "backend": "vulkan"}
        assert (await client.get("health")).json()["all_models_loaded"] == []  # its models were unloaded first
        assert (await _llamacpp(client))["backends"]["vulkan"]["state"] == "installable"

        # a model asking for a backend that is not installed: a 400 that says how to install it, never a 500
        body = {"model": TINY, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        await client.post("models/" + TINY + "/options", json={"llamacpp_backend": "vulkan"})  # saved: chat uses it
        response = await client.post("load", json={"model_name": TINY, "llamacpp_backend": "vulkan"})
        error = response.json()["error"]
        assert response.status_code == 400 and error["code"] == "backend_not_installed"
        assert 'POST /v1/install {"recipe": "llamacpp", "backend": "vulkan"}' in error["message"]

        # the wheel is kept: installing again does not compile
        events = await _install(client)
        assert events[-1][0] == "complete" and events[-1][1]["state"] == "installed"
        assert any("built before" in data["line"] for _, data in events)
        assert not any("Building wheel" in data.get("line", "") for _, data in events)

        # a build whose libraries no longer load: 503 naming the reinstall, never a 500
        build = llamacpp_builds.installed(served.cache, "vulkan")
        assert build is not None
        libraries = list((build.site / "llama_cpp" / "lib").glob("libggml-vulkan.so*"))  # a wheel holds copies
        assert libraries
        for library in libraries:
            library.write_bytes(b"not a shared library")
        response = await client.post("load", json={"model_name": TINY, "llamacpp_backend": "vulkan"})
        error = response.json()["error"]
        assert response.status_code == 503 and error["code"] == "backend_unavailable", error
        assert 'POST /v1/install {"recipe": "llamacpp", "backend": "vulkan"}' in error["message"]
        assert "file too short" in error["message"] or "invalid ELF header" in error["message"], error["message"]
        # installing it again mends it from the kept wheel, without compiling
        events = await _install(client)
        assert events[-1][0] == "complete", events[-3:]
        lines = [data["line"] for _, data in events if data.get("line")]
        assert any("is installed but broken" in line for line in lines) and any(
            "built before" in line for line in lines
        )
        response = await client.post("chat/completions", json=body)
        assert response.status_code == 200, response.text
        assert (await client.get("health")).json()["all_models_loaded"][0]["backend"] == "vulkan"


@pytest.mark.timeout(1800)  # compiles llama.cpp again: about 7 minutes on 2 cores
async def test_force_compiles_again(vhost: Host) -> None:
    if vhost.kind != "standalone":
        pytest.skip("one compile is enough to show what force does; the other host shares the wheel it makes")
    async with _client(vhost) as client:
        response = await client.post(
            "install", json={"recipe": "llamacpp", "backend": "vulkan", "force": True, "stream": True}
        )
        events = _events(response)
        assert events[-1][0] == "complete" and events[-1][1]["state"] == "installed", events[-3:]
        lines = [data["line"] for _, data in events if data.get("line")]
        assert not any("built before" in line for line in lines)
        assert any("Building wheel for llama_cpp_python" in line for line in lines), lines[:5]
        compiled = [data["percent"] for _, data in events if re.match(r"\s*\[\d+/\d+\]", data.get("line", ""))]
        assert compiled and compiled[0] < 10 and 90 <= compiled[-1] < 100  # ninja's steps move the progress along
        entry = await _load_on_vulkan(client, TINY)
        assert entry["offload"]["layers"] == entry["offload"]["of"]


#: a third chat model for the placement test: the tiny model's file under another name
TINY_C = "user.tiny-llama-c"


@pytest.fixture(scope="module")
def capped(vulkan_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Host]:
    """A server whose operator gave lemonkit 600 MiB of the device, the counts left at their defaults: two tiny
    models fit on it with every layer (262 MiB each, mostly compute buffers), three do not."""
    cache = _cache(tmp_path_factory)
    models = json.loads((cache / "user_models.json").read_text())
    models["tiny-llama-c"] = {**models["tiny-llama"]}
    (cache / "user_models.json").write_text(json.dumps(models))
    server = Standalone({**vulkan_env, "LEMONADE_CACHE_DIR": str(cache), "LEMONKIT_GPU_MEMORY": "600MiB"})
    yield Host("standalone", server.root, API_KEY)
    server.stop()


def _placement(health: dict[str, Any]) -> dict[str, tuple[str, int]]:
    return {m["model_name"]: (m["device"], m["offload"]["layers"]) for m in health["all_models_loaded"]}


async def test_placement_by_device_memory(capped: Host) -> None:
    async with _client(capped) as client:
        events = await _install(client)  # the wheel an earlier test built: no compile
        assert events[-1][0] == "complete", events[-3:]
        tiny = await _load_on_vulkan(client, TINY)
        assert tiny["offload"]["layers"] == tiny["offload"]["of"] == 3 and tiny["offload"]["estimate_mb"] == 262

        # memory is the limit on the GPU: a second chat model that fits stays beside the first (on the CPU the
        # default count of one per type would have unloaded it)
        await _load_on_vulkan(client, TINY_B)
        assert _placement((await client.get("health")).json()) == {TINY: ("gpu", 3), TINY_B: ("gpu", 3)}

        # a third that does not fit: the least recently used unpinned model goes
        response = await client.post("load", json={"model_name": TINY_C, "llamacpp_backend": "vulkan"})
        assert response.status_code == 200, response.text
        assert _placement((await client.get("health")).json()) == {TINY_B: ("gpu", 3), TINY_C: ("gpu", 3)}

        # with the device held by pinned models, a fixed -ngl that cannot fit is refused with the figures
        for name in (TINY_B, TINY_C):
            response = await client.post(
                "load", json={"model_name": name, "llamacpp_backend": "vulkan", "pinned": True}
            )
            assert response.status_code == 200, response.text
        body = {"model_name": TINY, "llamacpp_backend": "vulkan", "llamacpp_args": "-ngl all"}
        response = await client.post("load", json=body)
        error = response.json()["error"]
        assert response.status_code == 400 and error["code"] == "model_load_error", error
        assert "3 layers: 262 MiB" in error["message"] and "76 of 600 MiB are free" in error["message"], error
        assert f"{TINY_B} (262 MiB, pinned)" in error["message"]

        # -ngl auto (the default) takes what is left: too little for a layer, so this one runs on the CPU
        entry = await _load_on_vulkan(client, TINY)
        assert (entry["device"], entry["offload"]["layers"], entry["offload"]["budget_mb"]) == ("cpu", 0, 76)
        assert _placement((await client.get("health")).json()) == {
            TINY_B: ("gpu", 3),
            TINY_C: ("gpu", 3),
            TINY: ("cpu", 0),
        }
        chat = {"model": TINY, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert (await client.post("chat/completions", json=chat)).status_code == 200
