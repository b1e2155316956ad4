"""The machine's GPUs as their own drivers see them: Vulkan through its loader, NVIDIA through NVML, AMD's gfx
targets through the kernel's KFD topology, Apple's GPU on macOS.

Asking a Vulkan loader for its devices loads every installed driver into the asking process (Mesa's lavapipe
brings LLVM), and a broken driver can crash it, so :func:`detect` runs :func:`probe` in a child interpreter
(``python -m lemonkit.catalog.accelerators``) and keeps its answer for the life of the server process. Each list holds
only what a driver reported: no row for a device nobody has seen.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import json
import logging
import os
import platform
import subprocess
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["detect", "ggml_vulkan_names", "kfd_gfx_targets", "probe"]

log = logging.getLogger("lemonkit.accelerators")

_VK_TYPES = {0: "other", 1: "integrated_gpu", 2: "discrete_gpu", 3: "virtual_gpu", 4: "cpu"}
_VK_VENDORS = {
    0x1002: "AMD",
    0x10DE: "NVIDIA",
    0x8086: "Intel",
    0x106B: "Apple",
    0x13B5: "ARM",
    0x5143: "Qualcomm",
    0x10005: "Mesa",
}
_VK_DEVICE_LOCAL = 0x1
#: seconds the child may take: loaders enumerate every driver, lavapipe starts LLVM (about 0.2 s here)
_TIMEOUT = 20.0


def _vk_version(v: int) -> str:
    return f"{(v >> 22) & 0x7F}.{(v >> 12) & 0x3FF}.{v & 0xFFF}"


def _driver_version(vendor: int, v: int) -> str:
    if vendor == 0x10DE:  # NVIDIA packs its own release numbers: 10 bits, 8, 8, 6
        return f"{v >> 22}.{(v >> 14) & 0xFF}.{(v >> 6) & 0xFF}"
    return _vk_version(v)


class _AppInfo(ctypes.Structure):
    _fields_ = [
        ("sType", ctypes.c_int32),
        ("pNext", ctypes.c_void_p),
        ("pApplicationName", ctypes.c_char_p),
        ("applicationVersion", ctypes.c_uint32),
        ("pEngineName", ctypes.c_char_p),
        ("engineVersion", ctypes.c_uint32),
        ("apiVersion", ctypes.c_uint32),
    ]


class _InstanceInfo(ctypes.Structure):
    _fields_ = [
        ("sType", ctypes.c_int32),
        ("pNext", ctypes.c_void_p),
        ("flags", ctypes.c_uint32),
        ("pApplicationInfo", ctypes.POINTER(_AppInfo)),
        ("enabledLayerCount", ctypes.c_uint32),
        ("ppEnabledLayerNames", ctypes.c_void_p),
        ("enabledExtensionCount", ctypes.c_uint32),
        ("ppEnabledExtensionNames", ctypes.c_void_p),
    ]


def _vulkan() -> list[dict[str, Any]]:
    """Every physical device the Vulkan loader reports (raises OSError where there is no loader)."""
    name = ctypes.util.find_library("vulkan") or ("libvulkan.1.dylib" if sys.platform == "darwin" else "libvulkan.so.1")
    vk = ctypes.CDLL(name)
    app = _AppInfo(0, None, b"lemonkit", 1, b"lemonkit", 1, (1 << 22) | (1 << 12))  # API 1.1
    info = _InstanceInfo(1, None, 0, ctypes.pointer(app), 0, None, 0, None)
    instance = ctypes.c_void_p()
    result = vk.vkCreateInstance(ctypes.byref(info), None, ctypes.byref(instance))
    if result != 0:
        raise OSError(f"vkCreateInstance failed (VkResult {result})")
    try:
        count = ctypes.c_uint32()
        vk.vkEnumeratePhysicalDevices(instance, ctypes.byref(count), None)
        handles = (ctypes.c_void_p * count.value)()
        vk.vkEnumeratePhysicalDevices(instance, ctypes.byref(count), handles)
        devices = []
        for index, handle in enumerate(handles[: count.value]):
            # VkPhysicalDeviceProperties begins apiVersion, driverVersion, vendorID, deviceID, deviceType (4 bytes
            # each), deviceName[256]; the limits after it are not read, the buffer only has to hold them
            props = ctypes.create_string_buffer(4096)
            vk.vkGetPhysicalDeviceProperties(ctypes.c_void_p(handle), props)
            api, driver, vendor, device_id, kind = (
                int.from_bytes(props.raw[i : i + 4], "little") for i in range(0, 20, 4)
            )
            # VkPhysicalDeviceMemoryProperties: memoryTypeCount, 32 types of 8 bytes, memoryHeapCount, then from
            # offset 264 (8-aligned) 16 heaps of {VkDeviceSize size; flags; padding}
            memory = ctypes.create_string_buffer(1024)
            vk.vkGetPhysicalDeviceMemoryProperties(ctypes.c_void_p(handle), memory)
            heaps = int.from_bytes(memory.raw[260:264], "little")
            local = 0
            for h in range(min(heaps, 16)):
                offset = 264 + 16 * h
                size = int.from_bytes(memory.raw[offset : offset + 8], "little")
                flags = int.from_bytes(memory.raw[offset + 8 : offset + 12], "little")
                if flags & _VK_DEVICE_LOCAL:
                    local += size
            devices.append(
                {
                    "index": index,
                    "name": props.raw[20:276].split(b"\0", 1)[0].decode(errors="replace"),
                    "type": _VK_TYPES.get(kind, "other"),
                    "vendor": _VK_VENDORS.get(vendor, f"0x{vendor:04x}"),
                    "device_id": f"0x{device_id:04x}",
                    "api_version": _vk_version(api),
                    "driver_version": _driver_version(vendor, driver),
                    "memory_gb": round(local / 1024**3, 1),
                }
            )
        return devices
    finally:
        vk.vkDestroyInstance(instance, None)


class _NvmlMemory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


def _nvidia() -> dict[str, Any]:
    """NVIDIA's GPUs through NVML, the driver's own library (raises OSError where there is no driver)."""
    nvml = ctypes.CDLL("libnvidia-ml.so.1" if sys.platform != "win32" else "nvml.dll")
    if nvml.nvmlInit_v2() != 0:
        raise OSError("nvmlInit failed: the NVIDIA driver is not loaded")
    try:
        text = ctypes.create_string_buffer(96)
        nvml.nvmlSystemGetDriverVersion(text, 96)
        driver = text.value.decode()
        cuda = ctypes.c_int()
        nvml.nvmlSystemGetCudaDriverVersion_v2(ctypes.byref(cuda))
        count = ctypes.c_uint()
        nvml.nvmlDeviceGetCount_v2(ctypes.byref(count))
        gpus = []
        for i in range(count.value):
            handle = ctypes.c_void_p()
            if nvml.nvmlDeviceGetHandleByIndex_v2(i, ctypes.byref(handle)) != 0:
                continue
            nvml.nvmlDeviceGetName(handle, text, 96)
            memory = _NvmlMemory()
            nvml.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(memory))
            major, minor = ctypes.c_int(), ctypes.c_int()
            nvml.nvmlDeviceGetCudaComputeCapability(handle, ctypes.byref(major), ctypes.byref(minor))
            gpus.append(
                {
                    "index": i,
                    "name": text.value.decode(errors="replace"),
                    "vram_gb": round(memory.total / 1024**3, 1),
                    "free_gb": round(memory.free / 1024**3, 1),
                    "compute_capability": f"{major.value}.{minor.value}",
                }
            )
        return {
            "driver_version": driver,
            "cuda_version": f"{cuda.value // 1000}.{cuda.value % 1000 // 10}",
            "gpus": gpus,
        }
    finally:
        nvml.nvmlShutdown()


def kfd_gfx_targets(root: Path = Path("/")) -> list[str]:
    """The gfx targets (``gfx1100``) of the AMD GPUs the kernel's KFD driver lists, for ROCm builds."""
    targets: list[str] = []
    nodes = root / "sys/class/kfd/kfd/topology/nodes"
    try:
        entries = sorted(nodes.iterdir())
    except OSError:
        return targets
    for node in entries:
        try:
            text = (node / "properties").read_text()
        except OSError:
            continue
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "gfx_target_version" and value.strip().isdigit() and int(value) > 0:
                v = int(value)
                target = f"gfx{v // 10000}{v // 100 % 100:x}{v % 100:x}"
                if target not in targets:
                    targets.append(target)
    return targets


def probe() -> dict[str, Any]:
    """What this process's drivers report: ``{"vulkan": {...}, "nvidia": {...}}``, each with its devices or the
    ``error`` that stopped the asking."""
    out: dict[str, Any] = {}
    for name, ask in (("vulkan", _vulkan), ("nvidia", _nvidia)):
        try:
            out[name] = {"devices": ask()} if name == "vulkan" else ask()
        except (OSError, AttributeError) as exc:
            out[name] = {"error": str(exc)}
    return out


def ggml_vulkan_names(devices: list[dict[str, Any]], environ: Mapping[str, str]) -> dict[int, str]:
    """Loader index -> the name ggml-vulkan gives the device (``Vulkan0``...), for those it uses.

    ggml uses the devices ``GGML_VK_VISIBLE_DEVICES`` lists, in its order; without it, every device but CPU-type
    ones (a software rasteriser such as lavapipe is slower than ggml's own CPU backend).
    """
    visible = environ.get("GGML_VK_VISIBLE_DEVICES")
    if visible is not None:
        order = [int(p) for p in visible.split(",") if p.strip().isdigit()]
    else:
        order = [d["index"] for d in devices if d.get("type") != "cpu"]
    known = {d["index"] for d in devices}
    return {index: f"Vulkan{n}" for n, index in enumerate(i for i in order if i in known)}


_asked = threading.Lock()  # one child at a time: a first request and the server's warm-up may ask together


@functools.lru_cache(maxsize=1)
def _detect_locked() -> dict[str, Any]:
    command = [sys.executable, "-m", "lemonkit.catalog.accelerators"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    try:
        run = subprocess.run(command, capture_output=True, text=True, timeout=_TIMEOUT, env=env, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("could not ask the GPU drivers for their devices: %s", exc)
        return {"vulkan": {"error": str(exc)}, "nvidia": {"error": str(exc)}}
    try:
        answer: dict[str, Any] = json.loads(run.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        reason = (run.stderr.strip().splitlines() or [f"exit status {run.returncode}"])[-1]
        log.warning("the GPU driver probe failed: %s", reason)
        return {"vulkan": {"error": reason}, "nvidia": {"error": reason}}
    return answer


def _detect_cached() -> dict[str, Any]:
    with _asked:
        return _detect_locked()


def detect(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The drivers' view of this machine (see :func:`probe`), asked once per server process; Vulkan devices carry
    ``ggml_name`` where ggml-vulkan would use them, and ``metal`` is present on a Mac with Apple silicon."""
    answer = json.loads(json.dumps(_detect_cached()))  # a copy: callers may change it
    names = ggml_vulkan_names(answer.get("vulkan", {}).get("devices", []), os.environ if environ is None else environ)
    for device in answer.get("vulkan", {}).get("devices", []):
        device["ggml_name"] = names.get(device["index"])
    if platform.system() == "Darwin" and platform.machine() == "arm64":
        answer["metal"] = {"devices": [{"name": "Apple GPU", "type": "integrated_gpu", "ggml_name": "Metal"}]}
    return answer


if __name__ == "__main__":
    print(json.dumps(probe()))
