"""The omni tool loop: a chat completion on a ``collection.omni`` model (spec: openai-api.md, "Server-Side Tools").

The collection's chat component answers with the built-in tools merged into the client's. The server runs each call
of a built-in tool on the component that plays its role (an image model's or a voice's sidecar, called directly as
the image and speech routes call it: no HTTP loop back through the server), embeds the media in the answer, feeds a
short result back to the model and asks it again, for at most ``LEMONKIT_OMNI_MAX_ROUNDS`` rounds. Calls of the
client's own tools end the request with ``finish_reason: "tool_calls"``; the client resumes by sending the results.

A round's answer is always streamed from the chat component, so one loop serves both forms: a stream passes text on
as it comes and media the moment its tool finishes (in deltas of at most 16,000 characters), a plain answer gathers
the same events into one message.

``tool_choice`` naming one function applies to the first round only (the call it forces has then been made; forcing
it again would repeat it until the round limit). ``"required"`` applies to every round: the model must call a tool
each time, so the loop ends at a client tool or at the limit. At the limit the model is asked once more without
tools, and its text ends the answer (``finish_reason`` as that last round gives it).
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from lemonkit.backends.images.pictures import image_kind
from lemonkit.backends.protocol import Upload
from lemonkit.catalog.model_info import ModelInfo
from lemonkit.catalog.omni.builtin_tools import (
    EDIT_IMAGE,
    GENERATE_IMAGE,
    TEXT_TO_SPEECH,
    Roles,
    system_prompt,
    tool_definitions,
)
from lemonkit.catalog.omni.media import audio_tag, chunks, image_markdown, strip_media
from lemonkit.errors import LemonkitError, ModelNotApplicable, ModelNotFound
from lemonkit.formats import sse
from lemonkit.formats.headers import PROVENANCE_HEADER
from lemonkit.server import provenance
from lemonkit.server.handler import LemonkitHandler

__all__ = ["OmniChat"]

#: request fields the loop sets itself for each round
_LOOP_FIELDS = frozenset({"model", "messages", "tools", "tool_choice", "stream", "stream_options"})
#: a base64 PNG or JPEG data URL in a message: what edit_image edits when this request made no image yet
_IMAGE_URL = re.compile(r"data:image/(?:png|jpeg);base64,([A-Za-z0-9+/=]+)")


@dataclass
class _Round:
    """What one answer of the chat component said."""

    text: str = ""
    calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    finish: str = "stop"


class OmniChat:
    """One chat completion on an omni collection.

    Args:
        handler: The chat completions handler serving the request (its sidecar helpers and its connection).
        info: The collection.
        body: The checked request.
    """

    def __init__(self, handler: LemonkitHandler, info: ModelInfo, body: dict[str, Any]) -> None:
        self.handler = handler
        self.service = handler.service
        self.info = info
        self.body = body
        self.max_rounds = self.service.settings.omni_max_rounds
        self.id = "chatcmpl-" + secrets.token_urlsafe(24)
        self.created = int(time.time())
        self.usage: dict[str, int] = {}
        self.images: list[str] = []  # base64 of the images this request made, latest last
        self.roles = Roles(None, None, None, None)
        self._content = ""  # what the client has been sent as content so far
        self._opened = False  # whether the answer's headers are set (and a stream's sent)

    async def serve(self) -> None:
        """Answer the request (plain JSON, or SSE when it asks for a stream).

        Raises:
            ModelNotFound: A component of the collection is no longer registered.
            ModelNotApplicable: The collection has no chat model.
            LemonkitError: Before a stream starts (and for a plain answer), whatever failed: a component that
                failed to load or run answers with its error.
        """
        parts = await asyncio.to_thread(self.service.registry.collection_parts, self.info)
        if len(parts) != len(self.info.components):
            names = ", ".join(self.info.components)
            raise ModelNotFound(f"{self.info.id}: some of its components ({names}) are no longer registered")
        self.roles = Roles.of(parts)
        if self.roles.chat is None:
            raise ModelNotApplicable(f"{self.info.id} has no chat model among its components to run the omni loop")
        async with self.service.manager.request(self.roles.chat.id):  # one request, however many rounds and tools
            if self.body.get("stream"):
                await self.handler.pump(self._frames())  # the stream opens once the chat model is ready (see _ask)
            else:
                self.handler.write_json(await self._complete())

    # -- the two forms of the answer -------------------------------------------------------------------------

    async def _complete(self) -> dict[str, Any]:
        content, reasoning = [], []
        calls: list[dict[str, Any]] = []
        finish = "stop"
        async for kind, value in self._events():
            if kind == "content":
                content.append(value)
            elif kind == "reasoning":
                reasoning.append(value)
            elif kind == "tool_calls":
                calls = value
            else:
                finish = value
        message: dict[str, Any] = {"role": "assistant", "content": "".join(content) or (None if calls else "")}
        if reasoning:
            message["reasoning_content"] = "".join(reasoning)
        if calls:
            message["tool_calls"] = calls
        return {
            **self._base("chat.completion"),
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": self._usage(),
        }

    async def _frames(self) -> AsyncIterator[bytes]:
        role = self._chunk({"role": "assistant", "content": None})
        try:
            async for kind, value in self._events():
                if role:
                    yield role
                    role = b""
                if kind == "content":
                    yield self._chunk({"content": value})
                elif kind == "reasoning":
                    yield self._chunk({"reasoning_content": value})
                elif kind == "tool_calls":
                    yield self._chunk({"tool_calls": [{"index": i, **c} for i, c in enumerate(value)]})
                else:
                    yield self._chunk({}, finish=value)
        except LemonkitError as exc:
            if not self._opened:
                raise  # nothing sent yet: the handler answers with the error's status and JSON body
            if role:
                yield role
            # the spec's in-stream error: text, then a normal end
            yield self._chunk({"content": ("\n\n" if self._content else "") + f"Error: {exc.message}"})
            yield self._chunk({}, finish="stop")
        if (self.body.get("stream_options") or {}).get("include_usage"):
            yield _frame({**self._base("chat.completion.chunk"), "choices": [], "usage": self._usage()})
        yield sse.DONE

    def _base(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.info.id}

    def _chunk(self, delta: dict[str, Any], finish: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        return _frame({**self._base("chat.completion.chunk"), "choices": [choice]})

    def _usage(self) -> dict[str, int]:
        prompt, completion = self.usage.get("prompt_tokens", 0), self.usage.get("completion_tokens", 0)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    # -- the loop --------------------------------------------------------------------------------------------

    async def _events(self) -> AsyncIterator[tuple[str, Any]]:
        """``("content" | "reasoning", text)``, ``("tool_calls", client calls)``, then ``("finish", reason)``."""
        ours = self.roles.tools
        theirs = self.body.get("tools") or []
        clash = set(ours) & {t.get("function", {}).get("name") for t in theirs if isinstance(t, dict)}
        if clash:
            ours = [n for n in ours if n not in clash]  # the client's own tool of that name wins: it is theirs
        tools = tool_definitions(ours) + list(theirs)
        messages = self._messages(ours)
        passed = {k: v for k, v in self.body.items() if k not in _LOOP_FIELDS}
        for n in range(self.max_rounds + 1):
            request = {**passed, "model": self.roles.chat.id, "messages": messages}  # type: ignore[union-attr]
            if n < self.max_rounds and tools:  # the last round, at the limit, answers without tools
                request["tools"] = tools
                choice = self._tool_choice(n)
                if choice is not None:
                    request["tool_choice"] = choice
            answer = _Round()
            async for event in self._ask(request, answer):
                yield event
            calls = [answer.calls[i] for i in sorted(answer.calls)]
            if not calls:
                yield "finish", answer.finish
                return
            own = [c for c in calls if c["function"]["name"] in ours]
            client = [c for c in calls if c["function"]["name"] not in ours]
            messages.append({"role": "assistant", "content": answer.text or None, "tool_calls": calls})
            for call in own:
                note = None
                async for event in self._run_tool(call):
                    if event[0] == "note":
                        note = event[1]
                    else:
                        yield event
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": note or ""})
            if client:
                yield "tool_calls", client
                yield "finish", "tool_calls"
                return
        yield "finish", "stop"  # not reached: the last round offers no tools, so it makes no calls

    def _tool_choice(self, round_number: int) -> Any:
        choice = self.body.get("tool_choice")
        if isinstance(choice, dict) and round_number > 0:
            return "auto"  # the named function was called in the first round
        return choice

    def _messages(self, ours: list[str]) -> list[dict[str, Any]]:
        """The client's messages as the chat component gets them: the built-in (or the collection's own) system
        prompt first, joined with the client's; embedded media replaced by placeholders; attached images kept only
        for a chat model that sees them."""
        vision = "vision" in self.roles.chat.labels  # type: ignore[union-attr]
        out = []
        for message in self.body["messages"]:
            message = dict(message)
            content = message.get("content")
            if isinstance(content, str):
                message["content"] = strip_media(content)
            elif isinstance(content, list):
                message["content"] = [_part(p, vision) for p in content]
            out.append(message)
        prompt = self.info.system_prompt or system_prompt(ours)
        if out and out[0].get("role") in ("system", "developer") and isinstance(out[0].get("content"), str):
            out[0] = {**out[0], "role": "system", "content": prompt + "\n\n" + out[0]["content"]}
        else:
            out.insert(0, {"role": "system", "content": prompt})
        return out

    async def _ask(self, request: dict[str, Any], answer: _Round) -> AsyncIterator[tuple[str, str]]:
        """Stream one answer of the chat component: text and reasoning out, tool calls gathered in ``answer``."""
        chat = self.roles.chat
        assert chat is not None
        request = {**request, "stream": True, "stream_options": {"include_usage": True}}
        async with self.service.manager.use(chat.id) as model:
            if not self._opened:
                # The chat model is loaded: it is the answer's provenance, and a stream starts now. Whatever fails
                # before this (a component gone, the chat model not loading) answers with its status and JSON.
                self._opened = True
                self.handler.set_header(PROVENANCE_HEADER, await provenance.header_value(model))
                if self.body.get("stream"):
                    await self.handler.sse_open()
            response = await self.handler.sidecar_request(model, "/v1/chat/completions", request)
            async for chunk in self.handler.sidecar_events(model, response):
                for key, value in (chunk.get("usage") or {}).items():
                    if key in ("prompt_tokens", "completion_tokens"):
                        self.usage[key] = self.usage.get(key, 0) + int(value)
                for choice in chunk.get("choices") or []:
                    for event in _take(choice, answer):
                        if event[0] == "content":
                            self._content += event[1]
                        yield event

    # -- the built-in tools ----------------------------------------------------------------------------------

    async def _run_tool(self, call: dict[str, Any]) -> AsyncIterator[tuple[str, str]]:
        """Run one built-in tool: its media as content events, then ``("note", what the model is told)``.

        A call the component refuses (400: an empty prompt, no image to edit) is told to the model, which may try
        again; any other failure (a component that does not load or whose engine fails) fails the request.
        """
        name = call["function"]["name"]
        try:
            args = json.loads(call["function"].get("arguments") or "{}")
            if not isinstance(args, dict):
                raise ValueError
        except ValueError:
            yield "note", "Error: the arguments are not a JSON object"
            return
        try:
            if name == TEXT_TO_SPEECH:
                media = audio_tag(await self._speak(str(args.get("text") or "")))
                note = "The user heard the speech."
            else:
                b64 = await self._draw(name, str(args.get("prompt") or ""))
                self.images.append(b64)
                media = image_markdown(b64)
                note = "The image is shown to the user." if name == GENERATE_IMAGE else "The edited image is shown."
        except LemonkitError as exc:
            if exc.status != 400:
                raise
            yield "note", f"Error: {exc.message}"
            return
        separator = "\n\n" if self._content and not self._content.endswith("\n") else ""
        for piece in chunks(separator + media):
            self._content += piece
            yield "content", piece
        yield "note", note

    async def _draw(self, tool: str, prompt: str) -> str:
        """A PNG (base64) from the image component (``generate_image``) or the edit one (``edit_image``)."""
        part = self.roles.image if tool == GENERATE_IMAGE else self.roles.edit
        assert part is not None
        if not prompt.strip():
            raise LemonkitError(f"{tool}: the prompt is empty", status=400)
        body: dict[str, Any] = {"prompt": prompt, "n": 1}
        files = None
        path = "/v1/images/generations"
        if tool == EDIT_IMAGE:
            source = self._latest_image()
            if source is None:
                raise LemonkitError("edit_image: there is no image in the conversation to edit", status=400)
            files, path = [Upload("image.png", source, "image/png")], "/v1/images/edits"
            body["has_mask"] = False
        async with self.service.manager.use(part.id) as model:
            response = await self.handler.sidecar_request(model, path, body, files=files)
            raw = await self.handler.sidecar_body(model, response)
        result = await asyncio.to_thread(json.loads, raw)  # hundreds of kilobytes of base64: off the event loop
        return str(result["data"][0]["b64_json"])

    def _latest_image(self) -> bytes | None:
        """The image this request made last, else the last PNG or JPEG data URL in the client's messages."""
        candidates = list(self.images)
        if not candidates:
            for message in self.body["messages"]:
                content = message.get("content")
                texts = [content] if isinstance(content, str) else [json.dumps(content)] if content else []
                for text in texts:
                    candidates.extend(_IMAGE_URL.findall(text))
        for b64 in reversed(candidates):
            data = base64.b64decode(b64)
            if image_kind(data) is not None:
                return data
        return None

    async def _speak(self, text: str) -> str:
        """MP3 speech (base64) of ``text`` from the text-to-speech component."""
        part = self.roles.tts
        assert part is not None
        if not text.strip():
            raise LemonkitError("text_to_speech: the text is empty", status=400)
        body = {"model": part.id, "input": text, "response_format": "mp3"}
        async with self.service.manager.use(part.id) as model:
            response = await self.handler.sidecar_request(model, "/v1/audio/speech", body)
            audio = await self.handler.sidecar_body(model, response)
        return await asyncio.to_thread(lambda: base64.b64encode(audio).decode())


def _part(part: Any, vision: bool) -> Any:
    """One part of a message's content, as the chat component gets it."""
    if not isinstance(part, dict):
        return part
    if part.get("type") == "text" and isinstance(part.get("text"), str):
        return {**part, "text": strip_media(part["text"])}
    if part.get("type") == "image_url" and not vision:
        return {"type": "text", "text": "[image]"}  # a model without vision cannot take it; edit_image can
    return part


def _take(choice: dict[str, Any], answer: _Round) -> list[tuple[str, str]]:
    """One streamed choice of the chat component: the text it adds, and its tool-call parts merged by index."""
    delta = choice.get("delta") or {}
    events = []
    if delta.get("reasoning_content"):
        events.append(("reasoning", delta["reasoning_content"]))
    if delta.get("content"):
        answer.text += delta["content"]
        events.append(("content", delta["content"]))
    for part in delta.get("tool_calls") or []:
        call = answer.calls.setdefault(
            int(part.get("index") or 0), {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
        )
        call["id"] = part.get("id") or call["id"]
        fn = part.get("function") or {}
        call["function"]["name"] += fn.get("name") or ""
        call["function"]["arguments"] += fn.get("arguments") or ""
    if choice.get("finish_reason"):
        answer.finish = choice["finish_reason"]
    return events


def _frame(data: dict[str, Any]) -> bytes:
    return sse.frame(data)
