"""How much device memory a llama.cpp model takes, and how many of its layers fit in a budget.

Estimated from the GGUF header (:func:`lemonkit.gguf_header.read_gguf_layout`) the way llama.cpp places a model:
``-ngl N`` puts the last ``N`` repeating blocks on the GPU, and ``N`` above the block count the output layer too;
the input embedding stays on the CPU. A block offloaded carries its weights and, unless ``--no-kv-offload``, its
KV cache (``n_ctx`` tokens of K and V); a GPU that computes the output layer also holds a compute buffer with one
ubatch of logits. The server uses the same figures to decide what to evict before a load, the engine to choose
``-ngl auto``, so the two agree.
"""

from __future__ import annotations

from dataclasses import dataclass

from lemonkit.gguf_header import Layout

__all__ = ["Estimate", "MiB", "estimate", "fit_layers", "parse_size"]

MiB = 1024 * 1024
#: ggml's per-backend work buffers, scheduler copies and driver overhead beside the graph's own tensors
_OVERHEAD = 256 * MiB
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
    """

    layers: int
    weights: int
    kv: int
    compute: int

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.compute

    def describe(self) -> str:
        return (
            f"{self.layers} layers: {self.total / MiB:.0f} MiB ({self.weights / MiB:.0f} weights, "
            f"{self.kv / MiB:.0f} KV cache, {self.compute / MiB:.0f} compute)"
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
) -> Estimate:
    """Device memory with ``layers`` layers offloaded (``layers > n_layer``: every block and the output layer)."""
    layers = max(0, min(layers, layout.n_layer + 1))
    if layers == 0:
        return Estimate(0, 0, 0, 0)
    blocks = range(layout.n_layer - min(layers, layout.n_layer), layout.n_layer)
    weights = sum(layout.layer_bytes[i] for i in blocks)
    per_token = (_KV_BYTES.get(type_k, 2.0) + _KV_BYTES.get(type_v, 2.0)) / 2
    kv = int(sum(layout.kv_width[i] for i in blocks) * n_ctx * per_token) if kv_offload else 0
    compute = _OVERHEAD + n_ubatch * layout.n_embd * 4 * 8  # activations of one ubatch, several live at once
    if layers > layout.n_layer:
        # the output layer: its own tensor, or the input embedding duplicated for it when the two are tied
        weights += layout.output_bytes or layout.other_bytes
        compute += n_ubatch * layout.n_vocab * 4
    return Estimate(layers, weights, kv, compute)


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
