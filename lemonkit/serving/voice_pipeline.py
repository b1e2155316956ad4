"""The voice-chat recipe's pipeline: transcription, then a streamed chat reply, spoken sentence by sentence while
the rest of the reply is still being generated.

The pipeline only composes; the models are reached through :class:`Stages` (the server's implementation talks to
the sidecars through the model manager, :mod:`lemonkit.server.recipes`). It produces the events of the spec's
event/done envelope (``audio-api.md``, ``/v1/tasks/stream``), each tagged with the ``role`` that produced it, and
then the result.

Speech starts early because the chat reply is cut into sentences as it streams (:class:`SentenceChunker`) and each
complete sentence goes to the speaker at once. The hand-over holds at most :data:`READ_AHEAD` sentence waiting:
while the speaker is behind, the reply is not read further (the chat model keeps generating into its connection).
That bounds how far the text runs ahead of the speech, and it makes the order of the events certain rather than a
race: once three sentences of the reply are complete, the first sentence's audio is out before any later text.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import time
import wave
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from lemonkit.backends.tts import SENTENCE_END
from lemonkit.serving.recipe_pipelines import RunRequest, history_artifact

__all__ = ["READ_AHEAD", "SentenceChunker", "Speaker", "Stages", "VoiceChat", "pcm_wav"]

#: complete sentences that may wait for the speaker while it speaks one (see the module's docstring)
READ_AHEAD = 1
#: a "sentence" longer than this (a reply without punctuation) is cut at a space, so that speech still starts
_LONGEST = 300

#: speaks one sentence: its 16-bit mono PCM and sample rate
Speaker = Callable[[str], Awaitable[tuple[bytes, int]]]


class Stages(Protocol):
    """The three models of a voice chat, as the pipeline uses them."""

    async def transcribe(self, audio: bytes, model: str, options: dict[str, Any]) -> dict[str, Any]:
        """``audio`` (a file's bytes) to ``{"text", "language"}``."""

    def chat(self, model: str, messages: list[dict[str, str]], options: dict[str, Any]) -> AsyncIterator[str]:
        """The reply to ``messages``, streamed as text deltas; closing the iterator stops the generation."""

    def speaker(self, model: str, options: dict[str, Any]) -> contextlib.AbstractAsyncContextManager[Speaker]:
        """The text-to-speech model held for the run (loaded on entry)."""


def _speakable(text: str) -> bool:
    return any(c.isalnum() for c in text)


class SentenceChunker:
    """Streamed text cut into sentences as each completes: a sentence is complete once what follows its end
    punctuation (or line break) has arrived, so "Dr" + "." is not cut before the next word shows where it ends."""

    def __init__(self) -> None:
        self._pending = ""

    def feed(self, delta: str) -> list[str]:
        """The sentences ``delta`` completed (those with something to say)."""
        pieces = SENTENCE_END.split(self._pending + delta)
        self._pending = pieces.pop()
        while len(self._pending) > _LONGEST:
            cut = self._pending.rfind(" ", 1, _LONGEST)
            if cut <= 0:
                break
            pieces.append(self._pending[:cut])
            self._pending = self._pending[cut + 1 :]
        return [p.strip() for p in pieces if _speakable(p)]

    def flush(self) -> list[str]:
        """What is left once the text ended."""
        rest, self._pending = self._pending.strip(), ""
        return [rest] if _speakable(rest) else []


def pcm_wav(pcm: bytes, sample_rate: int) -> bytes:
    """16-bit mono PCM as a WAV file."""
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes(pcm)
    return out.getvalue()


def _ms(since: float) -> float:
    return round((time.perf_counter() - since) * 1000, 1)


@dataclass
class VoiceChat:
    """One run of the voice-chat recipe.

    Args:
        request: The checked request.
        stages: The models.
        audio: The question (the request's inline audio, or the server-local file it named, read).

    Iterate :meth:`events` to run it; :attr:`result` is set once they end.
    """

    request: RunRequest
    stages: Stages
    audio: bytes
    result: dict[str, Any] | None = None
    _out: asyncio.Queue[dict[str, Any] | BaseException | None] = field(default_factory=asyncio.Queue)
    _sentences: asyncio.Queue[str | None] = field(default_factory=lambda: asyncio.Queue(READ_AHEAD))
    _pcm: list[bytes] = field(default_factory=list)
    _rate: int = 0
    _timing: dict[str, float | None] = field(default_factory=lambda: {"ttft_ms": None, "ttfa_ms": None})

    async def events(self) -> AsyncGenerator[dict[str, Any], None]:
        """The run's events, as each stage produces them; closing this early stops every stage.

        Raises:
            LemonkitError: A stage failed (a model that would not load, an audio file that does not decode...).
        """
        start = time.perf_counter()
        request = self.request
        speaking = asyncio.create_task(self._speak(start))
        talking: asyncio.Task[None] | None = None
        try:
            heard = await self.stages.transcribe(self.audio, request.models["asr"], request.options["asr"])
            transcript = str(heard.get("text") or "").strip()
            language = heard.get("language")
            yield {"role": "asr", "partial_text": {"text": transcript, "language": language}, "is_final": True}
            messages = [
                {"role": "system", "content": request.system_prompt},
                *request.history,
                {"role": "user", "content": transcript},
            ]
            reply: list[str] = []
            talking = asyncio.create_task(self._talk(messages, reply, start))
            for task in (talking, speaking):
                task.add_done_callback(self._report)
            finished = 0
            while finished < 2:
                item = await self._out.get()
                if item is None:
                    finished += 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
            text = "".join(reply).strip()
            history = [
                *request.history,
                {"role": "user", "content": transcript},
                {"role": "assistant", "content": text},
            ]
            pcm = b"".join(self._pcm)
            self.result = {
                "text": text,
                "transcript": transcript,
                "language": language,
                "audio": base64.b64encode(pcm_wav(pcm, self._rate)).decode() if pcm else "",
                "sample_rate": self._rate,
                "channels": 1,
                "duration": len(pcm) / 2 / self._rate if self._rate else 0.0,
                "models": dict(request.models),
                "artifacts": [history_artifact(history)],
                "timing": {**self._timing, "wall_ms": _ms(start)},
            }
        finally:
            stages = [stage for stage in (speaking, talking) if stage is not None]
            for stage in stages:
                stage.cancel()
            await asyncio.gather(*stages, return_exceptions=True)  # their models are released before we return

    def _report(self, task: asyncio.Task[None]) -> None:
        """A stage's end: ``None`` when it finished, its exception when it failed."""
        if task.cancelled():
            return
        self._out.put_nowait(task.exception())

    async def _talk(self, messages: list[dict[str, str]], reply: list[str], start: float) -> None:
        """The chat reply: each delta out as an event, each complete sentence handed to the speaker."""
        chunker = SentenceChunker()
        stream = self.stages.chat(self.request.models["conversation"], messages, self.request.options["conversation"])
        try:
            async for delta in stream:
                if not delta:
                    continue
                if self._timing["ttft_ms"] is None:
                    self._timing["ttft_ms"] = _ms(start)
                reply.append(delta)
                self._out.put_nowait({"role": "conversation", "partial_text": {"text": delta}, "is_final": False})
                for sentence in chunker.feed(delta):
                    await self._sentences.put(sentence)  # waits while the speaker is READ_AHEAD sentences behind
        finally:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()  # stops the generation when the run is cancelled mid-reply
        for sentence in chunker.flush():
            await self._sentences.put(sentence)
        self._out.put_nowait({"role": "conversation", "is_final": True})
        await self._sentences.put(None)

    async def _speak(self, start: float) -> None:
        """Each sentence spoken as it arrives, its audio out as an event (WAV, base64)."""
        async with self.stages.speaker(self.request.models["tts"], self.request.options["tts"]) as speak:
            while (sentence := await self._sentences.get()) is not None:
                pcm, rate = await speak(sentence)
                if self._timing["ttfa_ms"] is None:
                    self._timing["ttfa_ms"] = _ms(start)
                self._pcm.append(pcm)
                self._rate = rate
                audio = base64.b64encode(pcm_wav(pcm, rate)).decode()
                self._out.put_nowait({"role": "tts", "audio": audio, "sample_rate": rate, "is_final": False})
        self._out.put_nowait({"role": "tts", "is_final": True})
