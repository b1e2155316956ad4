"""Request validation for every JSON route, as small declarative schemas (built of the nodes in
:mod:`lemonkit.formats.schema_nodes`).

``validate(route, body)`` type-checks a parsed JSON body at every depth before any
model is touched, so bad input answers 400 with the spec's code and a message naming
the JSON path (``messages[1].content: expected string or array, got number``) instead
of surfacing later as a backend 500. Unknown fields pass: OpenAI clients send many.
``null`` on an optional field counts as absent (clients send ``"stop": null``).
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from typing import Any

from lemonkit.errors import InvalidJSON
from lemonkit.formats.audio_codec import ENCODINGS
from lemonkit.formats.llamacpp_args import FORBIDDEN_LLAMACPP_FLAGS
from lemonkit.formats.schema_nodes import (
    ANY,
    BOOL,
    INT,
    NUM,
    OBJ,
    STR,
    Arr,
    Int,
    Num,
    Obj,
    OneOf,
    Schema,
    Str,
    Tagged,
    WholeNumber,
    invalid_at,
)

__all__ = ["FORBIDDEN_LLAMACPP_FLAGS", "FORBIDDEN_WHISPERCPP_FLAGS", "ROUTES", "validate"]


# -- llama-server / whisper-server argument strings --------------------------------------------

FORBIDDEN_WHISPERCPP_FLAGS = frozenset({"-m", "--model", "--port"})


def _forbid_flags(flags: frozenset[str]) -> Callable[[str, str], None]:
    def rule(value: str, path: str) -> None:
        try:
            tokens = shlex.split(value)
        except ValueError as e:  # unbalanced quotes
            raise invalid_at(path, f"cannot parse arguments: {e}") from None
        for tok in tokens:
            flag = tok.split("=", 1)[0]  # also `--port=8080`
            if flag in flags:
                raise invalid_at(path, f"{flag} is not allowed (lemonkit sets it)")

    return rule


# -- shared pieces ------------------------------------------------------------------------------

STOP = OneOf(STR, Arr(STR))
POS_INT = Int(1)
CTX_SIZE = Int(-1)  # -1: the model's own context length
STREAM_OPTIONS = Obj({"include_usage": BOOL})
THINKING = OneOf(BOOL, Obj({"type": STR, "budget_tokens": INT}))

#: Sampling fields common to chat, completions and responses.
SAMPLING: dict[str, Schema] = {
    "model": STR,
    "stream": BOOL,
    "stream_options": STREAM_OPTIONS,
    "temperature": NUM,
    "top_p": Num(0, 1),
    "top_k": INT,
    "min_p": Num(0, 1),
    "repeat_penalty": Num(1, 2),
    "frequency_penalty": Num(-2, 2),
    "presence_penalty": Num(-2, 2),
    "seed": INT,
    "ctx_size": CTX_SIZE,
    "route_trace": BOOL,
    "n": POS_INT,
    "user": STR,
    "logit_bias": OneOf(OBJ, Arr(ANY)),  # OpenAI's object, or llama-server's [[token, bias]]
}

# -- chat/completions ---------------------------------------------------------------------------

TEXT_PART = Obj({"text": STR}, required=["text"])
CHAT_PARTS = {
    "text": TEXT_PART,
    "image_url": Obj(
        {"image_url": Obj({"url": STR, "detail": Str(["auto", "low", "high"])}, required=["url"])},
        required=["image_url"],
    ),
    "input_audio": Obj({"input_audio": Obj({"data": STR, "format": STR}, required=["data"])}, required=["input_audio"]),
    "file": Obj({"file": Obj({"file_data": STR, "file_id": STR, "filename": STR})}, required=["file"]),
}
TEXT_CONTENT = OneOf(STR, Arr(Tagged("type", {"text": TEXT_PART})))
USER_CONTENT = OneOf(STR, Arr(Tagged("type", CHAT_PARTS)))
FUNCTION_CALL = Obj({"name": STR, "arguments": STR}, required=["name"])
TOOL_CALL = Obj({"id": STR, "type": Str(["function"]), "function": FUNCTION_CALL}, required=["function"])
CHAT_MESSAGE = Tagged(
    "role",
    {
        "system": Obj({"content": TEXT_CONTENT, "name": STR}, required=["content"]),
        "developer": Obj({"content": TEXT_CONTENT, "name": STR}, required=["content"]),
        "user": Obj({"content": USER_CONTENT, "name": STR}, required=["content"]),
        # content may be null when the turn only calls tools
        "assistant": Obj(
            {
                "content": OneOf(STR, Arr(Tagged("type", {"text": TEXT_PART, "refusal": Obj({"refusal": STR})}))),
                "name": STR,
                "tool_calls": Arr(TOOL_CALL),
                "reasoning_content": STR,
                "refusal": STR,
            }
        ),
        "tool": Obj({"content": TEXT_CONTENT, "tool_call_id": STR}, required=["content", "tool_call_id"]),
    },
)
CHAT_TOOL = Tagged(
    "type",
    {
        "function": Obj(
            {"function": Obj({"name": STR, "description": STR, "parameters": OBJ, "strict": BOOL}, required=["name"])},
            required=["function"],
        )
    },
)
CHAT_TOOL_CHOICE = OneOf(
    Str(["auto", "none", "required"]),
    Obj({"type": Str(["function"]), "function": Obj({"name": STR}, required=["name"])}, required=["type", "function"]),
)
RESPONSE_FORMAT = Tagged(
    "type",
    {
        "text": Obj(),
        "json_object": Obj({"schema": OBJ}),  # llama.cpp also takes a schema here
        "json_schema": Obj(
            {"json_schema": Obj({"name": STR, "description": STR, "schema": OBJ, "strict": BOOL})},
            required=["json_schema"],
        ),
    },
)

CHAT = Obj(
    {
        **SAMPLING,
        "messages": Arr(CHAT_MESSAGE, min_items=1),
        "stop": STOP,
        "logprobs": BOOL,
        "top_logprobs": Int(0, 20),
        "tools": Arr(CHAT_TOOL),
        "tool_choice": CHAT_TOOL_CHOICE,
        "parallel_tool_calls": BOOL,
        "response_format": RESPONSE_FORMAT,
        "max_tokens": POS_INT,
        "max_completion_tokens": POS_INT,
        "enable_thinking": BOOL,
        "thinking": THINKING,
        "reasoning_effort": Str(["none", "minimal", "low", "medium", "high"]),
        "chat_template_kwargs": OBJ,
        "grammar": STR,  # llama-server's: GBNF the answer follows (tool-call markup in it is still read)
        "reasoning_budget": Int(-1),  # llama-server's: the reasoning's tokens (-1: no limit)
    },
    required=["messages", "model"],
)

# -- completions --------------------------------------------------------------------------------

COMPLETIONS = Obj(
    {
        **SAMPLING,
        "prompt": OneOf(STR, Arr(STR, min_items=1)),
        "stop": STOP,
        "echo": BOOL,
        "logprobs": OneOf(BOOL, Int(0, 20)),
        "max_tokens": POS_INT,
        "suffix": STR,
        "best_of": POS_INT,
        "grammar": STR,
    },
    required=["prompt", "model"],
)

# -- responses ----------------------------------------------------------------------------------

RESP_TEXT = Obj({"text": STR}, required=["text"])
RESP_PARTS = {
    "input_text": RESP_TEXT,
    "output_text": RESP_TEXT,  # earlier assistant turns sent back as history
    "input_image": Obj({"image_url": STR, "detail": Str(["auto", "low", "high"])}, required=["image_url"]),
    "refusal": Obj({"refusal": STR}, required=["refusal"]),
}
RESP_MESSAGE = Obj(
    {"role": Str(["user", "assistant", "system", "developer"]), "content": OneOf(STR, Arr(Tagged("type", RESP_PARTS)))},
    required=["role", "content"],
)
RESP_ITEM = Tagged(
    "type",
    {
        "message": RESP_MESSAGE,
        "function_call": Obj(
            {"call_id": STR, "name": STR, "arguments": STR}, required=["call_id", "name", "arguments"]
        ),
        "function_call_output": Obj(
            {"call_id": STR, "output": OneOf(STR, Arr(Tagged("type", {"input_text": RESP_TEXT})))},
            required=["call_id", "output"],
        ),
        "reasoning": Obj({"summary": Arr(OBJ), "content": Arr(OBJ)}),  # history; dropped when translated
    },
    default="message",
)
RESP_TOOL = Tagged(
    "type",
    {"function": Obj({"name": STR, "description": STR, "parameters": OBJ, "strict": BOOL}, required=["name"])},
)
RESP_FORMAT = Tagged(
    "type",
    {
        "text": Obj(),
        "json_object": Obj(),
        "json_schema": Obj({"name": STR, "description": STR, "schema": OBJ, "strict": BOOL}, required=["schema"]),
    },
)
RESPONSES = Obj(
    {
        **SAMPLING,
        "input": OneOf(STR, Arr(RESP_ITEM, min_items=1)),
        "instructions": STR,
        "max_output_tokens": POS_INT,
        "tools": Arr(RESP_TOOL),
        "tool_choice": OneOf(
            Str(["auto", "none", "required"]),
            Obj({"type": Str(["function"]), "name": STR}, required=["type", "name"]),
        ),
        "parallel_tool_calls": BOOL,
        "text": Obj({"format": RESP_FORMAT}),
        "reasoning": Obj({"effort": STR, "summary": STR}),
        "store": BOOL,
        "previous_response_id": STR,
        "metadata": OBJ,
        "enable_thinking": BOOL,
        "thinking": THINKING,
    },
    required=["input", "model"],
)

# -- embeddings, rerank, load, unload -----------------------------------------------------------

EMBEDDINGS = Obj(
    {
        "model": STR,
        "input": OneOf(STR, Arr(STR, min_items=1)),
        "encoding_format": Str(["float", "base64"]),
        "dimensions": POS_INT,
        "ctx_size": CTX_SIZE,
        "user": STR,
    },
    required=["input", "model"],
)
RERANK = Obj(
    {"model": STR, "query": STR, "documents": Arr(STR, min_items=1), "top_n": POS_INT, "return_documents": BOOL},
    required=["query", "documents", "model"],
)
LLAMACPP_BACKEND = Str(["vulkan", "rocm", "metal", "cuda", "cpu"])  # cuda: lemonkit's, beside the spec's four
LLAMACPP_ARGS = Str(rule=_forbid_flags(FORBIDDEN_LLAMACPP_FLAGS))
LOAD = Obj(
    {
        "model_name": STR,
        "save_options": BOOL,
        "merge_args": BOOL,
        "pinned": BOOL,
        "ctx_size": CTX_SIZE,
        "llamacpp_backend": LLAMACPP_BACKEND,
        "llamacpp_args": LLAMACPP_ARGS,
        "whispercpp_backend": Str(["npu", "cpu", "vulkan"]),
        "whispercpp_args": Str(rule=_forbid_flags(FORBIDDEN_WHISPERCPP_FLAGS)),
        "steps": POS_INT,
        "cfg_scale": NUM,
        "width": POS_INT,
        "height": POS_INT,
    },
    required=["model_name"],
)
UNLOAD = Obj({"model_name": STR})
#: Values ``POST /v1/models/{id}/options`` saves (after its null / -1 / "" / "auto" removals; only null removes the
#: boolean merge_args). Unlike a load's, ctx_size 0 is refused: the spec allows a positive size or -1, and
#: llama.cpp's context is 32-bit.
OPTIONS = Obj(
    {
        "dry_run": BOOL,
        "ctx_size": WholeNumber(1, 2**31 - 1, also=(-1,)),
        "llamacpp_backend": LLAMACPP_BACKEND,
        "llamacpp_args": LLAMACPP_ARGS,
        "merge_args": BOOL,
    }
)
#: POST /v1/install and /v1/uninstall (which takes no ``force``); the recipe table decides which names exist
INSTALL = Obj({"recipe": STR, "backend": STR, "stream": BOOL, "force": BOOL}, required=["recipe", "backend"])
UNINSTALL = Obj({"recipe": STR, "backend": STR, "stream": BOOL}, required=["recipe", "backend"])

#: POST /v1/pull: a registered name, or a registration (checkpoint + recipe, or a collection's components)
PULL = Obj(
    {
        "model_name": STR,
        "stream": BOOL,
        "subscribe": BOOL,
        "checkpoint": STR,
        "recipe": STR,
        "reasoning": BOOL,
        "vision": BOOL,
        "embedding": BOOL,
        "reranking": BOOL,
        "mmproj": STR,
        "labels": Arr(STR),
        "components": Arr(STR, min_items=1),
        "system_prompt": STR,  # an omni collection's, in place of the built-in one
        # the remote recipe: the upstream's base URL(s) and the server variable holding its key
        "remote_url": STR,
        "remote_urls": Arr(STR, min_items=1),
        "api_key_env": STR,
    },
    required=["model_name"],
)
TRANSCRIPTION_FORMATS = ("json", "verbose_json", "text", "srt", "vtt")
#: the fields every speech-to-text route takes; ``audio`` is the JSON form's server-local path
_STT: dict[str, Schema] = {
    "model": STR,
    "audio": STR,
    "language": STR,
    "prompt": STR,
    "temperature": Num(0, 1),
    "timestamp_granularities": Arr(Str(["word", "segment"])),
}
TRANSCRIPTION = Obj(
    {**_STT, "response_format": Str(TRANSCRIPTION_FORMATS), "stream": BOOL},
    required=["model"],
)
ALIGNMENT = Obj({**_STT, "text": STR}, required=["model", "text"])
BATCH_TRANSCRIPTION = Obj({**_STT, "audio": OneOf(STR, Arr(STR, min_items=1))}, required=["model"])


def _speakable(value: str, path: str) -> None:
    if not value.strip():
        raise invalid_at(path, "the text to speak must not be empty")


#: POST /v1/audio/speech. ``speed`` takes OpenAI's range; an engine that takes less answers 400 naming its own
SPEECH = Obj(
    {
        "model": STR,
        "input": Str(rule=_speakable),
        "voice": STR,
        "speed": Num(0.25, 4.0),
        "response_format": Str((*ENCODINGS, "json")),
        "stream": BOOL,
        "stream_format": Str(["audio", "sse"]),
        "seed": INT,
        "instructions": STR,
    },
    required=["input", "model"],
)
#: the fields every image route takes (``n`` from 1 to 10, OpenAI's range). ``response_format`` lists ``url`` so the
#: handler can say why it is refused; ``quality``, ``style``, ``background``, ``user``... are OpenAI's, ignored
_IMAGES: dict[str, Schema] = {
    "model": STR,
    "prompt": STR,
    "size": STR,
    "n": Int(1, 10),
    "response_format": Str(["b64_json", "url"]),
    "steps": Int(1, 1000),
    "cfg_scale": Num(0, 100),
    "seed": INT,
    "user": STR,
    "quality": STR,
    "style": STR,
    "background": STR,
    "moderation": STR,
    "output_format": STR,
    "output_compression": INT,
    "input_fidelity": STR,
}
IMAGE_GENERATION = Obj(_IMAGES, required=["prompt", "model"])
IMAGE_EDIT = Obj(_IMAGES, required=["prompt", "model"])
IMAGE_VARIATION = Obj(_IMAGES, required=["model"])
#: POST /v1/images/upscale. ``upscale_factor`` must be the model's own scale; its engine says so otherwise
IMAGE_UPSCALE = Obj({"image": STR, "model": STR, "upscale_factor": WholeNumber(1)}, required=["image", "model"])
DOWNLOADS_CONTROL = Obj({"id": STR, "action": Str(["pause", "cancel", "remove"])}, required=["id", "action"])
DELETE = Obj({"model_name": STR}, required=["model_name"])

ROUTES: dict[str, Obj] = {
    "chat/completions": CHAT,
    "completions": COMPLETIONS,
    "responses": RESPONSES,
    "embeddings": EMBEDDINGS,
    "rerank": RERANK,
    "load": LOAD,
    "unload": UNLOAD,
    "install": INSTALL,
    "uninstall": UNINSTALL,
    "options": OPTIONS,
    "pull": PULL,
    "downloads/control": DOWNLOADS_CONTROL,
    "delete": DELETE,
    "audio/transcriptions": TRANSCRIPTION,
    "audio/alignments": ALIGNMENT,
    "batches/transcriptions": BATCH_TRANSCRIPTION,
    "audio/speech": SPEECH,
    "images/generations": IMAGE_GENERATION,
    "images/edits": IMAGE_EDIT,
    "images/variations": IMAGE_VARIATION,
    "images/upscale": IMAGE_UPSCALE,
}


def validate(route: str, body: object) -> dict[str, Any]:
    """Check ``body`` against ``route``'s schema and return it unchanged (typed as a dict).

    Args:
        route: One of :data:`ROUTES` (``"chat/completions"``, ``"load"``, ...).
        body: The parsed JSON body. ``None`` (an empty body) is taken as ``{}``, so
            ``unload`` without a body works and the others report their missing argument.

    Raises:
        InvalidJSON: ``body`` is not a JSON object.
        MissingArgument: a required top-level argument is absent or null.
        InvalidArgument: a wrong JSON type, enum value or range at any depth; the message names the path.
        KeyError: ``route`` is unknown (a programming error, not a client one).
    """
    schema = ROUTES[route]
    if body is None:
        body = {}
    if not isinstance(body, dict):
        raise InvalidJSON("The body is not a JSON object")
    schema.check(body, "")
    return body
