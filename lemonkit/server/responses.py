"""The Responses API on top of chat completions, as pure translation (no HTTP).

A ``/v1/responses`` request becomes a chat completions request for the model's
sidecar (:func:`to_chat_request`); the answer comes back as a Response object
(:func:`from_chat_completion`) or, streaming, as Responses events built chunk by chunk
(:class:`lemonkit.server.response_stream.ResponseStream`, from the item and response
shapes here). Shapes follow the spec's examples plus the fields the
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

__all__ = [
    "Event",
    "call_item",
    "from_chat_completion",
    "message_item",
    "new_id",
    "output_messages",
    "reasoning_item",
    "response_object",
    "text_part",
    "to_chat_request",
    "usage_object",
]

#: a streamed event: its name and its data
Event = tuple[str, dict[str, Any]]

#: Responses request fields that mean the same in a chat completions request.
_PASSED = (
    "model", "temperature", "top_p", "top_k", "min_p", "repeat_penalty", "frequency_penalty", "presence_penalty",
    "seed", "ctx_size", "route_trace", "enable_thinking", "thinking", "parallel_tool_calls",
)  # fmt: skip


def new_id(prefix: str) -> str:
    """A fresh id of an object or item: ``resp_``, ``msg_``, ``rs_``, ``fc_``, ``call_`` and a random tail."""
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


def usage_object(usage: Mapping[str, Any] | None, reasoning_tokens: int = 0) -> dict[str, Any]:
    """A chat completion's ``usage`` as a Response's (``reasoning_tokens``: a count where the engine gave none)."""
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


def response_object(
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
    """The Response object, finished or (``in_progress``) a snapshot of one being streamed."""
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


def text_part(text: str) -> dict[str, Any]:
    """A message item's ``output_text`` content part."""
    return {"type": "output_text", "annotations": [], "logprobs": [], "text": text}


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    """An assistant ``message`` output item holding ``text``."""
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": [text_part(text)]}


def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    """A ``reasoning`` output item holding the model's thinking as ``reasoning_text``."""
    return {
        "id": item_id,
        "type": "reasoning",
        "status": status,
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
    }


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    """A ``function_call`` output item."""
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
        output.append(reasoning_item(new_id("rs_"), msg["reasoning_content"], item_status))
    calls = msg.get("tool_calls") or []
    if msg.get("content") or not calls:
        output.append(message_item(new_id("msg_"), msg.get("content") or "", item_status))
    for call in calls:
        fn = call.get("function") or {}
        output.append(
            call_item(
                new_id("fc_"),
                call.get("id") or new_id("call_"),
                fn.get("name", ""),
                fn.get("arguments") or "",
                "completed",
            )
        )
    resp = response_object(
        response_id=response_id,
        created_at=created_at,
        model=model,
        status="incomplete" if truncated else "completed",
        output=output,
        request=request,
        usage=usage_object(chat.get("usage")),
        completed_at=int(time.time()),
        incomplete=truncated,
    )
    if chat.get("timings") is not None:
        resp["timings"] = chat["timings"]
    return resp
