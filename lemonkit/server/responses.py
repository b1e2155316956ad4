"""The Responses API on top of chat completions, as pure translation (no HTTP).

A ``/v1/responses`` request becomes a chat completions request for the model's
sidecar (:func:`to_chat_request`); the answer comes back as a Response object
(:func:`from_chat_completion`) or, streaming, as Responses events built chunk by chunk
(:class:`ResponseStream`). Shapes follow the spec's examples plus the fields the
openai SDK's pydantic models require (``parallel_tool_calls``, ``tool_choice``,
``tools``, ``sequence_number``, usage details), so ``client.responses.create`` and
``client.responses.stream`` both parse them.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Mapping
from typing import Any

from lemonkit.errors import BackendError

__all__ = ["ResponseStream", "from_chat_completion", "to_chat_request"]

Event = tuple[str, dict[str, Any]]

#: Responses request fields that mean the same in a chat completions request.
_PASSED = (
    "model", "temperature", "top_p", "top_k", "min_p", "repeat_penalty", "frequency_penalty", "presence_penalty",
    "seed", "ctx_size", "route_trace", "enable_thinking", "thinking", "parallel_tool_calls",
)  # fmt: skip


def _new_id(prefix: str) -> str:
    return prefix + secrets.token_urlsafe(24)


# -- request -----------------------------------------------------------------------------------


def _text_of(parts: list[dict[str, Any]]) -> str:
    return "\n".join(p.get("text") or p.get("refusal") or "" for p in parts)


def _chat_content(content: str | list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """Responses content -> chat content: plain text when there is no image (every chat template takes a string)."""
    if isinstance(content, str):
        return content
    if not any(p.get("type") == "input_image" for p in content):
        return _text_of(content)
    parts: list[dict[str, Any]] = []
    for p in content:
        if p.get("type") == "input_image":
            image: dict[str, Any] = {"url": p["image_url"]}
            if p.get("detail"):
                image["detail"] = p["detail"]
            parts.append({"type": "image_url", "image_url": image})
        else:
            parts.append({"type": "text", "text": p.get("text") or p.get("refusal") or ""})
    return parts


def _messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            role = item["role"]
            # local chat templates know "system", rarely OpenAI's newer "developer"
            messages.append(
                {"role": "system" if role == "developer" else role, "content": _chat_content(item["content"])}
            )
        elif kind == "function_call":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # parallel calls, or text then calls: one turn
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item["output"]
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": item["call_id"],
                    "content": output if isinstance(output, str) else _text_of(output),
                }
            )
        # "reasoning" items from earlier turns are dropped: chat templates strip past thinking anyway
    return messages


def output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's ``output`` items as the chat messages a later turn continues from (reasoning left out)."""
    return _messages([item for item in output if item.get("type") in ("message", "function_call")])


def to_chat_request(body: Mapping[str, Any]) -> dict[str, Any]:
    """A validated Responses request -> the chat completions request that serves it."""
    messages: list[dict[str, Any]] = []
    if body.get("instructions"):
        messages.append({"role": "system", "content": body["instructions"]})
    inp = body["input"]
    messages += [{"role": "user", "content": inp}] if isinstance(inp, str) else _messages(inp)
    chat: dict[str, Any] = {key: body[key] for key in _PASSED if body.get(key) is not None}
    chat["messages"] = messages
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    if body.get("tools"):
        chat["tools"] = [
            {
                "type": "function",
                "function": {k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None},
            }
            for t in body["tools"]
        ]
    choice = body.get("tool_choice")
    if isinstance(choice, str):
        chat["tool_choice"] = choice
    elif isinstance(choice, dict):
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    fmt = (body.get("text") or {}).get("format")
    if fmt and fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "description", "schema", "strict") if fmt.get(k) is not None}
        chat["response_format"] = {"type": "json_schema", "json_schema": schema}
    elif fmt and fmt.get("type") == "json_object":
        chat["response_format"] = {"type": "json_object"}
    if body.get("stream"):
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}  # the usage chunk feeds response.completed
    return chat


# -- response objects --------------------------------------------------------------------------


def _usage(usage: Mapping[str, Any] | None, reasoning_tokens: int = 0) -> dict[str, Any]:
    usage = usage or {}
    prompt = usage.get("prompt_tokens") or 0
    completion = usage.get("completion_tokens") or 0
    details = usage.get("completion_tokens_details") or {}
    return {
        "input_tokens": prompt,
        "output_tokens": completion,
        "total_tokens": usage.get("total_tokens") or prompt + completion,
        "input_tokens_details": {
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
            "cache_write_tokens": 0,  # the SDK requires it; llama.cpp has no such notion
        },
        "output_tokens_details": {"reasoning_tokens": details.get("reasoning_tokens") or reasoning_tokens},
    }


def _response(
    *,
    response_id: str,
    created_at: int,
    model: str,
    status: str,
    output: list[dict[str, Any]],
    request: Mapping[str, Any] | None,
    usage: dict[str, Any] | None = None,
    completed_at: int | None = None,
    incomplete: bool = False,
) -> dict[str, Any]:
    request = request or {}
    tool_choice = request.get("tool_choice") or "auto"
    resp: dict[str, Any] = {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "model": model,
        "output": output,
        # fields the SDK's Response model requires, echoed from the request like OpenAI does
        "parallel_tool_calls": request.get("parallel_tool_calls", True),
        "tool_choice": tool_choice,
        "tools": list(request.get("tools") or []),
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": request.get("instructions"),
        "max_output_tokens": request.get("max_output_tokens"),
        "temperature": request.get("temperature"),
        "top_p": request.get("top_p"),
        "metadata": request.get("metadata") or {},
    }
    if completed_at is not None:
        resp["completed_at"] = completed_at
    if usage is not None:
        resp["usage"] = usage
    return resp


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "annotations": [], "logprobs": [], "text": text}


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": [_text_part(text)]}


def _reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "reasoning",
        "status": status,
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
    }


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "function_call",
        "status": status,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
    }


def from_chat_completion(
    chat: Mapping[str, Any],
    *,
    response_id: str,
    created_at: int,
    model: str,
    request: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A chat completion -> the non-streaming Response object.

    Args:
        chat: The sidecar's ``chat.completion`` answer.
        response_id: ``resp_...`` id of this response.
        created_at: Unix time the request arrived.
        model: The model name the client asked for.
        request: The Responses request, to echo ``tools``, ``tool_choice``, ``instructions``... as OpenAI does.

    Raises:
        BackendError: The completion has no choice (the spec's 500 for a backend answer lacking a field).
    """
    choices = chat.get("choices")
    if not choices:
        raise BackendError("The backend's chat completion has no choices")
    choice = choices[0]
    msg = choice.get("message") or {}
    truncated = choice.get("finish_reason") == "length"
    item_status = "incomplete" if truncated else "completed"
    output: list[dict[str, Any]] = []
    if msg.get("reasoning_content"):
        output.append(_reasoning_item(_new_id("rs_"), msg["reasoning_content"], item_status))
    calls = msg.get("tool_calls") or []
    if msg.get("content") or not calls:
        output.append(_message_item(_new_id("msg_"), msg.get("content") or "", item_status))
    for call in calls:
        fn = call.get("function") or {}
        output.append(
            _call_item(
                _new_id("fc_"),
                call.get("id") or _new_id("call_"),
                fn.get("name", ""),
                fn.get("arguments") or "",
                "completed",
            )
        )
    resp = _response(
        response_id=response_id,
        created_at=created_at,
        model=model,
        status="incomplete" if truncated else "completed",
        output=output,
        request=request,
        usage=_usage(chat.get("usage")),
        completed_at=int(time.time()),
        incomplete=truncated,
    )
    if chat.get("timings") is not None:
        resp["timings"] = chat["timings"]
    return resp


# -- streaming ---------------------------------------------------------------------------------


class _Item:
    """One output item being streamed: its index, id and accumulated text (a list: joining once is O(n))."""

    __slots__ = ("call_id", "id", "index", "kind", "name", "parts")

    def __init__(self, kind: str, index: int, item_id: str, call_id: str = "", name: str = "") -> None:
        self.kind, self.index, self.id = kind, index, item_id
        self.call_id, self.name = call_id, name
        self.parts: list[str] = []


class ResponseStream:
    """Turns a chat completion chunk stream into Responses streaming events.

    Feed each parsed ``chat.completion.chunk`` to :meth:`feed` and call :meth:`finish`
    after ``[DONE]``; both return ``(event name, data)`` pairs to send as
    ``event: <name>\\ndata: <json>``. ``response.created`` and ``response.in_progress``
    come from :meth:`start`, which :meth:`feed` calls itself when the caller has not.

    Reasoning (``reasoning_content``) streams as a ``reasoning`` item, text as a
    ``message`` item, and tool calls as ``function_call`` items; a new kind of delta
    closes the item before it. The stream always ends with ``response.completed``
    (the event the SDK's stream helper waits for), whose status is ``incomplete``
    when generation hit the token limit.

    Args:
        response_id: ``resp_...`` id of this response.
        created_at: Unix time the request arrived.
        model: The model name the client asked for.
        request: The Responses request, echoed into the response object (optional).
    """

    def __init__(
        self, *, response_id: str, created_at: int, model: str, request: Mapping[str, Any] | None = None
    ) -> None:
        self.response_id, self.created_at, self.model, self.request = response_id, created_at, model, request
        self._seq = 0
        self._started = False
        self._finished = False
        self._items: list[_Item] = []
        self._open: _Item | None = None  # the reasoning/message item deltas currently go to
        self._calls: dict[int, _Item] = {}  # chat tool_call index -> its function_call item
        self._usage: dict[str, Any] | None = None
        self._timings: Any = None
        self._finish_reason: str | None = None
        self._reasoning_chunks = 0  # llama.cpp sends one token per chunk: the reasoning token count, roughly

    def _ev(self, name: str, data: dict[str, Any]) -> Event:
        self._seq += 1
        return name, {"type": name, "sequence_number": self._seq - 1, **data}

    def _snapshot(self, status: str, **kw: Any) -> dict[str, Any]:
        return _response(
            response_id=self.response_id,
            created_at=self.created_at,
            model=self.model,
            status=status,
            request=self.request,
            **kw,
        )

    def start(self) -> list[Event]:
        """``response.created`` and ``response.in_progress`` (once; later calls return nothing)."""
        if self._started:
            return []
        self._started = True
        return [
            self._ev("response.created", {"response": self._snapshot("in_progress", output=[])}),
            self._ev("response.in_progress", {"response": self._snapshot("in_progress", output=[])}),
        ]

    def _open_item(self, kind: str, events: list[Event]) -> _Item:
        self._close_open(events)
        prefix = "rs_" if kind == "reasoning" else "msg_"
        item = _Item(kind, len(self._items), _new_id(prefix))
        self._items.append(item)
        self._open = item
        if kind == "reasoning":
            added = _reasoning_item(item.id, "", "in_progress")
            added["content"] = []
            part: dict[str, Any] = {"type": "reasoning_text", "text": ""}
        else:
            added = _message_item(item.id, "", "in_progress")
            added["content"] = []
            part = _text_part("")
        events.append(self._ev("response.output_item.added", {"output_index": item.index, "item": added}))
        events.append(
            self._ev(
                "response.content_part.added",
                {"item_id": item.id, "output_index": item.index, "content_index": 0, "part": part},
            )
        )
        return item

    def _close_open(self, events: list[Event]) -> None:
        item = self._open
        if item is None:
            return
        self._open = None
        text = "".join(item.parts)
        base = {"item_id": item.id, "output_index": item.index, "content_index": 0}
        if item.kind == "reasoning":
            events.append(self._ev("response.reasoning_text.done", {**base, "text": text}))
            events.append(
                self._ev("response.content_part.done", {**base, "part": {"type": "reasoning_text", "text": text}})
            )
        else:
            events.append(self._ev("response.output_text.done", {**base, "text": text, "logprobs": []}))
            events.append(self._ev("response.content_part.done", {**base, "part": _text_part(text)}))
        events.append(
            self._ev("response.output_item.done", {"output_index": item.index, "item": self._final_item(item)})
        )

    def _final_item(self, item: _Item) -> dict[str, Any]:
        text = "".join(item.parts)
        status = "incomplete" if self._finish_reason == "length" else "completed"
        if item.kind == "reasoning":
            return _reasoning_item(item.id, text, status)
        if item.kind == "message":
            return _message_item(item.id, text, status)
        return _call_item(item.id, item.call_id, item.name, text, "completed")

    def feed(self, chunk: Mapping[str, Any]) -> list[Event]:
        """Events for one chat chunk (the per-token path: a few dict builds per delta)."""
        events = self.start() if not self._started else []
        if chunk.get("usage"):
            self._usage = chunk["usage"]
        if chunk.get("timings") is not None:
            self._timings = chunk["timings"]
        for choice in chunk.get("choices") or ():
            if choice.get("index", 0) != 0:  # Responses has one output; n > 1 is not a thing there
                continue
            delta = choice.get("delta") or {}
            reasoning = delta.get("reasoning_content")
            if reasoning:
                item = self._open if self._open is not None and self._open.kind == "reasoning" else None
                if item is None:
                    item = self._open_item("reasoning", events)
                item.parts.append(reasoning)
                self._reasoning_chunks += 1
                events.append(
                    self._ev(
                        "response.reasoning_text.delta",
                        {"item_id": item.id, "output_index": item.index, "content_index": 0, "delta": reasoning},
                    )
                )
            content = delta.get("content")
            if content:
                item = self._open if self._open is not None and self._open.kind == "message" else None
                if item is None:
                    item = self._open_item("message", events)
                item.parts.append(content)
                events.append(
                    self._ev(
                        "response.output_text.delta",
                        {
                            "item_id": item.id,
                            "output_index": item.index,
                            "content_index": 0,
                            "delta": content,
                            "logprobs": [],
                        },
                    )
                )
            for call in delta.get("tool_calls") or ():
                self._feed_call(call, events)
            if choice.get("finish_reason"):
                self._finish_reason = choice["finish_reason"]
        return events

    def _feed_call(self, call: Mapping[str, Any], events: list[Event]) -> None:
        index = call.get("index", 0)
        fn = call.get("function") or {}
        item = self._calls.get(index)
        if item is None:
            self._close_open(events)
            item = _Item(
                "function_call",
                len(self._items),
                _new_id("fc_"),
                call.get("id") or _new_id("call_"),
                fn.get("name") or "",
            )
            self._items.append(item)
            self._calls[index] = item
            added = _call_item(item.id, item.call_id, item.name, "", "in_progress")
            events.append(self._ev("response.output_item.added", {"output_index": item.index, "item": added}))
        args = fn.get("arguments")
        if args:
            item.parts.append(args)
            events.append(
                self._ev(
                    "response.function_call_arguments.delta",
                    {"item_id": item.id, "output_index": item.index, "delta": args},
                )
            )

    def finish(self) -> list[Event]:
        """Closing events and ``response.completed`` (once), after the chat stream's ``[DONE]``."""
        if self._finished:
            return []
        self._finished = True
        events = self.start()
        if not self._calls and not any(item.kind == "message" for item in self._items):
            self._open_item("message", events)  # always answer with a message, as from_chat_completion does
        self._close_open(events)
        for item in self._calls.values():
            arguments = "".join(item.parts)
            events.append(
                self._ev(
                    "response.function_call_arguments.done",
                    {"item_id": item.id, "output_index": item.index, "name": item.name, "arguments": arguments},
                )
            )
            events.append(
                self._ev("response.output_item.done", {"output_index": item.index, "item": self._final_item(item)})
            )
        truncated = self._finish_reason == "length"
        response = self._snapshot(
            "incomplete" if truncated else "completed",
            output=[self._final_item(item) for item in self._items],
            usage=_usage(self._usage, self._reasoning_chunks),
            completed_at=int(time.time()),
            incomplete=truncated,
        )
        data: dict[str, Any] = {"response": response}
        if self._timings is not None:
            data["timings"] = self._timings  # spec: beside "response" on response.completed
        events.append(self._ev("response.completed", data))
        return events
