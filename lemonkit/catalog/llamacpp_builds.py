"""llama.cpp builds per backend: what each needs to compile, its CMake flags, and where it lives.

lemonkit's own llama-cpp-python, the one pip installs with ``lemonkit[llamacpp]``, is the ``cpu`` build; nothing
the API does removes or replaces it. Every other build ``POST /v1/install`` makes is the same llama-cpp-python
release compiled with its backend's CMake flags, installed apart from the server's environment::

    <cache>/backends/llamacpp-<backend>/site/llama_cpp/...   pip --target, without dependencies
    <cache>/backends/llamacpp-<backend>/build.json            release, CMake flags, when it was built

A sidecar for a model loaded with ``llamacpp_backend: X`` runs with ``site`` first on its ``PYTHONPATH``, so its
``import llama_cpp`` loads build X's libraries while numpy and the rest come from the server's environment. The
wheel a build produced stays in the wheel cache, keyed by release and flags, so an uninstall followed by an install,
or a second test run, does not compile again (``force`` does).

Nothing here runs a compiler or imports an engine: :func:`plan` looks for what a build needs on disk and names the
command that installs whatever is missing, so a request is refused before anything starts.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "BACKENDS",
    "DISTRIBUTION",
    "GPU_BACKENDS",
    "Build",
    "Missing",
    "Plan",
    "build_dir",
    "installed",
    "lean_cmake",
    "own_version",
    "plan",
    "vulkan_header_version",
    "wheel_dir",
]

DISTRIBUTION = "llama-cpp-python"
BACKENDS = ("cpu", "vulkan", "cuda", "rocm", "metal")
GPU_BACKENDS = ("cuda", "rocm", "metal", "vulkan")  # the order a default prefers them in
#: ggml-vulkan's oldest usable headers: it uses vk::LayerSettingEXT (VK_EXT_layer_settings, headers 1.3.261)
VULKAN_MIN_HEADERS = (1, 3, 261)
#: the library each build adds beside libggml-cpu: present in its ``llama_cpp/lib`` when the flags took effect
BACKEND_LIBRARY = {"vulkan": "ggml-vulkan", "cuda": "ggml-cuda", "rocm": "ggml-hip", "metal": "ggml-metal"}

_APT = "apt-get install"
#: where the CUDA Toolkit's installers put it, when neither CUDA_HOME nor CUDA_PATH says
_CUDA_HOMES = (Path("/usr/local/cuda"),)


def lean_cmake() -> Path:
    """The CMake include that leaves llama.cpp's common library out of every build (see the file's comment)."""
    return Path(__file__).parent / "data" / "llama-cpp-lean.cmake"


def invariant_attention_source() -> Path:
    """lemonkit's batch-invariant flash attention, which ``llama-cpp-lean.cmake`` patches into ggml-cpu."""
    return Path(__file__).parent / "data" / "lemonkit-invariant-fa.inc"


def invariant_attention_sha256() -> str:
    """The SHA-256 of :func:`invariant_attention_source`, as ``llama-cpp-lean.cmake`` writes it into a build."""
    return hashlib.sha256(invariant_attention_source().read_bytes()).hexdigest()


@dataclass(frozen=True)
class Missing:
    """A prerequisite a build needs and this machine lacks.

    Attributes:
        what: What is missing, as a person would name it.
        install: The command (or page) that provides it.
    """

    what: str
    install: str

    def __str__(self) -> str:
        return f"{self.what} ({self.install})"


@dataclass(frozen=True)
class Plan:
    """How a backend's build would be made here.

    Attributes:
        backend: ``cpu``, ``vulkan``, ``cuda``, ``rocm`` or ``metal``.
        cmake_args: What ``CMAKE_ARGS`` gets.
        env: Further environment for the compile (compilers chosen by path).
        missing: What must be installed first; empty when the build can start.
        found: What was found, for the build's log (``"Vulkan headers": "1.4.309 in /x/include"``).
    """

    backend: str
    cmake_args: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    missing: tuple[Missing, ...] = ()
    found: dict[str, str] = field(default_factory=dict)

    def key(self, version: str) -> str:
        """Names the wheel these flags make of ``version`` on this machine (flags and CPU decide its code)."""
        # the lean include's path is where lemonkit is installed, not a property of the build; what it and the kernel
        # it patches in say is (another lemonkit's kernel makes another wheel)
        lean = f"lean:{hashlib.sha256(lean_cmake().read_bytes()).hexdigest()}:{invariant_attention_sha256()}"
        args = [lean if a.startswith("-DCMAKE_PROJECT_llama_cpp_INCLUDE=") else a for a in self.cmake_args]
        text = json.dumps([version, args, platform.machine(), platform.system()])
        return hashlib.sha256(text.encode()).hexdigest()[:12]


@dataclass(frozen=True)
class Build:
    """A build installed apart under the cache.

    Attributes:
        backend: Its backend.
        site: The directory a sidecar puts first on ``PYTHONPATH``.
        version: The llama-cpp-python release it was built from.
        record: Its ``build.json`` (flags, time, wheel).
    """

    backend: str
    site: Path
    version: str
    record: dict[str, Any]


def build_dir(cache_dir: Path, backend: str) -> Path:
    return cache_dir / "backends" / f"llamacpp-{backend}"


def wheel_dir(wheels: Path, backend: str, version: str, key: str) -> Path:
    return wheels / f"llamacpp-{backend}-{version}-{key}"


def installed(cache_dir: Path, backend: str) -> Build | None:
    """The build of ``backend`` installed apart, if a whole one is there (an install writes it under another name
    and renames it into place, so a directory with ``build.json`` and the package is complete)."""
    root = build_dir(cache_dir, backend)
    try:
        record = json.loads((root / "build.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    site = root / "site"
    if not isinstance(record, dict) or not (site / "llama_cpp" / "__init__.py").is_file():
        return None
    return Build(backend, site, str(record.get("version", "")), record)


def own_version() -> str | None:
    """The version of the llama-cpp-python in the server's own environment, if it is importable there."""
    try:
        version = importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None
    return version if importlib.util.find_spec("llama_cpp") is not None else None


# -- prerequisites ------------------------------------------------------------------------------------------------


def _which(name: str, environ: Mapping[str, str], *extra_dirs: Path) -> str | None:
    for directory in extra_dirs:
        candidate = directory / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return shutil.which(name, path=environ.get("PATH", os.defpath))


def _compiler(environ: Mapping[str, str]) -> list[Missing]:
    if platform.system() == "Darwin":
        found = _which("c++", environ) or _which("clang++", environ)
        return [] if found else [Missing("a C++ compiler", "xcode-select --install")]
    cxx = environ.get("CXX") or "c++"
    if _which(cxx, environ) or _which("g++", environ) or _which("clang++", environ):
        return []
    return [Missing("a C++ compiler", f"{_APT} build-essential")]


def vulkan_header_version(include: Path) -> tuple[int, int, int] | None:
    """``(major, minor, patch)`` of the Vulkan headers in ``include`` (``vulkan/vulkan_core.h``), if there."""
    try:
        text = (include / "vulkan" / "vulkan_core.h").read_text(errors="replace")
    except OSError:
        return None
    patch = re.search(r"^#define VK_HEADER_VERSION (\d+)", text, re.M)
    complete = re.search(r"^#define VK_HEADER_VERSION_COMPLETE VK_MAKE_API_VERSION\(\d+, (\d+), (\d+),", text, re.M)
    if not patch or not complete:
        return None
    return int(complete.group(1)), int(complete.group(2)), int(patch.group(1))


def _lib_dirs(prefix: Path) -> list[Path]:
    return [prefix / "lib" / f"{platform.machine()}-linux-gnu", prefix / "lib64", prefix / "lib"]


def _find_file(dirs: list[Path], *names: str) -> Path | None:
    for directory in dirs:
        for name in names:
            if (directory / name).exists():
                return directory / name
    return None


def _vulkan(environ: Mapping[str, str]) -> Plan:
    sdk = Path(environ["VULKAN_SDK"]) if environ.get("VULKAN_SDK") else None
    prefixes = [p for p in (sdk, Path("/usr"), Path("/usr/local")) if p is not None]
    missing: list[Missing] = []
    found: dict[str, str] = {}
    args = ["-DGGML_VULKAN=on"]
    headers = [(p / "include", vulkan_header_version(p / "include")) for p in prefixes]
    usable = [(inc, v) for inc, v in headers if v is not None and v >= VULKAN_MIN_HEADERS]
    need = ".".join(map(str, VULKAN_MIN_HEADERS))
    if usable:
        include, version = usable[0]
        found["Vulkan headers"] = f"{'.'.join(map(str, version))} in {include}"
        args.append(f"-DVulkan_INCLUDE_DIR={include}")
    else:
        old = next(((inc, v) for inc, v in headers if v is not None), None)
        what = (
            f"Vulkan headers {need} or newer (those in {old[0]} are {'.'.join(map(str, old[1]))})"
            if old
            else f"Vulkan headers {need} or newer"
        )
        install = (
            f"{_APT} libvulkan-dev where it is {need} or newer; on Debian 12, "
            "scripts/vulkan-headers unpacks Debian 13's into a folder, then set VULKAN_SDK to the folder it prints"
        )
        missing.append(Missing(what, install))
    # the loader to link: the SDK's, else the system's (Debian's libvulkan1 ships only the versioned name)
    lib_dirs = [d for p in prefixes for d in _lib_dirs(p)]
    loader = _find_file(lib_dirs, "libvulkan.so", "libvulkan.so.1", "libvulkan.dylib", "libvulkan.1.dylib")
    if loader is None:
        missing.append(Missing("the Vulkan loader (libvulkan)", f"{_APT} libvulkan1"))
    else:
        found["Vulkan loader"] = str(loader)
        args.append(f"-DVulkan_LIBRARY={loader}")
    glslc = _which("glslc", environ, *([sdk / "bin"] if sdk else []))
    if glslc is None:
        missing.append(Missing("glslc, the GLSL-to-SPIR-V compiler", f"{_APT} glslc"))
    else:
        found["glslc"] = glslc
        args.append(f"-DVulkan_GLSLC_EXECUTABLE={glslc}")
    spirv = [
        d / "SPIRV-Headers"
        for p in prefixes
        for d in (p / "share" / "cmake", p / "lib" / "cmake", *(x / "cmake" for x in _lib_dirs(p)))
    ]
    config = _find_file(spirv, "SPIRV-HeadersConfig.cmake")
    if config is None:
        missing.append(Missing("SPIR-V headers (SPIRV-HeadersConfig.cmake)", f"{_APT} spirv-headers"))
    else:
        found["SPIR-V headers"] = str(config.parent)
        args.append(f"-DSPIRV-Headers_DIR={config.parent}")
    return Plan("vulkan", tuple(args), missing=tuple(missing), found=found)


def _cuda(environ: Mapping[str, str], gpu_archs: list[str]) -> Plan:
    homes = [Path(environ[k]) for k in ("CUDA_HOME", "CUDA_PATH") if environ.get(k)] + list(_CUDA_HOMES)
    nvcc = environ.get("CUDACXX") or _which("nvcc", environ, *(h / "bin" for h in homes))
    missing: list[Missing] = []
    found: dict[str, str] = {}
    args = ["-DGGML_CUDA=on"]
    toolkit = (
        "the CUDA Toolkit (https://developer.nvidia.com/cuda-downloads; Debian/Ubuntu: apt-get install "
        "nvidia-cuda-toolkit)"
    )
    if nvcc is None:
        missing.append(Missing("nvcc, the CUDA compiler", toolkit))
    else:
        found["nvcc"] = nvcc
        args.append(f"-DCMAKE_CUDA_COMPILER={nvcc}")
        homes.insert(0, Path(nvcc).resolve().parent.parent)
    roots = [d for h in homes for d in (h, *sorted(h.glob("targets/*")))]
    header = _find_file([r / "include" for r in roots], "cublas_v2.h")
    library = _find_file([d for r in roots for d in (r / "lib64", r / "lib")], "libcublas.so", "libcublas.dylib")
    if header is None or library is None:
        missing.append(Missing("cuBLAS (its headers and libcublas)", toolkit))
    else:
        found["cuBLAS"] = str(library)
    gpu_archs = [a for a in environ.get("CMAKE_CUDA_ARCHITECTURES", "").split(";") if a] or gpu_archs
    if gpu_archs:
        # the GPUs present only: ggml's default list compiles every kernel for six architectures
        args.append(f"-DCMAKE_CUDA_ARCHITECTURES={';'.join(gpu_archs)}")
    return Plan("cuda", tuple(args), missing=tuple(missing), found=found)


def _rocm(environ: Mapping[str, str], gpu_archs: list[str]) -> Plan:
    home = Path(environ.get("ROCM_PATH") or environ.get("HIP_PATH") or "/opt/rocm")
    missing: list[Missing] = []
    found: dict[str, str] = {}
    args = ["-DGGML_HIP=on"]
    env: dict[str, str] = {}
    install = "ROCm (https://rocm.docs.amd.com; Ubuntu: amdgpu-install --usecase=rocm)"
    clang = home / "llvm" / "bin" / "clang"
    if not clang.is_file():
        missing.append(Missing(f"ROCm's clang ({clang})", install))
    else:
        found["HIP compiler"] = str(clang)
        env.update(HIPCXX=str(clang), HIP_PATH=str(home))
    for name, lib in (("rocBLAS", "librocblas.so"), ("hipBLAS", "libhipblas.so")):
        path = _find_file([home / "lib", home / "lib64"], lib)
        if path is None:
            missing.append(Missing(f"{name} ({lib})", install))
        else:
            found[name] = str(path)
    gpu_archs = [a for a in re.split(r"[;,]", environ.get("AMDGPU_TARGETS", "")) if a] or gpu_archs
    if gpu_archs:
        args.append(f"-DAMDGPU_TARGETS={';'.join(gpu_archs)}")
    else:
        missing.append(Missing("an AMD GPU to build for (its gfx target)", "set AMDGPU_TARGETS, e.g. gfx1100"))
    return Plan("rocm", tuple(args), env=env, missing=tuple(missing), found=found)


def _metal(environ: Mapping[str, str]) -> Plan:
    missing: list[Missing] = []
    if platform.system() != "Darwin":
        missing.append(Missing("macOS (Metal is Apple's)", "build on a Mac"))
    elif _which("xcrun", environ) is None:
        missing.append(Missing("Xcode's command line tools (xcrun)", "xcode-select --install"))
    return Plan("metal", ("-DGGML_METAL=on", "-DGGML_METAL_EMBED_LIBRARY=on"), missing=tuple(missing))


def plan(
    backend: str,
    *,
    environ: Mapping[str, str] | None = None,
    gpu_archs: list[str] | None = None,
) -> Plan:
    """How ``backend`` would be built here, and what is missing for it.

    Args:
        backend: One of :data:`BACKENDS`.
        environ: The environment to look in (``VULKAN_SDK``, ``CUDA_HOME``, ``ROCM_PATH``, ``PATH``...).
        gpu_archs: The architectures of the GPUs present (CUDA ``"89"``, ROCm ``"gfx1100"``): the build compiles
            for those only, where known.

    Raises:
        ValueError: An unknown backend.
    """
    env = os.environ if environ is None else environ
    archs = list(gpu_archs or [])
    if backend == "cpu":
        built = Plan("cpu", ())
    elif backend == "vulkan":
        built = _vulkan(env)
    elif backend == "cuda":
        built = _cuda(env, archs)
    elif backend == "rocm":
        built = _rocm(env, archs)
    elif backend == "metal":
        built = _metal(env)
    else:
        raise ValueError(f"unknown llama.cpp backend {backend!r} (known: {', '.join(BACKENDS)})")
    lean = f"-DCMAKE_PROJECT_llama_cpp_INCLUDE={lean_cmake()}"
    return Plan(
        built.backend,
        (*built.cmake_args, lean),
        env=built.env,
        missing=(*_compiler(env), *built.missing),
        found=built.found,
    )
