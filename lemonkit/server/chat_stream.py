"""Reading a sidecar's OpenAI chat stream as the pieces other APIs are made of.

Ollama's lines and Anthropic's events are both built from the same stream of ``chat.completion.chunk`` objects:
text, thinking, a tool call's start (its id and name, as soon as they are known) and its arguments in pieces, then
how the answer ended and its usage. :class:`ChatStream` turns chunks into those pieces and keeps the whole answer.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ChatStream", "Piece", "ToolCall"]


@dataclass(frozen=True)
class Piece:
    """One step of an answer: ``kind`` is ``text``, ``thinking``, ``tool_start`` (``index``, ``id``, ``name``) or
    ``tool_args`` (``index``, ``text``: the next piece of the call's JSON arguments)."""

    kind: str
    text: str = ""
    index: int = 0
    id: str = ""
    name: str = ""


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""

    @property
    def complete(self) -> bool:
        """The arguments so far are a whole JSON object: the call is made (checked only when they end in ``}``)."""
        if not self.arguments.rstrip().endswith("}"):
            return False
        try:
            return isinstance(json.loads(self.arguments), dict)
        except ValueError:
            return False

    def parsed(self) -> dict[str, Any]:
        """The arguments as an object (``{}`` when the model's JSON does not parse; a bare value under
        ``value``)."""
        try:
            value = json.loads(self.arguments or "{}")
        except ValueError:
            return {}
        return value if isinstance(value, dict) else {"value": value}


@dataclass
class ChatStream:
    """The answer so far, fed one chunk at a time."""

    text: list[str] = field(default_factory=list)
    thinking: list[str] = field(default_factory=list)
    calls: dict[int, ToolCall] = field(default_factory=dict)
    finish_reason: str | None = None
    #: the stop string that ended the text, when the engine says (lemonkit's ``stop_sequence`` on the choice)
    stop_sequence: str | None = None
    usage: dict[str, Any] = field(default_factory=dict)
    #: ``time.perf_counter_ns()`` of the first piece
    first_ns: int | None = None

    def feed(self, chunk: dict[str, Any]) -> list[Piece]:
        """The pieces of one chunk (a chat chunk, or a text completion's)."""
        pieces: list[Piece] = []
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            for kind, value in (("thinking", delta.get("reasoning_content")), ("text", delta.get("content"))):
                if value:
                    pieces.append(Piece(kind, value))
            if choice.get("text"):  # a completion's chunk
                pieces.append(Piece("text", choice["text"]))
            for call in delta.get("tool_calls") or []:
                index = int(call.get("index", 0))
                function = call.get("function") or {}
                if index not in self.calls:
                    self.calls[index] = ToolCall(str(call.get("id") or f"call_{index}"), function.get("name") or "")
                    pieces.append(
                        Piece("tool_start", index=index, id=self.calls[index].id, name=self.calls[index].name)
                    )
                if function.get("arguments"):
                    self.calls[index].arguments += function["arguments"]
                    pieces.append(Piece("tool_args", function["arguments"], index=index))
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
                self.stop_sequence = choice.get("stop_sequence")
        for piece in pieces:
            if piece.kind == "text":
                self.text.append(piece.text)
            elif piece.kind == "thinking":
                self.thinking.append(piece.text)
        if pieces and self.first_ns is None:
            self.first_ns = time.perf_counter_ns()
        return pieces

    @property
    def content(self) -> str:
        return "".join(self.text)

    @property
    def reasoning(self) -> str:
        return "".join(self.thinking)

    def tool_calls(self) -> list[ToolCall]:
        return [self.calls[i] for i in sorted(self.calls)]

    @property
    def prompt_tokens(self) -> int:
        return int(self.usage.get("prompt_tokens") or 0)

    @property
    def completion_tokens(self) -> int:
        return int(self.usage.get("completion_tokens") or 0)
