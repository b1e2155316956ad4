"""The devices ggml offers this sidecar's llama.cpp build, and how a model is placed on them.

ggml registers a device per GPU its build supports (``Vulkan0``, ``CUDA0``, ``ROCm0``, ``Metal``) beside the CPU.
llama-cpp-python does not pass llama.cpp's ``devices`` list through, so :func:`load_on` fills it in for the
duration of a load by wrapping the one call that reads it, ``llama_model_load_from_file``.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

__all__ = ["Device", "gpu_devices", "load_on"]

_TYPES = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel"}


@dataclass(frozen=True)
class Device:
    """A ggml device.

    Attributes:
        name: ggml's name (``Vulkan0``), as llama-server's ``--device`` and ``--list-devices`` spell it.
        description: The driver's name for it (``NVIDIA GeForce RTX 4090``, ``llvmpipe (LLVM 15.0.6, 256 bits)``).
        kind: ``gpu``, ``igpu`` or ``accel``.
        free: Bytes free, as its driver reports.
        total: Bytes in all.
        handle: The ``ggml_backend_dev_t``.
    """

    name: str
    description: str
    kind: str
    free: int
    total: int
    handle: int

    def info(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "type": self.kind,
            "memory_total_mb": self.total // (1024 * 1024),
            "memory_free_mb": self.free // (1024 * 1024),
        }


def _lib() -> Any:
    from llama_cpp._ggml import libggml

    libggml.ggml_backend_dev_count.restype = ctypes.c_size_t
    libggml.ggml_backend_dev_count.argtypes = []
    libggml.ggml_backend_dev_get.restype = ctypes.c_void_p
    libggml.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
    for name in ("ggml_backend_dev_name", "ggml_backend_dev_description"):
        getattr(libggml, name).restype = ctypes.c_char_p
        getattr(libggml, name).argtypes = [ctypes.c_void_p]
    libggml.ggml_backend_dev_type.restype = ctypes.c_int
    libggml.ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
    libggml.ggml_backend_dev_memory.restype = None
    libggml.ggml_backend_dev_memory.argtypes = [
        ctypes.c_void_p,
        ctypes.POINTER(ctypes.c_size_t),
        ctypes.POINTER(ctypes.c_size_t),
    ]
    return libggml


def gpu_devices() -> list[Device]:
    """Every device but the CPU that this build's ggml registered, in ggml's order."""
    lib = _lib()
    found = []
    for i in range(lib.ggml_backend_dev_count()):
        handle = lib.ggml_backend_dev_get(i)
        kind = _TYPES.get(lib.ggml_backend_dev_type(handle), "other")
        if kind == "cpu":
            continue
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        lib.ggml_backend_dev_memory(handle, ctypes.byref(free), ctypes.byref(total))
        found.append(
            Device(
                name=lib.ggml_backend_dev_name(handle).decode(errors="replace"),
                description=lib.ggml_backend_dev_description(handle).decode(errors="replace"),
                kind=kind,
                free=int(free.value),
                total=int(total.value),
                handle=int(handle),
            )
        )
    return found


@contextlib.contextmanager
def load_on(devices: list[Device] | None) -> Iterator[None]:
    """Loads inside use only ``devices`` for offloading (``None``: every device, llama.cpp's default)."""
    if devices is None:
        yield
        return
    from llama_cpp import _internals

    chosen = (ctypes.c_void_p * (len(devices) + 1))(*[d.handle for d in devices], None)  # NULL-terminated
    original = _internals.llama_cpp.llama_model_load_from_file

    def load(path: bytes, params: Any) -> Any:
        params.devices = ctypes.cast(chosen, ctypes.c_void_p)
        return original(path, params)

    _internals.llama_cpp.llama_model_load_from_file = load  # the module object _internals calls through
    try:
        yield
    finally:
        _internals.llama_cpp.llama_model_load_from_file = original
