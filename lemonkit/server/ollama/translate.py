"""Ollama's requests as OpenAI chat and completion requests, and the OpenAI stream read back into Ollama's pieces
(``options``, ``format``, ``think``, ``images``, ``keep_alive``, tool calls)."""

from __future__ import annotations

import base64
import json
import re
import time
from datetime import UTC, datetime
from typing import Any

from lemonkit.errors import InvalidArgument
from lemonkit.formats import schemas
from lemonkit.server.chat_stream import ChatStream

#: the Ollama API version these routes follow (clients read it to tell which features the server has)
OLLAMA_API_VERSION = "0.12.0"
NDJSON = "application/x-ndjson"
#: ``/api/ps``'s ``expires_at`` for a model that stays loaded until memory is needed (Ollama's ``keep_alive: -1``)
NEVER_EXPIRES = "2318-01-01T00:00:00Z"

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


def now() -> str:
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


class OllamaAnswer(ChatStream):
    """An OpenAI chat stream read into Ollama's pieces: text, thinking, and each tool call whole as soon as its
    arguments are a whole JSON object (else once the next starts or the answer ends): Ollama sends a call whole,
    with its arguments as an object."""

    sent_calls: int = 0

    def step(self, chunk: dict[str, Any]) -> tuple[str, str, list[dict[str, Any]]]:
        """(text, thinking, tool calls now complete) of one chunk."""
        pieces = self.feed(chunk)
        text = "".join(p.text for p in pieces if p.kind == "text")
        thinking = "".join(p.text for p in pieces if p.kind == "thinking")
        newest = max(self.calls, default=None)
        if self.finish_reason is not None or (newest is not None and self.calls[newest].complete):
            done = len(self.calls)
        else:
            done = max(0, len(self.calls) - 1)
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
