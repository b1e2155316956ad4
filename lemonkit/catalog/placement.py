"""How much memory a model takes: a llama.cpp model's device memory and how many of its layers fit in a budget,
and any sidecar's host memory.

Estimated from the GGUF header (:func:`lemonkit.formats.gguf_header.read_gguf_layout`) the way llama.cpp places a model:
``-ngl N`` puts the last ``N`` repeating blocks on the GPU, and ``N`` above the block count the output layer too;
the input embedding stays on the CPU. A block offloaded carries its weights and, unless ``--no-kv-offload``, its
KV cache (``n_ctx`` tokens of K and V); a GPU that computes the output layer also holds a compute buffer with one
ubatch of logits. The server uses the same figures to decide what to evict before a load, the engine to choose
``-ngl auto``, so the two agree.

Host memory (:func:`host_estimate`) is what a model's sidecar holds in RAM: its interpreter and engine libraries,
the weights it reads (a file mapped by llama.cpp is read in full as it runs), and on the CPU the KV cache and
compute buffers. The manager counts loaded models by these figures against ``LEMONKIT_MEMORY`` or the machine's
memory, and checks what the system has free.
"""

from __future__ import annotations

from dataclasses import dataclass

from lemonkit.formats.gguf_header import Layout

__all__ = [
    "PROCESS_BYTES",
    "Estimate",
    "MiB",
    "context_limit",
    "estimate",
    "fit_layers",
    "host_estimate",
    "parse_size",
]

MiB = 1024 * 1024
#: ggml's per-backend work buffers, scheduler copies and driver overhead beside the graph's own tensors
_OVERHEAD = 256 * MiB
#: a sidecar before its weights: Python, numpy and the engine's libraries. Measured, RSS with the weights: 75-85 MiB
#: for llama.cpp with a tiny model, 165-250 MiB for Piper, MiniLM (onnxruntime) and Whisper tiny (faster-whisper);
#: the estimates came out 1.1-3x those (a KV cache is reserved, not yet touched). torch's sidecars take more,
#: which the check of the system's available memory sees
PROCESS_BYTES = 256 * MiB
#: rows of logits a CPU model's step keeps (its batch's outputs: the slots, 4 by default, with room)
_HOST_OUTPUTS = 8
#: bytes per cached value by KV type name (llama.cpp's -ctk/-ctv), q-types with their block scales
_KV_BYTES = {0: 4.0, 1: 2.0, 30: 2.0, 8: 34 / 32, 2: 18 / 32, 3: 20 / 32, 6: 22 / 32, 7: 24 / 32, 20: 18 / 32}


@dataclass(frozen=True)
class Estimate:
    """Device bytes of one placement.

    Attributes:
        layers: Layers on the device (blocks, plus one for the output layer when all blocks are).
        weights: Their weights.
        kv: Their KV cache.
        compute: The compute buffer and overhead.
        state: Their recurrent layers' states (a state per sequence, and per token a draft may roll back).
    """

    layers: int
    weights: int
    kv: int
    compute: int
    state: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.compute + self.state

    def describe(self) -> str:
        return (
            f"{self.layers} layers: {self.total / MiB:.0f} MiB ({self.weights / MiB:.0f} weights, "
            f"{self.kv / MiB:.0f} KV cache, {self.compute / MiB:.0f} compute"
            + (f", {self.state / MiB:.0f} recurrent state)" if self.state else ")")
        )


def estimate(
    layout: Layout,
    layers: int,
    *,
    n_ctx: int,
    n_ubatch: int = 512,
    type_k: int = 1,
    type_v: int = 1,
    kv_offload: bool = True,
    overhead: int = _OVERHEAD,
    n_seq: int = 1,
    n_rs_seq: int = 0,
    mtp: bool = False,
) -> Estimate:
    """Device memory with ``layers`` layers offloaded (``layers > n_layer``: every block and the output layer);
    ``n_seq`` sequences, whose recurrent states llama.cpp keeps ``1 + n_rs_seq`` times (``n_rs_seq``: the tokens a
    rejected draft may roll back); ``mtp``: the model drafts with its MTP layers, which run in a context of their
    own beside the target's, with a compute buffer as large (measured on a tiny GLM-4.5-style model: 2.89 MiB
    beside the target's 3.03)."""
    layers = max(0, min(layers, layout.n_layer + 1))
    if layers == 0:
        return Estimate(0, 0, 0, 0)
    blocks = range(layout.n_layer - min(layers, layout.n_layer), layout.n_layer)
    weights = sum(layout.layer_bytes[i] for i in blocks)
    per_token = (_KV_BYTES.get(type_k, 2.0) + _KV_BYTES.get(type_v, 2.0)) / 2
    kv = int(sum(layout.kv_width[i] for i in blocks) * n_ctx * per_token) if kv_offload else 0
    states = sum(layout.state_width[i] for i in blocks if i < len(layout.state_width))
    state = states * 4 * n_seq * (1 + n_rs_seq) if kv_offload else 0  # float32, as llama.cpp keeps them
    compute = n_ubatch * layout.n_embd * 4 * 8  # activations of one ubatch, several live at once
    if layers > layout.n_layer:
        # the output layer: its own tensor, or the input embedding duplicated for it when the two are tied
        weights += layout.output_bytes or layout.other_bytes
        compute += n_ubatch * layout.n_vocab * 4
    return Estimate(layers, weights, kv, overhead + _contexts(layout, mtp) * compute, state)


def _contexts(layout: Layout, mtp: bool) -> int:
    """The llama.cpp contexts a load computes in: the target's, and its MTP head's when it drafts with one."""
    return 2 if mtp and layout.n_nextn else 1


def host_estimate(
    file_bytes: int,
    layout: Layout | None = None,
    *,
    on_gpu: bool = False,
    n_ctx: int = 0,
    n_ubatch: int = 512,
    type_k: int = 1,
    type_v: int = 1,
    cache_ram: int = 0,
    n_seq: int = 1,
    n_rs_seq: int = 0,
    mtp: bool = False,
) -> int:
    """Host bytes of a model's sidecar.

    Args:
        file_bytes: The bytes of the files it loads (weights, a projector, a voice).
        layout: A llama.cpp model's layout: on the CPU its KV cache and compute buffers count too.
        on_gpu: A llama.cpp model loaded to offload its layers: the host keeps what llama.cpp leaves on the CPU
            (the input embedding, a projector) and the device holds the rest, which
            :class:`lemonkit.serving.memory.Evictor` places apart.
        n_ctx, n_ubatch, type_k, type_v, n_seq, n_rs_seq, mtp: As for :func:`estimate`.
        cache_ram: The bytes its prompt cache may take in host memory besides (``--cache-ram``).
    """
    if layout is None:
        return PROCESS_BYTES + file_bytes
    if on_gpu:
        return PROCESS_BYTES + max(0, file_bytes - layout.weight_bytes) + layout.other_bytes + cache_ram
    # every block's KV cache and activations; of the output layer only the logits of the sequences a step decodes
    # (the batcher's slots), as llama.cpp computes logits for a batch's outputs alone
    blocks = estimate(
        layout,
        layout.n_layer,
        n_ctx=n_ctx,
        n_ubatch=n_ubatch,
        type_k=type_k,
        type_v=type_v,
        overhead=0,
        n_seq=n_seq,
        n_rs_seq=n_rs_seq,
        mtp=mtp,
    )
    outputs = _HOST_OUTPUTS * layout.n_vocab * 4 * _contexts(layout, mtp)
    return PROCESS_BYTES + file_bytes + blocks.kv + blocks.state + blocks.compute + outputs + cache_ram


#: the share of its memory a model's automatic context may fill with KV cache (the rest: its weights, other models)
_CONTEXT_SHARE = 4
#: an automatic context is never smaller than this (lemonkit's earlier fixed default), unless trained smaller
CONTEXT_FLOOR = 4096


def context_limit(layout: Layout, memory: int, *, type_k: int = 1, type_v: int = 1) -> int:
    """The most tokens an automatic context may have: as many as a quarter of ``memory`` (the host's, or the
    device's for a GPU load) holds of the model's KV cache, in steps of 256, never below :data:`CONTEXT_FLOOR`.
    A model trained for less than that uses its whole context
    (:func:`lemonkit.catalog.recipe_options.llamacpp_context_size`)."""
    per_token = estimate(layout, layout.n_layer, n_ctx=1, type_k=type_k, type_v=type_v, overhead=0).kv or 1
    tokens = memory // _CONTEXT_SHARE // per_token
    return max(CONTEXT_FLOOR, tokens // 256 * 256)


def fit_layers(layout: Layout, budget: int, **kwargs: int | bool) -> Estimate:
    """The most layers whose :func:`estimate` fits ``budget`` bytes (zero layers when not even one does)."""
    best = Estimate(0, 0, 0, 0)
    for layers in range(1, layout.n_layer + 2):
        guess = estimate(layout, layers, **kwargs)  # type: ignore[arg-type]
        if guess.total > budget:
            break
        best = guess
    return best


def parse_size(text: str) -> int:
    """``"6GiB"``, ``"512MiB"``, ``"8G"``, ``"1.5GB"`` or bytes -> bytes (powers of 1024 for every unit).

    Raises:
        ValueError: Not a size.
    """
    value = text.strip().upper().removesuffix("B").removesuffix("I")
    units = {"K": 1024, "M": MiB, "G": 1024 * MiB, "T": 1024 * 1024 * MiB}
    factor = units.get(value[-1:], 1)
    number = value[:-1] if value[-1:] in units else value
    try:
        size = float(number)
    except ValueError:
        raise ValueError(f"not a size: {text!r} (e.g. 6GiB, 512MiB)") from None
    if size < 0:
        raise ValueError(f"not a size: {text!r}")
    return int(size * factor)
