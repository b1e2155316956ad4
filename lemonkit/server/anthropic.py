"""Anthropic's Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``), for the ``anthropic`` SDK
and the agents built on it.

A message request becomes an OpenAI chat request to the model's sidecar (system prompt, text and image blocks,
``tool_use`` and ``tool_result`` turns, tools and ``tool_choice``, ``stop_sequences``, ``thinking``); its SSE
chunks become Anthropic's events: ``message_start``, a ``content_block_start``/``content_block_delta``/
``content_block_stop`` run per block (``thinking_delta``, ``text_delta``, ``input_json_delta`` as the tool call's
arguments arrive), ``message_delta`` with the ``stop_reason`` and usage, ``message_stop``; ``ping`` while the model
is quiet. Errors have Anthropic's shape, ``{"type": "error", "error": {"type", "message"}}``.
"""

from __future__ import annotations

import contextlib
import json
import secrets
from collections.abc import AsyncIterator
from typing import Any

import httpx

from lemonkit.catalog.model_info import a_model_of
from lemonkit.catalog.registry import ModelInfo
from lemonkit.errors import InvalidArgument, LemonkitError, MissingArgument, ModelNotApplicable
from lemonkit.formats import schemas, sse
from lemonkit.server.chat_stream import ChatStream, Piece
from lemonkit.server.handler import LemonkitHandler, as_lemonkit_error
from lemonkit.serving.loaded_model import LoadedModel

__all__ = ["CountTokensHandler", "MessagesHandler", "chat_request"]

#: Anthropic's error ``type`` by status
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
#: the request's fields. ``service_tier``, ``speed`` and ``inference_geo`` choose among Anthropic's capacity, which
#: has no meaning here; ``cache_control`` marks a prefix to cache, which llama.cpp's slots do by themselves
_FIELDS = {
    "cache_control",
    "inference_geo",
    "speed",
    "output_config",
    "model",
    "max_tokens",
    "messages",
    "system",
    "stop_sequences",
    "stream",
    "temperature",
    "top_p",
    "top_k",
    "tools",
    "tool_choice",
    "thinking",
    "metadata",
    "service_tier",
}
_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


def _text(value: Any, where: str) -> str:
    """A string, or a list of text blocks, as one string."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(b, dict) and b.get("type") == "text" for b in value):
        return "".join(str(b.get("text") or "") for b in value)
    raise InvalidArgument(f"{where}: expected a string or a list of text blocks")


def _image(block: dict[str, Any], where: str) -> dict[str, Any]:
    source = block.get("source")
    if not isinstance(source, dict):
        raise InvalidArgument(f"{where}.source: required")
    if source.get("type") == "base64":
        if not source.get("media_type") or not source.get("data"):
            raise InvalidArgument(f"{where}.source: a base64 image needs media_type and data")
        url = f"data:{source['media_type']};base64,{source['data']}"
    elif source.get("type") == "url" and source.get("url"):
        url = str(source["url"])
    else:
        raise InvalidArgument(f"{where}.source.type: expected base64 or url")
    return {"type": "image_url", "image_url": {"url": url}}


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
        raise InvalidArgument(f"{where}: expected a string or a list of content blocks")
    return content


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if body.get("system"):
        out.append({"role": "system", "content": _text(body["system"], "system")})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise MissingArgument("messages: required, a list of messages")
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise InvalidArgument(f"{where}: expected an object")
        role = message.get("role")
        blocks = _blocks(message.get("content"), f"{where}.content")
        if role == "user":
            parts: list[dict[str, Any]] = []
            for j, block in enumerate(blocks):
                kind, at = block.get("type"), f"{where}.content[{j}]"
                if kind == "text":
                    parts.append({"type": "text", "text": str(block.get("text") or "")})
                elif kind == "image":
                    parts.append(_image(block, at))
                elif kind == "tool_result":
                    # results answer the calls of the turn before, so they come first, as OpenAI's tool messages
                    result = _text(block.get("content") or "", f"{at}.content")
                    if block.get("is_error"):
                        result = f"Error: {result}"
                    out.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id") or ""), "content": result})
                else:
                    raise InvalidArgument(f"{at}.type: lemonkit takes text, image and tool_result blocks, not {kind!r}")
            if parts:
                out.append({"role": "user", "content": parts})
        elif role == "assistant":
            text, thinking, calls = [], [], []
            for j, block in enumerate(blocks):
                kind = block.get("type")
                if kind == "text":
                    text.append(str(block.get("text") or ""))
                elif kind == "thinking":
                    thinking.append(str(block.get("thinking") or ""))
                elif kind == "redacted_thinking":
                    continue  # encrypted by Anthropic: nothing a local model can read
                elif kind == "tool_use":
                    calls.append(
                        {
                            "id": str(block.get("id") or f"toolu_{i}_{j}"),
                            "type": "function",
                            "function": {
                                "name": str(block.get("name") or ""),
                                "arguments": json.dumps(block.get("input") or {}),
                            },
                        }
                    )
                else:
                    raise InvalidArgument(f"{where}.content[{j}].type: not an assistant block: {kind!r}")
            item: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
            if calls:
                item["tool_calls"] = calls
            if thinking:
                item["reasoning_content"] = "".join(thinking)
            out.append(item)
        else:
            raise InvalidArgument(f"{where}.role: expected user or assistant, got {role!r}")
    return out


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise InvalidArgument("tools: expected a list")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not tool.get("name"):
            raise InvalidArgument(f"tools[{i}]: expected {{name, description, input_schema}}")
        if tool.get("type") not in (None, "custom"):
            raise InvalidArgument(
                f"tools[{i}].type: {tool['type']!r} is one of Anthropic's server tools, which run there"
            )
        function: dict[str, Any] = {"name": tool["name"], "parameters": tool.get("input_schema") or {"type": "object"}}
        if tool.get("description"):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Any) -> dict[str, Any]:
    if choice is None:
        return {}
    if not isinstance(choice, dict):
        raise InvalidArgument("tool_choice: expected {type: auto | any | tool | none}")
    kind = choice.get("type")
    mapped: Any = {"auto": "auto", "any": "required", "none": "none"}.get(str(kind))
    if kind == "tool":
        if not choice.get("name"):
            raise MissingArgument("tool_choice.name: required with type tool")
        mapped = {"type": "function", "function": {"name": choice["name"]}}
    if mapped is None:
        raise InvalidArgument(f"tool_choice.type: expected auto, any, tool or none, got {kind!r}")
    out: dict[str, Any] = {"tool_choice": mapped}
    if choice.get("disable_parallel_tool_use"):
        out["parallel_tool_calls"] = False
    return out


def _thinking(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict) or value.get("type") not in ("enabled", "disabled", "adaptive", "between_tools"):
        raise InvalidArgument("thinking: expected {type: enabled, budget_tokens}, {type: adaptive} or {type: disabled}")
    out: dict[str, Any] = {"enable_thinking": value["type"] != "disabled"}
    budget = value.get("budget_tokens")
    if value["type"] == "enabled" and budget is not None:
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
            raise InvalidArgument(f"thinking.budget_tokens: expected an integer >= 0, got {budget!r}")
        out["reasoning_budget"] = budget  # the engine closes the thinking after that many tokens
    return out


def _output_config(value: Any) -> dict[str, Any]:
    """``output_config``: a ``format`` (a JSON schema the answer must follow: a grammar here) and an ``effort``
    (``low`` answers without thinking, any other level thinks first)."""
    if value is None:
        return {}
    if not isinstance(value, dict) or set(value) - {"format", "effort"}:
        raise InvalidArgument("output_config: expected {format: {type: json_schema, schema}, effort}")
    out: dict[str, Any] = {}
    fmt = value.get("format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise InvalidArgument("output_config.format: expected {type: json_schema, schema}")
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
    effort = value.get("effort")
    if effort is not None:
        if effort not in ("low", "medium", "high", "xhigh", "max"):
            raise InvalidArgument(f"output_config.effort: expected low, medium, high, xhigh or max, got {effort!r}")
        out["enable_thinking"] = effort != "low"
    return out


def chat_request(body: dict[str, Any], model_id: str) -> dict[str, Any]:
    """The OpenAI chat request (streamed from the sidecar) an Anthropic message request stands for.

    Raises:
        InvalidArgument, MissingArgument: A field that does not translate, named.
    """
    unknown = sorted(set(body) - _FIELDS)
    if unknown:
        raise InvalidArgument(f"{', '.join(unknown)}: not fields lemonkit's Messages API takes")
    max_tokens = body.get("max_tokens")
    if max_tokens is None:
        raise MissingArgument("max_tokens: required")
    chat: dict[str, Any] = {
        "model": model_id,
        "messages": _messages(body),
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        **_thinking(body.get("thinking")),
        **_output_config(body.get("output_config")),
    }
    for name in ("temperature", "top_p", "top_k"):
        if body.get(name) is not None:
            chat[name] = body[name]
    if body.get("stop_sequences"):
        chat["stop"] = body["stop_sequences"]
    if body.get("tools"):
        chat["tools"] = _tools(body["tools"])
        chat.update(_tool_choice(body.get("tool_choice")))
    elif body.get("tool_choice") not in (None, {"type": "auto"}, {"type": "none"}):
        raise InvalidArgument("tool_choice: the request has no tools")
    metadata = body.get("metadata")
    if isinstance(metadata, dict) and isinstance(metadata.get("user_id"), str):
        chat["user"] = metadata["user_id"]
    return schemas.validate("chat/completions", chat)


def _event(name: str, data: dict[str, Any]) -> bytes:
    return sse.frame({"type": name, **data}, name)


class _Blocks:
    """Anthropic's content blocks, opened and closed as an answer's pieces arrive: each piece of another kind (or
    another tool call) closes the open block and opens the next."""

    def __init__(self) -> None:
        self.index = -1
        self.open: tuple[str, int] | None = None  # (kind, tool index)

    def events(self, piece: Piece) -> list[bytes]:
        kind = "tool" if piece.kind in ("tool_start", "tool_args") else piece.kind
        key = (kind, piece.index if kind == "tool" else 0)
        out = []
        if self.open != key:
            out += self.close()
            self.index += 1
            self.open = key
            if kind == "text":
                block: dict[str, Any] = {"type": "text", "text": ""}
            elif kind == "thinking":
                block = {"type": "thinking", "thinking": "", "signature": ""}
            else:
                block = {"type": "tool_use", "id": piece.id, "name": piece.name, "input": {}}
            out.append(_event("content_block_start", {"index": self.index, "content_block": block}))
        if piece.kind == "text":
            delta: dict[str, Any] | None = {"type": "text_delta", "text": piece.text}
        elif piece.kind == "thinking":
            delta = {"type": "thinking_delta", "thinking": piece.text}
        elif piece.kind == "tool_args":
            delta = {"type": "input_json_delta", "partial_json": piece.text}
        else:
            delta = None
        if delta is not None:
            out.append(_event("content_block_delta", {"index": self.index, "delta": delta}))
        return out

    def close(self) -> list[bytes]:
        if self.open is None:
            return []
        out = []
        if self.open[0] == "thinking":  # a local model's thinking carries no signature; the SDK expects the field
            out.append(
                _event(
                    "content_block_delta", {"index": self.index, "delta": {"type": "signature_delta", "signature": ""}}
                )
            )
        out.append(_event("content_block_stop", {"index": self.index}))
        self.open = None
        return out


class _AnthropicRoute(LemonkitHandler):
    """Anthropic's error shape on these routes, streamed (an ``error`` event) or not."""

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info", (None, None, None))[1]
        err = as_lemonkit_error(exc, status_code)
        if self._sse_open:
            return
        self.clear()
        self.set_status(err.status)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(_error_body(err)))

    async def model(self, body: dict[str, Any]) -> ModelInfo:
        name = body.get("model")
        if not isinstance(name, str) or not name:
            raise MissingArgument("model: required")
        info = await self.service.usable(name)
        if info.type != "llm":
            raise ModelNotApplicable(f"{info.id} is {a_model_of(info.type)}; /v1/messages needs a chat model")
        return info


def _error_body(err: LemonkitError) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(err.status, "api_error" if err.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


class MessagesHandler(_AnthropicRoute):
    """``POST /v1/messages``."""

    async def post(self) -> None:
        body = self.json_body()
        info = await self.model(body)
        chat = chat_request(body, info.id)
        await self.unless_gone(self._serve(info, body, chat))

    async def _serve(self, info: ModelInfo, body: dict[str, Any], chat: dict[str, Any]) -> None:
        async with self.service.manager.use(info.id) as model:
            upstream = await self.sidecar_request(model, "/v1/chat/completions", chat)
            message_id = "msg_" + secrets.token_hex(12)
            if body.get("stream"):
                await self.sse_open()
                await self.pump(self._events(model, upstream, message_id, body["model"]))
                return
            answer = ChatStream()
            async with contextlib.aclosing(self.sidecar_events(model, upstream)) as events:
                async for chunk in events:
                    answer.feed(chunk)
            self.write_json(_message(answer, message_id, body["model"]))

    async def _events(
        self, model: LoadedModel, upstream: httpx.Response, message_id: str, name: str
    ) -> AsyncIterator[bytes]:
        answer, blocks = ChatStream(), _Blocks()
        start = {**_message(answer, message_id, name), "content": [], "stop_reason": None}
        yield _event("message_start", {"message": start})
        yield _event("ping", {})
        try:
            async with contextlib.aclosing(self.sidecar_events(model, upstream)) as events:
                async for chunk in events:
                    for piece in answer.feed(chunk):
                        for frame in blocks.events(piece):
                            yield frame
        except LemonkitError as exc:
            yield _event("error", {"error": _error_body(exc)["error"]})
            return
        for frame in blocks.close():
            yield frame
        stop_reason, stop_sequence = _stop(answer)
        usage = {"input_tokens": answer.prompt_tokens, "output_tokens": answer.completion_tokens}
        yield _event(
            "message_delta", {"delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence}, "usage": usage}
        )
        yield _event("message_stop", {})


def _stop(answer: ChatStream) -> tuple[str, str | None]:
    if answer.stop_sequence is not None:
        return "stop_sequence", answer.stop_sequence
    return _STOP_REASONS.get(answer.finish_reason or "stop", "end_turn"), None


def _message(answer: ChatStream, message_id: str, name: str) -> dict[str, Any]:
    content: list[dict[str, Any]] = []
    if answer.reasoning:
        content.append({"type": "thinking", "thinking": answer.reasoning, "signature": ""})
    if answer.content:
        content.append({"type": "text", "text": answer.content})
    content += [{"type": "tool_use", "id": c.id, "name": c.name, "input": c.parsed()} for c in answer.tool_calls()]
    stop_reason, stop_sequence = _stop(answer)
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": name,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": {"input_tokens": answer.prompt_tokens, "output_tokens": answer.completion_tokens},
    }


class CountTokensHandler(_AnthropicRoute):
    """``POST /v1/messages/count_tokens``: the tokens the request's prompt takes, through the model's template."""

    async def post(self) -> None:
        body = self.json_body()
        info = await self.model(body)
        chat = chat_request({**body, "max_tokens": body.get("max_tokens") or 1}, info.id)
        await self.unless_gone(self._count(info, chat))

    async def _count(self, info: ModelInfo, chat: dict[str, Any]) -> None:
        async with self.service.manager.use(info.id) as model:
            counted = await self.sidecar_json(model, "/v1/chat/tokens", chat)
        self.write_json({"input_tokens": int(counted["input_tokens"])})
