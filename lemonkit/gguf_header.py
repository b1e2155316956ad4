"""What a GGUF file's header says, read without loading the model.

``gguf.GGUFReader`` parses every array (a 262k-token vocabulary takes it ~10 s), which neither a model
listing nor an engine load can afford: these helpers stream the key/value section and stop at the answer.
"""

from __future__ import annotations

import os
import struct
import threading
from collections.abc import Iterator
from typing import Any, BinaryIO

__all__ = ["gguf_has_key", "read_gguf_context_length"]

_context_cache: dict[tuple[str, int, int], int | None] = {}
_context_lock = threading.Lock()


def read_gguf_context_length(path: str | os.PathLike[str]) -> int | None:
    """``<arch>.context_length`` from a GGUF header, cached per path, mtime and size.

    Only the key/value section is streamed, stopping at the answer: ``gguf.GGUFReader`` parses every array
    (a 262k-token vocabulary takes it ~10 s), which a model listing cannot afford.

    Args:
        path: A GGUF file.

    Returns:
        The training context length, or ``None`` when the file is unreadable or does not say.
    """
    try:
        stat = os.stat(path)
    except OSError:
        return None
    key = (os.fspath(path), stat.st_mtime_ns, stat.st_size)
    with _context_lock:
        if key in _context_cache:
            return _context_cache[key]
    try:
        with open(path, "rb", buffering=1 << 16) as f:
            value = _scan_context_length(f)
    except (OSError, ValueError, struct.error, KeyError):
        value = None
    with _context_lock:
        if len(_context_cache) > 1024:
            _context_cache.clear()
        _context_cache[key] = value
    return value


class _Scanner:
    """Reads a GGUF header's key/value section from a file object, value by value."""

    def __init__(self, f: BinaryIO) -> None:
        from gguf.constants import GGUFValueType  # lazy: importing gguf costs ~0.1 s

        self.f = f
        self.types = GGUFValueType
        self.scalar = {
            GGUFValueType.UINT8: "<B",
            GGUFValueType.INT8: "<b",
            GGUFValueType.UINT16: "<H",
            GGUFValueType.INT16: "<h",
            GGUFValueType.UINT32: "<I",
            GGUFValueType.INT32: "<i",
            GGUFValueType.FLOAT32: "<f",
            GGUFValueType.BOOL: "<?",
            GGUFValueType.UINT64: "<Q",
            GGUFValueType.INT64: "<q",
            GGUFValueType.FLOAT64: "<d",
        }

    def read(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        data = self.f.read(size)
        if len(data) != size:
            raise ValueError("truncated GGUF")
        return struct.unpack(fmt, data)[0]

    def read_str(self) -> str:
        length = self.read("<Q")
        if length > 1 << 20:
            raise ValueError("implausible GGUF string")
        return self.f.read(length).decode("utf-8", "replace")

    def skip(self, vtype: Any) -> None:
        if vtype == self.types.STRING:
            self.f.seek(self.read("<Q"), os.SEEK_CUR)
        elif vtype == self.types.ARRAY:
            item, count = self.types(self.read("<I")), self.read("<Q")
            if item in self.scalar:
                self.f.seek(count * struct.calcsize(self.scalar[item]), os.SEEK_CUR)
            else:
                for _ in range(count):
                    self.skip(item)
        else:
            self.f.seek(struct.calcsize(self.scalar[vtype]), os.SEEK_CUR)

    def keys(self) -> Iterator[tuple[str, Any]]:
        """``(name, value type)`` per key; the caller reads the value or :meth:`skip` s it before the next."""
        from gguf.constants import GGUF_MAGIC

        if self.read("<I") != GGUF_MAGIC or self.read("<I") < 2:  # v1 used 32-bit counts; no current model is v1
            return
        self.read("<Q")  # tensor count
        for _ in range(self.read("<Q")):
            name = self.read_str()
            yield name, self.types(self.read("<I"))


def _scan_context_length(f: BinaryIO) -> int | None:
    scan = _Scanner(f)
    arch: str | None = None
    lengths: dict[str, int] = {}
    for name, vtype in scan.keys():
        if name == "general.architecture" and vtype == scan.types.STRING:
            arch = scan.read_str()
        elif name.endswith(".context_length") and vtype in scan.scalar and vtype != scan.types.BOOL:
            lengths[name] = int(scan.read(scan.scalar[vtype]))
        else:
            scan.skip(vtype)
        if arch is not None and f"{arch}.context_length" in lengths:
            break
    return lengths.get(f"{arch}.context_length") if arch else None


def gguf_has_key(path: str | os.PathLike[str], key: str) -> bool:
    """Whether a GGUF header has ``key`` (``tokenizer.chat_template``: an instruct model); ``False`` when unreadable.

    Args:
        path: A GGUF file.
        key: The metadata key.
    """
    try:
        with open(path, "rb", buffering=1 << 16) as f:
            scan = _Scanner(f)
            for name, vtype in scan.keys():
                if name == key:
                    return True
                scan.skip(vtype)
    except (OSError, ValueError, struct.error, KeyError):
        pass
    return False
