"""``GET /v1/system-info``: this machine for real, and a fake /proc + /sys tree for the GPU/NPU paths."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import platform
from pathlib import Path
from typing import Any

import pytest

from lemonkit.catalog import system_info as si
from lemonkit.catalog.hardware import detect_devices
from lemonkit.catalog.recipe_table import DEFAULT_RECIPES, load_recipes
from lemonkit.catalog.system_info import backend_status, system_info

CPUINFO = "".join(
    f"processor\t: {n}\nmodel name\t: Fake CPU 9000\nphysical id\t: {n // 4}\ncore id\t\t: {n % 4 // 2}\n\n"
    for n in range(8)
)  # 2 sockets x 2 cores x 2 threads


def _fake_root(tmp_path: Path, *, gpu: bool = True, npu: bool = True) -> Path:
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/cpuinfo").write_text(CPUINFO)
    (tmp_path / "proc/meminfo").write_text("MemTotal:       24576000 kB\nMemFree:        1000 kB\n")
    drm = tmp_path / "sys/class/drm"
    drm.mkdir(parents=True)
    if gpu:
        for card, vendor, extra in (
            ("card0", "0x1002", {"mem_info_vram_total": str(512 * 1024**2), "product_name": "Radeon 890M"}),
            ("card1", "0x10de", {}),
            ("card2", "0x8086", {}),  # Intel: not a kind the spec lists
        ):
            dev = drm / card / "device"
            dev.mkdir(parents=True)
            (dev / "vendor").write_text(vendor + "\n")
            (dev / "device").write_text("0x150e\n")
            for name, value in extra.items():
                (dev / name).write_text(value)
        (drm / "card0-HDMI-A-1").mkdir()  # a connector, not a card
    if npu:
        drivers = tmp_path / "sys/bus/pci/drivers/amdxdna"
        drivers.mkdir(parents=True)
        node = tmp_path / "sys/class/accel/accel0/device"
        node.mkdir(parents=True)
        os.symlink(drivers, node / "driver")
    return tmp_path


def test_this_machine() -> None:
    info = system_info()
    json.dumps(info)
    assert info["OS Version"] == platform.platform()
    assert info["Processor"] and info["Processor"] == info["devices"]["cpu"]["name"]
    assert info["Physical Memory"].endswith(" GB") and float(info["Physical Memory"].split()[0]) > 0
    cpu = info["devices"]["cpu"]
    assert cpu["available"] is True and cpu["family"] == platform.machine()
    assert 1 <= cpu["cores"] <= cpu["threads"] == os.cpu_count()
    for windows_only in ("OEM System", "BIOS Version", "CPU Max Clock", "Windows Power Setting"):
        assert windows_only not in info
    llamacpp = info["recipes"]["llamacpp"]
    backends = llamacpp["backends"]
    assert set(backends) == {"cpu", "vulkan", "cuda", "rocm", "metal"}
    cpu_backend = backends["cpu"]
    if importlib.util.find_spec("llama_cpp") is None:
        assert cpu_backend["state"] == "installable"
        assert cpu_backend["message"] == "Backend is supported but not installed."
        assert cpu_backend["action"] == "pip install 'lemonkit[llamacpp]'"
    else:
        assert cpu_backend["state"] in ("installed", "update_required")
        assert cpu_backend["version"] == importlib.metadata.version("llama-cpp-python")
    assert cpu_backend["devices"] == ["cpu"]
    devices = info["devices"]
    # each GPU backend is unsupported exactly where its devices are absent, and then says why
    present = {
        "vulkan": any(d["available"] for d in devices["vulkan"]),
        "cuda": bool(devices["nvidia_gpu"]),
        "rocm": bool(devices["amd_gpu"]),
        "metal": bool(devices.get("metal")),
    }
    for name, found in present.items():
        assert (backends[name]["state"] != "unsupported") == found, (name, backends[name])
        if not found:
            assert backends[name]["devices"] == [] and backends[name]["message"] and backends[name]["action"] == ""
    if platform.system() != "Darwin":
        assert backends["metal"]["message"] == "Requires macOS"
    # the default is the CPU build unless a GPU build is installed for a GPU this machine has
    if not any(b["state"] == "installed" for n, b in backends.items() if n != "cpu"):
        assert llamacpp["default_backend"] == "cpu"


#: Mesa's lavapipe registers itself with the Vulkan loader through this file
LAVAPIPE_ICD = Path(f"/usr/share/vulkan/icd.d/lvp_icd.{platform.machine()}.json")


def test_the_vulkan_loader_reports_lavapipe(monkeypatch: pytest.MonkeyPatch) -> None:
    if not LAVAPIPE_ICD.exists():
        reason = f"no Mesa lavapipe ({LAVAPIPE_ICD}): run `apt-get install mesa-vulkan-drivers` (scripts/test does)"
        pytest.fail(reason, pytrace=False) if os.environ.get("CI") else pytest.skip(reason)
    devices = detect_devices()["vulkan"]
    lavapipe = [d for d in devices if d["name"].startswith("llvmpipe")]
    assert len(lavapipe) == 1, devices
    device = lavapipe[0]
    assert device["type"] == "cpu" and device["vendor"] == "Mesa"
    assert device["api_version"].startswith("1.") and device["memory_gb"] > 0
    if "GGML_VK_VISIBLE_DEVICES" not in os.environ:
        # a CPU-type device is not one ggml uses unless the operator opts in, so the backend says how
        assert device["ggml_name"] is None and device["available"] is False
        vulkan = system_info()["recipes"]["llamacpp"]["backends"]["vulkan"]
        if not any(d["available"] for d in devices):
            assert vulkan["state"] == "unsupported" and "GGML_VK_VISIBLE_DEVICES" in vulkan["message"]
    monkeypatch.setenv("GGML_VK_VISIBLE_DEVICES", str(device["index"]))
    opted = next(d for d in detect_devices()["vulkan"] if d["index"] == device["index"])
    assert opted["ggml_name"] == "Vulkan0" and opted["available"] is True
    info = system_info()["recipes"]["llamacpp"]
    assert info["backends"]["vulkan"]["state"] != "unsupported" and info["backends"]["vulkan"]["devices"] == ["vulkan"]
    if info["backends"]["vulkan"]["state"] == "installed" and not any(
        d["available"] and d["type"] != "cpu" for d in detect_devices()["vulkan"]
    ):
        assert info["default_backend"] == "cpu"  # lavapipe is never the default, even opted in


def test_this_machine_has_no_accelerator() -> None:
    # the workplace's machines have none; empty GPU arrays, no NPU key
    devices = detect_devices()
    if devices["amd_gpu"] or devices["nvidia_gpu"] or "amd_npu" in devices:
        pytest.skip("this machine has an accelerator")
    backends = system_info()["recipes"]["llamacpp"]["backends"]
    assert backends["cuda"]["message"] == "No NVIDIA GPU found."
    assert backends["rocm"]["message"] == "No AMD GPU found."


def test_fake_machine_devices(tmp_path: Path) -> None:
    devices = detect_devices(_fake_root(tmp_path))
    assert devices["cpu"]["name"] == "Fake CPU 9000"
    assert devices["cpu"]["cores"] == 4  # (physical id, core id) pairs, hyper-threads counted once
    assert devices["amd_gpu"] == [{"name": "Radeon 890M", "available": True, "vram_gb": 0.5}]
    assert devices["nvidia_gpu"] == [{"name": "NVIDIA GPU 0x150e", "available": True}]
    assert devices["amd_npu"]["available"] is True


def test_fake_machine_without_accelerators(tmp_path: Path) -> None:
    info = system_info(root=_fake_root(tmp_path, gpu=False, npu=False))
    assert info["Physical Memory"] == "23.4 GB"
    assert info["devices"]["amd_gpu"] == [] and info["devices"]["nvidia_gpu"] == [] and "amd_npu" not in info["devices"]


def test_gpu_present_makes_its_build_installable(tmp_path: Path) -> None:
    backends = system_info(root=_fake_root(tmp_path), cache_dir=tmp_path / "cache")["recipes"]["llamacpp"]["backends"]
    for name in ("cuda", "rocm"):  # the fake tree has one AMD and one NVIDIA card
        assert backends[name]["state"] == "installable" and backends[name]["devices"], backends[name]
        assert backends[name]["message"].startswith("Backend is supported but not installed.")
        assert backends[name]["action"]  # the install request, or the command for what its build lacks
    assert backends["vulkan"]["state"] == "unsupported"  # no Vulkan driver answered for the fake tree


def test_fake_vulkan_gpus_choose_vulkan_once_installed(tmp_path: Path) -> None:
    from lemonkit.catalog import llamacpp_builds

    drivers = {"vulkan": {"devices": [{"index": 0, "name": "Radeon", "type": "discrete_gpu", "ggml_name": "Vulkan0"}]}}
    cache = tmp_path / "cache"
    info = system_info(root=_fake_root(tmp_path, gpu=False, npu=False), cache_dir=cache, drivers=drivers)
    assert info["recipes"]["llamacpp"]["default_backend"] == "cpu"  # the Vulkan build is not installed yet
    site = llamacpp_builds.build_dir(cache, "vulkan") / "site" / "llama_cpp"
    site.mkdir(parents=True)
    (site / "__init__.py").write_text("")
    (site.parent.parent / "build.json").write_text(json.dumps({"version": si.wanted_llamacpp()}))
    info = system_info(root=tmp_path, cache_dir=cache, drivers=drivers)
    assert info["recipes"]["llamacpp"]["backends"]["vulkan"]["state"] == "installed"
    assert info["recipes"]["llamacpp"]["default_backend"] == "vulkan"
    # a build of another llama-cpp-python release must be rebuilt before it runs
    (site.parent.parent / "build.json").write_text(json.dumps({"version": "0.0.1"}))
    vulkan = system_info(root=tmp_path, cache_dir=cache, drivers=drivers)["recipes"]["llamacpp"]["backends"]["vulkan"]
    assert vulkan["state"] == "update_required" and vulkan["action"].startswith("POST /v1/install")
    # a lavapipe-only machine never defaults to it, even installed and opted in
    cpu_type = {"vulkan": {"devices": [{"index": 0, "name": "llvmpipe", "type": "cpu", "ggml_name": "Vulkan0"}]}}
    (site.parent.parent / "build.json").write_text(json.dumps({"version": si.wanted_llamacpp()}))
    info = system_info(root=tmp_path, cache_dir=cache, drivers=cpu_type)["recipes"]["llamacpp"]
    assert info["backends"]["vulkan"]["state"] == "installed" and info["default_backend"] == "cpu"


CPU_ONLY: dict[str, Any] = {"cpu": {"available": True}, "amd_gpu": [], "nvidia_gpu": []}


@pytest.mark.parametrize(
    ("spec", "state", "message", "action"),
    [
        ({"devices": ["cpu"]}, "installed", "", ""),
        (
            {"devices": ["cpu"], "distribution": "surely-not-a-dist-lemonkit", "extra": "speech"},
            "installable",
            "Backend is supported but not installed.",
            "pip install 'lemonkit[speech]'",
        ),
        (
            {"devices": ["cpu"], "distribution": "pytest", "module": "surely_not_a_module_lemonkit"},
            "installable",
            "Backend is supported but not installed.",
            "pip install pytest",
        ),
        ({"devices": ["cpu"], "distribution": "pytest", "module": "pytest", "min_version": "1.0"}, "installed", "", ""),
        (
            {"devices": ["cpu"], "distribution": "pytest", "min_version": "999.0", "extra": "x"},
            "update_required",
            f"Backend update is required before use (pytest {importlib.metadata.version('pytest')} < 999.0).",
            "pip install -U 'lemonkit[x]'",
        ),
        ({"devices": ["amd_npu"], "missing": "No NPU found."}, "unsupported", "No NPU found.", ""),
        ({"devices": ["nvidia_gpu"]}, "unsupported", "No supported device found.", ""),
        ({"os": "Plan9", "missing": "Requires Plan 9"}, "unsupported", "Requires Plan 9", ""),
        ({"devices": ["cpu"], "unsupported": "Not built here."}, "unsupported", "Not built here.", ""),
    ],
)
def test_backend_status(spec: dict[str, Any], state: str, message: str, action: str) -> None:
    status = backend_status(spec, CPU_ONLY)
    assert (status["state"], status["message"], status["action"]) == (state, message, action)
    assert status["devices"] == ([] if state == "unsupported" else ["cpu"])
    assert ("version" in status) == (state in ("installed", "update_required") and "distribution" in spec)


def test_recipes_are_data() -> None:
    recipes = {
        **DEFAULT_RECIPES,
        "speech": {
            "default_backend": "npu",
            "backends": {"npu": {"devices": ["amd_npu"]}, "cpu": {"devices": ["cpu"]}},
        },
        "nothing": {"default_backend": "x", "backends": {"x": {"devices": ["nvidia_gpu"]}}},
    }
    info = system_info(recipes)["recipes"]
    assert info["speech"]["default_backend"] == "cpu"  # the preferred one is unsupported here
    assert "default_backend" not in info["nothing"]  # spec: only when some backend is not unsupported
    assert info["nothing"]["backends"]["x"]["state"] == "unsupported"


def test_required_version_comes_from_lemonkits_metadata(monkeypatch: pytest.MonkeyPatch) -> None:
    reqs = ["tornado>=6", 'llama-cpp-python>=0.4.0; extra == "other"', 'llama_cpp_python==0.3.36; extra == "llamacpp"']
    monkeypatch.setattr(si.importlib.metadata, "requires", lambda dist: reqs)
    assert si._required_min("llama-cpp-python", "llamacpp") == "0.3.36"
    assert si._required_min("tornado", None) == "6"
    assert si._required_min("numpy", None) is None


@pytest.mark.parametrize(
    ("a", "b"), [("0.3.9", "0.3.16"), ("0.3.16", "0.3.16.post1"), ("1.2rc1", "1.3"), ("0.3.16", "1")]
)
def test_version_order(a: str, b: str) -> None:
    assert si._vtuple(a) <= si._vtuple(b)


def test_operator_recipes_merge_over_the_defaults(tmp_path: Path) -> None:
    path = tmp_path / "recipes.json"
    path.write_text(
        json.dumps(
            {
                "llamacpp": {"backends": {"cpu": {"pip_args": ["--extra-index-url", "https://wheels"], "extra": None}}},
                "speech": {"default_backend": "cpu", "backends": {"cpu": {"devices": ["cpu"], "distribution": "x"}}},
            }
        )
    )
    recipes = load_recipes(path)
    cpu = recipes["llamacpp"]["backends"]["cpu"]
    assert cpu["pip_args"] == ["--extra-index-url", "https://wheels"] and "extra" not in cpu  # null removes
    assert cpu["distribution"] == "llama-cpp-python" and set(recipes["llamacpp"]["backends"]) >= {"vulkan", "metal"}
    assert recipes["speech"]["default_backend"] == "cpu"
    assert "speech" not in DEFAULT_RECIPES and "pip_args" not in DEFAULT_RECIPES["llamacpp"]["backends"]["cpu"]
    assert load_recipes(None) == DEFAULT_RECIPES
    for bad in ("[1]", '{"x": {"backends": [1]}}', "{not json", '{"x": {"backends": {"y": {"pip_args": "-U"}}}}'):
        path.write_text(bad)
        with pytest.raises(ValueError, match="recipes file"):
            load_recipes(path)


def test_install_requirement() -> None:
    cpu = DEFAULT_RECIPES["llamacpp"]["backends"]["cpu"]
    own = si._lemonkit_requirement("llama-cpp-python", "llamacpp")
    assert si.install_requirement(cpu) == (own or "llama-cpp-python>=0.3.36")  # lemonkit's own pin when installed
    assert si.install_requirement({"distribution": "x", "min_version": "2"}) == "x>=2"
    assert si.install_requirement({"distribution": "x"}) == "x"
    assert si.install_requirement({"distribution": "x", "requirement": "x==1.0"}) == "x==1.0"
    with pytest.raises(ValueError):
        si.install_requirement({"devices": ["cpu"]})
