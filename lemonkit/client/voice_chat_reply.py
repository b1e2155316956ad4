"""What :func:`lemonkit.voice_chat` takes and returns: its options (:class:`VoiceChatOptions`) and its answer
(:class:`VoiceChatReply`, the question as heard, the reply, and the reply spoken, which plays inline)."""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

from lemonkit.client.audio_clips import Speech

__all__ = ["VoiceChatOptions", "VoiceChatReply"]


class VoiceChatOptions(TypedDict, total=False):
    """The keyword-only options of :meth:`lemonkit.Client.voice_chat` (each documented there)."""

    sample_rate: int | None
    system_prompt: str | None
    history: VoiceChatReply | None
    asr_model: str | None
    chat_model: str | None
    tts_model: str | None
    language: str | None
    max_tokens: int | None
    temperature: float | None
    seed: int | None
    voice: str | None
    speed: float | None


@dataclass(repr=False)
class VoiceChatReply:
    """What :func:`lemonkit.voice_chat` returns.

    Attributes:
        text: The reply.
        transcript: The question, as the speech-to-text model heard it.
        speech: The reply spoken (a :class:`~lemonkit.client.audio_clips.Speech`: ``.samples``, ``.sample_rate``,
            ``.save(path)``; plays inline).
        language: The language the question was heard in.
        models: Role (``asr``, ``conversation``, ``tts``) -> the model that played it.
        timing: ``ttft_ms`` (the reply's first text), ``ttfa_ms`` (its first audio), ``wall_ms``.
        artifacts: The recipe's artifacts: the conversation so far, which ``history=`` sends back.
        provenance: The request and the server's facts (see :class:`~lemonkit.ChatResult`).
    """

    text: str
    transcript: str
    speech: Speech
    language: str | None = None
    models: dict[str, str] = field(default_factory=dict)
    timing: dict[str, Any] = field(default_factory=dict)
    artifacts: list[dict[str, Any]] = field(default_factory=list)
    provenance: dict[str, Any] = field(default_factory=dict)

    def save(self, path: str | Path) -> Path:
        """Write the spoken reply to ``path`` (see :meth:`lemonkit.client.audio_clips.AudioClip.save`).

        Returns:
            The path written.

        Raises:
            InvalidArgument: An extension that names no audio format.
        """
        return self.speech.save(path)

    def _repr_html_(self) -> str:
        question, reply = html.escape(self.transcript), html.escape(self.text)
        return (
            f'<div class="lk-voice-chat"><div><b>Heard:</b> {question}</div><div><b>Reply:</b> {reply}</div>'
            f"{self.speech.player_html()}</div>"
        )

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, str]:
        return {"text/plain": repr(self), "text/html": self._repr_html_()}

    def __repr__(self) -> str:
        text = self.text if len(self.text) <= 60 else self.text[:57] + "..."
        return f"VoiceChatReply(transcript={self.transcript!r}, text={text!r}, speech={self.speech.duration:.2f} s)"
