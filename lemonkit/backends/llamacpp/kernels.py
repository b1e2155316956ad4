"""Batch-invariant kernels: a sequence's logits do not depend on what else is in its batch.

ggml picks its CPU kernels by batch shape, and they round differently:

- K-quant matrices go through tiled kernels from 8 rows on, repacked weights through gemm kernels in groups of 4,
  and flash attention through a tiled kernel from 64 query rows on and a split-KV kernel for one row on a long
  cache. The CPU backend's reference mode (``ggml_backend_cpu_set_use_ref``) keeps every shape on the per-row
  kernels, and ``use_extra_bufts = false`` (llama-server's ``--no-repack``) keeps weights unpacked.
- Float (F32/F16/BF16) matrices go through llamafile's sgemm from 2 rows on and ``vec_dot`` for one row. The batcher
  pads a lone row with a throwaway one for models where that changes the logits (it probes at load).
- Attention visits a unified KV cache's cells in index order: the batcher keeps each sequence's cells in position
  order (``Batcher._compact``). In reference mode ggml's per-row attention is replaced, where the build carries it
  (:func:`patched_attention`), by lemonkit's tiled batch-invariant one (``catalog/data/lemonkit-invariant-fa.inc``):
  prompt processing at about the speed of ggml's fastest kernels instead of half of it.

Logits are bit-identical alone and among other sequences, for any chunking; what it costs against ggml's fastest
kernels is measured by ``benchmarks/concurrency.py --sections kernels,long`` (the README's Benchmarks tables).

llama.cpp creates its backends inside ``llama_init_from_model`` and does not hand them out, so
:func:`reference_kernels` wraps the CPU device's ``init_backend`` entry for the duration of a load.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Iterator
from typing import Any

from lemonkit.errors import KernelsUnavailable

__all__ = ["attention_build", "patched_attention", "reference_kernels"]

#: ``init_backend``'s place in ggml's ``struct ggml_backend_device_i`` (get_name, get_description, get_memory,
#: get_type, get_props, init_backend, ...), the first member of ``struct ggml_backend_device``.
_INIT_BACKEND = 5
#: llama-cpp-python releases whose ggml was read for that layout: another one could place the entry elsewhere, and
#: calling the wrong entry would crash the process rather than raise
_VERIFIED = ("0.3.36",)
_CPU_DEVICE = 0  # GGML_BACKEND_DEVICE_TYPE_CPU
_InitBackend = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)
_lock = threading.Lock()
_keep: list[Any] = []  # ctypes callbacks must outlive every backend they created


def _libs() -> tuple[Any, Any, Any]:
    import llama_cpp
    from llama_cpp._ctypes_extensions import load_shared_library
    from llama_cpp._ggml import libggml, libggml_base_path

    if llama_cpp.__version__ not in _VERIFIED:
        raise KernelsUnavailable(f"llama-cpp-python {llama_cpp.__version__}: its ggml device table is unverified")
    try:
        cpu = load_shared_library("ggml-cpu", libggml_base_path)
        base = load_shared_library("ggml-base", libggml_base_path)
        set_use_ref = cpu.ggml_backend_cpu_set_use_ref
        is_cpu = cpu.ggml_backend_is_cpu
    except (OSError, AttributeError, FileNotFoundError) as exc:
        raise KernelsUnavailable(f"llama-cpp-python {llama_cpp.__version__}: {exc}") from exc
    libggml.ggml_backend_dev_by_type.restype = ctypes.c_void_p
    libggml.ggml_backend_dev_by_type.argtypes = [ctypes.c_int]
    set_use_ref.argtypes = [ctypes.c_void_p, ctypes.c_bool]
    set_use_ref.restype = None
    is_cpu.argtypes = [ctypes.c_void_p]
    is_cpu.restype = ctypes.c_bool
    base.ggml_backend_free.argtypes = [ctypes.c_void_p]
    base.ggml_backend_free.restype = None
    return libggml, cpu, base


@contextlib.contextmanager
def reference_kernels() -> Iterator[list[int]]:
    """Every CPU backend ggml creates inside runs on its reference kernels.

    Yields:
        A list that gets one entry per backend switched, so the caller can check that its load went through it.

    Raises:
        KernelsUnavailable: The CPU backend has no reference mode, or its device table is not laid out as expected.
    """
    import llama_cpp

    libggml, cpu, base = _libs()
    llama_cpp.llama_backend_init()
    device = libggml.ggml_backend_dev_by_type(_CPU_DEVICE)
    if not device:
        raise KernelsUnavailable("ggml has no CPU device")
    table = (ctypes.c_void_p * (_INIT_BACKEND + 1)).from_address(device)
    with _lock:
        address = table[_INIT_BACKEND]
        if not address:
            raise KernelsUnavailable("ggml's CPU device has no init_backend entry")
        original = _InitBackend(address)
        probe = original(device, None)
        if not probe or not cpu.ggml_backend_is_cpu(probe):
            raise KernelsUnavailable("ggml's CPU device table is not laid out as this build expects")
        base.ggml_backend_free(probe)
        switched: list[int] = []

        def init_backend(dev: int, params: bytes | None) -> int | None:
            backend = original(dev, params)
            if backend:
                cpu.ggml_backend_cpu_set_use_ref(backend, True)
                switched.append(backend)
            return backend

        hook = _InitBackend(init_backend)
        _keep.extend((hook, original))
        table[_INIT_BACKEND] = ctypes.cast(hook, ctypes.c_void_p).value
        try:
            yield switched
        finally:
            table[_INIT_BACKEND] = ctypes.cast(original, ctypes.c_void_p).value


def attention_build() -> str:
    """Which of lemonkit's batch-invariant flash attention the loaded ggml-cpu carries.

    ``"current"``: the kernel of this lemonkit's ``lemonkit-invariant-fa.inc`` (``llama-cpp-lean.cmake`` patches it
    in at build time and exports the SHA-256 of the file it was made from); ``"older"``: the kernel of another
    lemonkit (pip's wheel cache keys on the sdist alone, so a reinstall can hand back a wheel built before an
    update); ``"missing"``: a build without it, whose reference mode runs ggml's per-row attention (as invariant,
    half as fast on long prompts); ``"unsupported"``: built with it, on a CPU it has no code for (no ggml SIMD, or
    SVE, RVV), where it falls back to that same attention.
    """
    from llama_cpp._ctypes_extensions import load_shared_library
    from llama_cpp._ggml import libggml_base_path

    try:
        cpu = load_shared_library("ggml-cpu", libggml_base_path)
        version = cpu.lemonkit_invariant_fa_version
    except (OSError, AttributeError, FileNotFoundError):
        return "missing"
    version.argtypes = []
    version.restype = ctypes.c_int
    if version() < 1:
        return "unsupported"
    try:
        source = cpu.lemonkit_invariant_fa_source
    except AttributeError:  # built by a lemonkit from before the kernel named its source
        return "older"
    source.argtypes = []
    source.restype = ctypes.c_char_p
    from lemonkit.catalog.llamacpp_builds import invariant_attention_sha256

    return "current" if (source() or b"").decode() == invariant_attention_sha256() else "older"


def patched_attention() -> bool:
    """Whether the loaded ggml-cpu runs lemonkit's batch-invariant flash attention (any lemonkit's)."""
    return attention_build() in ("current", "older")


def rebuild_command() -> str:
    """The shell commands that rebuild the installed llama-cpp-python with this lemonkit's kernel.

    pip's cached wheel goes first: pip would hand it back, whatever ``CMAKE_ARGS`` say.
    """
    import sys

    import llama_cpp

    from lemonkit.catalog import llamacpp_builds

    pip = f"{sys.executable} -m pip"
    include = f"-DCMAKE_PROJECT_llama_cpp_INCLUDE={llamacpp_builds.lean_cmake()}"
    return (
        f"{pip} cache remove llama_cpp_python; CMAKE_ARGS={include!r} "
        f"{pip} install --force-reinstall --no-deps llama-cpp-python=={llama_cpp.__version__}"
    )
