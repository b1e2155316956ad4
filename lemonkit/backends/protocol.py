"""The protocol between a sidecar process and the engine it wraps.

A sidecar (:mod:`lemonkit.backends.sidecar`) owns exactly one :class:`Engine`.
It calls the engine's methods on one worker thread, one request at a time, in
arrival order; the engine never sees the event loop or HTTP. What a method
returns decides the answer: a dict is a JSON body; an iterator of dicts is an
SSE stream (the sidecar frames each, then ``data: [DONE]``); :class:`Binary`
is a body of bytes; :class:`BinaryStream` is a chunked body of bytes. The
sidecar checks ``cancelled`` for the engine between items, and turns
exceptions into error answers.

Routes whose requests carry audio (``files=True`` in :data:`ROUTES`) receive the
front's JSON with each ``files`` entry's base64 ``data`` already decoded: the
engine gets ``body["files"]`` as a list of :class:`Upload`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, TypedDict

from lemonkit.errors import InvalidArgument

__all__ = [
    "NO_STATS",
    "ROUTES",
    "Binary",
    "BinaryStream",
    "Cancelled",
    "Engine",
    "LoadSpec",
    "SidecarRoute",
    "Upload",
    "physical_cores",
    "positive_option",
    "thread_count",
]

Cancelled = Callable[[], bool]

#: ``/v1/stats`` of a model that has no figures to give (none served yet, or an engine that measures none)
NO_STATS: dict[str, Any] = {
    "time_to_first_token": None,
    "tokens_per_second": None,
    "input_tokens": None,
    "output_tokens": None,
    "decode_token_times": [],
    "prompt_tokens": None,
    "cache_tokens": None,
}


class LoadSpec(TypedDict, total=False):
    """What the manager sends a sidecar to load (JSON over stdin)."""

    model_name: str
    recipe: str
    type: str  # "llm" | "embedding" | "reranking" | ...
    model_path: str
    mmproj_path: str | None
    draft_path: str | None  # a draft model for speculative decoding (-md, the "draft" checkpoint, a companion)
    mtp_path: str | None  # an MTP head in a file of its own (a Gemma 4 assistant) that draft-mtp drafts with
    chat_format: str | None
    labels: list[str]  # the registry row's labels (``mtp`` switches MTP drafts on by default)
    options: dict[str, Any]  # resolved recipe options: ctx_size, llamacpp_args, ...
    device_budget: int | None  # bytes of device memory the model may take (the manager's placement), if capped
    auto_ctx_limit: int | None  # the most tokens an automatic context may have (the manager's, from memory)


@dataclass(frozen=True)
class Upload:
    """One uploaded file of a request (``body["files"]`` on a ``files`` route)."""

    filename: str
    content: bytes
    content_type: str = "application/octet-stream"


@dataclass
class Binary:
    """A non-JSON answer: ``content`` with its ``media_type`` (an encoded audio file, say)."""

    content: bytes
    media_type: str
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class BinaryStream:
    """A chunked non-JSON answer: each chunk is sent as it is produced (raw PCM as it is synthesised, say)."""

    chunks: Iterator[bytes]
    media_type: str
    headers: dict[str, str] = field(default_factory=dict)


class Engine(Protocol):
    """One loaded model. Every method may raise :class:`lemonkit.errors.LemonkitError`."""

    def chat(self, body: dict[str, Any], *, cancelled: Cancelled) -> dict[str, Any] | Iterator[dict[str, Any]]:
        """``/v1/chat/completions``: a completion dict, or chunks when ``body["stream"]``."""
        ...

    def complete(self, body: dict[str, Any], *, cancelled: Cancelled) -> dict[str, Any] | Iterator[dict[str, Any]]:
        """``/v1/completions``."""
        ...

    def embed(self, body: dict[str, Any]) -> dict[str, Any]:
        """``/v1/embeddings`` (always float vectors; the front encodes base64)."""
        ...

    def rerank(self, body: dict[str, Any]) -> dict[str, Any]:
        """``/v1/rerank``."""
        ...

    # The methods of the other modalities are optional: the sidecar answers 400 ``model_not_applicable`` for a
    # route whose method the engine lacks. Speech-to-text engines implement
    #   transcribe(body, *, cancelled)        body["files"][0] is the audio; a dict, or dict events when streaming
    #   align(body, *, cancelled)             body["files"][0] and body["text"]
    #   transcribe_batch(body, *, cancelled)  one event per body["files"] entry as each is done
    # and text-to-speech engines
    #   speak(body, *, cancelled)             Binary (an encoded file), BinaryStream (raw PCM) or dict events
    #   voices(body)                          {"voices": [...]}
    # image engines
    #   generate(body, *, cancelled)          {"created", "data": [{"b64_json", "generation_info"}], "output_format"}
    #   edit(body, *, cancelled)              body["files"]: the images, then the mask when body["has_mask"]
    #   vary(body, *, cancelled)              body["files"][0] is the source image
    #   upscale(body, *, cancelled)           body["files"][0]; {"created", "data": [{"b64_json"}]}
    # and audio engines the generic tasks (lemonkit.backends.task_engine)
    #   run_task(body, *, cancelled)          a result dict, or task.stream.* events when body["stream"]
    #   run_task_batch(body, *, cancelled)    task.batch.* events (engines with a native batch path only)

    def stats(self) -> dict[str, Any]:
        """``/v1/stats`` fields for the last request this engine served."""
        ...

    def info(self) -> dict[str, Any]:
        """Facts about the loaded model: ``ctx_size``, ``n_threads``, ``device``..."""
        ...

    def close(self) -> None: ...


class SidecarRoute(NamedTuple):
    """How the sidecar calls the engine for one path."""

    method: str
    #: the method takes ``cancelled`` (it can stop early when the client leaves)
    cancellable: bool
    #: the body's ``files`` entries carry base64 audio, decoded to :class:`Upload` before the call
    files: bool = False


#: sidecar path -> how it calls the engine. Engines of other modalities raise ModelNotApplicable for the rest.
ROUTES: dict[str, SidecarRoute] = {
    "/v1/chat/completions": SidecarRoute("chat", True),
    "/v1/completions": SidecarRoute("complete", True),
    "/v1/chat/tokens": SidecarRoute("count_chat_tokens", False),  # a chat request's prompt, counted
    # llama-server's utility routes
    "/v1/tokenize": SidecarRoute("tokenize", False),
    "/v1/detokenize": SidecarRoute("detokenize", False),
    "/v1/slots/action": SidecarRoute("slot_action", False),  # save, restore or erase an idle slot's prompt
    "/v1/embeddings": SidecarRoute("embed", False),
    "/v1/rerank": SidecarRoute("rerank", False),
    # speech-to-text: transcribe() answers /transcriptions, /details, /live and /realtime (the front shapes them)
    "/v1/audio/transcriptions": SidecarRoute("transcribe", True, files=True),
    "/v1/audio/alignments": SidecarRoute("align", True, files=True),
    "/v1/batches/transcriptions": SidecarRoute("transcribe_batch", True, files=True),
    # text-to-speech
    "/v1/audio/speech": SidecarRoute("speak", True),
    "/v1/audio/voices": SidecarRoute("voices", False),
    # images: the front sends uploaded images as ``files`` (PNG/JPEG bytes); the engine decodes them
    "/v1/images/generations": SidecarRoute("generate", True),
    "/v1/images/edits": SidecarRoute("edit", True, files=True),
    "/v1/images/variations": SidecarRoute("vary", True, files=True),
    "/v1/images/upscale": SidecarRoute("upscale", True, files=True),
    # audio-api.md's generic tasks (backends/tasks.py): run_task answers /v1/tasks/run and, with ``stream``,
    # /v1/tasks/stream; only engines with a native batch path have run_task_batch
    "/v1/tasks/run": SidecarRoute("run_task", True, files=True),
    "/v1/tasks/batch": SidecarRoute("run_task_batch", True, files=True),
}


def physical_cores() -> int:
    """The engines' default thread count: one per physical core (hyper-threads slow matrix kernels down)."""
    import psutil

    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


def positive_option(options: Mapping[str, Any], name: str, default: int) -> int:
    """``options[name]`` (``default`` when absent or 0), which must be a positive integer (InvalidArgument)."""
    value = options.get(name) or default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgument(f"{name} must be a positive integer, got {value!r}")
    return value


def thread_count(options: Mapping[str, Any], fallback: int | None = None) -> int:
    """An engine's threads: ``options["n_threads"]``, else ``fallback`` (a ``-t`` among its arguments), else one
    per physical core; a positive integer or InvalidArgument."""
    return positive_option(options, "n_threads", fallback or physical_cores())
