"""``GET /v1/system-info``: this machine's hardware and which recipe backends can run on it.

Everything is read from ``/proc``, ``/sys`` and package metadata (:mod:`lemonkit.catalog.hardware` finds the
devices): no engine is imported (importing llama_cpp loads a large shared library), so a call costs a few
milliseconds. The server calls it off the event loop all the same. The recipes and their backends are data
(:mod:`lemonkit.catalog.recipe_table`); here is each backend's state on this machine (:func:`backend_status`)
and the versions lemonkit's own metadata asks for.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
import platform
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lemonkit.catalog import llamacpp_builds
from lemonkit.catalog.hardware import detect_devices, gpu_archs, physical_memory
from lemonkit.catalog.recipe_table import DEFAULT_RECIPES

__all__ = [
    "backend_status",
    "default_llamacpp_backend",
    "install_action",
    "install_requirement",
    "lemonkit_requires",
    "llamacpp_backends",
    "refresh_installed",
    "system_info",
    "wanted_llamacpp",
]


def _present(kind: str, devices: Mapping[str, Any]) -> bool:
    found = devices.get(kind)
    if kind == "cpu":
        return found is not None and bool(found["available"])
    if isinstance(found, list):
        return any(d.get("available", True) for d in found)
    return bool(found)


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


def _own_requirements() -> list[tuple[str, str, str | None]]:
    """lemonkit's own requirements, from its installed metadata: ``(normalised name, requirement without its
    marker, the extra it belongs to or None)`` each; none when lemonkit has no metadata."""
    try:
        reqs = importlib.metadata.requires("lemonkit") or []
    except importlib.metadata.PackageNotFoundError:
        return []
    found = []
    for req in reqs:
        spec, _, marker = req.partition(";")
        m = re.match(r"\s*([A-Za-z0-9._-]+)", spec)
        in_extra = re.search(r"extra\s*==\s*['\"]([^'\"]+)['\"]", marker)
        if m:
            found.append((_norm(m.group(1)), spec.strip(), in_extra.group(1) if in_extra else None))
    return found


def _required_min(distribution: str, extra: str | None) -> str | None:
    """The lower bound (``>=``, ``==``, ``~=``) lemonkit's installed metadata puts on ``distribution`` for ``extra``
    (a requirement of no extra counts for every one)."""
    for name, spec, in_extra in _own_requirements():
        if name != _norm(distribution) or (in_extra is not None and in_extra != extra):
            continue
        bound = re.search(r"(?:>=|==|~=)\s*([0-9][^,\s]*)", spec)  # a pin is the oldest usable too
        if bound:
            return bound.group(1)
    return None


def _lemonkit_requirement(distribution: str, extra: str | None) -> str | None:
    """lemonkit's own requirement string (no marker) for ``distribution`` in ``extra``, e.g. ``x==1.2``."""
    return next(
        (spec for name, spec, in_extra in _own_requirements() if name == _norm(distribution) and in_extra == extra),
        None,
    )


def lemonkit_requires(distribution: str) -> bool:
    """Whether lemonkit's own installed metadata asks for ``distribution`` (in any extra): a package of the
    server's own installation, which no API call may remove."""
    return _norm(distribution) in {name for name, _, _ in _own_requirements()}


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
        devices: :func:`lemonkit.catalog.hardware.detect_devices`.
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
        recipes: Recipe table in the format of :data:`lemonkit.catalog.recipe_table.DEFAULT_RECIPES` (default:
            that table).
        root: Filesystem root for ``proc/``/``sys/`` (tests only).
        cache_dir: Where llama.cpp builds live (``Settings.cache_dir``).
        drivers: What the GPU drivers report (default: asked, see :func:`lemonkit.catalog.hardware.detect_devices`).

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
        "Physical Memory": physical_memory(root),
        "devices": devices,
        "recipes": out_recipes,
    }


def _gpu_devices(backend: str, devices: Mapping[str, Any]) -> bool:
    """Whether ``backend`` would run on a real GPU here (not only a CPU-type Vulkan device)."""
    if backend == "vulkan":
        return any(d.get("available") and d.get("type") != "cpu" for d in devices.get("vulkan", []))
    return True
