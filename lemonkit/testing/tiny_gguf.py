"""Tiny random-weight GGUF models written with the ``gguf`` package, for tests.

Each writer produces a file of a few hundred KB in milliseconds that llama.cpp loads like a
real model: a ChatML chat model (llama architecture, SPM vocab), a BERT embedding model and a
BERT reranker (WPM vocab). The output is noise; the point is that every chat, completion,
streaming, tool, grammar, embedding and rerank code path runs for real and fast. Weights are
drawn from ``numpy.random.default_rng(seed)``, so a given seed always writes the same file.
"""

from __future__ import annotations

import os
import string
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGUFWriter, PoolingType, TokenType

__all__ = [
    "CHATML_TEMPLATE",
    "png_data_url",
    "write_tiny_bert_embedding",
    "write_tiny_bert_reranker",
    "write_tiny_gemma4",
    "write_tiny_gemma4_assistant",
    "write_tiny_gemma4_pair",
    "write_tiny_lfm2",
    "write_tiny_llama",
    "write_tiny_mamba",
    "write_tiny_mmproj",
    "write_tiny_mtp",
    "write_tiny_qwen35",
]

N_EMBD = 64
N_LAYER = 2
N_HEAD = 4
N_FF = 128

# A few common words so text tokenizes into word pieces, not only bytes/characters.
_WORDS = (
    "hello world the and you is of to in it that for on with as this are be at",
    "have from or one by but not what all were we when your can said there use an",
    "each which she do how their if will up other about out many then them these so",
    "some her would make like him into time has look two more write go see number no",
    "way could people my than first water been call who oil its now find long down day",
    "did get come made may part test model text query document answer question yes",
    # the Hermes tool preamble and JSON-schema words, so tool prompts stay short in tokens
    "tools tool call response functions function assist user provided signatures within xml",
    "tags return json object name arguments args type description parameters properties",
    "string integer number boolean array items required enum system assistant weather city",
)
WORDS: tuple[str, ...] = tuple(" ".join(_WORDS).split())

# Hermes/Qwen2.5-style ChatML template: system prompt, tool declarations in <tools>, assistant
# tool calls as <tool_call> JSON and tool results folded into a user turn as <tool_response>.
# Content may be a string, null or a list of OpenAI content parts (text parts are joined).
CHATML_TEMPLATE = r"""
{%- macro text(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is iterable -%}
        {%- for part in content if part.type == 'text' -%}{{- part.text -}}{%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages and messages[0].role == 'system' %}
        {{- text(messages[0].content) + '\n\n' }}
    {%- endif %}
    {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' }}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
    {%- for tool in tools %}
        {{- '\n' + (tool | tojson) }}
    {%- endfor %}
    {{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments' }}
    {{- ' within <tool_call></tool_call> XML tags:\n<tool_call>\n' }}
    {{- '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- elif messages and messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + text(messages[0].content) + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first)
          or (message.role == 'assistant' and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + text(message.content) + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant' }}
        {%- if message.content %}
            {{- '\n' + text(message.content) }}
        {%- endif %}
        {%- for call in message.tool_calls %}
            {%- if call.function is defined %}
                {%- set call = call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' + call.name + '", "arguments": ' }}
            {%- if call.arguments is string %}
                {{- call.arguments }}
            {%- else %}
                {{- call.arguments | tojson }}
            {%- endif %}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + text(message.content) + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
""".strip()


@dataclass
class _Vocab:
    """Token list with per-token SPM scores and GGUF token types, in id order."""

    tokens: list[str] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    types: list[int] = field(default_factory=list)
    ids: dict[str, int] = field(default_factory=dict)

    def add(self, token: str, kind: TokenType = TokenType.NORMAL, score: float = 0.0) -> None:
        self.ids[token] = len(self.tokens)
        self.tokens.append(token)
        self.scores.append(score)
        self.types.append(int(kind))

    def extend(self, tokens: Iterable[str]) -> None:
        """Add ordinary pieces, skipping duplicates; SPM merges prefer the higher (longer) score."""
        for token in tokens:
            if token not in self.ids:
                self.add(token, score=float(len(token)))


class _Weights:
    """Named float32 tensors drawn from one seeded generator, in insertion (= file) order."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.tensors: dict[str, np.ndarray] = {}

    def normal(self, name: str, *shape: int) -> np.ndarray:
        # numpy shape is ggml's reversed: (rows, fan_in). 1/sqrt(fan_in) keeps activations O(1)
        # so logits and scores vary visibly between inputs instead of collapsing to ~0.
        array = (self.rng.standard_normal(shape) * shape[-1] ** -0.5).astype(np.float32)
        self.tensors[name] = array
        return array

    def const(self, name: str, value: float, *shape: int) -> None:
        self.tensors[name] = np.full(shape, value, dtype=np.float32)

    def norm(self, prefix: str, bias: bool) -> None:
        self.const(f"{prefix}.weight", 1.0, N_EMBD)
        if bias:
            self.const(f"{prefix}.bias", 0.0, N_EMBD)

    def linear(self, prefix: str, n_out: int, n_in: int, bias: bool) -> None:
        self.normal(f"{prefix}.weight", n_out, n_in)
        if bias:
            self.normal(f"{prefix}.bias", n_out)


def _write(
    path: str | os.PathLike[str],
    arch: str,
    *,
    name: str,
    vocab: _Vocab,
    weights: _Weights,
    configure: Callable[[GGUFWriter], None],
    n_layer: int = N_LAYER,
    n_ctx_train: int = 4096,
    tokenizer: str = "llama",
    n_embd: int = N_EMBD,
) -> Path:
    """Write the hyperparameters every tiny model shares, the vocab, arch-specific keys and tensors."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(path, arch)
    writer.add_name(name)
    writer.add_context_length(n_ctx_train)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(N_FF)
    writer.add_head_count(N_HEAD)
    writer.add_tokenizer_model(tokenizer)
    writer.add_token_list(vocab.tokens)
    writer.add_token_scores(vocab.scores)
    writer.add_token_types(vocab.types)
    configure(writer)
    for tensor_name, array in weights.tensors.items():
        writer.add_tensor(tensor_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# --------------------------------------------------------------------------- llama (chat)


def _llama_vocab(words: Iterable[str] = WORDS) -> _Vocab:
    vocab = _Vocab()
    vocab.add("<unk>", TokenType.UNKNOWN)
    vocab.add("<s>", TokenType.CONTROL)
    vocab.add("</s>", TokenType.CONTROL)
    for byte in range(256):  # byte fallback: any UTF-8 text round-trips
        vocab.add(f"<0x{byte:02X}>", TokenType.BYTE)
    vocab.add("<|im_start|>", TokenType.CONTROL)
    vocab.add("<|im_end|>", TokenType.CONTROL)
    # Single characters first (a lone "▁" must be a piece, else it detokenizes as "▁", not " ").
    # SPM builds longer pieces by merging adjacent pieces already in the vocab, so every prefix
    # of "▁word" must be present for "▁word" to be reachable.
    vocab.extend(["▁", *(c for c in string.printable if not c.isspace())])
    # Bare pieces too, for words glued to punctuation ("<tool_call>", '{"name":').
    vocab.extend(pre + word[:n] for word in words for pre in ("▁", "") for n in range(1, len(word) + 1))
    return vocab


def _chat_keys(writer: GGUFWriter, vocab: _Vocab, chat_template: str = CHATML_TEMPLATE) -> None:
    """The keys every tiny chat model of :func:`_llama_vocab` shares: its special tokens and chat template."""
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(vocab.tokens))
    writer.add_bos_token_id(vocab.ids["<s>"])
    # ChatML models end a turn with <|im_end|>; as EOS it is also llama-cpp-python's stop token.
    writer.add_eos_token_id(vocab.ids["<|im_end|>"])
    writer.add_unk_token_id(vocab.ids["<unk>"])
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_chat_template(chat_template)


def _quiet(output: np.ndarray, vocab: _Vocab, extra: Iterable[str] = ()) -> None:
    """Zero the output rows of special tokens (so replies are not cut short) and of every byte but printable ASCII
    and newline: non-UTF-8 output makes llama-cpp-python's streaming hold back partial characters at 12-15 ms/token,
    not ~0.2 ms. A zero row gives logit 0 while the ~850 ordinary pieces get N(0, 1) logits, so such a token never
    wins greedily (nor within top-k 40)."""
    keep = set(extra)
    printable = {ord(c) for c in string.printable if c not in "\t\r\x0b\x0c"}
    for token_id, (token, kind) in enumerate(zip(vocab.tokens, vocab.types, strict=True)):
        is_odd_byte = kind == TokenType.BYTE and int(token[3:5], 16) not in printable
        if (is_odd_byte or kind in (TokenType.CONTROL, TokenType.UNKNOWN)) and token not in keep:
            output[token_id] = 0.0


def _chat_weights(seed: int, output_norm: str = "output_norm") -> tuple[_Vocab, _Weights]:
    """The vocabulary of :func:`write_tiny_llama` and the weights every tiny chat model starts with: the input
    embedding, the output norm and the output layer (quiet where :func:`_quiet` says)."""
    vocab = _llama_vocab()
    w = _Weights(seed)
    w.normal("token_embd.weight", len(vocab.tokens), N_EMBD)
    w.norm(output_norm, bias=False)
    _quiet(w.normal("output.weight", len(vocab.tokens), N_EMBD), vocab)
    return vocab, w


def write_tiny_llama(
    path: str | os.PathLike[str],
    *,
    seed: int = 0,
    chat_template: str = CHATML_TEMPLATE,
    special_tokens: Iterable[str] = (),
    words: Iterable[str] = WORDS,
) -> Path:
    """Write a random-weight llama-architecture chat GGUF with a ChatML template; return its path.

    Greedy output is printable ASCII noise (see below); generation never ends on its own, so
    callers bound it with ``max_tokens`` or ``stop``.

    Args:
        chat_template: The template stored in the GGUF (another family's, to test its format).
        special_tokens: Control tokens added to the vocab, as that family's GGUFs have them (``<|channel|>``,
            ``[TOOL_CALLS]``, ...). Unlike the ChatML ones they keep ordinary logits, so a model steered
            through them by a grammar may emit them as one token each.
        words: The words whose pieces the vocabulary holds (others give a model of another tokenizer).
    """
    vocab = _llama_vocab(words)
    extra = [t for t in dict.fromkeys(special_tokens) if t not in vocab.ids]
    for token in extra:
        vocab.add(token, TokenType.CONTROL)
    n_vocab = len(vocab.tokens)
    w = _Weights(seed)
    w.normal("token_embd.weight", n_vocab, N_EMBD)
    w.norm("output_norm", bias=False)
    _quiet(w.normal("output.weight", n_vocab, N_EMBD), vocab, extra)
    for layer in range(N_LAYER):
        blk = f"blk.{layer}"
        w.norm(f"{blk}.attn_norm", bias=False)
        for proj in ("attn_q", "attn_k", "attn_v", "attn_output"):
            w.linear(f"{blk}.{proj}", N_EMBD, N_EMBD, bias=False)
        w.norm(f"{blk}.ffn_norm", bias=False)
        w.linear(f"{blk}.ffn_gate", N_FF, N_EMBD, bias=False)
        w.linear(f"{blk}.ffn_up", N_FF, N_EMBD, bias=False)
        w.linear(f"{blk}.ffn_down", N_EMBD, N_FF, bias=False)

    def configure(writer: GGUFWriter) -> None:
        writer.add_head_count_kv(N_HEAD)
        writer.add_rope_dimension_count(N_EMBD // N_HEAD)
        _chat_keys(writer, vocab, chat_template)

    return _write(
        path,
        "llama",
        name="tiny-llama-chatml",
        vocab=vocab,
        weights=w,
        configure=configure,
    )


# --------------------------------------------------------------------------- GLM-4.5 layout with an MTP layer

#: the MTP layer's mixture of experts: experts, experts per token, each expert's FFN width
_MTP_EXPERTS, _MTP_EXPERTS_USED, _MTP_N_FF_EXP = 4, 2, 32


def write_tiny_mtp(path: str | os.PathLike[str], *, seed: int = 0, predictable: bool = False) -> Path:
    """Write a random-weight GLM-4.5-architecture (``glm4moe``) chat GGUF with one MTP (next-n) layer; return its path.

    The trunk is :data:`N_LAYER` dense layers; the next-n block after them is a mixture of experts with a shared
    expert, as GLM-4.5's, with the ``nextn`` projections that read the trunk's hidden state. Same vocabulary and
    ChatML template as :func:`write_tiny_llama`; its MTP drafts are as random as its text.

    Args:
        predictable: Make the head draft what the trunk will say: every block's attention and FFN outputs are
            zero, so the trunk's next token is a fixed function of the last one (its embedding through the output
            norm and head), and the head's projection passes the token's embedding alone through the same norm and
            head, which is the trunk's next token after it. Its drafts are all accepted.
    """
    vocab, w = _chat_weights(seed)
    experts, n_ff_exp = _MTP_EXPERTS, _MTP_N_FF_EXP
    for layer in range(N_LAYER + 1):
        blk = f"blk.{layer}"
        w.norm(f"{blk}.attn_norm", bias=False)
        for proj in ("attn_q", "attn_k", "attn_v"):
            w.linear(f"{blk}.{proj}", N_EMBD, N_EMBD, bias=True)  # GLM's attention has biases
        w.linear(f"{blk}.attn_output", N_EMBD, N_EMBD, bias=False)
        w.norm(f"{blk}.post_attention_norm", bias=False)
        if layer < N_LAYER:
            w.linear(f"{blk}.ffn_gate", N_FF, N_EMBD, bias=False)
            w.linear(f"{blk}.ffn_up", N_FF, N_EMBD, bias=False)
            w.linear(f"{blk}.ffn_down", N_EMBD, N_FF, bias=False)
            continue
        w.normal(f"{blk}.ffn_gate_inp.weight", experts, N_EMBD)
        w.const(f"{blk}.exp_probs_b.bias", 0.0, experts)
        w.normal(f"{blk}.ffn_gate_exps.weight", experts, n_ff_exp, N_EMBD)
        w.normal(f"{blk}.ffn_up_exps.weight", experts, n_ff_exp, N_EMBD)
        w.normal(f"{blk}.ffn_down_exps.weight", experts, N_EMBD, n_ff_exp)
        w.linear(f"{blk}.ffn_gate_shexp", n_ff_exp, N_EMBD, bias=False)
        w.linear(f"{blk}.ffn_up_shexp", n_ff_exp, N_EMBD, bias=False)
        w.linear(f"{blk}.ffn_down_shexp", N_EMBD, n_ff_exp, bias=False)
        w.normal(f"{blk}.nextn.eh_proj.weight", N_EMBD, 2 * N_EMBD)
        w.norm(f"{blk}.nextn.enorm", bias=False)
        w.norm(f"{blk}.nextn.hnorm", bias=False)
    if predictable:
        for name, array in w.tensors.items():
            outputs = ("attn_output.weight", "ffn_down.weight", "ffn_down_exps.weight", "ffn_down_shexp.weight")
            if name.endswith(outputs):
                array[...] = 0.0
        eh_proj = w.tensors[f"blk.{N_LAYER}.nextn.eh_proj.weight"]  # input: the token's normed embedding, then h
        eh_proj[...] = 0.0
        eh_proj[:, :N_EMBD] = np.eye(N_EMBD, dtype=np.float32)
        w.tensors["output.weight"] *= 32.0  # logits N(0, 1024): the head is sure of its picks (over --spec-draft-p-min)

    def configure(writer: GGUFWriter) -> None:
        writer.add_head_count_kv(N_HEAD)
        writer.add_rope_dimension_count(N_EMBD // N_HEAD)
        _chat_keys(writer, vocab)
        writer.add_expert_count(experts)
        writer.add_expert_used_count(_MTP_EXPERTS_USED)
        writer.add_expert_shared_count(1)
        writer.add_expert_feed_forward_length(n_ff_exp)
        writer.add_leading_dense_block_count(N_LAYER)  # the trunk is dense; the MTP block is the MoE one
        writer.add_uint32("glm4moe.nextn_predict_layers", 1)

    return _write(
        path,
        "glm4moe",
        name="tiny-glm4moe-mtp",
        vocab=vocab,
        weights=w,
        configure=configure,
        n_layer=N_LAYER + 1,
    )


# --------------------------------------------------------------------------- Mamba (a recurrent model)

#: Mamba's sizes: the inner width (llama.cpp takes twice the embedding only), state, convolution and time-step rank
_SSM_INNER, _SSM_STATE, _SSM_CONV, _SSM_DT_RANK = 2 * N_EMBD, 16, 4, 4


def write_tiny_mamba(path: str | os.PathLike[str], *, seed: int = 0) -> Path:
    """Write a random-weight Mamba chat GGUF (recurrent layers: a state per sequence, no KV cache); return its path.

    Same vocabulary and ChatML template as :func:`write_tiny_llama`.
    """
    vocab, w = _chat_weights(seed)
    for layer in range(N_LAYER):
        blk = f"blk.{layer}"
        w.norm(f"{blk}.attn_norm", bias=False)
        w.normal(f"{blk}.ssm_in.weight", 2 * _SSM_INNER, N_EMBD)
        w.normal(f"{blk}.ssm_conv1d.weight", _SSM_INNER, _SSM_CONV)
        w.const(f"{blk}.ssm_conv1d.bias", 0.0, _SSM_INNER)
        w.normal(f"{blk}.ssm_x.weight", _SSM_DT_RANK + 2 * _SSM_STATE, _SSM_INNER)
        w.normal(f"{blk}.ssm_dt.weight", _SSM_INNER, _SSM_DT_RANK)
        w.const(f"{blk}.ssm_dt.bias", 0.0, _SSM_INNER)
        # A = -exp(A_log) with A_log = log(1..d_state), as Mamba initialises it: every state decays
        w.tensors[f"{blk}.ssm_a"] = -np.tile(np.arange(1, _SSM_STATE + 1, dtype=np.float32), (_SSM_INNER, 1))
        w.const(f"{blk}.ssm_d", 1.0, _SSM_INNER)
        w.normal(f"{blk}.ssm_out.weight", N_EMBD, _SSM_INNER)

    def configure(writer: GGUFWriter) -> None:
        writer.add_ssm_conv_kernel(_SSM_CONV)
        writer.add_ssm_inner_size(_SSM_INNER)
        writer.add_ssm_state_size(_SSM_STATE)
        writer.add_ssm_time_step_rank(_SSM_DT_RANK)
        _chat_keys(writer, vocab)

    return _write(
        path,
        "mamba",
        name="tiny-mamba",
        vocab=vocab,
        weights=w,
        configure=configure,
    )


# --------------------------------------------------------------------------- LFM2 (a hybrid model)

#: LFM2's layers: short convolutions (a recurrent state per sequence) around one attention layer
_LFM2_LAYERS = ("conv", "attention", "conv")
_LFM2_CONV = 3  # the convolution's length (``shortconv.l_cache``)


def write_tiny_lfm2(path: str | os.PathLike[str], *, seed: int = 0) -> Path:
    """Write a random-weight LFM2 chat GGUF, a hybrid model (recurrent convolution layers and an attention layer,
    whose states llama.cpp can roll back a few tokens); return its path.

    Same vocabulary and ChatML template as :func:`write_tiny_llama`.
    """
    vocab, w = _chat_weights(seed, output_norm="token_embd_norm")  # LFM2's output norm, under this name
    for layer, kind in enumerate(_LFM2_LAYERS):
        blk = f"blk.{layer}"
        w.norm(f"{blk}.attn_norm", bias=False)
        w.norm(f"{blk}.ffn_norm", bias=False)
        w.linear(f"{blk}.ffn_gate", N_FF, N_EMBD, bias=False)
        w.linear(f"{blk}.ffn_up", N_FF, N_EMBD, bias=False)
        w.linear(f"{blk}.ffn_down", N_EMBD, N_FF, bias=False)
        if kind == "attention":
            w.const(f"{blk}.attn_q_norm.weight", 1.0, N_EMBD // N_HEAD)
            w.const(f"{blk}.attn_k_norm.weight", 1.0, N_EMBD // N_HEAD)
            for proj in ("attn_q", "attn_k", "attn_v", "attn_output"):
                w.linear(f"{blk}.{proj}", N_EMBD, N_EMBD, bias=False)
        else:
            w.normal(f"{blk}.shortconv.conv.weight", N_EMBD, _LFM2_CONV)
            w.normal(f"{blk}.shortconv.in_proj.weight", 3 * N_EMBD, N_EMBD)
            w.normal(f"{blk}.shortconv.out_proj.weight", N_EMBD, N_EMBD)

    def configure(writer: GGUFWriter) -> None:
        writer.add_head_count_kv([N_HEAD if kind == "attention" else 0 for kind in _LFM2_LAYERS])
        writer.add_uint32("lfm2.shortconv.l_cache", _LFM2_CONV)
        _chat_keys(writer, vocab)

    return _write(
        path,
        "lfm2",
        name="tiny-lfm2",
        vocab=vocab,
        weights=w,
        configure=configure,
        n_layer=len(_LFM2_LAYERS),
    )


# --------------------------------------------------------------------------- Qwen3.5 (hybrid, with an MTP layer)

#: Qwen3.5's gated delta-net sizes: key heads (groups), value heads, head width, convolution
_DN_K_HEADS, _DN_V_HEADS, _DN_HEAD, _DN_CONV = 2, 4, 16, 4


def write_tiny_qwen35(path: str | os.PathLike[str], *, seed: int = 0, predictable: bool = False) -> Path:
    """Write a random-weight Qwen3.5-architecture (``qwen35``) chat GGUF with one MTP layer; return its path.

    The trunk is a gated delta-net layer (recurrent: a state per sequence) and a gated attention layer, as
    Qwen3.5 alternates them; the MTP block after them is an attention block with the ``nextn`` projections. Same
    vocabulary and ChatML template as :func:`write_tiny_llama`.

    Args:
        predictable: Make the head draft what the trunk will say, as :func:`write_tiny_mtp` does (every block's
            output zero, the head's projection passing the token's embedding alone). The recurrent state then
            changes no logit.
    """
    vocab, w = _chat_weights(seed)
    head = N_EMBD // N_HEAD
    key_dim, value_dim = _DN_HEAD * _DN_K_HEADS, _DN_HEAD * _DN_V_HEADS
    kinds = ("delta-net", "attention", "mtp")
    for layer, kind in enumerate(kinds):
        blk = f"blk.{layer}"
        w.norm(f"{blk}.attn_norm", bias=False)
        w.norm(f"{blk}.post_attention_norm", bias=False)
        if kind == "delta-net":
            w.normal(f"{blk}.attn_qkv.weight", 2 * key_dim + value_dim, N_EMBD)
            w.normal(f"{blk}.attn_gate.weight", value_dim, N_EMBD)
            w.normal(f"{blk}.ssm_conv1d.weight", 2 * key_dim + value_dim, _DN_CONV)
            w.const(f"{blk}.ssm_dt.bias", 0.0, _DN_V_HEADS)
            w.const(f"{blk}.ssm_a", -1.0, _DN_V_HEADS)
            w.normal(f"{blk}.ssm_beta.weight", _DN_V_HEADS, N_EMBD)
            w.normal(f"{blk}.ssm_alpha.weight", _DN_V_HEADS, N_EMBD)
            w.const(f"{blk}.ssm_norm.weight", 1.0, _DN_HEAD)
            w.normal(f"{blk}.ssm_out.weight", N_EMBD, value_dim)
        else:
            w.normal(f"{blk}.attn_q.weight", 2 * N_EMBD, N_EMBD)  # the query and its gate
            w.normal(f"{blk}.attn_k.weight", N_EMBD, N_EMBD)
            w.normal(f"{blk}.attn_v.weight", N_EMBD, N_EMBD)
            w.normal(f"{blk}.attn_output.weight", N_EMBD, N_EMBD)
            w.const(f"{blk}.attn_q_norm.weight", 1.0, head)
            w.const(f"{blk}.attn_k_norm.weight", 1.0, head)
        w.linear(f"{blk}.ffn_gate", N_FF, N_EMBD, bias=False)
        w.linear(f"{blk}.ffn_up", N_FF, N_EMBD, bias=False)
        w.linear(f"{blk}.ffn_down", N_EMBD, N_FF, bias=False)
        if kind == "mtp":
            w.normal(f"{blk}.nextn.eh_proj.weight", N_EMBD, 2 * N_EMBD)
            w.norm(f"{blk}.nextn.enorm", bias=False)
            w.norm(f"{blk}.nextn.hnorm", bias=False)
    if predictable:
        for name, array in w.tensors.items():
            if name.endswith(("attn_output.weight", "ffn_down.weight", "ssm_out.weight")):
                array[...] = 0.0
        eh_proj = w.tensors[f"blk.{len(kinds) - 1}.nextn.eh_proj.weight"]
        eh_proj[...] = 0.0
        eh_proj[:, :N_EMBD] = np.eye(N_EMBD, dtype=np.float32)
        w.tensors["output.weight"] *= 32.0

    def configure(writer: GGUFWriter) -> None:
        writer.add_head_count_kv(N_HEAD)
        writer.add_rope_dimension_count(head)
        writer.add_rope_dimension_sections([3, 3, 2, 0])  # Qwen3.5's multi-axis rope: halves of the rotary width
        writer.add_uint32("qwen35.full_attention_interval", 2)  # delta-net, attention, ...
        writer.add_ssm_conv_kernel(_DN_CONV)
        writer.add_ssm_inner_size(value_dim)
        writer.add_ssm_state_size(_DN_HEAD)
        writer.add_ssm_time_step_rank(_DN_V_HEADS)
        writer.add_ssm_group_count(_DN_K_HEADS)
        writer.add_uint32("qwen35.nextn_predict_layers", 1)
        _chat_keys(writer, vocab)

    return _write(
        path,
        "qwen35",
        name="tiny-qwen35-mtp",
        vocab=vocab,
        weights=w,
        configure=configure,
        n_layer=len(kinds),
    )


# --------------------------------------------------------------------------- Gemma 4 and its MTP assistant

#: Gemma 4's layers, sliding-window (True) or full attention: the last one full and the one before it sliding, as
#: the assistant reads the cache of those two
_G4_SWA = (True, False, True, False)
#: the head widths of sliding and full layers (Gemma 4's full layers have the wider heads), the KV heads of both
_G4_HEAD_SWA, _G4_HEAD_FULL, _G4_HEAD_KV = 16, 32, 2
_G4_WINDOW = 128  # the sliding window
_G4_ROPE_BASE, _G4_ROPE_BASE_SWA = 1_000_000.0, 10_000.0
#: the assistant's width (its own, under the target's) and its layers (which target layer's cache each reads)
_G4A_EMBD, _G4A_SWA = 32, (True, False)


def _g4_rope_freqs() -> np.ndarray:
    """The full layers' "proportional" rope as the converter writes it: a quarter of the head rotates, the rest
    is held still by a huge frequency divisor."""
    n_rot = _G4_HEAD_FULL // 8  # partial_rotary_factor 0.25, in pairs
    return np.array([1.0] * n_rot + [1e30] * (_G4_HEAD_FULL // 2 - n_rot), dtype=np.float32)


def _g4_silence_blocks(w: _Weights) -> None:
    """Zero every block's attention and FFN output: the residual stream carries the token's embedding alone."""
    for name, array in w.tensors.items():
        if name.endswith(("attn_output.weight", "ffn_down.weight")):
            array[...] = 0.0


def _g4_predictable_output(output: np.ndarray, scale: float) -> np.ndarray:
    """A predictable pair's output layer from the target's random one: its first ``_G4A_EMBD`` dimensions (the rest
    zero), scaled so the picks are sure ones (mostly over ``--spec-draft-p-min``)."""
    cut = np.zeros_like(output)
    cut[:, :_G4A_EMBD] = output[:, :_G4A_EMBD] * scale
    return cut


def _g4_attention_keys(writer: GGUFWriter, swa: tuple[bool, ...]) -> None:
    """The attention hyperparameters the target and its assistant share (the assistant attends to the target's
    cached keys and values, so they must match)."""
    writer.add_head_count_kv(_G4_HEAD_KV)
    writer.add_key_length(_G4_HEAD_FULL)
    writer.add_value_length(_G4_HEAD_FULL)
    writer.add_key_length_swa(_G4_HEAD_SWA)
    writer.add_value_length_swa(_G4_HEAD_SWA)
    writer.add_rope_dimension_count(_G4_HEAD_FULL)
    writer.add_rope_dimension_count_swa(_G4_HEAD_SWA)  # else the full layers' count, wider than a sliding head
    writer.add_rope_freq_base(_G4_ROPE_BASE)
    writer.add_rope_freq_base_swa(_G4_ROPE_BASE_SWA)
    writer.add_sliding_window(_G4_WINDOW)
    writer.add_sliding_window_pattern(list(swa))


def write_tiny_gemma4(
    path: str | os.PathLike[str], *, seed: int = 0, predictable: bool = False, shared_kv_layers: int = 0
) -> Path:
    """Write a random-weight Gemma 4 (``gemma4``) chat GGUF; return its path.

    Four dense layers, sliding-window and full attention in turn (the full ones with wider heads and Gemma 4's
    partial "proportional" rope), no per-layer embeddings and no layers sharing another's KV cache, as Gemma 4 31B.
    Same vocabulary and ChatML template as :func:`write_tiny_llama`. :func:`write_tiny_gemma4_assistant` writes its
    MTP drafter (any seed fits; for ``predictable`` pairs, the same seed).

    Args:
        predictable: Make the next token a fixed function of the last one, which
            ``write_tiny_gemma4_assistant(predictable=True)`` of the same seed drafts: every block's attention and FFN
            outputs are zero (the hidden state is the token's embedding), and the embedding and output layer use
            only the first 32 of the 64 dimensions, the assistant's width, so it can carry them.
        shared_kv_layers: How many of the last layers reuse the cache of the last earlier layer of their kind and
            keep none of their own (Gemma 3n and 4's smaller models; 2 at most here).
    """
    vocab, w = _chat_weights(seed)
    for layer, swa in enumerate(_G4_SWA):
        blk = f"blk.{layer}"
        head = _G4_HEAD_SWA if swa else _G4_HEAD_FULL
        w.norm(f"{blk}.attn_norm", bias=False)
        w.normal(f"{blk}.attn_q.weight", N_HEAD * head, N_EMBD)
        w.normal(f"{blk}.attn_k.weight", _G4_HEAD_KV * head, N_EMBD)
        w.normal(f"{blk}.attn_v.weight", _G4_HEAD_KV * head, N_EMBD)
        w.normal(f"{blk}.attn_output.weight", N_EMBD, N_HEAD * head)
        w.const(f"{blk}.attn_q_norm.weight", 1.0, head)
        w.const(f"{blk}.attn_k_norm.weight", 1.0, head)
        w.norm(f"{blk}.post_attention_norm", bias=False)
        w.norm(f"{blk}.ffn_norm", bias=False)
        w.linear(f"{blk}.ffn_gate", N_FF, N_EMBD, bias=False)
        w.linear(f"{blk}.ffn_up", N_FF, N_EMBD, bias=False)
        w.linear(f"{blk}.ffn_down", N_EMBD, N_FF, bias=False)
        w.norm(f"{blk}.post_ffw_norm", bias=False)
    w.tensors["rope_freqs.weight"] = _g4_rope_freqs()
    if predictable:
        _g4_silence_blocks(w)
        w.tensors["token_embd.weight"][:, _G4A_EMBD:] = 0.0
        w.tensors["output.weight"][...] = _g4_predictable_output(w.tensors["output.weight"], 32.0)

    def configure(writer: GGUFWriter) -> None:
        _g4_attention_keys(writer, _G4_SWA)
        writer.add_embedding_length_per_layer_input(0)  # required; 0: no per-layer embeddings
        writer.add_shared_kv_layers(shared_kv_layers)
        _chat_keys(writer, vocab)

    return _write(
        path,
        "gemma4",
        name="tiny-gemma4",
        vocab=vocab,
        weights=w,
        configure=configure,
        n_layer=len(_G4_SWA),
    )


def write_tiny_gemma4_assistant(path: str | os.PathLike[str], *, seed: int = 0, predictable: bool = False) -> Path:
    """Write a random-weight Gemma 4 MTP drafter (``gemma4-assistant``) for :func:`write_tiny_gemma4`; return its
    path.

    A model of its own, narrower than the target, whose layers hold no keys or values: llama.cpp runs it in a
    context made with ``ctx_other`` set to the target's context, where it attends to the target's KV cache (its
    sliding layer to the target's last sliding layer's, its full one to the target's last layer's). It reads a
    token, embedded by the target's ``token_embd``, with the target's hidden state (``embedding_length_out``
    wide), and gives logits over the same vocabulary (through its own tied ``token_embd``) and its next hidden
    state, through ``nextn.post_projection``.

    Args:
        seed: The weights' seed; with ``predictable``, the target's.
        predictable: Draft what ``write_tiny_gemma4(predictable=True)`` of the same seed will say: the blocks'
            outputs are zero, ``nextn.pre_projection`` passes the token's embedding alone (its first 32 dimensions,
            where the target's embedding lives) and the output layer is the target's, cut to those
            dimensions, so each draft is the target's next token after the drafted one. Its drafts are all accepted.
    """
    vocab = _llama_vocab()
    n_vocab, n_embd = len(vocab.tokens), _G4A_EMBD
    w = _Weights(seed)
    _quiet(w.normal("token_embd.weight", n_vocab, n_embd), vocab)  # also the output layer
    w.const("output_norm.weight", 1.0, n_embd)
    w.normal("nextn.pre_projection.weight", n_embd, 2 * N_EMBD)  # [target's embedding of the token, h] -> n_embd
    w.normal("nextn.post_projection.weight", N_EMBD, n_embd)  # -> the next h, the target's width
    for layer, swa in enumerate(_G4A_SWA):
        blk = f"blk.{layer}"
        head = _G4_HEAD_SWA if swa else _G4_HEAD_FULL
        w.const(f"{blk}.attn_norm.weight", 1.0, n_embd)
        w.normal(f"{blk}.attn_q.weight", N_HEAD * head, n_embd)
        w.normal(f"{blk}.attn_output.weight", n_embd, N_HEAD * head)
        w.const(f"{blk}.attn_q_norm.weight", 1.0, head)
        w.const(f"{blk}.post_attention_norm.weight", 1.0, n_embd)
        w.const(f"{blk}.layer_output_scale.weight", 1.0, 1)
        w.const(f"{blk}.ffn_norm.weight", 1.0, n_embd)
        w.normal(f"{blk}.ffn_gate.weight", N_FF, n_embd)
        w.normal(f"{blk}.ffn_up.weight", N_FF, n_embd)
        w.normal(f"{blk}.ffn_down.weight", n_embd, N_FF)
        w.const(f"{blk}.post_ffw_norm.weight", 1.0, n_embd)
    w.tensors["rope_freqs.weight"] = _g4_rope_freqs()
    if predictable:
        _g4_silence_blocks(w)
        pre = w.tensors["nextn.pre_projection.weight"]  # input: the target's embedding of the token, then h
        pre[...] = 0.0
        pre[:, :n_embd] = np.eye(n_embd, dtype=np.float32)
        target_output = _chat_weights(seed)[1].tensors["output.weight"]  # the target's draws, in the same order
        # x2: its final norm over 32 dimensions, not 64, leaves its logits 1/sqrt(2) of the target's
        w.tensors["token_embd.weight"][...] = _g4_predictable_output(target_output, 64.0)[:, :n_embd]

    def configure(writer: GGUFWriter) -> None:
        _g4_attention_keys(writer, _G4A_SWA)
        writer.add_embedding_length_out(N_EMBD)  # the target's hidden size (llama.cpp refuses it equal to its own)
        writer.add_nextn_predict_layers(len(_G4A_SWA))  # every layer is a next-n layer
        _chat_keys(writer, vocab)

    return _write(
        path,
        "gemma4-assistant",
        name="tiny-gemma4-assistant",
        vocab=vocab,
        weights=w,
        configure=configure,
        n_layer=len(_G4A_SWA),
        n_embd=n_embd,
    )


def write_tiny_gemma4_pair(
    directory: str | os.PathLike[str], *, seed: int = 0, predictable: bool = False
) -> tuple[Path, Path]:
    """Write :func:`write_tiny_gemma4` and its :func:`write_tiny_gemma4_assistant` (same seed and ``predictable``)
    into ``directory`` as ``tiny-gemma4.gguf`` and ``tiny-gemma4-assistant.gguf``; return their paths, the
    target's first."""
    directory = Path(directory)
    return (
        write_tiny_gemma4(directory / "tiny-gemma4.gguf", seed=seed, predictable=predictable),
        write_tiny_gemma4_assistant(directory / "tiny-gemma4-assistant.gguf", seed=seed, predictable=predictable),
    )


# --------------------------------------------------------------------------- BERT (embed, rerank)

_BERT_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
_BERT_N_CTX = 512


def _bert_vocab() -> _Vocab:
    vocab = _Vocab()
    for token in _BERT_SPECIALS:
        vocab.add(token, TokenType.UNKNOWN if token == "[UNK]" else TokenType.CONTROL)
    # llama.cpp's WPM marks a word start with "▁" and continuations bare (HF's "##" dropped);
    # every printable character in both forms means any ASCII text avoids [UNK].
    chars = [c for c in string.printable if not c.isspace()]
    vocab.extend(["▁" + c for c in chars] + chars)
    vocab.extend("▁" + word for word in WORDS)
    vocab.extend(("ing", "ed", "er", "ly", "es", "tion"))
    return vocab


def _write_bert(path: str | os.PathLike[str], *, seed: int, name: str, rank: bool) -> Path:
    """A 2-layer BERT; ``rank`` adds the classifier head llama.cpp applies under RANK pooling."""
    vocab = _bert_vocab()
    w = _Weights(seed)
    w.normal("token_embd.weight", len(vocab.tokens), N_EMBD)
    w.normal("token_types.weight", 2, N_EMBD)
    w.normal("position_embd.weight", _BERT_N_CTX, N_EMBD)
    w.norm("token_embd_norm", bias=True)
    for layer in range(N_LAYER):
        blk = f"blk.{layer}"
        for proj in ("attn_q", "attn_k", "attn_v", "attn_output"):
            w.linear(f"{blk}.{proj}", N_EMBD, N_EMBD, bias=True)
        w.norm(f"{blk}.attn_output_norm", bias=True)
        w.linear(f"{blk}.ffn_up", N_FF, N_EMBD, bias=True)
        w.linear(f"{blk}.ffn_down", N_EMBD, N_FF, bias=True)
        w.norm(f"{blk}.layer_output_norm", bias=True)
    if rank:
        # score = cls.output(tanh(cls(h_[CLS]))): RoBERTa's classification head, one label
        # (llama.cpp's n_cls_out defaults to 1 without {arch}.classifier.output_labels).
        w.linear("cls", N_EMBD, N_EMBD, bias=True)
        w.linear("cls.output", 1, N_EMBD, bias=True)

    def configure(writer: GGUFWriter) -> None:
        writer.add_layer_norm_eps(1e-12)
        writer.add_causal_attention(False)
        writer.add_pooling_type(PoolingType.RANK if rank else PoolingType.MEAN)
        writer.add_token_type_count(2)  # llama.cpp refuses a BERT without it
        writer.add_pad_token_id(vocab.ids["[PAD]"])
        writer.add_unk_token_id(vocab.ids["[UNK]"])
        writer.add_bos_token_id(vocab.ids["[CLS]"])
        writer.add_sep_token_id(vocab.ids["[SEP]"])
        writer.add_mask_token_id(vocab.ids["[MASK]"])

    return _write(
        path,
        "bert",
        name=name,
        n_ctx_train=_BERT_N_CTX,
        tokenizer="bert",
        vocab=vocab,
        weights=w,
        configure=configure,
    )


def write_tiny_bert_embedding(path: str | os.PathLike[str], *, seed: int = 0) -> Path:
    """Write a random-weight BERT embedding GGUF (mean pooling, dim 64); return its path."""
    return _write_bert(path, seed=seed, name="tiny-bert-embedding", rank=False)


def write_tiny_bert_reranker(path: str | os.PathLike[str], *, seed: int = 0) -> Path:
    """Write a random-weight BERT reranker GGUF (RANK pooling, one score per pair); return its path."""
    return _write_bert(path, seed=seed, name="tiny-bert-reranker", rank=True)


def write_tiny_mmproj(path: str | os.PathLike[str], *, n_embd_llm: int = 64, seed: int = 0) -> Path:
    """A random-weight SigLIP-style CLIP mmproj with llama.cpp's ``gemma3`` projector (56 px -> 4 tokens).

    The same layout as real Gemma 3 / globalmm mmproj files, shrunk to one 32-wide layer.
    """
    path = Path(path)
    rng = np.random.default_rng(seed)
    embd, ffn, image, patch = 32, 64, 56, 14

    def rand(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * shape[-1] ** -0.5).astype(np.float32)

    def const(value: float, n: int) -> np.ndarray:
        return np.full(n, value, dtype=np.float32)

    w = GGUFWriter(str(path), "clip")
    w.add_string("clip.projector_type", "gemma3")
    w.add_bool("clip.has_text_encoder", False)
    w.add_bool("clip.has_vision_encoder", True)
    w.add_bool("clip.has_llava_projector", False)
    for key, value in (
        ("image_size", image),
        ("patch_size", patch),
        ("embedding_length", embd),
        ("feed_forward_length", ffn),
        ("projection_dim", n_embd_llm),
        ("block_count", 1),
        ("attention.head_count", 2),
        ("projector.scale_factor", 2),
    ):
        w.add_uint32(f"clip.vision.{key}", value)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    w.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    w.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    w.add_bool("clip.use_gelu", True)
    w.add_tensor("v.patch_embd.weight", rand(embd, 3, patch, patch))
    w.add_tensor("v.patch_embd.bias", const(0, embd))
    w.add_tensor("v.position_embd.weight", rand((image // patch) ** 2, embd))
    for norm in ("ln1", "ln2"):
        w.add_tensor(f"v.blk.0.{norm}.weight", const(1, embd))
        w.add_tensor(f"v.blk.0.{norm}.bias", const(0, embd))
    for proj in ("attn_q", "attn_k", "attn_v", "attn_out"):
        w.add_tensor(f"v.blk.0.{proj}.weight", rand(embd, embd))
        w.add_tensor(f"v.blk.0.{proj}.bias", const(0, embd))
    w.add_tensor("v.blk.0.ffn_up.weight", rand(ffn, embd))
    w.add_tensor("v.blk.0.ffn_up.bias", const(0, ffn))
    w.add_tensor("v.blk.0.ffn_down.weight", rand(embd, ffn))
    w.add_tensor("v.blk.0.ffn_down.bias", const(0, embd))
    w.add_tensor("v.post_ln.weight", const(1, embd))
    w.add_tensor("v.post_ln.bias", const(0, embd))
    w.add_tensor("mm.input_projection.weight", rand(embd, n_embd_llm))
    w.add_tensor("mm.soft_emb_norm.weight", const(1, embd))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def png_data_url(rgb: tuple[int, int, int], size: int = 8) -> str:
    """A solid-colour PNG as a base64 data URL (written by hand: no imaging library needed)."""
    import base64
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    rows = b"".join(b"\x00" + bytes(rgb) * size for _ in range(size))
    png = (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", size, size, 8, 2, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(rows))
        + chunk(b"IEND", b"")
    )
    return "data:image/png;base64," + base64.b64encode(png).decode()
