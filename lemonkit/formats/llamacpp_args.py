"""``llamacpp_args``: llama-server style flag strings, parsed and merged without any inference library.

The options layer checks and merges these strings (:mod:`lemonkit.catalog.recipe_options`,
:mod:`lemonkit.catalog.config`), the request schema refuses the forbidden ones (:mod:`lemonkit.formats.schemas`) and the
llama.cpp engine turns them into ``Llama()`` arguments and sampling defaults; all three read the one table here, so what
the server accepts is what loads.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lemonkit.errors import InvalidArgument

__all__ = ["FORBIDDEN_LLAMACPP_FLAGS", "SPEC_TYPES", "merge_llamacpp_args", "parse_llamacpp_args"]

#: Flags lemonkit sets itself, with llama.cpp's aliases of each (the spec's list for ``POST /v1/load`` and what
#: Lemonade reserves). The model and its companions (mmproj, LoRA, template file) come from the registry: a request
#: naming them would also make the server read a file of the client's choosing. A draft model (``-md``) is named as
#: a registered model, never as a path (see :func:`_draft_model`).
# fmt: off
FORBIDDEN_LLAMACPP_FLAGS = frozenset({
    "-m", "--model", "-mm", "--mmproj", "-mmu", "--mmproj-url", "-mdu", "--model-draft-url", "--lora",
    "--chat-template-file",
    "--port", "--host", "-c", "--ctx-size", "--jinja", "--no-jinja",
    "--embeddings", "--embedding", "--reranking", "--rerank",
})
# fmt: on

# flag -> (key, converter). Keys are Llama() kwargs, sampling defaults (the engine's DEFAULT_SAMPLING keys),
# or the engine's own (chat_template, grammar, reasoning_budget, max_tokens, seed, n_parallel, _ignored).
_GGML_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "iq4_nl": 20, "bf16": 30}
_POOLING = {"none": 0, "mean": 1, "cls": 2, "last": 3, "rank": 4}


def _choice(table: dict[str, int]) -> Callable[[str], int]:
    def convert(value: str) -> int:
        if value not in table:
            raise ValueError(f"one of {', '.join(table)}")
        return table[value]

    return convert


#: llama-server's --load-mode -> the Llama() kwargs it sets; auto keeps the engine's default (weights read into huge
#: pages). llama-cpp-python's loader offers no direct I/O (dio).
_LOAD_MODES: dict[str, dict[str, bool]] = {
    "auto": {},
    "none": {"use_mmap": False, "use_mlock": False},
    "mmap": {"use_mmap": True, "use_mlock": False},
    "mlock": {"use_mmap": False, "use_mlock": True},
    "mmap+mlock": {"use_mmap": True, "use_mlock": True},
}
#: settings a flag replaces besides its own, when llamacpp_args strings are merged
_COVERS = {"load_mode": frozenset({"use_mmap", "use_mlock"})}


def _load_mode(value: str) -> dict[str, bool]:
    if value not in _LOAD_MODES:
        raise ValueError(f"one of {', '.join(_LOAD_MODES)}")
    return _LOAD_MODES[value]


def _gpu_layers(value: str) -> int | str:
    """llama-server's ``-ngl``: a count, ``all``, or ``auto`` (as many as fit in the device's free memory)."""
    if value in ("all", "auto"):
        return value
    n = int(value)
    if n < 0:
        return "all"  # llama.cpp reads a negative count as every layer
    return n


def _devices(value: str) -> list[str]:
    """``--device``: ggml device names separated by commas (``Vulkan0,Vulkan1``), or ``none`` (the CPU only)."""
    names = [v.strip() for v in value.split(",") if v.strip()]
    if not names or any(not n.replace("_", "").isalnum() for n in names):
        raise ValueError("device names separated by commas (as --list-devices prints them), or none")
    return [] if names == ["none"] else names


def _split(value: str) -> list[float]:
    parts = [float(v) for v in value.replace("/", ",").split(",") if v.strip()]
    if not parts or any(p < 0 for p in parts) or sum(parts) <= 0:
        raise ValueError("proportions separated by commas, such as 3,1")
    return parts


def _at_least(floor: int, meaning: str) -> Callable[[str], int]:
    """An integer flag's converter: ``floor`` or more, ``meaning`` saying what the values are when it is not."""

    def convert(value: str) -> int:
        n = int(value)
        if n < floor:
            raise ValueError(meaning)
        return n

    return convert


_natural = _at_least(0, "0 or more")
_positive = _at_least(1, "1 or more")
_budget = _at_least(-1, "-1 (no limit), 0 (no reasoning) or a number of tokens")
_mebibytes = _at_least(-1, "MiB: -1 (no limit), 0 (off) or a size")


def _prefill_budget(value: str) -> int | None:
    """``--prefill-budget``: ``auto`` (measured, None) or the prompt tokens a step takes while others generate."""
    if value == "auto":
        return None
    return _positive(value)


def _on_off(value: str) -> bool:
    v = value.lower()
    if v in ("on", "true", "1", "auto", "enabled"):
        return True  # auto resolves to on for the CPU backend
    if v in ("off", "false", "0", "disabled"):
        return False
    raise ValueError("on, off or auto")


#: ``--spec-type`` values lemonkit speculates with (:mod:`lemonkit.backends.llamacpp.drafts`); a comma list tries
#: them in order, as llama-server does
SPEC_TYPES = ("none", "ngram-simple", "ngram-mod", "draft-simple", "draft-mtp")


def _spec_type(value: str) -> tuple[str, ...]:
    kinds = tuple(dict.fromkeys(v.strip() for v in value.split(",") if v.strip()))
    unknown = [k for k in kinds if k not in SPEC_TYPES]
    if not kinds or unknown:
        raise ValueError(
            "none, or ngram-simple, ngram-mod, draft-simple and draft-mtp separated by commas (the sequence's own "
            "n-grams, a pool the model's slots share, a draft model, the model's own MTP layers); EAGLE3 and DFlash "
            "heads are not served by lemonkit"
        )
    if "draft-simple" in kinds and "draft-mtp" in kinds:
        raise ValueError("draft-simple or draft-mtp, not both: a slot's drafts come from one model")
    return () if kinds == ("none",) else tuple(k for k in kinds if k != "none")


def _draft_model(value: str) -> str:
    """``-md``: the draft model as a registered model's name (its main checkpoint is loaded beside the target)."""
    if not value or "/" in value or "\\" in value or value.endswith(".gguf"):
        raise ValueError("the name of a registered model (GET /v1/models lists them), not a file path")
    return value


def _probability(value: str) -> float:
    p = float(value)
    if not 0.0 <= p <= 1.0:
        raise ValueError("a probability from 0 to 1")
    return p


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
    (("--grammar",), "grammar", str),  # a default GBNF for the model's answers (a request's grammar wins)
    (("--reasoning-budget",), "reasoning_budget", _budget),
    (("-np", "--parallel"), "n_parallel", int),  # requests generated together (continuous batching)
    (("-cram", "--cache-ram"), "cache_ram", _mebibytes),  # host RAM for prompts evicted from the slots
    # lemonkit's own: the prompt tokens of a step while other sequences generate (decoding goes first; see batch)
    (("--prefill-budget",), "prefill_budget", _prefill_budget),
    # speculative decoding (lemonkit.backends.llamacpp.drafts): llama-server's current spellings and its older ones
    (("--spec-type",), "spec_type", _spec_type),
    (("--spec-draft-n-max", "--draft-max", "--draft", "--draft-n"), "draft_max", _positive),
    (("--spec-draft-n-min", "--draft-min", "--draft-n-min"), "draft_min", _natural),
    (("--spec-draft-p-min", "--draft-p-min"), "draft_p_min", _probability),
    (("-md", "--model-draft", "--spec-draft-model"), "model_draft", _draft_model),
    (("--spec-ngram-simple-size-n", "--spec-ngram-size-n"), "ngram_n", _positive),
    (("--spec-ngram-simple-size-m", "--spec-ngram-size-m"), "ngram_m", _positive),
    (("--spec-ngram-mod-n-match",), "ngram_mod_match", _positive),
    (("--spec-ngram-mod-n-min",), "ngram_mod_min", _natural),
    (("--spec-ngram-mod-n-max",), "ngram_mod_max", _positive),
    (("-lm", "--load-mode"), "load_mode", _load_mode),  # llama-server's successor of --[no-]mmap and --mlock
    # offload: llama.cpp builds with a GPU backend (lemonkit.catalog.llamacpp_builds); the CPU build has nothing to
    # offload to
    (("-ngl", "--n-gpu-layers", "--gpu-layers"), "n_gpu_layers", _gpu_layers),
    (("-dev", "--device"), "devices", _devices),
    (("-sm", "--split-mode"), "split_mode", _choice({"none": 0, "layer": 1, "row": 2})),
    (("-ts", "--tensor-split"), "tensor_split", _split),
    (("-mg", "--main-gpu"), "main_gpu", _natural),
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
    "--repack": ("repack", True),
    "-nr": ("repack", False),
    "--no-repack": ("repack", False),
    "-nkvo": ("offload_kqv", False),
    "--no-kv-offload": ("offload_kqv", False),
    "-kvo": ("offload_kqv", True),
    "--kv-offload": ("offload_kqv", True),
    # lemonkit's own (llama-server has no such mode): see lemonkit.backends.llamacpp.kernels
    "--batch-invariant": ("batch_invariant", True),
    "--no-batch-invariant": ("batch_invariant", False),
}
# Flags the engine accepts and ignores, grouped by what they set in llama-server (a group counts as one flag when
# llamacpp_args strings are merged: -cb and -nocb are the two values of one setting).
_IGNORED_GROUPS = (
    ("-cb", "--cont-batching", "-nocb", "--no-cont-batching"),
    ("--no-webui",),
    ("--metrics",),
    ("--no-warmup",),
    ("--log-disable",),
    ("--no-perf",),
    # what the engine always does: its batcher's slots share one unified KV cache, and a generation that fills the
    # context ends there (finish_reason "length") rather than shifting the context
    ("-kvu", "--kv-unified"),
    ("--no-context-shift",),
)
#: flags asking for what the engine does not do, with the reason
_REFUSED = {
    "--no-kv-unified": "lemonkit's batcher gives its slots one unified KV cache (-kvu); it has no per-slot caches",
    "--context-shift": "a generation that fills the context ends there (finish_reason 'length'); lemonkit does "
    "not shift the context: raise ctx_size instead",
}
_IGNORED_SETTING = {flag: group[-1] for group in _IGNORED_GROUPS for flag in group}
_SWITCHES.update({flag: ("_ignored", True) for flag in _IGNORED_SETTING if flag not in _VALUE_FLAGS})


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
        if flag in FORBIDDEN_LLAMACPP_FLAGS:
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
        elif word in _REFUSED:
            raise InvalidArgument(f"llamacpp_args: {word}: {_REFUSED[word]}")
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
    out: dict[str, Any] = {}
    for flag in _split_llamacpp_args(args):
        if flag.key == "load_mode":
            for key in _COVERS["load_mode"]:
                out.pop(key, None)
            out.update(flag.value)
        else:
            out[flag.key] = flag.value
    out.pop("_ignored", None)
    return out


def merge_llamacpp_args(base: str, override: str) -> str:
    """``base`` flags (the server's) merged with ``override`` flags (a model's), flag by flag.

    A flag of ``base`` is dropped when ``override`` sets the same thing under any spelling (``-t 2`` replaces
    ``--threads 4``, ``--mmap`` replaces ``--no-mmap``, ``--load-mode`` replaces both and ``--mlock``); the rest are
    kept, before ``override``'s flags (so the engine's last-wins parse agrees with the merge).

    Returns:
        The merged flags; ``override`` or ``base`` unchanged when the other is empty.

    Raises:
        InvalidArgument: Either string is not valid ``llamacpp_args``.
    """
    theirs, mine = _split_llamacpp_args(base), _split_llamacpp_args(override)
    if not theirs or not mine:
        return override if mine else base
    replaced = {flag.setting for flag in mine}
    replaced |= {covered for setting in replaced for covered in _COVERS.get(setting, ())}
    kept = [word for flag in theirs if flag.setting not in replaced for word in flag.words]
    return shlex.join(kept + [word for flag in mine for word in flag.words])
