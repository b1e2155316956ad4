"""A sentence-transformers BERT directory (safetensors) -> one float32 GGUF for llama.cpp: the other way to serve the
bundled all-MiniLM-L6-v2, measured against the ONNX one by ``benchmarks/embeddings.py``.

It follows llama.cpp's ``convert_hf_to_gguf.py`` (``BertModel``) for the tensors and metadata llama.cpp reads,
without torch. The weights stay float32 and the pooling is the model's own (mean); the output is a function of the
input files alone.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from sentence_bert import SentenceBert

__all__ = ["convert"]

#: tensors sentence-transformers does not use (the pooler) or llama.cpp computes itself (position ids)
_SKIPPED = ("embeddings.position_ids", "pooler.")
#: mean pooling: llama.cpp's LLAMA_POOLING_TYPE_MEAN
_POOLING_MEAN = 1


def _vocab(model_dir: Path) -> tuple[list[str], list[int]]:
    """The WordPiece vocabulary in llama.cpp's "phantom space" spelling, and each token's GGUF type."""
    import gguf

    tokenizer = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    vocab: dict[str, int] = tokenizer["model"]["vocab"]
    special = {t["content"] for t in tokenizer.get("added_tokens", []) if t.get("special")}
    tokens = [""] * len(vocab)
    for token, index in vocab.items():
        tokens[index] = token
    types = [int(gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL) for t in tokens]

    def phantom(token: str) -> str:
        if token in special or (token.startswith("[") and token.endswith("]")):
            return token
        return token[2:] if token.startswith("##") else "\u2581" + token

    return [phantom(t) for t in tokens], types


def convert(model_dir: Path, output: Path) -> Path:
    """Write ``model_dir``'s BERT encoder as a float32 GGUF at ``output``.

    Args:
        model_dir: A sentence-transformers directory: ``config.json``, ``model.safetensors``, ``tokenizer.json``
            (a WordPiece tokenizer) and ``1_Pooling/config.json`` (mean pooling).
        output: The GGUF to write (its directory must exist).

    Returns:
        ``output``.

    Raises:
        ValueError: The directory is not a mean-pooled BERT model.
    """
    import gguf

    bert = SentenceBert.open(model_dir)
    config = bert.config
    blocks = int(config["num_hidden_layers"])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.BERT, blocks)
    arch = gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.BERT]

    writer = gguf.GGUFWriter(output, arch)
    writer.add_name(model_dir.name)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_context_length(int(config["max_position_embeddings"]))
    writer.add_embedding_length(int(config["hidden_size"]))
    writer.add_feed_forward_length(int(config["intermediate_size"]))
    writer.add_block_count(blocks)
    writer.add_head_count(int(config["num_attention_heads"]))
    writer.add_layer_norm_eps(float(config["layer_norm_eps"]))
    writer.add_causal_attention(False)
    writer.add_pooling_type(gguf.PoolingType(_POOLING_MEAN))

    tokens, types = _vocab(model_dir)
    writer.add_tokenizer_model("bert")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_type_count(int(config.get("type_vocab_size", 2)))
    index = {token: i for i, token in enumerate(tokens)}
    writer.add_bos_token_id(index["[CLS]"])  # llama.cpp's name for BERT's CLS
    writer.add_sep_token_id(index["[SEP]"])
    writer.add_pad_token_id(index["[PAD]"])
    writer.add_unk_token_id(index["[UNK]"])
    writer.add_mask_token_id(index["[MASK]"])
    writer.add_add_bos_token(True)
    writer.add_add_sep_token(True)

    for name, array in bert.tensors():
        if name.startswith(_SKIPPED):
            continue
        target = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if target is None:
            raise ValueError(f"{model_dir}: tensor {name} has no llama.cpp BERT name")
        writer.add_tensor(target, np.ascontiguousarray(array, dtype=np.float32))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return output
