"""This machine's devices, as ``GET /v1/system-info`` reports them: the CPU, the PCI GPUs, an NPU, and the memory.

Read from ``/proc`` and ``/sys`` (tests point ``root`` at a fake tree) and from what the GPU drivers report
(:mod:`lemonkit.catalog.accelerators`: NVML, the Vulkan loader, Metal); nothing imports an engine, so a call costs
a few milliseconds.
"""

from __future__ import annotations

import os
import platform
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lemonkit.catalog import accelerators

__all__ = ["detect_devices", "gpu_archs", "physical_memory"]

_PCI_VENDORS = {"0x1002": "amd_gpu", "0x10de": "nvidia_gpu"}


def _read(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace").strip()
    except OSError:
        return None


def _cpu(root: Path) -> dict[str, Any]:
    name = None
    cores: set[tuple[str, str]] = set()
    physical = core = None
    text = _read(root / "proc/cpuinfo") or ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key == "model name" and name is None:
            name = value
        elif key == "physical id":
            physical = value
        elif key == "core id":
            core = value
        elif not key:  # blank line ends one logical CPU's block
            if core is not None:
                cores.add((physical or "0", core))
            physical = core = None
    if core is not None:
        cores.add((physical or "0", core))
    threads = os.cpu_count() or 1
    return {
        "name": name or platform.processor() or platform.machine(),
        # (physical id, core id) pairs count hyper-threads once; absent (ARM, some VMs): logical count
        "cores": len(cores) or threads,
        "threads": threads,
        "available": True,
        "family": platform.machine(),
    }


def _gpus(root: Path, drivers: Mapping[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """The PCI display devices of AMD and NVIDIA, named and sized by their drivers where those answered."""
    found: dict[str, list[dict[str, Any]]] = {"amd_gpu": [], "nvidia_gpu": []}
    drm = root / "sys/class/drm"
    try:
        cards = sorted(p for p in drm.iterdir() if re.fullmatch(r"card\d+", p.name))
    except OSError:
        cards = []
    for card in cards:
        dev = card / "device"
        kind = _PCI_VENDORS.get(_read(dev / "vendor") or "")
        if kind is None:
            continue
        gpu: dict[str, Any] = {
            "name": _read(dev / "product_name")
            or f"{'AMD' if kind == 'amd_gpu' else 'NVIDIA'} GPU {_read(dev / 'device')}",
            "available": True,
        }
        vram = _read(dev / "mem_info_vram_total")  # amdgpu only
        if vram and vram.isdigit():
            gpu["vram_gb"] = round(int(vram) / 1024**3, 1)
        found[kind].append(gpu)
    nvidia = drivers.get("nvidia") or {}
    if nvidia.get("gpus"):
        # NVML is the driver itself: its list replaces what /sys could only number
        found["nvidia_gpu"] = [
            {
                "name": g["name"],
                "vram_gb": g["vram_gb"],
                "available": True,
                "family": f"sm_{g['compute_capability'].replace('.', '')}",
                "driver_version": nvidia.get("driver_version"),
                "cuda_version": nvidia.get("cuda_version"),
            }
            for g in nvidia["gpus"]
        ]
    targets = accelerators.kfd_gfx_targets(root)
    if len(targets) == 1:  # one target names every AMD GPU; several cannot be matched to cards by order
        for gpu in found["amd_gpu"]:
            gpu["family"] = targets[0]
    return found


def _npu(root: Path) -> dict[str, Any] | None:
    accel = root / "sys/class/accel"
    try:
        nodes = sorted(accel.iterdir())
    except OSError:
        return None
    for node in nodes:
        driver = node / "device/driver"
        if driver.is_symlink() and os.readlink(driver).rsplit("/", 1)[-1] == "amdxdna":
            return {"name": "AMD NPU", "available": True, "family": "XDNA"}
    return None


def detect_devices(root: Path = Path("/"), drivers: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The ``devices`` object. GPU arrays are present and empty when none is found; ``amd_npu`` only when present.

    Besides the spec's kinds, ``vulkan`` lists every device the Vulkan loader reports (``ggml_name`` set on those
    ggml-vulkan uses, ``available`` with it), and ``metal`` Apple's GPU on a Mac with Apple silicon.

    Args:
        root: Filesystem root holding ``proc/`` and ``sys/`` (tests point it at a fake tree).
        drivers: What the GPU drivers report (:func:`lemonkit.catalog.accelerators.detect`; asked when ``root``
            is ``/``, else none).
    """
    if drivers is None:
        drivers = accelerators.detect() if root == Path("/") else {}
    devices: dict[str, Any] = {"cpu": _cpu(root), **_gpus(root, drivers)}
    vulkan = (drivers.get("vulkan") or {}).get("devices") or []
    devices["vulkan"] = [{**d, "available": d.get("ggml_name") is not None} for d in vulkan]
    if drivers.get("metal"):
        devices["metal"] = [{**d, "available": True} for d in drivers["metal"]["devices"]]
    npu = _npu(root)
    if npu is not None:
        devices["amd_npu"] = npu
    return devices


def gpu_archs(backend: str, devices: Mapping[str, Any]) -> list[str]:
    """The architectures a ``backend`` build compiles for: those of the GPUs present (CUDA ``89``, ROCm
    ``gfx1100``)."""
    kind = {"cuda": "nvidia_gpu", "rocm": "amd_gpu"}.get(backend)
    families = [g.get("family") for g in devices.get(kind or "", [])]
    if backend == "cuda":
        return sorted({f.removeprefix("sm_") for f in families if f})
    return sorted({f for f in families if f})


def physical_memory(root: Path = Path("/")) -> str:
    """The machine's memory as ``GET /v1/system-info`` says it (``"15.5 GB"``; ``"Unknown"`` when unreadable)."""
    meminfo = _read(root / "proc/meminfo") or ""
    m = re.search(r"^MemTotal:\s*(\d+)\s*kB", meminfo, re.M)
    if m:
        total = int(m.group(1)) * 1024
    else:
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return "Unknown"
    return f"{total / 1024**3:.1f} GB"
