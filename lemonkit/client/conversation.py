"""A conversation kept in Python: :class:`Chat`."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from lemonkit.client import Client
from lemonkit.client.results import ChatResult

__all__ = ["Chat"]


class Chat:
    """A multi-turn conversation: each :meth:`send` sends the history and appends the answer to it.

    Args:
        model: The model; ``None``: as :func:`lemonkit.chat` picks it (at each turn).
        system: A system message kept at the head of the history.
        client: The client (default: :func:`lemonkit.default_client`).
        **sampling: Sampling parameters for every turn (``max_tokens``, ``temperature``, ...).

    Example:
        >>> chat = lemonkit.Chat(system="You are terse.")
        >>> chat.send("Name a colour.")
        >>> chat.send("Another one.")
        >>> chat.save("colours.json"); lemonkit.Chat.load("colours.json").messages[-1]["role"]
        'assistant'
    """

    def __init__(
        self, model: str | None = None, *, system: str | None = None, client: Client | None = None, **sampling: Any
    ) -> None:
        self.model = model
        self.system = system
        self.sampling = sampling
        self._client = client
        self.messages: list[dict[str, Any]] = []
        self.reset()

    @property
    def client(self) -> Client:
        from lemonkit.client import default_client

        return self._client or default_client()

    def send(self, text: str, *, stream: bool = True, **sampling: Any) -> ChatResult:
        """Add a user message, ask the model, add its answer.

        Args:
            text: The user's message.
            stream: Show the answer as it arrives (see :func:`lemonkit.chat`).
            **sampling: Parameters for this turn, over the conversation's.

        Returns:
            The answer; the history now ends with it. A failed or interrupted turn leaves the history as it was.

        Raises:
            LemonkitError: As :func:`lemonkit.chat`.
        """
        self.messages.append({"role": "user", "content": text})
        try:
            result = self.client.chat(self.messages, self.model, stream=stream, **{**self.sampling, **sampling})
        except BaseException:
            self.messages.pop()
            raise
        self.messages.append(result.message)
        return result

    def reset(self) -> None:
        """Forget the turns (the system message stays)."""
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the conversation (model, system message, sampling, messages) to a JSON file, atomically."""
        from lemonkit.formats.files import atomic_write_json

        data = {"model": self.model, "system": self.system, "sampling": self.sampling, "messages": self.messages}
        atomic_write_json(Path(path), data)

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, client: Client | None = None) -> Chat:
        """A conversation :meth:`save` wrote.

        Raises:
            OSError: The file cannot be read.
            ValueError: It is not a saved conversation.
        """
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        if not isinstance(data, dict) or not isinstance(data.get("messages"), list):
            raise ValueError(f"{path} is not a saved lemonkit.Chat (no 'messages' list)")
        chat = cls(data.get("model"), system=data.get("system"), client=client, **(data.get("sampling") or {}))
        chat.messages = data["messages"]
        return chat

    def __repr__(self) -> str:
        turns = sum(1 for m in self.messages if m["role"] == "user")
        return f"Chat(model={self.model!r}, turns={turns})"
