"""``GET /v1/system-info``: this machine's hardware and which recipe backends can run on it.

Everything is read from ``/proc``, ``/sys`` and package metadata: no engine is
imported (importing llama_cpp loads a large shared library), so a call costs a few
milliseconds. The server calls it off the event loop all the same.

Recipes are data (:data:`DEFAULT_RECIPES`): each backend names the devices it runs
on and the Python distribution that provides it, so a speech, TTS or image recipe is
added by adding an entry, not code. An operator's JSON file (``LEMONKIT_RECIPES``) is
merged over the defaults by :func:`load_recipes`: a new row, or a changed field of one
(an index with prebuilt wheels for ``pip_args``, a pinned ``requirement``).
"""

from __future__ import annotations

import copy
import importlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lemonkit.catalog import accelerators, llamacpp_builds

__all__ = [
    "DEFAULT_RECIPES",
    "backend_status",
    "default_llamacpp_backend",
    "detect_devices",
    "gpu_archs",
    "install_action",
    "install_requirement",
    "lemonkit_requires",
    "llamacpp_backends",
    "load_recipes",
    "refresh_installed",
    "system_info",
    "wanted_llamacpp",
]

#: recipe -> {"default_backend": name, "backends": {name: spec}}. A backend spec's keys, all optional:
#:   devices      device kinds it runs on ("cpu", "amd_gpu", "nvidia_gpu", "amd_npu", "vulkan": a Vulkan device
#:                ggml would use, "metal": Apple's GPU); none present -> unsupported
#:   os           platform.system() value it requires ("Darwin" for Metal)
#:   missing      message when its devices/OS are absent
#:   unsupported  message that makes it unsupported regardless (lemonkit has no engine for it)
#:   distribution PyPI distribution providing it (absent: part of lemonkit, always installed)
#:   module       top-level module that must be importable (checked with find_spec, without importing)
#:   min_version  oldest usable version; lemonkit's own requirement for the extra wins when installed
#:   extra        lemonkit extra that installs it, for the action text
#:   requirement  what ``POST /v1/install`` asks pip for (default: lemonkit's own requirement for the
#:                distribution in ``extra``, else ``distribution>=min_version``, else the distribution)
#:   pip_args     extra ``pip install`` arguments (``--extra-index-url ...``, ``--find-links DIR``)
#:   build        a llama.cpp backend lemonkit compiles (lemonkit.catalog.llamacpp_builds): its state is that of the
#:   build
#:                installed apart under the cache (for "cpu": lemonkit's own first)
#:   serves       deployment labels lemonkit's engine for the recipe serves, when fewer than the recipe's
#:                (``onnxruntime``: embeddings, not classification); models of the others are unsupported
DEFAULT_RECIPES: dict[str, dict[str, Any]] = {
    # llama.cpp: lemonkit's own CPU build (pip's, with lemonkit[llamacpp]) and the builds /v1/install compiles per
    # backend into the cache (lemonkit.catalog.llamacpp_builds); "build" names the backend whose CMake flags make it
    "llamacpp": {
        "default_backend": "cpu",
        "backends": {
            "cpu": {
                "devices": ["cpu"],
                "distribution": "llama-cpp-python",
                "module": "llama_cpp",
                "min_version": "0.3.36",
                "extra": "llamacpp",
                "build": "cpu",
            },
            "vulkan": {"devices": ["vulkan"], "build": "vulkan", "missing": "No Vulkan GPU found."},
            "cuda": {"devices": ["nvidia_gpu"], "build": "cuda", "missing": "No NVIDIA GPU found."},
            "rocm": {"devices": ["amd_gpu"], "build": "rocm", "missing": "No AMD GPU found."},
            "metal": {"devices": ["metal"], "os": "Darwin", "build": "metal", "missing": "Requires macOS"},
        },
    },
    "onnxruntime": {
        "default_backend": "cpu",
        "backends": {
            "cpu": {
                "devices": ["cpu"],
                "distribution": "onnxruntime",
                "module": "onnxruntime",
                "min_version": "1.17",
                "extra": "embeddings",
                "serves": ["embeddings"],
            },
        },
    },
    # speech-to-text and text-to-speech: one engine each, all on the CPU (CTranslate2 and ONNX Runtime)
    "faster-whisper": {
        "default_backend": "cpu",
        "backends": {
            "cpu": {
                "devices": ["cpu"],
                "distribution": "faster-whisper",
                "module": "faster_whisper",
                "min_version": "1.2.1",
                "extra": "audio",
            },
        },
    },
    "piper": {
        "default_backend": "cpu",
        "backends": {
            "cpu": {
                "devices": ["cpu"],
                "distribution": "piper-tts",
                "module": "piper",
                "min_version": "1.8.0",
                "extra": "audio",
            },
        },
    },
    "kokoro": {
        "default_backend": "cpu",
        "backends": {
            "cpu": {
                "devices": ["cpu"],
                "distribution": "kokoro-onnx",
                "module": "kokoro_onnx",
                "min_version": "0.6.1",
                "extra": "audio",
            },
        },
    },
    "hibari": {
        "default_backend": "cpu",
        "backends": {
            "cpu": {
                "devices": ["cpu"],
                "distribution": "hibari-tts",
                "module": "hibari",
                "min_version": "0.2.1",
                "extra": "audio",
            },
        },
    },
    "diffusers": {
        "default_backend": "cpu",
        "backends": {
            "cpu": {
                "devices": ["cpu"],
                "distribution": "diffusers",
                "module": "diffusers",
                "min_version": "0.42.1",
                "extra": "images",
            },
        },
    },
    # a model another server serves over an OpenAI-compatible API: lemonkit only forwards, nothing to install
    "remote": {"default_backend": "http", "backends": {"http": {}}},
    # image upscaling: Real-ESRGAN networks on ncnn's CPU path (its Vulkan path is never enabled)
    "ncnn": {
        "default_backend": "cpu",
        "backends": {
            "cpu": {
                "devices": ["cpu"],
                "distribution": "ncnn",
                "module": "ncnn",
                "min_version": "1.0.20240410",
                "extra": "upscale",
            },
        },
    },
}

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
        drivers: What the GPU drivers report (:func:`lemonkit.catalog.accelerators.detect`; asked when ``root`` is
        ``/``,
            else none).
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


def _present(kind: str, devices: Mapping[str, Any]) -> bool:
    found = devices.get(kind)
    if kind == "cpu":
        return found is not None and bool(found["available"])
    if isinstance(found, list):
        return any(d.get("available", True) for d in found)
    return bool(found)


def gpu_archs(backend: str, devices: Mapping[str, Any]) -> list[str]:
    """The architectures a ``backend`` build compiles for: those of the GPUs present (CUDA ``89``, ROCm
    ``gfx1100``)."""
    kind = {"cuda": "nvidia_gpu", "rocm": "amd_gpu"}.get(backend)
    families = [g.get("family") for g in devices.get(kind or "", [])]
    if backend == "cuda":
        return sorted({f.removeprefix("sm_") for f in families if f})
    return sorted({f for f in families if f})


def _vtuple(version: str) -> tuple[int, ...]:
    """Leading numeric release parts: ``"0.3.16.post1"`` -> ``(0, 3, 16)``."""
    parts = []
    for piece in version.split("."):
        m = re.match(r"\d+", piece)
        if not m:
            break
        parts.append(int(m.group()))
        if m.end() != len(piece):
            break
    return tuple(parts)


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _required_min(distribution: str, extra: str | None) -> str | None:
    """The lower bound (``>=``, ``==``, ``~=``) lemonkit's installed metadata puts on ``distribution`` for ``extra``."""
    try:
        reqs = importlib.metadata.requires("lemonkit") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    want = _norm(distribution)
    for req in reqs:
        spec, _, marker = req.partition(";")
        m = re.match(r"\s*([A-Za-z0-9._-]+)\s*(?:\[[^\]]*\])?\s*(.*)", spec)
        if not m or _norm(m.group(1)) != want:
            continue
        in_extra = re.search(r"extra\s*==\s*['\"]([^'\"]+)['\"]", marker)
        if in_extra and in_extra.group(1) != extra:
            continue
        bound = re.search(r"(?:>=|==|~=)\s*([0-9][^,\s]*)", m.group(2))  # a pin is the oldest usable too
        if bound:
            return bound.group(1)
    return None


def _lemonkit_requirement(distribution: str, extra: str | None) -> str | None:
    """lemonkit's own requirement string (no marker) for ``distribution`` in ``extra``, e.g. ``x==1.2``."""
    try:
        reqs = importlib.metadata.requires("lemonkit") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for req in reqs:
        spec, _, marker = req.partition(";")
        m = re.match(r"\s*([A-Za-z0-9._-]+)", spec)
        in_extra = re.search(r"extra\s*==\s*['\"]([^'\"]+)['\"]", marker)
        if m and _norm(m.group(1)) == _norm(distribution) and (in_extra.group(1) if in_extra else None) == extra:
            return spec.strip()
    return None


def lemonkit_requires(distribution: str) -> bool:
    """Whether lemonkit's own installed metadata asks for ``distribution`` (in any extra): a package of the
    server's own installation, which no API call may remove."""
    try:
        reqs = importlib.metadata.requires("lemonkit") or []
    except importlib.metadata.PackageNotFoundError:
        return False
    names = {_norm(m.group(1)) for req in reqs if (m := re.match(r"\s*([A-Za-z0-9._-]+)", req))}
    return _norm(distribution) in names


def install_requirement(spec: Mapping[str, Any]) -> str:
    """The pip requirement that installs (or updates) a backend to the version lemonkit wants.

    Raises:
        ValueError: The backend has no ``distribution`` (it is part of lemonkit).
    """
    dist = spec.get("distribution")
    if not dist:
        raise ValueError("the backend has no distribution to install")
    if spec.get("requirement"):
        return str(spec["requirement"])
    own = _lemonkit_requirement(dist, spec.get("extra"))
    if own:
        return own
    return f"{dist}>={spec['min_version']}" if spec.get("min_version") else str(dist)


def refresh_installed() -> None:
    """Forget what import and metadata lookups cached about installed packages (after pip changed them)."""
    importlib.invalidate_caches()
    # Python < 3.12's PathFinder does not reach the metadata finder's path cache (nor is its method a classmethod)
    importlib.metadata.MetadataPathFinder().invalidate_caches()


def load_recipes(path: str | os.PathLike[str] | None = None) -> dict[str, dict[str, Any]]:
    """:data:`DEFAULT_RECIPES` with the operator's JSON file at ``path`` merged over it.

    The file has the same shape. A recipe or backend it names that is not in the defaults is added; for
    one that is, its ``default_backend`` and each backend field it gives replace the default's (``null``
    removes a field).

    Raises:
        ValueError: The file is unreadable or not shaped like the table.
    """
    recipes = copy.deepcopy(DEFAULT_RECIPES)
    if not path:
        return recipes
    try:
        with open(path, encoding="utf-8") as f:
            extra = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"recipes file {path}: {exc}") from None
    if not isinstance(extra, dict):
        raise ValueError(f"recipes file {path}: expected a JSON object of recipes")
    for name, table in extra.items():
        backends = table.get("backends", {}) if isinstance(table, dict) else None
        if not isinstance(backends, dict) or not all(isinstance(b, dict) for b in backends.values()):
            raise ValueError(f"recipes file {path}: {name}: expected {{'backends': {{name: {{...}}}}}}")
        target = recipes.setdefault(name, {"backends": {}})
        if table.get("default_backend"):
            target["default_backend"] = table["default_backend"]
        for backend, fields in backends.items():
            args = fields.get("pip_args")
            if args is not None and not (isinstance(args, list) and all(isinstance(a, str) for a in args)):
                raise ValueError(f"recipes file {path}: {name}.{backend}.pip_args: expected a list of strings")
            merged = {**target["backends"].get(backend, {}), **fields}
            target["backends"][backend] = {k: v for k, v in merged.items() if v is not None}
    return recipes


def install_action(recipe: str, backend: str, *, force: bool = False) -> str:
    """What ``action`` says for a backend lemonkit builds: the request that installs it."""
    body = {"recipe": recipe, "backend": backend, **({"force": True} if force else {})}
    return f"POST /v1/install {json.dumps(body)}"


def wanted_llamacpp() -> str | None:
    """The llama-cpp-python release every build is made of: lemonkit's own requirement, else the one installed."""
    return _required_min(llamacpp_builds.DISTRIBUTION, "llamacpp") or llamacpp_builds.own_version()


def backend_status(
    spec: Mapping[str, Any],
    devices: Mapping[str, Any],
    *,
    cache_dir: Path | None = None,
    environ: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """One backend's ``{"devices", "state", "message", "action"[, "version"]}`` on this machine.

    Args:
        spec: Its row of the recipe table.
        devices: :func:`detect_devices`.
        cache_dir: Where builds of llama.cpp backends live (rows with ``build``); ``None``: none are looked for.
        environ: Where a build's prerequisites are looked up (default: this process's environment).
    """
    system_ok = spec.get("os") is None or platform.system() == spec["os"]
    present = [kind for kind in spec.get("devices", []) if _present(kind, devices)]
    if not system_ok or (spec.get("devices") and not present):
        message = spec.get("missing", "No supported device found.")
        if "vulkan" in spec.get("devices", []) and devices.get("vulkan"):
            names = ", ".join(f"{d['name']} ({d['type']})" for d in devices["vulkan"])
            message = (
                f"{message} The Vulkan devices, {names}, are not ones ggml uses by default: a CPU-type device is "
                "slower than the CPU build. Set GGML_VK_VISIBLE_DEVICES (0 for the first) to use one."
            )
        return {"devices": [], "state": "unsupported", "message": message, "action": ""}
    if spec.get("unsupported"):
        return {"devices": [], "state": "unsupported", "message": spec["unsupported"], "action": ""}
    build = spec.get("build")
    if build and build != "cpu":
        return _build_status(str(build), spec, present, devices, cache_dir, environ)
    dist = spec.get("distribution")
    if dist is None:
        return {"devices": present, "state": "installed", "message": "", "action": ""}
    extra = spec.get("extra")
    target = f"'lemonkit[{extra}]'" if extra else dist
    try:
        version = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        version = None
    module = spec.get("module")
    if version is None or (module and importlib.util.find_spec(module) is None):
        if build == "cpu":  # not in lemonkit's own environment: a build /v1/install made apart counts
            return _build_status("cpu", spec, present, devices, cache_dir, environ, own_action=f"pip install {target}")
        return {
            "devices": present,
            "state": "installable",
            "message": "Backend is supported but not installed.",
            "action": f"pip install {target}",
        }
    required = _required_min(dist, extra) or spec.get("min_version")
    if required and _vtuple(version) < _vtuple(required):
        return {
            "devices": present,
            "state": "update_required",
            "message": f"Backend update is required before use ({dist} {version} < {required}).",
            "action": f"pip install -U {target}",
            "version": version,
        }
    return {"devices": present, "state": "installed", "message": "", "action": "", "version": version}


def _build_status(
    backend: str,
    spec: Mapping[str, Any],
    present: list[str],
    devices: Mapping[str, Any],
    cache_dir: Path | None,
    environ: Mapping[str, str] | None,
    *,
    own_action: str | None = None,
) -> dict[str, Any]:
    """The state of a llama.cpp build installed apart under ``cache_dir``."""
    wanted = wanted_llamacpp() or spec.get("min_version")
    build = llamacpp_builds.installed(cache_dir, backend) if cache_dir is not None else None
    if build is not None and (wanted is None or build.version == wanted):
        return {"devices": present, "state": "installed", "message": "", "action": "", "version": build.version}
    if build is not None:
        return {
            "devices": present,
            "state": "update_required",
            "message": f"Backend update is required before use (built from {llamacpp_builds.DISTRIBUTION} "
            f"{build.version}, lemonkit runs {wanted}).",
            "action": install_action("llamacpp", backend),
            "version": build.version,
        }
    plan = llamacpp_builds.plan(backend, environ=environ, gpu_archs=gpu_archs(backend, devices))
    message = "Backend is supported but not installed."
    action = own_action or install_action("llamacpp", backend)
    if plan.missing and own_action is None:
        message += " Building it needs: " + "; ".join(str(m) for m in plan.missing) + "."
        action = plan.missing[0].install
    return {"devices": present, "state": "installable", "message": message, "action": action}


def _memory(root: Path) -> str:
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


def default_llamacpp_backend(backends: Mapping[str, Mapping[str, Any]]) -> str:
    """The best installed llama.cpp backend for this machine's devices: a GPU build whose devices are present
    (CUDA, ROCm, Metal, then Vulkan), else the CPU build. A Vulkan device counts only where ggml uses it, and a
    CPU-type one (lavapipe) is never chosen here, however the operator opted in: it is slower than the CPU."""
    for name in llamacpp_builds.GPU_BACKENDS:
        status = backends.get(name) or {}
        if status.get("state") == "installed" and status.get("devices") and status.get("gpu", True):
            return name
    return "cpu"


def llamacpp_backends(
    recipes: Mapping[str, Mapping[str, Any]], cache_dir: Path | None
) -> tuple[dict[str, dict[str, Any]], str]:
    """Each llama.cpp backend's status on this machine, and the default (see :func:`default_llamacpp_backend`)."""
    devices = detect_devices()
    table = recipes.get("llamacpp", {})
    backends = {n: backend_status(spec, devices, cache_dir=cache_dir) for n, spec in table.get("backends", {}).items()}
    return backends, default_llamacpp_backend({n: {**b, "gpu": _gpu_devices(n, devices)} for n, b in backends.items()})


def system_info(
    recipes: Mapping[str, Mapping[str, Any]] | None = None,
    *,
    root: Path = Path("/"),
    cache_dir: Path | None = None,
    drivers: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``GET /v1/system-info`` body for this machine.

    Args:
        recipes: Recipe table in the :data:`DEFAULT_RECIPES` format (default: that table).
        root: Filesystem root for ``proc/``/``sys/`` (tests only).
        cache_dir: Where llama.cpp builds live (``Settings.cache_dir``).
        drivers: What the GPU drivers report (default: asked, see :func:`detect_devices`).

    The Windows-only fields of the spec (OEM System, BIOS Version, ...) are left out.
    """
    devices = detect_devices(root, drivers)
    out_recipes: dict[str, Any] = {}
    for recipe, table in (DEFAULT_RECIPES if recipes is None else recipes).items():
        backends = {
            name: backend_status(spec, devices, cache_dir=cache_dir) for name, spec in table.get("backends", {}).items()
        }
        entry: dict[str, Any] = {}
        usable = [name for name, b in backends.items() if b["state"] != "unsupported"]
        if usable:  # spec: present when at least one backend is not unsupported
            default = table.get("default_backend")
            if recipe == "llamacpp":
                gpu = {n: {**b, "gpu": _gpu_devices(n, devices)} for n, b in backends.items()}
                default = default_llamacpp_backend(gpu) if default == "cpu" else default
            entry["default_backend"] = default if default in usable else usable[0]
        entry["backends"] = backends
        out_recipes[recipe] = entry
    return {
        "OS Version": platform.platform(),
        "Processor": devices["cpu"]["name"],
        "Physical Memory": _memory(root),
        "devices": devices,
        "recipes": out_recipes,
    }


def _gpu_devices(backend: str, devices: Mapping[str, Any]) -> bool:
    """Whether ``backend`` would run on a real GPU here (not only a CPU-type Vulkan device)."""
    if backend == "vulkan":
        return any(d.get("available") and d.get("type") != "cpu" for d in devices.get("vulkan", []))
    return True
