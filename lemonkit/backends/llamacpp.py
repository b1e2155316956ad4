"""The ``llamacpp`` recipe: chat, completions, embeddings and rerank on llama-cpp-python.

One :class:`LlamaCppEngine` owns one ``llama_cpp.Llama`` and runs in a sidecar process (see
:mod:`lemonkit.backends.base`); requests arrive one at a time on the sidecar's worker thread.

Generation runs our own loop over ``Llama.generate`` rather than ``create_completion(stream=True)``:
the library's streaming re-detokenizes the whole completion and rescans every stop string on
each token (quadratic in the answer length), needs ``logits_all=True`` (an n_ctx x n_vocab
float buffer: 4 GB for Gemma 3 at 4096) for logprobs, and cannot tell prompt time from
generation time. The loop here caches each token's bytes once, decodes UTF-8 incrementally,
matches stop strings only over the held-back tail, reads logprobs from the last logits row
only when asked, evaluates the prompt itself (exact ``prompt_ms``/``cache_n``) and checks
``cancelled()`` between tokens. Grammar-constrained output (``response_format``, forced tool
calls) samples as llama-server does, grammar last and only for rejected tokens
(:meth:`LlamaCppEngine._grammar_tokens`): 3.4x faster than llama-cpp-python's grammar-first
chain on Gemma's 262k vocab, same greedy output. Prompt rendering and output parsing live in
:mod:`lemonkit.backends.chat_format`.
"""

from __future__ import annotations

import codecs
import ctypes
import math
import os
import random
import secrets
import shlex
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from lemonkit.backends.base import Cancelled, LoadSpec
from lemonkit.backends.chat_format import (
    ChatTemplate,
    ForcedToolStream,
    StopMatcher,
    StreamParser,
    ToolSpec,
    merge_system_messages,
    new_call_id,
    normalize_messages,
    parse_tools,
    prompt_opens_thinking,
    response_format_grammar,
    tool_call_grammar,
    tool_system_prompt,
)
from lemonkit.errors import (
    InvalidArgument,
    ModelLoadError,
    ModelNotApplicable,
    NotEmbeddingModel,
)
from lemonkit.gguf_header import read_gguf_context_length
from lemonkit.options import DEFAULT_CTX_SIZE, llamacpp_context_size

__all__ = ["DEFAULT_CTX_SIZE", "LlamaCppEngine", "merge_llamacpp_args", "parse_llamacpp_args"]
#: Prompt batch: llama-server's physical batch size; larger buys nothing on CPU.
DEFAULT_N_BATCH = 512
#: llama-server's sampling defaults (``common_params_sampling``).
DEFAULT_SAMPLING: dict[str, Any] = {
    "temperature": 0.8,
    "top_k": 40,
    "top_p": 0.95,
    "min_p": 0.05,
    "typical_p": 1.0,
    "repeat_penalty": 1.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
}
MAX_TOP_LOGPROBS = 20

# ----------------------------------------------------------------------------- llamacpp_args

# flag -> (key, converter). Keys are Llama() kwargs, sampling defaults (DEFAULT_SAMPLING keys),
# or the engine's own (chat_template, max_tokens, seed, _ignored).
_GGML_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "iq4_nl": 20, "bf16": 30}
_POOLING = {"none": 0, "mean": 1, "cls": 2, "last": 3, "rank": 4}


def _choice(table: dict[str, int]) -> Callable[[str], int]:
    def convert(value: str) -> int:
        if value not in table:
            raise ValueError(f"one of {', '.join(table)}")
        return table[value]

    return convert


def _on_off(value: str) -> bool:
    v = value.lower()
    if v in ("on", "true", "1", "auto", "enabled"):
        return True  # auto resolves to on for the CPU backend
    if v in ("off", "false", "0", "disabled"):
        return False
    raise ValueError("on, off or auto")


_VALUE_FLAGS: dict[str, tuple[str, Callable[[str], Any]]] = {}
for _names, _key, _conv in (
    (("-t", "--threads"), "n_threads", int),
    (("-tb", "--threads-batch"), "n_threads_batch", int),
    (("-b", "--batch-size"), "n_batch", int),
    (("-ub", "--ubatch-size"), "n_ubatch", int),
    (("--temp", "--temperature"), "temperature", float),
    (("--top-k",), "top_k", int),
    (("--top-p",), "top_p", float),
    (("--min-p",), "min_p", float),
    (("--typical",), "typical_p", float),
    (("--repeat-penalty",), "repeat_penalty", float),
    (("--repeat-last-n",), "last_n_tokens_size", int),
    (("--presence-penalty",), "presence_penalty", float),
    (("--frequency-penalty",), "frequency_penalty", float),
    (("-s", "--seed"), "seed", int),
    (("-n", "--n-predict", "--predict"), "max_tokens", int),
    (("-ctk", "--cache-type-k"), "type_k", _choice(_GGML_TYPES)),
    (("-ctv", "--cache-type-v"), "type_v", _choice(_GGML_TYPES)),
    (("--rope-freq-base",), "rope_freq_base", float),
    (("--rope-freq-scale",), "rope_freq_scale", float),
    (("--pooling",), "pooling_type", _choice(_POOLING)),
    (("--chat-template",), "chat_template", str),
    (("-np", "--parallel"), "_ignored", int),  # one request at a time per sidecar
):
    for _name in _names:
        _VALUE_FLAGS[_name] = (_key, _conv)

_SWITCHES: dict[str, tuple[str, Any]] = {
    "--no-mmap": ("use_mmap", False),
    "--mmap": ("use_mmap", True),
    "--mlock": ("use_mlock", True),
    "--swa-full": ("swa_full", True),
    "-v": ("verbose", True),  # llama.cpp's own log on the sidecar's stderr, which reaches WS /logs/stream
    "--verbose": ("verbose", True),
    "-nfa": ("flash_attn", False),
    "--no-flash-attn": ("flash_attn", False),
}
# Flags the engine accepts and ignores, grouped by what they set in llama-server (a group counts as one flag when
# llamacpp_args strings are merged: -cb and -nocb are the two values of one setting).
_IGNORED_GROUPS = (
    ("-np", "--parallel"),
    ("-cb", "--cont-batching", "-nocb", "--no-cont-batching"),
    ("--no-webui",),
    ("--metrics",),
    ("--no-warmup",),
    ("--log-disable",),
    ("--no-perf",),
)
_IGNORED_SETTING = {flag: group[-1] for group in _IGNORED_GROUPS for flag in group}
_SWITCHES.update({flag: ("_ignored", True) for flag in _IGNORED_SETTING if flag not in _VALUE_FLAGS})
# Lemonade forbids these in llamacpp_args: the recipe sets them itself.
_FORBIDDEN = {
    "-m",
    "--model",
    "--port",
    "--host",
    "-c",
    "--ctx-size",
    "-ngl",
    "--n-gpu-layers",
    "--gpu-layers",
    "--jinja",
    "--mmproj",
    "--embedding",
    "--embeddings",
    "--reranking",
    "--rerank",
    "--chat-template-file",
    "--lora",
    "-md",
    "--model-draft",
}


@dataclass(frozen=True)
class _Flag:
    """One flag of a ``llamacpp_args`` string.

    Attributes:
        setting: What it sets: aliases (``-t``, ``--threads``) and opposites (``--mmap``, ``--no-mmap``) share it.
        key: The engine setting it writes (``"_ignored"`` for flags the engine accepts and ignores).
        value: The value it writes.
        words: The flag and its value as written.
    """

    setting: str
    key: str
    value: Any
    words: tuple[str, ...]


def _split_llamacpp_args(args: str) -> list[_Flag]:
    """The flags of ``args`` in order (see :func:`parse_llamacpp_args`).

    Raises:
        InvalidArgument: An unknown or forbidden flag, or a bad value.
    """
    try:
        words = shlex.split(args or "")
    except ValueError as exc:
        raise InvalidArgument(f"llamacpp_args: {exc}") from exc
    flags: list[_Flag] = []
    i = 0
    while i < len(words):
        start, word = i, words[i]
        flag, eq, inline = word.partition("=") if word.startswith("--") else (word, "", "")
        i += 1
        if flag in _FORBIDDEN:
            raise InvalidArgument(f"llamacpp_args: {flag} is not allowed (lemonkit sets it)")
        if flag in ("-fa", "--flash-attn"):
            # llama-server takes on/off/auto; older builds took a bare switch
            value = inline if eq else None
            if value is None and i < len(words) and not words[i].startswith("-"):
                value = words[i]
                i += 1
            try:
                key, val = "flash_attn", (True if value is None else _on_off(value))
            except ValueError as exc:
                raise InvalidArgument(f"llamacpp_args: {flag} takes {exc}") from exc
        elif flag in _SWITCHES and not eq:
            key, val = _SWITCHES[flag]
        elif flag in _VALUE_FLAGS:
            key, conv = _VALUE_FLAGS[flag]
            if eq:
                raw = inline
            elif i < len(words):
                raw = words[i]
                i += 1
            else:
                raise InvalidArgument(f"llamacpp_args: {flag} needs a value")
            try:
                val = conv(raw)
            except ValueError as exc:
                raise InvalidArgument(f"llamacpp_args: bad value {raw!r} for {flag} ({exc})") from exc
        else:
            raise InvalidArgument(f"llamacpp_args: unknown or unsupported flag {word!r}")
        setting = _IGNORED_SETTING.get(flag, flag) if key == "_ignored" else key
        flags.append(_Flag(setting, key, val, tuple(words[start:i])))
    return flags


def parse_llamacpp_args(args: str) -> dict[str, Any]:
    """Parse llama-server style flags into engine settings.

    Returns keys among ``Llama()`` kwargs (``n_threads``, ``n_batch``, ``flash_attn``, ``use_mmap``,
    ``type_k``...), sampling defaults (``temperature``, ``top_k``...), ``seed``, ``max_tokens`` and
    ``chat_template``. A flag given twice takes its last value, as in llama-server.

    Raises:
        InvalidArgument: An unknown or forbidden flag, or a bad value.
    """
    out = {flag.key: flag.value for flag in _split_llamacpp_args(args)}
    out.pop("_ignored", None)
    return out


def merge_llamacpp_args(base: str, override: str) -> str:
    """``base`` flags (the server's) merged with ``override`` flags (a model's), flag by flag.

    A flag of ``base`` is dropped when ``override`` sets the same thing under any spelling (``-t 2`` replaces
    ``--threads 4``, ``--mmap`` replaces ``--no-mmap``); the rest are kept, before ``override``'s flags (so the
    engine's last-wins parse agrees with the merge).

    Returns:
        The merged flags; ``override`` or ``base`` unchanged when the other is empty.

    Raises:
        InvalidArgument: Either string is not valid ``llamacpp_args``.
    """
    theirs, mine = _split_llamacpp_args(base), _split_llamacpp_args(override)
    if not theirs or not mine:
        return override if mine else base
    replaced = {flag.setting for flag in mine}
    kept = [word for flag in theirs if flag.setting not in replaced for word in flag.words]
    return shlex.join(kept + [word for flag in mine for word in flag.words])


# ----------------------------------------------------------------------------- request state


@dataclass
class _Job:
    """One generation: the prompt and everything that shapes sampling."""

    tokens: list[int]
    sampling: dict[str, Any]
    seed: int
    max_tokens: int  # -1: until the context is full
    stops: list[str] = field(default_factory=list)
    grammar: str | None = None
    n_probs: int | None = None  # None: no logprobs; else top alternatives per token
    prompt: str = ""
    images: list[bytes] = field(default_factory=list)  # decoded image files (vision)


@dataclass
class _Run:
    """What one generation measured (filled in as it runs)."""

    t_start: float
    finish_reason: str = "length"
    prompt_tokens: int = 0
    cached: int = 0
    generated: int = 0
    prompt_ms: float = 0.0
    ttft: float = 0.0
    times: list[float] = field(default_factory=list)

    def timings(self) -> dict[str, Any]:
        prompt_n = self.prompt_tokens - self.cached
        predicted_ms = sum(self.times) * 1000.0
        n = self.generated
        return {
            "cache_n": self.cached,
            "prompt_n": prompt_n,
            "prompt_ms": self.prompt_ms,
            "prompt_per_token_ms": self.prompt_ms / prompt_n if prompt_n else 0.0,
            "prompt_per_second": prompt_n * 1000.0 / self.prompt_ms if self.prompt_ms > 0 else 0.0,
            "predicted_n": n,
            "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / n if n else 0.0,
            "predicted_per_second": n * 1000.0 / predicted_ms if predicted_ms > 0 else 0.0,
        }

    def usage(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.generated,
            "total_tokens": self.prompt_tokens + self.generated,
            "prompt_tokens_details": {"cached_tokens": self.cached},
        }


def _add_usage(runs: list[_Run]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Usage and timings summed over the runs of a multi-prompt completion."""
    if len(runs) == 1:
        return runs[0].usage(), runs[0].timings()
    total = _Run(t_start=runs[0].t_start)
    for r in runs:
        total.prompt_tokens += r.prompt_tokens
        total.cached += r.cached
        total.generated += r.generated
        total.prompt_ms += r.prompt_ms
        total.times.extend(r.times)
    return total.usage(), total.timings()


@dataclass
class _ChatPlan:
    """How to turn the generated text of a chat request into a message."""

    mode: str  # "plain" | "auto" (parse tool calls) | "forced" (grammar-constrained call)
    tools: ToolSpec | None
    in_reasoning: bool


def _completion_id(prefix: str) -> str:
    return prefix + secrets.token_urlsafe(24).replace("-", "x").replace("_", "y")[:32]


def _check(name: str, value: Any, ok: bool, what: str) -> None:
    if not ok:
        raise InvalidArgument(f"'{name}' must be {what}, got {value!r}")


# ----------------------------------------------------------------------------- engine


class LlamaCppEngine:
    """One GGUF loaded with llama-cpp-python, serving the OpenAI routes its ``type`` allows.

    Args:
        spec: ``model_path``; ``type`` ("llm", "embedding" or "reranking"); optional
            ``mmproj_path`` (vision), ``chat_format`` (a llama-cpp-python format name used when
            the GGUF has no chat template, e.g. "gemma") and ``options``: ``ctx_size`` (-1 or
            absent: the trained context capped at :data:`DEFAULT_CTX_SIZE`; 0: the trained
            context), ``n_threads`` (default: physical cores), ``llamacpp_args``
            (llama-server flags, see :func:`parse_llamacpp_args`).

    Raises:
        InvalidArgument: Bad options.
        ModelLoadError: The model (or mmproj) does not load.
    """

    def __init__(self, spec: LoadSpec) -> None:
        import llama_cpp

        self._lc = llama_cpp
        self.spec = spec
        kind = spec.get("type") or "llm"
        self.kind = {"embeddings": "embedding", "rerank": "reranking", "reranker": "reranking"}.get(kind, kind)
        if self.kind not in ("llm", "embedding", "reranking"):
            raise ModelLoadError(f"llamacpp cannot serve model type {self.kind!r}")
        path = spec.get("model_path")
        if not path or not os.path.isfile(path):
            raise ModelLoadError(f"model file not found: {path}")
        options = dict(spec.get("options") or {})
        args = parse_llamacpp_args(str(options.get("llamacpp_args") or ""))

        self.n_ctx_train = read_gguf_context_length(path)
        ctx = options.get("ctx_size")
        if ctx is not None and (not isinstance(ctx, int) or isinstance(ctx, bool) or ctx < -1):
            raise InvalidArgument(f"ctx_size must be a positive integer, -1 or 0, got {ctx!r}")
        # The server predicts this size (the options routes' resolved_ctx_size) with the same function.
        ctx = llamacpp_context_size(ctx, self.n_ctx_train)
        # The typed option beats a -t in llamacpp_args; physical cores beat SMT siblings for decode.
        arg_threads = args.pop("n_threads", None)
        threads = options.get("n_threads") or arg_threads or _physical_cores()
        if not isinstance(threads, int) or threads < 1:
            raise InvalidArgument(f"n_threads must be a positive integer, got {threads!r}")

        self._sampling = {k: args.pop(k) if k in args else v for k, v in DEFAULT_SAMPLING.items()}
        self._default_seed: int | None = args.pop("seed", None)
        self._default_max_tokens: int = args.pop("max_tokens", -1)
        template_override: str | None = args.pop("chat_template", None)

        kwargs: dict[str, Any] = {
            "n_ctx": ctx,
            "n_threads": threads,
            "n_threads_batch": args.pop("n_threads_batch", threads),
            "n_batch": DEFAULT_N_BATCH,
            "n_ubatch": DEFAULT_N_BATCH,
            "flash_attn": True,  # llama-server's "auto" on CPU; +10% tok/s measured on gemma-270m
            "verbose": False,
        }
        if self.kind != "llm":
            # Non-causal encoders must see a whole input in one ubatch.
            kwargs.update(embedding=True, n_batch=ctx, n_ubatch=ctx)
            if self.kind == "reranking":
                kwargs["pooling_type"] = self._lc.LLAMA_POOLING_TYPE_RANK
        kwargs.update(args)
        self._kwargs = kwargs
        try:
            self._llm: Any = llama_cpp.Llama(model_path=path, **kwargs)
        except (ValueError, RuntimeError, OSError) as exc:
            raise ModelLoadError(f"llama.cpp could not load {os.path.basename(path)}: {exc}") from exc

        llm = self._llm
        self._n_ctx: int = llm.n_ctx()
        self._n_vocab: int = llm.n_vocab()
        self._vocab = llm._model.vocab
        self._add_bos: bool = bool(llm._model.add_bos_token())
        self._bos: int = llm.token_bos()
        self._bos_text: str = llm._model.token_get_text(self._bos) if self._bos >= 0 else ""
        if self.n_ctx_train is None:
            self.n_ctx_train = llm._model.n_ctx_train()
        self._pieces: dict[int, tuple[bytes, bool, str | None]] = {}
        self._fingerprint = f"llama-cpp-python-{llama_cpp.__version__}"
        self._stats: dict[str, Any] = {}
        self._closed = False

        # Chat prompt: an explicit template, else the GGUF's, else a llama-cpp-python format.
        self._template: ChatTemplate | None = None
        self._formatter: Any = None
        self._format_name: str | None = None
        if self.kind == "llm":
            self._setup_chat_format(template_override, spec.get("chat_format"))

        self._mtmd: Any = None
        self._marker = ""
        mmproj = spec.get("mmproj_path")
        if mmproj and self.kind == "llm":
            self._setup_vision(mmproj)

    # ------------------------------------------------------------------ setup

    def _setup_chat_format(self, override: str | None, chat_format: str | None) -> None:
        from llama_cpp import llama_chat_format

        model = self._llm._model
        bos = self._bos_text
        eos_id = self._llm.token_eos()
        eos = model.token_get_text(eos_id) if eos_id >= 0 else ""
        source = None
        if override is not None:
            if _formatter_by_name(llama_chat_format, override) is not None:
                chat_format = override  # llama-server also takes built-in template names
            else:
                source = override
        if source is None and override is None:
            source = self._llm.metadata.get("tokenizer.chat_template") or None
        if source is not None:
            try:
                self._template = ChatTemplate(source, bos_token=bos, eos_token=eos)
            except ValueError as exc:
                raise ModelLoadError(str(exc)) from exc
            return
        # llama-server falls back to ChatML when a model has no template
        name = chat_format or "chatml"
        self._formatter = _formatter_by_name(llama_chat_format, name)
        if self._formatter is None:
            raise ModelLoadError(f"unknown chat_format {name!r}")
        self._format_name = name

    def _setup_vision(self, mmproj: str) -> None:
        try:
            from llama_cpp import mtmd_cpp
            from llama_cpp.llama_chat_format import MTMDChatHandler

            handler = MTMDChatHandler(clip_model_path=mmproj, verbose=False, use_gpu=False)
            handler._init_mtmd_context(self._llm)
        except (ValueError, RuntimeError, OSError, ImportError, AttributeError) as exc:
            raise ModelLoadError(f"could not load the mmproj {os.path.basename(mmproj)}: {exc}") from exc
        self._mtmd = handler
        self._marker = mtmd_cpp.mtmd_default_marker().decode("utf-8")
        # mtmd logs every prompt and image to stderr on its own; route it through llama-cpp-python's
        # logger, which keeps only errors when verbose is off.
        from llama_cpp._logger import llama_log_callback

        mtmd_cpp.mtmd_log_set(llama_log_callback, None)
        mtmd_cpp.mtmd_helper_log_set(llama_log_callback, None)

    # ------------------------------------------------------------------ protocol

    def info(self) -> dict[str, Any]:
        """Facts about the loaded model (resolved ``ctx_size``, threads, ...)."""
        return {
            "type": self.kind,
            "ctx_size": self._n_ctx,
            "n_ctx_train": self.n_ctx_train,
            "n_threads": self._kwargs["n_threads"],
            "n_batch": self._kwargs["n_batch"],
            "flash_attn": bool(self._kwargs["flash_attn"]),
            "device": "cpu",
            "vision": self._mtmd is not None,
            "chat_template": "jinja" if self._template is not None else self._format_name,
            "engine": self._fingerprint,
        }

    def stats(self) -> dict[str, Any]:
        """``/v1/stats`` fields of the last generation (empty before the first)."""
        return dict(self._stats)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._llm.close()

    def chat(self, body: dict[str, Any], *, cancelled: Cancelled) -> dict[str, Any] | Iterator[dict[str, Any]]:
        """``/v1/chat/completions``; validates eagerly, so bad input raises before any chunk."""
        if self.kind != "llm":
            raise ModelNotApplicable(f"this is a {self.kind} model: it does not serve chat completions")
        t_start = time.perf_counter()
        job, plan = self._chat_job(body)
        base = {
            "id": _completion_id("chatcmpl-"),
            "object": "chat.completion.chunk" if body.get("stream") else "chat.completion",
            "created": int(time.time()),
            "model": body.get("model", ""),
            "system_fingerprint": self._fingerprint,
        }
        run = _Run(t_start=t_start)
        deltas = self._chat_deltas(job, plan, run, cancelled)
        if body.get("stream"):
            opts = body.get("stream_options")
            include_usage = bool(opts.get("include_usage")) if isinstance(opts, dict) else False
            return self._chat_stream(base, deltas, run, job, include_usage, cancelled)
        return self._chat_once(base, deltas, run, job)

    def complete(self, body: dict[str, Any], *, cancelled: Cancelled) -> dict[str, Any] | Iterator[dict[str, Any]]:
        """``/v1/completions``: one choice per prompt, in order."""
        if self.kind != "llm":
            raise ModelNotApplicable(f"this is a {self.kind} model: it does not serve completions")
        t_start = time.perf_counter()
        prompt = body.get("prompt")
        prompts = [prompt] if isinstance(prompt, str) else prompt
        if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
            raise InvalidArgument("'prompt' must be a string or a non-empty array of strings")
        logprobs = body.get("logprobs")
        if logprobs is None or logprobs is False:
            n_probs = None
        elif logprobs is True:
            n_probs = 1
        else:
            _check(
                "logprobs",
                logprobs,
                isinstance(logprobs, int) and 0 <= logprobs <= MAX_TOP_LOGPROBS,
                f"a boolean or an integer from 0 to {MAX_TOP_LOGPROBS}",
            )
            n_probs = int(logprobs)
        jobs = [self._job(body, self._tokenize(p), n_probs=n_probs, prompt=p) for p in prompts]
        base = {
            "id": _completion_id("cmpl-"),
            "object": "text_completion",
            "created": int(time.time()),
            "model": body.get("model", ""),
            "system_fingerprint": self._fingerprint,
        }
        echo = bool(body.get("echo"))
        if body.get("stream"):
            return self._complete_stream(base, jobs, echo, t_start, cancelled)
        return self._complete_once(base, jobs, echo, t_start, cancelled)

    def embed(self, body: dict[str, Any]) -> dict[str, Any]:
        """``/v1/embeddings``: L2-normalised float vectors, one per input."""
        if self.kind != "embedding":
            raise NotEmbeddingModel("this model was not loaded for embeddings")
        raw = body.get("input")
        inputs = [raw] if isinstance(raw, str) else raw
        if not isinstance(inputs, list) or not inputs or not all(isinstance(s, str) for s in inputs):
            raise InvalidArgument("'input' must be a string or a non-empty array of strings")
        limit = self._kwargs["n_ubatch"]
        for i, text in enumerate(inputs):
            n = len(self._llm.tokenize(text.encode("utf-8"), add_bos=True, special=False))
            if n > limit:
                raise InvalidArgument(f"input[{i}] has {n} tokens, more than the model's {limit}-token window")
        try:
            vectors, n_tokens = self._llm.embed(inputs, normalize=True, truncate=False, return_count=True)
        except (ValueError, RuntimeError) as exc:
            raise InvalidArgument(f"embedding failed: {exc}") from exc
        data = []
        for i, vec in enumerate(vectors):
            if vec and isinstance(vec[0], list):  # pooling "none": one vector per token -> mean, renormalise
                vec = _l2([sum(col) / len(vec) for col in zip(*vec, strict=True)])
            data.append({"object": "embedding", "index": i, "embedding": [float(x) for x in vec]})
        return {
            "object": "list",
            "data": data,
            "model": body.get("model", ""),
            "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
        }

    def rerank(self, body: dict[str, Any]) -> dict[str, Any]:
        """``/v1/rerank``: documents scored against ``query``, best first (llama-server's shape)."""
        if self.kind != "reranking":
            raise ModelNotApplicable("this model was not loaded for reranking")
        query = body.get("query")
        docs = body.get("documents")
        if not isinstance(query, str):
            raise InvalidArgument("'query' must be a string")
        if not isinstance(docs, list) or not docs or not all(isinstance(d, str) for d in docs):
            raise InvalidArgument("'documents' must be a non-empty array of strings")
        top_n = body.get("top_n")
        if top_n is not None:
            _check("top_n", top_n, isinstance(top_n, int) and top_n >= 1, "a positive integer")
        from lemonkit.backends.llama_rank import rank_scores

        try:
            scores, n_tokens = rank_scores(self._llm, query, docs)
        except (ValueError, RuntimeError) as exc:
            raise InvalidArgument(f"rerank failed: {exc}") from exc
        order = sorted(range(len(docs)), key=lambda i: scores[i], reverse=True)
        if top_n is not None:
            order = order[:top_n]
        results = []
        for i in order:
            item: dict[str, Any] = {"index": i, "relevance_score": float(scores[i])}
            if body.get("return_documents"):
                item["document"] = {"text": docs[i]}
            results.append(item)
        return {
            "model": body.get("model", ""),
            "object": "list",
            "results": results,
            "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
        }

    # ------------------------------------------------------------------ request parsing

    def _tokenize(self, text: str) -> list[int]:
        # Templates usually write {{ bos_token }} themselves: keep one BOS, as llama-server does
        # (and spare llama.cpp's "2 BOS tokens" warning on every request).
        add_bos = self._add_bos and not (self._bos_text and text.startswith(self._bos_text))
        tokens: list[int] = self._llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=True)
        if self._add_bos and len(tokens) >= 2 and tokens[0] == tokens[1] == self._bos:
            tokens = tokens[1:]
        if not tokens:
            raise InvalidArgument("the prompt is empty")
        if len(tokens) >= self._n_ctx:
            raise InvalidArgument(
                f"the request needs {len(tokens)} prompt tokens, more than the context size ({self._n_ctx}) allows"
            )
        return tokens

    def _job(
        self,
        body: dict[str, Any],
        tokens: list[int],
        *,
        n_probs: int | None,
        prompt: str = "",
        extra_stops: list[str] | None = None,
        grammar: str | None = None,
    ) -> _Job:
        """Validate the sampling parameters shared by chat and completions."""
        s = dict(self._sampling)
        g = body.get
        for key, lo, hi in (
            ("temperature", 0.0, None),
            ("top_p", 0.0, 1.0),
            ("min_p", 0.0, 1.0),
            ("typical_p", 0.0, 1.0),
            ("repeat_penalty", 1.0, 2.0),
            ("frequency_penalty", -2.0, 2.0),
            ("presence_penalty", -2.0, 2.0),
        ):
            v = g(key)
            if v is None:
                continue
            ok = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v >= lo
            ok = ok and (hi is None or v <= hi)
            _check(key, v, ok, f"a number from {lo} to {hi}" if hi is not None else f"a number >= {lo}")
            s[key] = float(v)
        top_k = g("top_k")
        if top_k is not None:
            _check("top_k", top_k, isinstance(top_k, int) and top_k >= 0, "an integer >= 0 (0: all tokens)")
            s["top_k"] = top_k
        sampling = {
            "temp": s["temperature"],
            "top_k": s["top_k"],
            "top_p": s["top_p"],
            "min_p": s["min_p"],
            "typical_p": s["typical_p"],
            "repeat_penalty": s["repeat_penalty"],
            "frequency_penalty": s["frequency_penalty"],
            "presence_penalty": s["presence_penalty"],
        }
        seed = g("seed")
        if seed is None:
            seed = self._default_seed
        _check("seed", seed, seed is None or (isinstance(seed, int) and not isinstance(seed, bool)), "an integer")
        # -1 (llama.cpp's "random") or none: a fresh seed; else the low 32 bits, as llama.cpp keeps
        seed = random.getrandbits(32) if seed is None or seed == -1 else seed & 0xFFFFFFFF
        if seed == self._lc.LLAMA_DEFAULT_SEED:
            seed -= 1  # that value means "random" to the sampler

        max_tokens = g("max_tokens")
        if max_tokens is None:
            max_tokens = g("max_completion_tokens")
        if max_tokens is None:
            max_tokens = self._default_max_tokens
        _check(
            "max_tokens",
            max_tokens,
            isinstance(max_tokens, int) and (max_tokens >= 1 or max_tokens == -1),
            "a positive integer (or -1: until the context is full)",
        )

        stop = g("stop")
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if not all(isinstance(x, str) for x in stops):
            raise InvalidArgument("'stop' must be a string or an array of strings")
        stops = [x for x in stops + (extra_stops or []) if x]

        if grammar is not None:
            self._check_grammar(grammar)
        return _Job(
            tokens=tokens,
            sampling=sampling,
            seed=seed,
            max_tokens=max_tokens,
            stops=stops,
            grammar=grammar,
            n_probs=n_probs,
            prompt=prompt,
        )

    def _check_grammar(self, gbnf: str) -> None:
        # llama-cpp-python adds a NULL sampler (and crashes in C) when a grammar does not parse:
        # parse it here first.
        sampler = self._lc.llama_sampler_init_grammar(self._vocab, gbnf.encode("utf-8"), b"root")
        if not sampler:
            raise InvalidArgument("the response format or tool schema could not be turned into a grammar")
        self._lc.llama_sampler_free(sampler)

    def _chat_job(self, body: dict[str, Any]) -> tuple[_Job, _ChatPlan]:
        tools = parse_tools(body.get("tools"))
        choice = body.get("tool_choice")
        forced: str | None = None
        if choice is None or choice == "auto":
            mode = "auto" if tools else "plain"
        elif choice == "none":
            mode = "plain"
        elif choice == "required":
            mode = "forced"
        elif isinstance(choice, dict):
            fn = choice.get("function")
            name = fn.get("name") if isinstance(fn, dict) else None
            if choice.get("type", "function") != "function" or not isinstance(name, str):
                raise InvalidArgument("tool_choice must be auto, none, required or a function: {'function': {name}}")
            mode, forced = "forced", name
        else:
            raise InvalidArgument(f"unsupported tool_choice {choice!r}")
        if mode == "forced":
            if tools is None:
                raise InvalidArgument("tool_choice requires a tool but the request has no 'tools'")
            if forced is not None and forced not in tools.params:
                raise InvalidArgument(f"tool_choice names {forced!r}, which is not among the request's tools")
        prompt_tools = tools if mode != "plain" else None

        logprobs = bool(body.get("logprobs"))
        n_probs = None
        if logprobs:
            top = body.get("top_logprobs") or 0
            _check(
                "top_logprobs",
                top,
                isinstance(top, int) and 0 <= top <= MAX_TOP_LOGPROBS,
                f"an integer from 0 to {MAX_TOP_LOGPROBS}",
            )
            n_probs = int(top)

        thinking = body.get("enable_thinking")
        if thinking is None:
            thinking = body.get("thinking")
            if isinstance(thinking, dict):  # {"type": "enabled" | "disabled"}
                thinking = thinking.get("type") != "disabled"
        enable_thinking = None if thinking is None else bool(thinking)

        if mode == "forced":
            assert tools is not None
            grammar: str | None = tool_call_grammar(tools, forced)
        else:
            grammar = response_format_grammar(body.get("response_format"))
        if grammar is not None and enable_thinking is None:
            enable_thinking = False  # constrained output starts at once: ask thinking templates for no think block

        images: list[str] | None = [] if self._mtmd is not None else None
        marker = self._marker if self._mtmd is not None else None
        extra_stops: list[str] = []
        if self._template is not None:
            tmpl = self._template
            messages = normalize_messages(
                body.get("messages"), tools_in_template=tmpl.supports_tools, image_marker=marker, images=images
            )
            if prompt_tools is not None and not tmpl.supports_tools:
                messages = _with_system(messages, tool_system_prompt(prompt_tools))
            prompt = tmpl.render(
                messages,
                tools=prompt_tools.tools if prompt_tools and tmpl.supports_tools else None,
                enable_thinking=enable_thinking,
            )
        else:
            messages = normalize_messages(
                body.get("messages"), tools_in_template=False, image_marker=marker, images=images
            )
            if prompt_tools is not None:
                messages = _with_system(messages, tool_system_prompt(prompt_tools))
            if self._format_name == "gemma":  # Gemma's format drops system turns: fold them into the user's
                messages = merge_system_messages(messages)
            try:
                response = self._formatter(messages=messages)
            except (KeyError, TypeError, ValueError) as exc:
                raise InvalidArgument(f"chat format {self._format_name!r} failed on these messages: {exc}") from exc
            prompt = response.prompt
            stop = response.stop
            extra_stops = [stop] if isinstance(stop, str) else list(stop or [])

        if grammar is not None and prompt_opens_thinking(prompt):
            prompt += "\n</think>\n\n"  # a template that always opens <think>: close it, empty
        # Vision prompts are tokenized again by mtmd with their images (_vision_prefill); the text
        # alone already tells whether the prompt fits.
        tokens = self._tokenize(prompt)
        job = self._job(body, tokens, n_probs=n_probs, prompt=prompt, extra_stops=extra_stops, grammar=grammar)
        job.images = [_decode_data_url(url) for url in images or []]
        in_reasoning = grammar is None and prompt_opens_thinking(prompt)
        if mode == "auto" and grammar is not None:
            mode = "plain"  # a response_format grammar leaves no room for tool-call markup
        return job, _ChatPlan(mode=mode, tools=tools if mode != "plain" else None, in_reasoning=in_reasoning)

    # ------------------------------------------------------------------ generation core

    def _piece(self, token: int) -> tuple[bytes, bool, str | None]:
        """A token's bytes, whether it ends generation, and its text when the bytes decode alone (cached)."""
        buf = ctypes.create_string_buffer(64)
        n = self._lc.llama_token_to_piece(self._vocab, token, buf, 64, 0, False)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = self._lc.llama_token_to_piece(self._vocab, token, buf, -n, 0, False)
        raw = buf.raw[:n]
        try:
            text: str | None = raw.decode("utf-8")
        except UnicodeDecodeError:
            text = None  # part of a multi-byte character: goes through the incremental decoder
        entry = (raw, bool(self._lc.llama_vocab_is_eog(self._vocab, token)), text)
        self._pieces[token] = entry
        return entry

    def _prefill(self, tokens: list[int]) -> int:
        """Evaluate the prompt, reusing the longest cached prefix; return how many tokens were reused.

        Leaves the context exactly at ``tokens`` so ``Llama.generate`` samples without re-evaluating.
        """
        import numpy as np

        llm = self._llm
        n_cached = llm.n_tokens
        prefix = 0
        if n_cached > 0:
            m = min(n_cached, len(tokens))
            diff = np.nonzero(llm.input_ids[:m] != np.asarray(tokens[:m], dtype=np.intc))[0]
            prefix = int(diff[0]) if len(diff) else m
        if prefix == len(tokens) == n_cached and not getattr(llm, "_requires_eval", True):
            return prefix
        # At least one token must be evaluated to get fresh logits.
        reuse = min(prefix, len(tokens) - 1)
        if reuse > 0 and llm._ctx.kv_cache_seq_rm(-1, reuse, -1):
            llm.n_tokens = reuse
        else:
            llm.reset()
            llm._ctx.kv_cache_clear()
            reuse = 0
        llm.eval(tokens[reuse:])
        return reuse

    def _vision_prefill(self, job: _Job) -> list[int]:
        """Tokenize the prompt with its images through mtmd and evaluate it; return the positions as ids."""
        mtmd = self._mtmd._mtmd_cpp
        handler = self._mtmd
        llm = self._llm
        bitmaps = []
        try:
            for data in job.images:
                try:
                    bitmaps.append(handler._create_bitmap_from_bytes(data))
                except ValueError as exc:
                    raise InvalidArgument(f"could not decode the image: {exc}") from exc
            prompt = job.prompt
            bos = self._bos_text if self._add_bos else ""
            if bos and prompt.startswith(bos):
                prompt = prompt[len(bos) :]  # mtmd adds the BOS itself (add_special): keep one, as llama-server
            text = mtmd.mtmd_input_text()
            raw = prompt.encode("utf-8")
            text.text = raw
            text.text_len = len(raw)
            text.add_special = self._add_bos
            text.parse_special = True
            chunks = mtmd.mtmd_input_chunks_init()
            try:
                arr = (mtmd.mtmd_bitmap_p_ctypes * len(bitmaps))(*bitmaps)
                if mtmd.mtmd_tokenize(handler.mtmd_ctx, chunks, ctypes.byref(text), arr, len(bitmaps)) != 0:
                    raise InvalidArgument("the number of images does not match the prompt's image markers")
                llm.reset()
                llm._ctx.kv_cache_clear()
                for i in range(mtmd.mtmd_input_chunks_size(chunks)):
                    chunk = mtmd.mtmd_input_chunks_get(chunks, i)
                    kind = mtmd.mtmd_input_chunk_get_type(chunk)
                    if kind == mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT:
                        n = ctypes.c_size_t()
                        ptr = mtmd.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
                        toks = [ptr[j] for j in range(n.value)]
                        if llm.n_tokens + len(toks) >= self._n_ctx:
                            raise InvalidArgument("the prompt with its images exceeds the context size")
                        llm.eval(toks)
                    else:
                        if llm.n_tokens + mtmd.mtmd_input_chunk_get_n_tokens(chunk) >= self._n_ctx:
                            raise InvalidArgument("the prompt with its images exceeds the context size")
                        new_past = self._lc.llama_pos(0)
                        rc = mtmd.mtmd_helper_eval_chunk_single(
                            handler.mtmd_ctx,
                            llm._ctx.ctx,
                            chunk,
                            self._lc.llama_pos(llm.n_tokens),
                            self._lc.llama_seq_id(0),
                            llm.n_batch,
                            False,
                            ctypes.byref(new_past),
                        )
                        if rc != 0:
                            raise InvalidArgument(f"evaluating an image failed (code {rc})")
                        llm.n_tokens = new_past.value
            finally:
                mtmd.mtmd_input_chunks_free(chunks)
        finally:
            for bm in bitmaps:
                mtmd.mtmd_bitmap_free(bm)
        return [int(t) for t in llm.input_ids[: llm.n_tokens]]

    def _logprob(self, token: int, n_top: int) -> tuple[float, list[tuple[int, float]]]:
        """Log-probability of ``token`` and the ``n_top`` best alternatives, from the logits it was sampled from."""
        import numpy as np

        ptr = self._lc.llama_get_logits_ith(self._llm._ctx.ctx, -1)
        logits = np.ctypeslib.as_array(ptr, shape=(self._n_vocab,))
        m = float(logits.max())
        lse = m + math.log(float(np.exp(logits - m).sum()))
        tops: list[tuple[int, float]] = []
        if n_top > 0:
            idx = np.argpartition(logits, -n_top)[-n_top:]
            idx = idx[np.argsort(-logits[idx])]
            tops = [(int(i), float(logits[i]) - lse) for i in idx]
        return float(logits[token]) - lse, tops

    def _grammar_tokens(self, gbnf: str, sampling: dict[str, Any]) -> Iterator[int]:
        """Sample under a grammar the way llama-server does: grammar last, and only when needed.

        ``Llama.generate`` puts the grammar first in the sampler chain, which checks every vocab
        entry against the grammar on every token (4x slower on Gemma's 262k vocab). Here the
        ordinary chain picks a token, the grammar checks just that one, and only a rejected
        token costs a full grammar pass and a resample. Expects the prompt already evaluated.
        """
        import numpy as np

        lc = self._lc
        llm = self._llm
        n_vocab = self._n_vocab
        chain = llm._init_sampler(**sampling)  # same chain (and seed) as Llama.generate builds
        grammar = lc.llama_sampler_init_grammar(self._vocab, gbnf.encode("utf-8"), b"root")
        if not grammar:
            raise InvalidArgument("the response format or tool schema could not be turned into a grammar")
        dtype = np.dtype([("id", np.intc), ("logit", np.single), ("p", np.single)], align=True)
        cand = np.zeros(n_vocab, dtype=dtype)
        ids = np.arange(n_vocab, dtype=np.intc)
        cand_ptr = cand.ctypes.data_as(lc.llama_token_data_p)
        cur = lc.llama_token_data_array(data=cand_ptr, size=n_vocab, selected=-1, sorted=False)
        one = (lc.llama_token_data * 1)()
        one_ptr = ctypes.cast(one, lc.llama_token_data_p)
        single = lc.llama_token_data_array(data=one_ptr, size=1, selected=-1, sorted=False)
        cur_ref, single_ref = ctypes.byref(cur), ctypes.byref(single)
        ctx = llm._ctx.ctx

        def load_logits() -> None:
            # Samplers may repoint ``data`` and shrink ``size``: reset the whole array each time.
            cand["id"] = ids
            cand["logit"] = np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))
            cand["p"] = 0.0
            cur.data, cur.size, cur.selected, cur.sorted = cand_ptr, n_vocab, -1, False

        try:
            while True:
                load_logits()
                lc.llama_sampler_apply(chain.sampler, cur_ref)
                token = int(cur.data[cur.selected].id)
                one[0].id, one[0].logit, one[0].p = token, 1.0, 0.0
                single.data, single.size, single.selected, single.sorted = one_ptr, 1, -1, False
                lc.llama_sampler_apply(grammar, single_ref)
                if single.data[0].logit == -math.inf:  # the grammar rejects it: sample again, grammar first
                    load_logits()
                    lc.llama_sampler_apply(grammar, cur_ref)
                    lc.llama_sampler_apply(chain.sampler, cur_ref)
                    token = int(cur.data[cur.selected].id)
                eog = (self._pieces.get(token) or self._piece(token))[1]
                if not eog:  # the grammar aborts on an end token it does not expect; the caller stops there
                    lc.llama_sampler_accept(grammar, token)
                lc.llama_sampler_accept(chain.sampler, token)
                yield token
                llm.eval([token])
        finally:
            lc.llama_sampler_free(grammar)
            chain.close()

    def _generate(self, job: _Job, run: _Run, cancelled: Cancelled) -> Iterator[tuple[str, Any]]:
        """Yield ``(text, logprob)`` per generated token; ``text`` may be "" while a stop string is undecided.

        ``logprob`` is None unless ``job.n_probs`` is set, else ``(token, bytes, logprob, tops)``.
        Fills ``run`` and ``self._stats`` as it goes (also when the consumer stops early).
        """
        llm = self._llm
        t0 = time.perf_counter()
        if job.images:
            tokens = self._vision_prefill(job)
            run.cached = 0
        else:
            tokens = job.tokens
            run.cached = self._prefill(tokens)
        now = time.perf_counter()
        run.prompt_ms = (now - t0) * 1000.0
        run.prompt_tokens = len(tokens)
        room = self._n_ctx - len(tokens)
        max_tokens = room if job.max_tokens < 0 else min(job.max_tokens, room)
        run.finish_reason = "length"

        llm.set_seed(job.seed)
        if job.grammar is not None:
            gen: Any = self._grammar_tokens(job.grammar, job.sampling)
        else:
            gen = llm.generate(tokens, reset=True, **job.sampling)
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        decode = decoder.decode
        pending = False  # the decoder holds part of a character
        stopper = StopMatcher(job.stops) if job.stops else None
        pieces = self._pieces
        n_probs = job.n_probs
        times = run.times
        last = now
        n = 0
        try:
            if max_tokens <= 0:
                return
            for token in gen:
                t = time.perf_counter()
                entry = pieces.get(token) or self._piece(token)
                if entry[1]:  # end of generation
                    run.finish_reason = "stop"
                    break
                times.append(t - last)
                last = t
                if n == 0:
                    run.ttft = t - run.t_start
                n += 1
                run.generated = n
                text = entry[2]
                if text is None or pending:
                    text = decode(entry[0])
                    pending = bool(decoder.buffer)
                lp = None
                if n_probs is not None:
                    lp = (token, entry[0], *self._logprob(token, n_probs))
                if stopper is not None:
                    text = stopper.feed(text)
                    if stopper.stopped:
                        run.finish_reason = "stop"
                        yield text, lp
                        break
                yield text, lp
                if n >= max_tokens:
                    break
                if cancelled():
                    run.finish_reason = "cancelled"
                    break
            if run.finish_reason != "cancelled":
                tail = decode(b"", final=True)
                if stopper is not None:
                    tail = stopper.feed(tail) + stopper.finish()
                if tail:
                    yield tail, None
        finally:
            gen.close()
            if job.images:
                llm.reset()  # image positions hold no token ids: never prefix-match them
            self._record(run)

    def _record(self, run: _Run) -> None:
        decode_s = sum(run.times)
        self._stats = {
            "time_to_first_token": run.ttft if run.generated else (time.perf_counter() - run.t_start),
            "tokens_per_second": run.generated / decode_s if decode_s > 0 else 0.0,
            "input_tokens": run.prompt_tokens - run.cached,
            "output_tokens": run.generated,
            "decode_token_times": list(run.times),
            "prompt_tokens": run.prompt_tokens,
        }

    # ------------------------------------------------------------------ chat

    def _chat_logprob(self, lp: tuple[int, bytes, float, list[tuple[int, float]]]) -> dict[str, Any]:
        _, raw, value, tops = lp
        return {
            "token": raw.decode("utf-8", "replace"),
            "logprob": value,
            "bytes": list(raw),
            "top_logprobs": [
                {"token": b.decode("utf-8", "replace"), "logprob": v, "bytes": list(b)}
                for b, v in ((self._token_bytes(i), v) for i, v in tops)
            ],
        }

    def _token_bytes(self, token: int) -> bytes:
        entry = self._pieces.get(token) or self._piece(token)
        return entry[0]

    def _chat_deltas(
        self, job: _Job, plan: _ChatPlan, run: _Run, cancelled: Cancelled
    ) -> Iterator[tuple[dict[str, Any], list[dict[str, Any]] | None]]:
        """OpenAI ``delta`` dicts for the generated text, with the logprobs of the tokens behind them."""
        pending: list[dict[str, Any]] = []
        want_lp = job.n_probs is not None
        if plan.mode == "forced":
            forced = ForcedToolStream()
            call_id = new_call_id()
            raw: list[str] = []
            named = False
            for text, lp in self._generate(job, run, cancelled):
                if want_lp and lp is not None:
                    pending.append(self._chat_logprob(lp))
                raw.append(text)
                for kind, value in forced.feed(text):
                    if kind == "tool_name":
                        named = True
                        part = {
                            "index": 0,
                            "id": call_id,
                            "type": "function",
                            "function": {"name": value, "arguments": ""},
                        }
                    else:
                        part = {"index": 0, "function": {"arguments": value}}
                    yield {"tool_calls": [part]}, pending or None
                    pending = []
            events, call = forced.finish()
            for _, value in events:
                yield {"tool_calls": [{"index": 0, "function": {"arguments": value}}]}, pending or None
                pending = []
            if call is not None:
                run.finish_reason = "tool_calls"
            elif not named and "".join(raw):
                yield {"content": "".join(raw)}, pending or None  # cut before the name: keep the text
                pending = []
            if pending:
                yield {}, pending
            return

        parser = StreamParser(
            in_reasoning=plan.in_reasoning, tool_names=plan.tools.names if plan.mode == "auto" and plan.tools else None
        )
        n_calls = 0

        def deltas(events: Any, logprobs: list[Any]) -> Iterator[tuple[dict[str, Any], list[Any] | None]]:
            nonlocal n_calls
            for kind, value in events:
                if kind == "content":
                    yield {"content": value}, logprobs or None
                elif kind == "reasoning":
                    yield {"reasoning_content": value}, logprobs or None
                else:
                    yield from self._call_deltas(n_calls, value, logprobs)
                    n_calls += 1
                logprobs = []  # each logprob rides on the first delta after its token

        def flush(events: Any) -> Iterator[tuple[dict[str, Any], list[Any] | None]]:
            nonlocal pending
            for delta in deltas(events, pending):
                pending = []
                yield delta

        for text, lp in self._generate(job, run, cancelled):
            if lp is not None:
                pending.append(self._chat_logprob(lp))
            if text:
                yield from flush(parser.feed(text))
        yield from flush(parser.finish())
        if n_calls and run.finish_reason != "cancelled":
            run.finish_reason = "tool_calls"
        if pending:
            yield {}, pending

    @staticmethod
    def _call_deltas(
        index: int, call: dict[str, str], lps: list[dict[str, Any]]
    ) -> Iterator[tuple[dict[str, Any], list[dict[str, Any]] | None]]:
        """A parsed call as two parts: id and name first, then the arguments."""
        head = {
            "index": index,
            "id": new_call_id(),
            "type": "function",
            "function": {"name": call["name"], "arguments": ""},
        }
        yield {"tool_calls": [head]}, lps or None
        yield {"tool_calls": [{"index": index, "function": {"arguments": call["arguments"]}}]}, None

    def _chat_once(
        self, base: dict[str, Any], deltas: Iterator[tuple[dict[str, Any], Any]], run: _Run, job: _Job
    ) -> dict[str, Any]:
        content: list[str] = []
        reasoning: list[str] = []
        calls: dict[int, dict[str, Any]] = {}
        logprobs: list[dict[str, Any]] = []
        for delta, lps in deltas:
            if lps:
                logprobs.extend(lps)
            if "content" in delta:
                content.append(delta["content"])
            elif "reasoning_content" in delta:
                reasoning.append(delta["reasoning_content"])
            elif "tool_calls" in delta:
                for part in delta["tool_calls"]:
                    call = calls.setdefault(
                        part["index"], {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
                    )
                    if "id" in part:
                        call["id"] = part["id"]
                        call["function"]["name"] = part["function"]["name"]
                    call["function"]["arguments"] += part["function"].get("arguments", "")
        message: dict[str, Any] = {"role": "assistant", "content": "".join(content)}
        if reasoning:
            message["reasoning_content"] = "".join(reasoning)
        if calls:
            message["tool_calls"] = [calls[i] for i in sorted(calls)]
            if not message["content"]:
                message["content"] = None
        choice = {
            "index": 0,
            "message": message,
            "logprobs": {"content": logprobs} if job.n_probs is not None else None,
            "finish_reason": _finish(run.finish_reason),
        }
        return {**base, "choices": [choice], "usage": run.usage(), "timings": run.timings()}

    def _chat_stream(
        self,
        base: dict[str, Any],
        deltas: Iterator[tuple[dict[str, Any], Any]],
        run: _Run,
        job: _Job,
        include_usage: bool,
        cancelled: Cancelled,
    ) -> Iterator[dict[str, Any]]:
        want_lp = job.n_probs is not None
        role = {
            **base,
            "choices": [
                {"index": 0, "delta": {"role": "assistant", "content": None}, "logprobs": None, "finish_reason": None}
            ],
        }
        # The role chunk waits for the prompt to be evaluated: an error found there (context, image)
        # then still reaches the client as an HTTP error, and the first chunk marks the first token.
        started = False
        for delta, lps in deltas:
            if not started:
                started = True
                yield role
            if not delta and not lps:
                continue
            yield {
                **base,
                "choices": [
                    {
                        "index": 0,
                        "delta": delta,
                        "logprobs": {"content": lps} if want_lp and lps else None,
                        "finish_reason": None,
                    }
                ],
            }
        if run.finish_reason == "cancelled" or cancelled():
            return  # nobody is listening: no final chunk
        if not started:
            yield role
        last = {
            **base,
            "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": _finish(run.finish_reason)}],
        }
        if include_usage:
            yield last
            last = {**base, "choices": [], "usage": run.usage()}
        last["timings"] = run.timings()  # llama-server puts timings on the very last chunk
        yield last

    # ------------------------------------------------------------------ completions

    def _completion_logprobs(self, items: list[tuple[Any, int]]) -> dict[str, Any]:
        """OpenAI completions logprobs for ``(lp, text_offset)`` pairs."""
        tokens, values, tops, offsets = [], [], [], []
        for (_, raw, value, alts), offset in items:
            tokens.append(raw.decode("utf-8", "replace"))
            values.append(value)
            tops.append({self._token_bytes(i).decode("utf-8", "replace"): v for i, v in alts})
            offsets.append(offset)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    def _complete_once(
        self, base: dict[str, Any], jobs: list[_Job], echo: bool, t_start: float, cancelled: Cancelled
    ) -> dict[str, Any]:
        choices = []
        runs = []
        for index, job in enumerate(jobs):
            run = _Run(t_start=t_start if index == 0 else time.perf_counter())
            runs.append(run)
            parts: list[str] = [job.prompt] if echo else []
            offset = len(job.prompt) if echo else 0
            lps: list[tuple[Any, int]] = []
            for text, lp in self._generate(job, run, cancelled):
                if lp is not None:
                    lps.append((lp, offset))
                    offset += len(lp[1].decode("utf-8", "replace"))
                parts.append(text)
            choices.append(
                {
                    "index": index,
                    "text": "".join(parts),
                    "logprobs": self._completion_logprobs(lps) if job.n_probs is not None else None,
                    "finish_reason": _finish(run.finish_reason),
                }
            )
        usage, timings = _add_usage(runs)
        return {**base, "choices": choices, "usage": usage, "timings": timings}

    def _complete_stream(
        self, base: dict[str, Any], jobs: list[_Job], echo: bool, t_start: float, cancelled: Cancelled
    ) -> Iterator[dict[str, Any]]:
        runs = []
        for index, job in enumerate(jobs):
            run = _Run(t_start=t_start if index == 0 else time.perf_counter())
            runs.append(run)
            want_lp = job.n_probs is not None
            offset = 0
            if echo:
                yield {
                    **base,
                    "choices": [{"index": index, "text": job.prompt, "logprobs": None, "finish_reason": None}],
                }
                offset = len(job.prompt)
            pending: list[tuple[Any, int]] = []
            for text, lp in self._generate(job, run, cancelled):
                if lp is not None:
                    pending.append((lp, offset))
                    offset += len(lp[1].decode("utf-8", "replace"))
                if not text:
                    continue
                yield {
                    **base,
                    "choices": [
                        {
                            "index": index,
                            "text": text,
                            "logprobs": self._completion_logprobs(pending) if want_lp else None,
                            "finish_reason": None,
                        }
                    ],
                }
                pending = []
            if run.finish_reason == "cancelled" or cancelled():
                return
            final: dict[str, Any] = {
                **base,
                "choices": [
                    {
                        "index": index,
                        "text": "",
                        "logprobs": self._completion_logprobs(pending) if want_lp and pending else None,
                        "finish_reason": _finish(run.finish_reason),
                    }
                ],
            }
            if index == len(jobs) - 1:
                final["usage"], final["timings"] = _add_usage(runs)
            yield final


# ----------------------------------------------------------------------------- helpers


def _decode_data_url(url: str) -> bytes:
    """The bytes of a base64 ``data:`` URL. Other URLs are refused: the engine fetches nothing."""
    import base64
    import binascii

    head, sep, payload = url.partition(",")
    if not url.startswith("data:") or not sep or not head.endswith(";base64"):
        raise InvalidArgument("image_url must be a base64 data: URL (data:image/...;base64,...)")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidArgument(f"image_url is not valid base64: {exc}") from exc
    if not data:
        raise InvalidArgument("image_url holds an empty image")
    return data


def _finish(reason: str) -> str:
    return "stop" if reason == "cancelled" else reason


def _physical_cores() -> int:
    try:
        import psutil

        n = psutil.cpu_count(logical=False)
    except ImportError:  # pragma: no cover - psutil is a dependency
        n = None
    return n or os.cpu_count() or 1


def _l2(vec: list[float]) -> list[float]:
    norm = math.sqrt(sum(x * x for x in vec))
    return [x / norm for x in vec] if norm > 0 else vec


def _with_system(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """Prepend ``text`` to the system message (adding one when there is none)."""
    if messages and messages[0]["role"] == "system":
        first = messages[0]
        return [{**first, "content": (first["content"] + "\n\n" + text) if first["content"] else text}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def _formatter_by_name(module: Any, name: str) -> Any:
    """A llama-cpp-python chat formatter (``format_<name>``) by its registered name, else None."""
    fn = getattr(module, "format_" + name.replace("-", "_").replace(".", "_"), None)
    if callable(fn):
        return fn
    # Registered names whose function is spelled differently ("vicuna" is ``format``, ...):
    # the registry keeps handlers that close over the formatter.
    try:
        handler = module.get_chat_completion_handler(name)
    except Exception:
        return None
    for cell in getattr(handler, "__closure__", None) or ():
        value = cell.cell_contents
        if callable(value) and getattr(value, "__name__", "").startswith("format"):
            return value
    return None
