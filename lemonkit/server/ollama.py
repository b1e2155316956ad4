"""Ollama's REST API (``/api/chat``, ``/api/generate``, ``/api/tags``, ...), for the clients that speak it: the
``ollama`` Python library, Open WebUI's Ollama connection, editor plug-ins and agent frameworks.

Each route translates to what the OpenAI and Lemonade routes already run: the same model manager and sidecars
(a chat is an OpenAI chat request to the model's sidecar, its SSE events turned into Ollama's NDJSON lines), the
same download jobs and the same authentication. Errors are Ollama's ``{"error": "..."}`` with the status of
lemonkit's error; one that comes after a stream started is its last line.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import re
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from lemonkit import schemas
from lemonkit._version import __version__
from lemonkit.downloads import Job, progress_events
from lemonkit.errors import (
    InvalidArgument,
    InvalidJSON,
    LemonkitError,
    MissingArgument,
    ModelNotApplicable,
    NotImplementedRoute,
)
from lemonkit.gguf_header import read_gguf_metadata
from lemonkit.manager import LoadedModel
from lemonkit.model_info import a_model_of
from lemonkit.registry import ModelInfo
from lemonkit.server.base import LemonkitHandler, as_lemonkit_error
from lemonkit.server.chat_stream import ChatStream
from lemonkit.server.downloads import delete_model
from lemonkit.server.openai import embedding_dimensions

__all__ = [
    "OLLAMA_ROUTES",
    "chat_request",
    "parse_keep_alive",
]

#: the Ollama API version these routes follow (clients read it to tell which features the server has)
OLLAMA_API_VERSION = "0.12.0"
NDJSON = "application/x-ndjson"
#: ``/api/ps``'s ``expires_at`` for a model that stays loaded until memory is needed (Ollama's ``keep_alive: -1``)
_NEVER = "2318-01-01T00:00:00Z"

# -- translation ----------------------------------------------------------------------------------------------------

#: Ollama ``options`` that are OpenAI sampling fields of the same name
_SAMPLING = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "seed",
    "repeat_penalty",
    "presence_penalty",
    "frequency_penalty",
)
#: options that set how a model is loaded rather than one request: lemonkit loads a model once for every client
_LOAD_OPTIONS = {
    "num_batch": "--batch-size",
    "num_gpu": "-ngl",
    "main_gpu": "--main-gpu",
    "num_thread": "--threads",
    "use_mmap": "--no-mmap",
    "use_mlock": "--mlock",
    "numa": "--numa",
    "num_keep": "--keep",
}


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def parse_keep_alive(value: Any) -> float | None:
    """Ollama's ``keep_alive`` in seconds: a number of seconds or a duration (``"5m"``, ``"1h30m"``, ``"300ms"``);
    ``None`` when absent or negative (stay loaded while memory allows: lemonkit's default).

    Raises:
        InvalidArgument: Not a duration.
    """
    if value is None or isinstance(value, bool):
        if isinstance(value, bool):
            raise InvalidArgument(f"keep_alive: expected a duration such as '5m' or seconds, got {value!r}")
        return None
    if isinstance(value, (int, float)):
        return None if value < 0 else float(value)
    if not isinstance(value, str):
        raise InvalidArgument(f"keep_alive: expected a duration such as '5m' or seconds, got {value!r}")
    text = value.strip()
    if re.fullmatch(r"-?\d+(\.\d+)?", text):
        seconds = float(text)
        return None if seconds < 0 else seconds
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|ms|m|s|us|µs|ns)", text.removeprefix("-"))
    if not parts or "".join(n + u for n, u in parts) != text.removeprefix("-"):
        raise InvalidArgument(f"keep_alive: expected a duration such as '5m', '1h30m' or seconds, got {value!r}")
    if text.startswith("-"):
        return None
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
    return sum(float(n) * units[u] for n, u in parts)


def _image_part(data: Any) -> dict[str, Any]:
    """An Ollama image (base64, as its clients send it) as an OpenAI ``image_url`` part with a data URL."""
    if not isinstance(data, str) or not data:
        raise InvalidArgument("images: each image is a base64 string")
    if data.startswith("data:"):
        return {"type": "image_url", "image_url": {"url": data}}
    try:
        head = base64.b64decode(data[:24] + "=" * (-len(data[:24]) % 4), validate=False)
    except ValueError:
        raise InvalidArgument("images: not base64") from None
    mime = "image/png"
    if head.startswith(b"\xff\xd8"):
        mime = "image/jpeg"
    elif head.startswith(b"GIF8"):
        mime = "image/gif"
    elif head[8:12] == b"WEBP":
        mime = "image/webp"
    return {"type": "image_url", "image_url": {"url": f"data:{mime};base64,{data}"}}


def _user_content(text: str, images: Any) -> Any:
    if not images:
        return text
    if not isinstance(images, list):
        raise InvalidArgument("images: expected a list of base64 strings")
    return [{"type": "text", "text": text}, *(_image_part(i) for i in images)]


def _messages(messages: Any) -> list[dict[str, Any]]:
    """Ollama messages as OpenAI chat messages: images as parts, tool calls with JSON-string arguments and ids, tool
    results tied to the call they answer (by ``tool_call_id``, else the earliest unanswered call of that name)."""
    if not isinstance(messages, list):
        raise InvalidArgument("messages: expected a list")
    out: list[dict[str, Any]] = []
    unanswered: list[tuple[str, str]] = []  # (call id, tool name)
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise InvalidArgument(f"messages[{i}]: expected an object")
        role = str(msg.get("role") or "").lower()
        content = msg.get("content") or ""
        if not isinstance(content, str):
            raise InvalidArgument(f"messages[{i}].content: expected a string")
        if role in ("system", "developer"):
            out.append({"role": role, "content": content})
        elif role == "user":
            out.append({"role": "user", "content": _user_content(content, msg.get("images"))})
        elif role == "assistant":
            item: dict[str, Any] = {"role": "assistant", "content": content}
            calls = []
            for j, call in enumerate(msg.get("tool_calls") or []):
                function = call.get("function") if isinstance(call, dict) else None
                if not isinstance(function, dict) or not function.get("name"):
                    raise InvalidArgument(f"messages[{i}].tool_calls[{j}]: expected {{function: {{name, arguments}}}}")
                call_id = str(call.get("id") or f"call_{i}_{j}")
                arguments = function.get("arguments") or {}
                calls.append(
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {
                            "name": function["name"],
                            "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments),
                        },
                    }
                )
                unanswered.append((call_id, function["name"]))
            if calls:
                item["tool_calls"] = calls
            if isinstance(msg.get("thinking"), str) and msg["thinking"]:
                item["reasoning_content"] = msg["thinking"]
            out.append(item)
        elif role == "tool":
            call_id = str(msg.get("tool_call_id") or "")
            if not call_id:
                name = msg.get("tool_name") or msg.get("name")
                match = next((c for c in unanswered if name is None or c[1] == name), None)
                call_id = match[0] if match else f"call_{i}"
            unanswered = [c for c in unanswered if c[0] != call_id]
            out.append({"role": "tool", "tool_call_id": call_id, "content": content})
        else:
            raise InvalidArgument(f"messages[{i}].role: expected system, user, assistant or tool, got {role!r}")
    return out


def _sampling(options: Any) -> dict[str, Any]:
    """Ollama ``options`` as OpenAI sampling fields (``num_ctx`` is taken apart: it sizes the load).

    Raises:
        InvalidArgument: An option lemonkit cannot apply to one request, named with what to do instead.
    """
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise InvalidArgument("options: expected an object")
    body: dict[str, Any] = {}
    unknown = []
    for name, value in options.items():
        if value is None or name == "num_ctx":
            continue
        if name in _SAMPLING:
            body[name] = value
        elif name == "stop":
            body["stop"] = [value] if isinstance(value, str) else value
        elif name == "num_predict":
            if not isinstance(value, int) or isinstance(value, bool) or value == 0:
                raise InvalidArgument(f"options.num_predict: expected a positive number of tokens or -1, got {value!r}")
            if value > 0:
                body["max_tokens"] = value
        elif name in _LOAD_OPTIONS:
            raise InvalidArgument(
                f"options.{name}: sets how the model is loaded, which lemonkit does once for every client; set "
                f"{_LOAD_OPTIONS[name]} in the model's llamacpp_args instead (POST /api/v1/models/{{model}}/options)"
            )
        else:
            unknown.append(name)
    if unknown:
        supported = ", ".join(("num_ctx", "num_predict", "stop", *_SAMPLING))
        raise InvalidArgument(f"options: lemonkit does not apply {', '.join(sorted(unknown))}; it applies {supported}")
    return body


def _format(value: Any) -> dict[str, Any] | None:
    if value in (None, ""):
        return None
    if value == "json":
        return {"type": "json_object"}
    if isinstance(value, dict):
        return {"type": "json_schema", "json_schema": {"name": "format", "schema": value}}
    raise InvalidArgument(f"format: expected 'json' or a JSON schema, got {value!r}")


def _think(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if isinstance(value, bool):
        return {"enable_thinking": value}
    if value in ("low", "medium", "high", "max"):
        return {"enable_thinking": True}
    raise InvalidArgument(f"think: expected true, false, 'low', 'medium', 'high' or 'max', got {value!r}")


def chat_request(body: dict[str, Any], model_id: str) -> dict[str, Any]:
    """The OpenAI chat request an Ollama ``/api/chat`` body stands for (always streamed from the sidecar).

    Raises:
        InvalidArgument, MissingArgument: A field that does not translate, named.
    """
    chat: dict[str, Any] = {
        "model": model_id,
        "messages": _messages(body.get("messages")),
        "stream": True,
        "stream_options": {"include_usage": True},
        **_sampling(body.get("options")),
        **_think(body.get("think")),
    }
    if body.get("tools"):
        chat["tools"] = body["tools"]
        if body.get("tool_choice") is not None:  # lemonkit's own: Ollama's API cannot force a call
            chat["tool_choice"] = body["tool_choice"]
    response_format = _format(body.get("format"))
    if response_format is not None:
        chat["response_format"] = response_format
    return schemas.validate("chat/completions", chat)


def generate_request(body: dict[str, Any], model_id: str) -> tuple[str, dict[str, Any]]:
    """The sidecar route and request an Ollama ``/api/generate`` body stands for: a chat turn with the model's
    template, or with ``raw`` a completion of the prompt as it is."""
    for field, why in (
        ("template", "lemonkit renders prompts with the model's own chat template; use raw: true to send your own"),
        ("context", "lemonkit keeps no conversation state for /api/generate; send the conversation to /api/chat"),
    ):
        if body.get(field):
            raise InvalidArgument(f"{field}: {why}")
    prompt = body.get("prompt") or ""
    if not isinstance(prompt, str):
        raise InvalidArgument("prompt: expected a string")
    common = {
        "model": model_id,
        "stream": True,
        "stream_options": {"include_usage": True},
        **_sampling(body.get("options")),
    }
    suffix = body.get("suffix")
    if suffix:  # Ollama's fill-in-the-middle: the completion between prompt and suffix, no chat template
        if not isinstance(suffix, str):
            raise InvalidArgument("suffix: expected a string")
        if body.get("images"):
            raise InvalidArgument("images: fill-in-the-middle takes text only")
        return "/v1/completions", schemas.validate("completions", {**common, "prompt": prompt, "suffix": suffix})
    if body.get("raw"):
        if body.get("images"):
            raise InvalidArgument("images: a raw prompt has no template to place images in; use /api/chat")
        return "/v1/completions", schemas.validate("completions", {**common, "prompt": prompt})
    messages: list[dict[str, Any]] = []
    if body.get("system"):
        messages.append({"role": "system", "content": str(body["system"])})
    messages.append({"role": "user", "content": _user_content(prompt, body.get("images"))})
    chat = {**common, "messages": messages, **_think(body.get("think"))}
    response_format = _format(body.get("format"))
    if response_format is not None:
        chat["response_format"] = response_format
    return "/v1/chat/completions", schemas.validate("chat/completions", chat)


class _Answer(ChatStream):
    """An OpenAI chat stream read into Ollama's pieces: text, thinking, and each tool call whole once the next
    starts or the answer ends (Ollama sends a call whole, with its arguments as an object)."""

    sent_calls: int = 0

    def step(self, chunk: dict[str, Any]) -> tuple[str, str, list[dict[str, Any]]]:
        """(text, thinking, tool calls now complete) of one chunk."""
        pieces = self.feed(chunk)
        text = "".join(p.text for p in pieces if p.kind == "text")
        thinking = "".join(p.text for p in pieces if p.kind == "thinking")
        done = len(self.calls) if self.finish_reason is not None else max(0, len(self.calls) - 1)
        ready = [self.call(i) for i in sorted(self.calls)[self.sent_calls : done]]
        self.sent_calls = max(self.sent_calls, done)
        return text, thinking, ready

    def call(self, index: int) -> dict[str, Any]:
        entry = self.calls[index]
        return {"id": entry.id, "function": {"index": index, "name": entry.name, "arguments": entry.parsed()}}

    @property
    def done_reason(self) -> str:
        return "length" if self.finish_reason == "length" else "stop"  # Ollama says "stop" after tool calls too

    def figures(self, start_ns: int, ready_ns: int) -> dict[str, int]:
        """Ollama's counts and durations (nanoseconds): loading, the prompt until the first token, the rest."""
        end = time.perf_counter_ns()
        first = self.first_ns or end
        return {
            "total_duration": end - start_ns,
            "load_duration": ready_ns - start_ns,
            "prompt_eval_count": self.prompt_tokens,
            "prompt_eval_duration": first - ready_ns,
            "eval_count": self.completion_tokens,
            "eval_duration": end - first,
        }


# -- what /api/tags, /api/show and /api/ps say of a model --------------------------------------------------------------


def _main_file(service: Any, info: ModelInfo) -> Path | None:
    for entry in service.registry.model_files(info):
        if entry["role"] == "main" and entry["exists"]:
            return Path(entry["path"])
    return None


def _quantization(metadata: dict[str, Any]) -> str:
    file_type = metadata.get("general.file_type")
    if not isinstance(file_type, int):
        return ""
    from gguf.constants import LlamaFileType

    try:
        return LlamaFileType(file_type).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except ValueError:
        return ""


def _parameter_size(metadata: dict[str, Any]) -> str:
    label = metadata.get("general.size_label")
    if isinstance(label, str) and label:
        return label
    count = metadata.get("general.parameter_count")
    if isinstance(count, int) and count > 0:
        for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
            if count >= size:
                return f"{count / size:.1f}{unit}".replace(".0", "")
    return ""


def _describe(service: Any, info: ModelInfo) -> dict[str, Any]:
    """What the model-listing routes say of a model: its files' size, newest time and metadata (read off the
    GGUF header, never loading the model)."""
    files = [f for f in service.registry.model_files(info) if f["exists"]]
    size = sum(int(f["size_bytes"]) for f in files)
    times = [Path(f["path"]).stat().st_mtime for f in files if Path(f["path"]).exists()]
    main = _main_file(service, info)
    metadata = read_gguf_metadata(main) if main is not None and main.suffix == ".gguf" else {}
    family = str(metadata.get("general.architecture") or info.recipe)
    identity = f"{info.id}\n{info.checkpoint}\n{size}\n{max(times, default=0)}"
    return {
        "size": size,
        "modified_at": datetime.fromtimestamp(max(times, default=0), UTC).isoformat().replace("+00:00", "Z"),
        # Ollama's digest names a manifest; lemonkit's names the model's files as they are (not their contents)
        "digest": hashlib.sha256(identity.encode()).hexdigest(),
        "details": {
            "parent_model": "",
            "format": "gguf" if metadata else info.recipe,
            "family": family,
            "families": [family],
            "parameter_size": _parameter_size(metadata),
            "quantization_level": _quantization(metadata),
        },
        "metadata": metadata,
    }


def _capabilities(info: ModelInfo, metadata: dict[str, Any]) -> list[str]:
    template = str(metadata.get("tokenizer.chat_template") or "")
    found = {"llm": ["completion"], "embedding": ["embedding"]}.get(info.type, [info.type])
    if info.type == "llm" and ("tools" in template or "tool" in info.labels):
        found.append("tools")
    if "vision" in info.labels or "mmproj" in info.checkpoints:
        found.append("vision")
    if "reasoning" in info.labels or "<think>" in template or "enable_thinking" in template:
        found.append("thinking")
    return found


def _tag(info: ModelInfo) -> str:
    return info.id if ":" in info.id else f"{info.id}:latest"


# -- handlers -------------------------------------------------------------------------------------------------------


class OllamaHandler(LemonkitHandler):
    """Ollama's error shape, NDJSON streams and model names (``name`` or ``model``, ``:latest`` or not)."""

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info", (None, None, None))[1]
        err = as_lemonkit_error(exc, status_code)
        if self._sse_open:
            return  # the stream's last line said it
        self.clear()
        self.set_status(err.status)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps({"error": err.message}))

    def ollama_body(self) -> dict[str, Any]:
        body = self.json_body(optional=True)
        if not isinstance(body, dict):
            raise InvalidJSON("The body is not a JSON object")
        return body

    @staticmethod
    def model_name(body: dict[str, Any], field: str = "model") -> str:
        name = body.get(field) or body.get("name")
        if not name or not isinstance(name, str):
            raise MissingArgument(f"{field}: required (the model's name)")
        return name

    async def ndjson_open(self) -> None:
        self.set_status(200)
        self.set_header("Content-Type", NDJSON)
        self.set_header("Cache-Control", "no-cache")
        self._sse_open = True
        await self.flush()

    @staticmethod
    def line(data: dict[str, Any]) -> bytes:
        return json.dumps(data).encode() + b"\n"


class VersionHandler(OllamaHandler):
    async def get(self) -> None:
        self.write_json({"version": OLLAMA_API_VERSION, "lemonkit": __version__})


class TagsHandler(OllamaHandler):
    """``GET /api/tags``: the downloaded models this machine runs."""

    async def get(self) -> None:
        service = self.service

        def build() -> list[dict[str, Any]]:
            models = []
            for info in service.registry.list():
                if info.remote is not None or not service.support.model(info, service.registry).supported:
                    continue
                if not service.registry.is_downloaded(info):
                    continue
                described = _describe(service, info)
                metadata = described.pop("metadata")
                models.append(
                    {
                        "name": _tag(info),
                        "model": _tag(info),
                        **described,
                        "capabilities": _capabilities(info, metadata),
                    }
                )
            return models

        self.write_json({"models": await asyncio.to_thread(build)})


class ShowHandler(OllamaHandler):
    """``POST /api/show``: a model's details, metadata, template, parameters and capabilities."""

    async def post(self) -> None:
        body = self.ollama_body()
        info = await self.service.lookup(self.model_name(body))
        service = self.service
        loaded = service.manager.loaded(info.id)

        def build() -> dict[str, Any]:
            described = _describe(service, info)
            metadata = described.pop("metadata")
            obj = service.registry.model_object(
                info, context_length=loaded.engine_info.get("ctx_size") if loaded else None
            )
            parameters = []
            if obj.get("context_length"):
                parameters.append(f"num_ctx {obj['context_length']}")
            options = obj.get("recipe_options") or {}
            if options.get("llamacpp_args"):
                parameters.append(f"llamacpp_args {json.dumps(options['llamacpp_args'])}")
            verbose = bool(body.get("verbose"))
            model_info = {k: v for k, v in metadata.items() if k != "tokenizer.chat_template" and (verbose or v != [])}
            modelfile = f"# Modelfile of lemonkit's {info.id}\nFROM {info.checkpoint}\n" + "".join(
                f"PARAMETER {p}\n" for p in parameters
            )
            return {
                "modelfile": modelfile,
                "parameters": "\n".join(parameters),
                "template": str(metadata.get("tokenizer.chat_template") or ""),
                "details": described["details"],
                "model_info": model_info,
                "capabilities": _capabilities(info, metadata),
                "modified_at": described["modified_at"],
                "license": str(metadata.get("general.license") or ""),
            }

        self.write_json(await asyncio.to_thread(build))


class PsHandler(OllamaHandler):
    """``GET /api/ps``: the loaded models, with the memory each holds and when it unloads."""

    async def get(self) -> None:
        service = self.service
        loaded = [m for m in service.manager.loaded_models() if m.upstream is None]

        def build() -> list[dict[str, Any]]:
            models = []
            for model in loaded:
                described = _describe(service, model.info)
                described.pop("metadata")
                device = service.manager.device_bytes(model)
                expires = model.expires_at
                models.append(
                    {
                        "name": _tag(model.info),
                        "model": _tag(model.info),
                        "size": model.host_bytes + device,
                        "digest": described["digest"],
                        "details": described["details"],
                        "expires_at": (
                            _NEVER
                            if expires is None
                            else datetime.fromtimestamp(expires, UTC).isoformat().replace("+00:00", "Z")
                        ),
                        "size_vram": device,
                        "context_length": int(model.engine_info.get("ctx_size") or 0),
                    }
                )
            return models

        self.write_json({"models": await asyncio.to_thread(build)})


class _ModelRun(OllamaHandler):
    """``/api/chat`` and ``/api/generate``: an empty request loads (``keep_alive: 0``: unloads) the model."""

    #: the key of the text in each line: ``message`` (chat) or ``response`` (generate)
    kind = "chat"

    async def post(self) -> None:
        start = time.perf_counter_ns()
        body = self.ollama_body()
        info = await self.service.usable(self.model_name(body))
        if info.type != "llm":
            raise ModelNotApplicable(f"{info.id} is {a_model_of(info.type)}; /api/{self.kind} needs a chat model")
        keep_alive = parse_keep_alive(body.get("keep_alive"))
        num_ctx = (body.get("options") or {}).get("num_ctx") if isinstance(body.get("options"), dict) else None
        if num_ctx is not None and (not isinstance(num_ctx, int) or isinstance(num_ctx, bool) or num_ctx < 1):
            raise InvalidArgument(f"options.num_ctx: expected a positive number of tokens, got {num_ctx!r}")
        ctx_size = num_ctx if self.caller.admin else None  # a shared server's models load with their saved options
        if self._empty(body):
            await self.unless_gone(self._load_only(info, body, keep_alive, ctx_size))
            return
        path, request = self.request_for(body, info.id)
        await self.unless_gone(self._run(info, body, path, request, keep_alive, ctx_size, start))

    def _empty(self, body: dict[str, Any]) -> bool:
        raise NotImplementedError

    def request_for(self, body: dict[str, Any], model_id: str) -> tuple[str, dict[str, Any]]:
        raise NotImplementedError

    def piece(self, text: str, thinking: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
        """The part of a line that carries ``text``: a ``message`` (chat) or a ``response`` (generate)."""
        raise NotImplementedError

    async def _load_only(self, info: ModelInfo, body: dict[str, Any], keep_alive: float | None, ctx: Any) -> None:
        manager = self.service.manager
        if body.get("keep_alive") is not None and keep_alive == 0:
            if manager.loaded(info.id) is not None:
                await manager.unload(info.id)
            reason = "unload"
        else:
            async with manager.use(info.id, ctx_size=ctx):
                pass
            manager.keep_alive(info.id, keep_alive, given="keep_alive" in body)
            reason = "load"
        self.write_json(
            {
                "model": body.get("model") or body.get("name"),
                "created_at": _now(),
                **self.piece("", "", []),
                "done": True,
                "done_reason": reason,
            }
        )

    async def _run(
        self,
        info: ModelInfo,
        body: dict[str, Any],
        path: str,
        request: dict[str, Any],
        keep_alive: float | None,
        ctx_size: int | None,
        start: int,
    ) -> None:
        manager = self.service.manager
        name = body.get("model") or body.get("name")
        stream = body.get("stream") is not False
        try:
            async with manager.use(info.id, ctx_size=ctx_size) as model:
                ready = time.perf_counter_ns()
                upstream = await self.sidecar_request(model, path, request)
                answer = _Answer()
                if stream:
                    await self.ndjson_open()
                    await self.pump(self._lines(model, upstream, answer, name, start, ready))
                else:
                    async with contextlib.aclosing(self.sidecar_events(model, upstream)) as events:
                        async for chunk in events:
                            answer.step(chunk)
                    message = self.piece(
                        answer.content, answer.reasoning, [answer.call(i) for i in sorted(answer.calls)]
                    )
                    self.write_json(
                        {
                            "model": name,
                            "created_at": _now(),
                            **message,
                            "done": True,
                            "done_reason": answer.done_reason,
                            **answer.figures(start, ready),
                        }
                    )
        finally:
            manager.keep_alive(info.id, keep_alive, given="keep_alive" in body)

    async def _lines(
        self, model: LoadedModel, upstream: httpx.Response, answer: _Answer, name: Any, start: int, ready: int
    ) -> AsyncIterator[bytes]:
        try:
            async with contextlib.aclosing(self.sidecar_events(model, upstream)) as events:
                async for chunk in events:
                    text, thinking, calls = answer.step(chunk)
                    if text or thinking or calls:
                        yield self.line(
                            {"model": name, "created_at": _now(), **self.piece(text, thinking, calls), "done": False}
                        )
        except LemonkitError as exc:
            yield self.line({"error": exc.message})
            return
        yield self.line(
            {
                "model": name,
                "created_at": _now(),
                **self.piece("", "", []),
                "done": True,
                "done_reason": answer.done_reason,
                **answer.figures(start, ready),
            }
        )


class ChatHandler(_ModelRun):
    """``POST /api/chat``."""

    kind = "chat"

    def _empty(self, body: dict[str, Any]) -> bool:
        return not body.get("messages")

    def request_for(self, body: dict[str, Any], model_id: str) -> tuple[str, dict[str, Any]]:
        return "/v1/chat/completions", chat_request(body, model_id)

    def piece(self, text: str, thinking: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if thinking:
            message["thinking"] = thinking
        if calls:
            message["tool_calls"] = calls
        return {"message": message}


class GenerateHandler(_ModelRun):
    """``POST /api/generate``."""

    kind = "generate"

    def _empty(self, body: dict[str, Any]) -> bool:
        return not body.get("prompt") and not body.get("images")

    def request_for(self, body: dict[str, Any], model_id: str) -> tuple[str, dict[str, Any]]:
        return generate_request(body, model_id)

    def piece(self, text: str, thinking: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
        return {"response": text, **({"thinking": thinking} if thinking else {})}


class EmbedHandler(OllamaHandler):
    """``POST /api/embed`` (``input``: a string or a list) and the older ``POST /api/embeddings`` (``prompt``)."""

    legacy = False

    async def post(self) -> None:
        start = time.perf_counter_ns()
        body = self.ollama_body()
        info = await self.service.usable(self.model_name(body))
        if info.type != "embedding":
            raise ModelNotApplicable(f"{info.id} is {a_model_of(info.type)}; /api/embed needs an embedding model")
        field = "prompt" if self.legacy else "input"
        texts = body.get(field)
        if isinstance(texts, str):
            texts = [texts]
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
            raise MissingArgument(f"{field}: required, a string{'' if self.legacy else ' or a list of strings'}")
        if body.get("truncate") is False:
            raise InvalidArgument(
                "truncate: lemonkit's embedding engines cut an input at the model's context; false is not supported"
            )
        keep_alive = parse_keep_alive(body.get("keep_alive"))
        dimensions = body.get("dimensions")
        if dimensions is not None and (
            not isinstance(dimensions, int) or isinstance(dimensions, bool) or dimensions < 1
        ):
            raise InvalidArgument(f"dimensions: expected a positive number, got {dimensions!r}")
        request = {"model": info.id, "input": texts}
        await self.unless_gone(self._run(info, body, request, dimensions, keep_alive, start))

    async def _run(
        self,
        info: ModelInfo,
        body: dict[str, Any],
        request: dict[str, Any],
        dimensions: int | None,
        keep_alive: float | None,
        start: int,
    ) -> None:
        manager = self.service.manager
        try:
            async with manager.use(info.id) as model:
                ready = time.perf_counter_ns()
                result = await self.sidecar_json(model, "/v1/embeddings", request)
        finally:
            manager.keep_alive(info.id, keep_alive, given="keep_alive" in body)
        vectors = [item["embedding"] for item in sorted(result["data"], key=lambda d: d["index"])]
        if dimensions is not None:
            vectors = embedding_dimensions(vectors, dimensions, info.id)
        if self.legacy:
            self.write_json({"embedding": vectors[0]})
            return
        end = time.perf_counter_ns()
        self.write_json(
            {
                "model": body.get("model") or body.get("name"),
                "embeddings": vectors,
                "total_duration": end - start,
                "load_duration": ready - start,
                "prompt_eval_count": int((result.get("usage") or {}).get("prompt_tokens") or 0),
            }
        )


class EmbeddingsHandler(EmbedHandler):
    legacy = True


class PullHandler(OllamaHandler):
    """``POST /api/pull``: the model's download job, its progress as Ollama's NDJSON lines."""

    async def post(self) -> None:
        self.require_admin("pulling a model")
        body = self.ollama_body()
        downloads = self.service.downloads
        await downloads.restore()
        info = await self.service.usable(self.model_name(body))
        job = await downloads.pull(info, owned=False, register=None, by=self.caller.name)
        downloads.subscribe(job)
        try:
            if not await self.unless_gone(asyncio.shield(job.planned)):
                return
            if body.get("stream") is False:
                if await self.unless_gone(job.wait_done()):
                    self.write_json({"status": "success"})
                return
            await self.ndjson_open()
            await self.pump(self._lines(job))
        finally:
            downloads.unsubscribe(job)

    async def _lines(self, job: Job) -> AsyncIterator[bytes]:
        yield self.line({"status": "pulling manifest"})
        async for event, data in progress_events(job, self.service.settings.ping_interval):
            if data is None or event == "ping":
                continue
            if event == "progress":
                name = str(data.get("file") or job.model_name)
                yield self.line(
                    {
                        "status": f"pulling {name}",
                        "digest": name,
                        "total": int(data.get("bytes_total") or 0),
                        "completed": int(data.get("bytes_downloaded") or 0),
                    }
                )
            elif event == "error":
                yield self.line({"error": str(data.get("error"))})
                return
        for status in ("verifying sha256 digest", "writing manifest", "success"):
            yield self.line({"status": status})


class DeleteHandler(OllamaHandler):
    """``DELETE /api/delete``: as ``POST /v1/delete``."""

    async def delete(self) -> None:
        self.require_admin("deleting a model")
        body = self.ollama_body()
        info = await self.service.lookup(self.model_name(body))
        await delete_model(self.service, info)
        self.write_json({})


class UnsupportedHandler(OllamaHandler):
    """Ollama routes that build or move model blobs, which lemonkit has no equivalent of: a 501 saying what to
    use instead."""

    what = ""

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedRoute(self.what)

    get = head = post = delete = _refuse


class CreateHandler(UnsupportedHandler):
    what = (
        "lemonkit has no Modelfiles or blobs: register a GGUF from a hub repo or an allowed directory with "
        "POST /api/v1/pull {model_name: 'user.NAME', checkpoint, recipe: 'llamacpp'}, and set ctx_size or "
        "llamacpp_args with POST /api/v1/models/{model}/options"
    )


class CopyHandler(UnsupportedHandler):
    what = (
        "lemonkit does not copy models: register another name for the same checkpoint with "
        "POST /api/v1/pull {model_name: 'user.NAME', checkpoint, recipe}"
    )


class PushHandler(UnsupportedHandler):
    what = "lemonkit does not publish models to a registry"


class BlobsHandler(UnsupportedHandler):
    what = "lemonkit has no blob store: models come from Hugging Face repos or allowed local directories"


#: the routes, under the host's root next to ``api/v1/`` (``{base_url}lemonkit/api/...`` in Jupyter)
OLLAMA_ROUTES: list[tuple[str, type[LemonkitHandler]]] = [
    ("version", VersionHandler),
    ("tags", TagsHandler),
    ("show", ShowHandler),
    ("ps", PsHandler),
    ("chat", ChatHandler),
    ("generate", GenerateHandler),
    ("embed", EmbedHandler),
    ("embeddings", EmbeddingsHandler),
    ("pull", PullHandler),
    ("delete", DeleteHandler),
    ("create", CreateHandler),
    ("copy", CopyHandler),
    ("push", PushHandler),
    ("blobs/(?P<digest>[^/]+)", BlobsHandler),
]
