"""What a GGUF file's header says, read without loading the model.

``gguf.GGUFReader`` parses every array (a 262k-token vocabulary takes it ~10 s), which neither a model
listing nor an engine load can afford: these helpers stream the key/value section and stop at the answer.
"""

from __future__ import annotations

import os
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

__all__ = ["Layout", "gguf_has_key", "read_gguf_context_length", "read_gguf_layout", "read_gguf_metadata"]

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


def read_gguf_metadata(path: str | os.PathLike[str], *, max_string: int = 1 << 20) -> dict[str, Any]:
    """A GGUF header's key/value section: numbers, booleans and strings as they are (``tokenizer.chat_template``
    included), each array as an empty list (a vocabulary is megabytes; what Ollama's ``/api/show`` does unless
    asked to be verbose); ``{}`` when the file is unreadable.

    Args:
        path: A GGUF file.
        max_string: Longer strings are left out.
    """
    found: dict[str, Any] = {}
    try:
        with open(path, "rb", buffering=1 << 16) as f:
            scan = _Scanner(f)
            for name, vtype in scan.keys():
                if vtype in scan.scalar:
                    value = scan.read(scan.scalar[vtype])
                    found[name] = bool(value) if vtype == scan.types.BOOL else value
                elif vtype == scan.types.STRING:
                    length = scan.read("<Q")
                    if length <= max_string:
                        found[name] = f.read(length).decode("utf-8", "replace")
                    else:
                        f.seek(length, os.SEEK_CUR)
                else:
                    scan.skip(vtype)
                    found[name] = []
    except (OSError, ValueError, struct.error, KeyError):
        return {}
    return found


@dataclass(frozen=True)
class Layout:
    """What a GGUF model needs in memory, from its header: weights by tensor and the shape of its KV cache.

    Attributes:
        arch: ``general.architecture``.
        n_layer: Repeating blocks (``<arch>.block_count``).
        layer_bytes: Bytes of each block's tensors (``blk.<i>.*``), by block.
        other_bytes: Bytes of the rest: ``token_embd`` (kept on the CPU by llama.cpp), ``output``, norms.
        output_bytes: Bytes of ``output.*`` (the output layer, offloaded with the last "layer").
        kv_width: Per block, the K plus V values one cached token holds (``n_head_kv * (key_length +
            value_length)``; none in a recurrent block).
        n_embd: ``<arch>.embedding_length``.
        n_vocab: Tokens in the vocabulary.
        state_width: Per block, the values of a sequence's recurrent state (convolution and SSM states, as
            llama.cpp sizes them: Mamba, Qwen3.5's delta-net, LFM2's convolutions, RWKV); zero in attention blocks,
            empty for a model without recurrent layers.
        n_nextn: Of the blocks, the last ones that are MTP (next-n) layers (``<arch>.nextn_predict_layers``).
    """

    arch: str
    n_layer: int
    layer_bytes: tuple[int, ...]
    other_bytes: int
    output_bytes: int
    kv_width: tuple[int, ...]
    n_embd: int
    n_vocab: int
    state_width: tuple[int, ...] = ()
    n_nextn: int = 0

    @property
    def weight_bytes(self) -> int:
        return sum(self.layer_bytes) + self.other_bytes


def read_gguf_layout(path: str | os.PathLike[str]) -> Layout | None:
    """The :class:`Layout` of a GGUF file, or ``None`` when it is unreadable or lacks the keys (not an LLM).

    Reads the key/value section and the tensor table, never the tensors: a few milliseconds for any model size.
    """
    try:
        size = os.path.getsize(path)
        with open(path, "rb", buffering=1 << 16) as f:
            return _scan_layout(f, size)
    except (OSError, ValueError, struct.error, KeyError):
        return None


def _scan_layout(f: BinaryIO, file_size: int) -> Layout | None:
    scan = _Scanner(f)
    values: dict[str, Any] = {}
    n_vocab = 0
    for name, vtype in scan.keys():
        if vtype == scan.types.STRING and name == "general.architecture":
            values[name] = scan.read_str()
        elif vtype in scan.scalar:
            values[name] = scan.read(scan.scalar[vtype])
        elif vtype == scan.types.ARRAY and name.endswith(_LAYER_ARRAYS):
            item, count = scan.types(scan.read("<I")), scan.read("<Q")
            values[name] = [scan.read(scan.scalar[item]) for _ in range(count)]
        elif vtype == scan.types.ARRAY and name == "tokenizer.ggml.tokens":
            item, n_vocab = scan.types(scan.read("<I")), scan.read("<Q")
            for _ in range(n_vocab):
                scan.skip(item)
        else:
            scan.skip(vtype)
    arch = values.get("general.architecture")
    if not arch or f"{arch}.block_count" not in values:
        return None
    f.seek(8)  # magic, version
    n_tensors = scan.read("<Q")
    f.seek(0)
    for _name, vtype in scan.keys():  # again, to reach the tensor table after the keys
        scan.skip(vtype)
    tensors: list[tuple[str, int]] = []
    for _ in range(n_tensors):
        name = scan.read_str()
        dims = scan.read("<I")
        f.seek(8 * dims + 4, os.SEEK_CUR)  # the shape and the type: sizes come from the offsets
        tensors.append((name, scan.read("<Q")))
    alignment = int(values.get("general.alignment", 32))
    data_start = -(-f.tell() // alignment) * alignment
    n_layer = int(values[f"{arch}.block_count"])
    layer_bytes = [0] * n_layer
    other = output = 0
    ordered = sorted(tensors, key=lambda t: t[1])
    for i, (name, offset) in enumerate(ordered):
        end = ordered[i + 1][1] if i + 1 < len(ordered) else file_size - data_start
        nbytes = end - offset
        if name.startswith("blk."):
            block = int(name.split(".", 2)[1])
            if block < n_layer:
                layer_bytes[block] += nbytes
                continue
        other += nbytes
        if name.startswith("output."):
            output += nbytes
    n_head = int(values.get(f"{arch}.attention.head_count", 0) or 0)
    n_embd = int(values.get(f"{arch}.embedding_length", 0) or 0)
    heads_kv = values.get(f"{arch}.attention.head_count_kv", n_head)
    per_layer_kv = list(heads_kv) if isinstance(heads_kv, list) else [int(heads_kv)] * n_layer
    head_dim = n_embd // n_head if n_head else 0
    k = int(values.get(f"{arch}.attention.key_length", head_dim))
    v = int(values.get(f"{arch}.attention.value_length", head_dim))
    # Gemma 4: sliding-window layers with heads of their own width, marked in a per-layer pattern
    pattern = values.get(f"{arch}.attention.sliding_window_pattern")
    swa = [bool(x) for x in pattern] if isinstance(pattern, list) else []
    k_swa = int(values.get(f"{arch}.attention.key_length_swa", k))
    v_swa = int(values.get(f"{arch}.attention.value_length_swa", v))
    # Gemma 3n and 4's last layers reuse an earlier layer's cache and keep none of their own
    own = n_layer - int(values.get(f"{arch}.attention.shared_kv_layers", 0) or 0)
    state = _state_width(arch, values, n_layer, per_layer_kv)
    kv_width = tuple(
        0 if (state and state[i]) or i >= own else int(h) * ((k_swa + v_swa) if i < len(swa) and swa[i] else (k + v))
        for i, h in enumerate((per_layer_kv + [0] * n_layer)[:n_layer])
    )
    n_nextn = int(values.get(f"{arch}.nextn_predict_layers", 0) or 0)
    return Layout(arch, n_layer, tuple(layer_bytes), other, output, kv_width, n_embd, n_vocab, state, n_nextn)


#: per-layer arrays the layout reads (the others are skipped)
_LAYER_ARRAYS = (
    ".attention.head_count_kv",
    ".feed_forward_length",
    ".attention.recurrent_layers",
    ".attention.sliding_window_pattern",
)


def _state_width(arch: str, values: dict[str, Any], n_layer: int, heads_kv: list[int]) -> tuple[int, ...]:
    """:attr:`Layout.state_width` from the header's keys, as llama.cpp's ``n_embd_r() + n_embd_s()`` and its
    recurrent layers (``is_recr``) for the families it has."""

    def key(name: str, default: int = 0) -> int:
        return int(values.get(f"{arch}.{name}", default) or 0)

    n_embd = key("embedding_length")
    d_conv, d_inner, d_state, n_group = (
        key(f"ssm.{k}") for k in ("conv_kernel", "inner_size", "state_size", "group_count")
    )
    l_cache, wkv = key("shortconv.l_cache"), key("wkv.head_size")
    if l_cache:  # LFM2: short convolutions wherever a layer has no attention heads
        width, recurrent = n_embd * (l_cache - 1), [h == 0 for h in heads_kv]
    elif wkv:  # RWKV: token shifts and the WKV state in every layer
        width, recurrent = key("token_shift_count", 2) * n_embd + n_embd * wkv, [True] * n_layer
    elif d_inner:  # Mamba 1 and 2, gated delta-net: the convolution's last d_conv - 1 inputs and the SSM state
        width = max(0, d_conv - 1) * (d_inner + 2 * n_group * d_state) + d_state * d_inner
        marked = values.get(f"{arch}.attention.recurrent_layers")
        trunk = n_layer - key("nextn_predict_layers")
        if isinstance(marked, list):
            recurrent = [bool(m) for m in marked]
        elif f"{arch}.full_attention_interval" in values or arch.startswith(("qwen35", "qwen3next")):
            interval = key("full_attention_interval", 4)
            recurrent = [i < trunk and (i + 1) % interval != 0 for i in range(n_layer)]
        elif len(set(heads_kv)) > 1:  # hybrids that list heads per layer: Mamba where a layer has none
            ff = values.get(f"{arch}.feed_forward_length")
            # Nemotron-H has FFN-only layers too, without heads
            ffn = ff if arch.startswith("nemotron_h") and isinstance(ff, list) else [0] * len(heads_kv)
            recurrent = [h == 0 and not ffn[i] for i, h in enumerate(heads_kv)]
        else:
            recurrent = [True] * n_layer
    else:
        return ()
    return tuple(width if i < len(recurrent) and recurrent[i] else 0 for i in range(n_layer))
