"""A ``/v1/responses`` stream: chat completion chunks in, Responses streaming events out (no HTTP).

:class:`ResponseStream` keeps the output items being streamed (reasoning, message text, function calls) and turns
each chunk into the events the openai SDK's stream helper parses, ending with ``response.completed``; the items
and the response object it sends are the shapes of :mod:`lemonkit.server.responses`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from lemonkit.server.responses import (
    Event,
    call_item,
    message_item,
    new_id,
    reasoning_item,
    response_object,
    text_part,
    usage_object,
)

__all__ = ["ResponseStream"]


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
        return response_object(
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
        item = _Item(kind, len(self._items), new_id(prefix))
        self._items.append(item)
        self._open = item
        if kind == "reasoning":
            added = reasoning_item(item.id, "", "in_progress")
            added["content"] = []
            part: dict[str, Any] = {"type": "reasoning_text", "text": ""}
        else:
            added = message_item(item.id, "", "in_progress")
            added["content"] = []
            part = text_part("")
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
            events.append(self._ev("response.content_part.done", {**base, "part": text_part(text)}))
        events.append(
            self._ev("response.output_item.done", {"output_index": item.index, "item": self._final_item(item)})
        )

    def _final_item(self, item: _Item) -> dict[str, Any]:
        text = "".join(item.parts)
        status = "incomplete" if self._finish_reason == "length" else "completed"
        if item.kind == "reasoning":
            return reasoning_item(item.id, text, status)
        if item.kind == "message":
            return message_item(item.id, text, status)
        return call_item(item.id, item.call_id, item.name, text, "completed")

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
                self._reasoning_chunks += 1
                item = self._text_item("reasoning", reasoning, events)
                events.append(
                    self._ev(
                        "response.reasoning_text.delta",
                        {"item_id": item.id, "output_index": item.index, "content_index": 0, "delta": reasoning},
                    )
                )
            content = delta.get("content")
            if content:
                item = self._text_item("message", content, events)
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

    def _text_item(self, kind: str, text: str, events: list[Event]) -> _Item:
        """The open ``reasoning`` or ``message`` item, holding ``text`` now (opened first unless it is of ``kind``:
        a new kind of delta closes the item before it)."""
        item = self._open if self._open is not None and self._open.kind == kind else None
        if item is None:
            item = self._open_item(kind, events)
        item.parts.append(text)
        return item

    def _feed_call(self, call: Mapping[str, Any], events: list[Event]) -> None:
        index = call.get("index", 0)
        fn = call.get("function") or {}
        item = self._calls.get(index)
        if item is None:
            self._close_open(events)
            item = _Item(
                "function_call",
                len(self._items),
                new_id("fc_"),
                call.get("id") or new_id("call_"),
                fn.get("name") or "",
            )
            self._items.append(item)
            self._calls[index] = item
            added = call_item(item.id, item.call_id, item.name, "", "in_progress")
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
            usage=usage_object(self._usage, self._reasoning_chunks),
            completed_at=int(time.time()),
            incomplete=truncated,
        )
        data: dict[str, Any] = {"response": response}
        if self._timings is not None:
            data["timings"] = self._timings  # spec: beside "response" on response.completed
        events.append(self._ev("response.completed", data))
        return events
