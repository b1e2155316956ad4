"""What a GGUF file's header says, read without loading the model.

``gguf.GGUFReader`` parses every array (a 262k-token vocabulary takes it ~10 s), which neither a model
listing nor an engine load can afford: these helpers stream the key/value section and stop at the answer.
"""

from __future__ import annotations

import os
import struct
import threading
from typing import Any, BinaryIO

__all__ = ["read_gguf_context_length"]

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


def _scan_context_length(f: BinaryIO) -> int | None:
    from gguf.constants import GGUF_MAGIC, GGUFValueType  # lazy: importing gguf costs ~0.1 s

    scalar = {
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

    def read(fmt: str) -> Any:
        size = struct.calcsize(fmt)
        data = f.read(size)
        if len(data) != size:
            raise ValueError("truncated GGUF")
        return struct.unpack(fmt, data)[0]

    def read_str() -> str:
        length = read("<Q")
        if length > 1 << 20:
            raise ValueError("implausible GGUF string")
        return f.read(length).decode("utf-8", "replace")

    def skip(vtype: GGUFValueType) -> None:
        if vtype == GGUFValueType.STRING:
            f.seek(read("<Q"), os.SEEK_CUR)
        elif vtype == GGUFValueType.ARRAY:
            item, count = GGUFValueType(read("<I")), read("<Q")
            if item in scalar:
                f.seek(count * struct.calcsize(scalar[item]), os.SEEK_CUR)
            else:
                for _ in range(count):
                    skip(item)
        else:
            f.seek(struct.calcsize(scalar[vtype]), os.SEEK_CUR)

    if read("<I") != GGUF_MAGIC or read("<I") < 2:  # v1 used 32-bit counts; no current model is v1
        return None
    read("<Q")  # tensor count
    arch: str | None = None
    lengths: dict[str, int] = {}
    for _ in range(read("<Q")):
        name = read_str()
        vtype = GGUFValueType(read("<I"))
        if name == "general.architecture" and vtype == GGUFValueType.STRING:
            arch = read_str()
        elif name.endswith(".context_length") and vtype in scalar and vtype != GGUFValueType.BOOL:
            lengths[name] = int(read(scalar[vtype]))
        else:
            skip(vtype)
        if arch is not None and f"{arch}.context_length" in lengths:
            break
    return lengths.get(f"{arch}.context_length") if arch else None
