"""``ChatPanel``: a conversation with a chat model, its answers streaming in token by token."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Generator
from concurrent.futures import Future
from typing import Any, ClassVar, cast

import traitlets

from lemonkit.client import Client, Event
from lemonkit.errors import InvalidRequest
from lemonkit.widgets.assets import esm
from lemonkit.widgets.panel import Panel
from lemonkit.widgets.picker import choices

__all__ = ["ChatPanel"]


class ChatPanel(Panel):
    """A chat with a model, with a model picker, streaming answers, a stop button, reasoning and history.

    Args:
        client: The client doing the work (default: :func:`lemonkit.default_client`).
        model: The model to chat with (default: a loaded chat model, else the first downloaded one).
        **sampling: Sent with every request (``temperature``, ``max_tokens``, ``seed``, ...).

    Example:
        >>> panel = lemonkit.ChatPanel(max_tokens=200)
        >>> panel.send("Explain entropy in two sentences").result()["content"]
        'Entropy measures ...'
    """

    _esm = esm("chat_panel")
    models = traitlets.List(traitlets.Unicode()).tag(sync=True)
    model = traitlets.Unicode("").tag(sync=True)
    #: the conversation: ``{"role", "content"}``; an answer adds ``reasoning``, ``finish_reason`` and ``stopped``
    messages: traitlets.List[dict[str, Any]] = traitlets.List().tag(sync=True)
    #: the answer streaming in (``{"content", "reasoning"}``), ``None`` between answers
    partial = traitlets.Dict(allow_none=True, default_value=None).tag(sync=True)
    streaming = traitlets.Bool(False).tag(sync=True)
    actions: ClassVar[frozenset[str]] = frozenset({"send", "stop", "clear", "refresh_models", "dismiss"})
    #: seconds between updates of the streaming answer: tokens coalesce, so the page keeps up with a fast model
    refresh_interval = 0.05

    def __init__(self, *, client: Client | None = None, model: str | None = None, **sampling: Any) -> None:
        super().__init__(client=client, model=model or "")
        self.sampling = sampling
        self._stop = threading.Event()
        self._conversation = 0  # which conversation an answer belongs to: clear() starts a new one
        self.ready = self.refresh_models()

    def refresh_models(self) -> Future[None]:
        """Read the chat models the picker offers again."""

        def run() -> None:
            models, preferred = choices(self.client, "chat")
            self.models = models
            if not self.model and preferred:
                self.model = preferred

        return self.background(run)

    def send(self, text: str) -> Future[dict[str, Any]]:
        """Ask ``text``; the future gives the answer's message once it is complete (or stopped).

        Raises:
            InvalidRequest: An answer is still streaming.
        """
        with self._lock:
            if self.streaming:
                raise InvalidRequest("An answer is still streaming: stop it first")
            self.dismiss()
            self.streaming = True
            self.messages = [*self.messages, {"role": "user", "content": str(text)}]
            self._stop.clear()
            return self.background(self._answer, self._conversation)

    def stop(self) -> None:
        """Stop the answer streaming in: the stream closes and the server stops at its next token."""
        self._stop.set()

    def clear(self) -> None:
        """Forget the conversation (stopping an answer under way)."""
        with self._lock:
            self.stop()
            self._conversation += 1
            self.messages = []

    def _answer(self, conversation: int) -> dict[str, Any]:
        if not self.model:
            self.streaming = False
            raise InvalidRequest("No chat model is downloaded: pull one (lemonkit.ModelBrowser) and refresh")
        body = {
            "model": self.model,
            "messages": [{"role": m["role"], "content": m["content"]} for m in self.messages],
            "stream": True,
            **self.sampling,
        }
        reply: dict[str, Any] = {"role": "assistant", "content": "", "reasoning": "", "finish_reason": None}
        shown = 0.0
        try:
            stream = cast(Generator[Event, None, None], self.client.events("chat/completions", body))
            with contextlib.closing(stream) as events:
                for event in events:
                    for choice in event.data.get("choices") or ():
                        delta = choice.get("delta") or {}
                        reply["content"] += delta.get("content") or ""
                        reply["reasoning"] += delta.get("reasoning_content") or ""
                        reply["finish_reason"] = choice.get("finish_reason") or reply["finish_reason"]
                    if self._stop.is_set():
                        break
                    if time.monotonic() - shown >= self.refresh_interval:
                        self.partial = {"content": reply["content"], "reasoning": reply["reasoning"]}
                        shown = time.monotonic()
        finally:
            reply["stopped"] = self._stop.is_set()
            with self._lock:
                if conversation == self._conversation and (reply["content"] or reply["reasoning"] or reply["stopped"]):
                    self.messages = [*self.messages, reply]
            self.set_trait("partial", None)
            self.streaming = False
        return reply
