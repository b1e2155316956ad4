"""Speech-to-text of audio that is still arriving, shared by ``POST /v1/audio/transcriptions/live`` and
``WS /realtime``.

Whisper is a buffered model: it transcribes a whole piece of audio, not a stream. So the front keeps the audio
of the current utterance (cut by :mod:`lemonkit.formats.vad`, or by the client's commits) and asks the model's sidecar
for an *interim* transcript of what it holds each time about a second of new speech has arrived, and for the
*final* one when the utterance ends. One request per session is in flight at a time, finals first; an interim is
skipped while the model is serving anything else (another session, another route), so interims never queue up
behind real work. The sidecar decodes and transcribes; the front only appends samples and writes a WAV header.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from lemonkit.backends.protocol import Upload
from lemonkit.errors import BackendError, InvalidArgument, LemonkitError
from lemonkit.formats.audio_codec import wav_bytes
from lemonkit.formats.vad import RmsVad, VadSettings

if TYPE_CHECKING:
    from lemonkit.server.handler import LemonkitHandler

__all__ = ["Listener", "SidecarTranscriber", "SpeechInput", "StableText", "new_id"]

log = logging.getLogger("lemonkit.server")

SIDECAR_PATH = "/v1/audio/transcriptions"
#: seconds of new speech between two interim transcripts of an utterance
INTERIM_EVERY = 1.0
#: an utterance longer than this is cut there (Whisper's window is 30 s)
MAX_UTTERANCE = 28.0
#: audio a session may hold uncommitted when the client commits by hand
MAX_BUFFER = 600.0


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(10)}"


class Listener(Protocol):
    """What a route does with a session's events (each awaited in order)."""

    async def speech_started(self, item: str, ms: int) -> None: ...
    async def speech_stopped(self, item: str, ms: int) -> None: ...
    async def committed(self, item: str) -> None: ...
    async def interim(self, item: str, text: str) -> None: ...
    async def completed(self, item: str, text: str) -> None: ...
    async def failed(self, item: str, error: LemonkitError) -> None: ...


class SidecarTranscriber:
    """Transcribes mono float32 samples with one model, through its sidecar (loaded on first use).

    Args:
        handler: The request (or WebSocket) on whose behalf it runs.
        model: The model's registered id.
        options: ``language``, ``prompt`` (and any other field of the transcribe contract) for every request.
    """

    def __init__(self, handler: LemonkitHandler, model: str, options: dict[str, Any] | None = None) -> None:
        self.handler, self.model, self.options = handler, model, dict(options or {})

    def busy(self) -> bool:
        """Whether the model is serving a request now, or has requests waiting for their turn."""
        return self.handler.service.manager.busy(self.model)

    async def __call__(self, samples: np.ndarray, sample_rate: int) -> str:
        """The text of ``samples``.

        Raises:
            LemonkitError: The model failed to load or to transcribe.
        """
        wav = await asyncio.to_thread(wav_bytes, samples, sample_rate)
        body = {**self.options, "model": self.model, "word_timestamps": False, "stream": False}
        # one turn per utterance, so a long session never holds the model; the session's start paid its rate
        async with self.handler.service.manager.use(self.model, metered=False) as model:
            result = await self.handler.sidecar_json(
                model, SIDECAR_PATH, body, files=[Upload("audio.wav", wav, "audio/wav")]
            )
        return " ".join(str(result.get("text") or "").split())


class _Buffer:
    """Samples indexed from the first one the session received, with everything before ``start`` dropped."""

    def __init__(self, start: int = 0) -> None:
        self.start = self.end = start
        self._chunks: list[np.ndarray] = []

    def __len__(self) -> int:
        return self.end - self.start

    def append(self, samples: np.ndarray) -> None:
        self._chunks.append(samples)
        self.end += len(samples)

    def samples(self, upto: int | None = None) -> np.ndarray:
        if len(self._chunks) != 1:
            self._chunks = [np.concatenate(self._chunks) if self._chunks else np.zeros(0, dtype=np.float32)]
        whole = self._chunks[0]
        return whole if upto is None else whole[: max(0, upto - self.start)]

    def drop_before(self, index: int) -> None:
        index = min(max(index, self.start), self.end)
        if index > self.start:
            self._chunks = [self.samples()[index - self.start :]]
            self.start = index


class SpeechInput:
    """One session's audio in, its utterances' transcripts out (through ``listener``).

    Args:
        transcribe: Turns samples into text (a :class:`SidecarTranscriber`).
        listener: Receives the session's events.
        sample_rate: Rate of the samples fed.
        vad: Server-side turn detection; ``None``: utterances end only at :meth:`commit`, and no interim
            transcripts are made.
        busy: Whether the model is serving something else now (interims wait for it to be free).
    """

    def __init__(
        self,
        transcribe: Callable[[np.ndarray, int], Awaitable[str]],
        listener: Listener,
        *,
        sample_rate: int,
        vad: VadSettings | None,
        busy: Callable[[], bool] = lambda: False,
    ) -> None:
        self._transcribe, self._listener, self._busy = transcribe, listener, busy
        self.rate = sample_rate
        self._buffer = _Buffer()
        self._vad = RmsVad(vad, sample_rate) if vad is not None else None
        self._item: str | None = None  # the utterance being spoken (VAD) or buffered (manual)
        self._interim_at = 0  # utterance length when its last interim was asked for
        self._finals: deque[tuple[str, np.ndarray]] = deque()
        self._wake = asyncio.Event()
        self._closing = False
        self._worker = asyncio.ensure_future(self._work())

    # -- audio in --------------------------------------------------------------------------------------------

    async def feed(self, samples: np.ndarray) -> None:
        """Append mono float32 samples (any amount)."""
        if self._vad is None and len(self._buffer) + len(samples) > MAX_BUFFER * self.rate:
            raise InvalidArgument(
                f"The input audio buffer holds {MAX_BUFFER:.0f} s already: commit or clear it",
                code="input_audio_buffer_full",
            )
        start = self._buffer.end
        self._buffer.append(samples)
        if self._vad is None:
            return
        for event in self._vad.feed(samples):
            if event.kind == "start":
                self._item = new_id("item")
                self._interim_at = 0
                padding = self._vad.settings.prefix_padding_ms * self.rate // 1000
                self._buffer.drop_before(event.sample - padding)
                await self._listener.speech_started(self._item, self._ms(event.sample))
            elif self._item is not None:
                item, audio = self._item, self._buffer.samples(event.sample)
                self._item = None
                self._buffer.drop_before(event.sample)
                await self._listener.speech_stopped(item, self._ms(event.sample))
                await self._end(item, audio)
        if self._item is not None and len(self._buffer) >= MAX_UTTERANCE * self.rate:
            await self._cut()
        if self._item is None:
            self._forget_silence(start + len(samples))
        self._wake.set()

    def _forget_silence(self, end: int) -> None:
        """Keep only what a coming utterance may start with: its padding, and a run of voice being judged."""
        assert self._vad is not None
        padding = self._vad.settings.prefix_padding_ms * self.rate // 1000
        candidate = self._vad.candidate_start
        self._buffer.drop_before((candidate if candidate is not None else end) - padding)

    async def _cut(self) -> None:
        """End an utterance that is too long for one transcript where it stands; the speech goes on in a new one."""
        assert self._item is not None
        item, audio = self._item, self._buffer.samples()
        self._item, self._interim_at = new_id("item"), 0
        self._buffer.drop_before(self._buffer.end)
        await self._listener.speech_stopped(item, self._ms(self._buffer.end))
        await self._end(item, audio)
        await self._listener.speech_started(self._item, self._ms(self._buffer.end))

    async def commit(self) -> None:
        """End the current utterance now, whatever the VAD thinks (``input_audio_buffer.commit``).

        Raises:
            InvalidArgument: Nothing is buffered (``input_audio_buffer_commit_empty``).
        """
        if len(self._buffer) == 0 or (self._vad is not None and self._item is None):
            raise InvalidArgument(
                "The input audio buffer is empty: append audio before committing it",
                code="input_audio_buffer_commit_empty",
            )
        item, audio = self._item or new_id("item"), self._buffer.samples()
        self._reset()
        await self._end(item, audio)

    def clear(self) -> None:
        """Drop the buffered audio (``input_audio_buffer.clear``)."""
        self._reset()

    def _reset(self) -> None:
        self._buffer.drop_before(self._buffer.end)
        self._item = None
        if self._vad is not None:
            self._vad.reset()

    async def _end(self, item: str, audio: np.ndarray) -> None:
        await self._listener.committed(item)
        self._finals.append((item, audio))
        self._wake.set()

    # -- transcripts out -------------------------------------------------------------------------------------

    async def finish(self) -> None:
        """The audio ended: transcribe what is left of an utterance, and return once every transcript is out."""
        if self._vad is not None and (self._item is not None or self._vad.candidate_start is not None):
            # the buffer starts where the utterance (or a last short word still being judged) does, padding included
            item, audio = self._item or new_id("item"), self._buffer.samples()
            self._reset()
            await self._end(item, audio)
        self._closing = True
        self._wake.set()
        await self._worker

    def close(self) -> None:
        """Stop at once (the client went away): nothing more is transcribed or reported."""
        self._worker.cancel()

    async def _work(self) -> None:
        while not (self._closing and not self._finals):
            await self._wake.wait()
            self._wake.clear()
            while self._finals:
                item, audio = self._finals[0]
                text = await self._run(item, audio)
                self._finals.popleft()
                if text is not None:
                    await self._listener.completed(item, text)
            await self._interim()

    async def _interim(self) -> None:
        item = self._item
        if item is None or self._closing or self._busy():
            return
        size = len(self._buffer)
        if size - self._interim_at < INTERIM_EVERY * self.rate:
            return
        self._interim_at = size
        text = await self._run(item, self._buffer.samples())
        if text is not None and item == self._item:  # not yet committed: the final says the rest
            await self._listener.interim(item, text)
        self._wake.set()  # speech that arrived meanwhile may be due for its own interim

    async def _run(self, item: str, audio: np.ndarray) -> str | None:
        failure: LemonkitError
        try:
            return await self._transcribe(audio, self.rate)
        except LemonkitError as err:
            failure = err
        except Exception as exc:  # an engine's surprise must not end the session silently
            log.exception("transcription failed")
            failure = BackendError(f"The transcription failed: {exc}", status=500)
        await self._listener.failed(item, failure)
        return None

    def _ms(self, sample: int) -> int:
        return sample * 1000 // self.rate


class StableText:
    """Append-only deltas out of revisable interim transcripts (the live route's ``transcript.text.delta``).

    A word is sent once two interim transcripts in a row agree on it and on every word before it; the final
    transcript of an utterance sends the rest of its words. Deltas concatenated are :attr:`text`.
    """

    def __init__(self) -> None:
        self._words: list[str] = []  # every word sent
        self._sent = 0  # of the current utterance
        self._previous: list[str] = []

    @property
    def text(self) -> str:
        return " ".join(self._words)

    def interim(self, text: str) -> str:
        """The delta a new interim transcript of the current utterance makes stable ("" if none)."""
        words = text.split()
        agreed = 0
        for old, new in zip(self._previous, words, strict=False):
            if old != new:
                break
            agreed += 1
        self._previous = words
        return self._send(words[self._sent : agreed])

    def final(self, text: str) -> str:
        """The delta that completes the current utterance; the next interim starts a new one."""
        delta = self._send(text.split()[self._sent :])
        self._sent, self._previous = 0, []
        return delta

    def _send(self, words: list[str]) -> str:
        if not words:
            return ""
        lead = " " if self._words else ""
        self._words += words
        self._sent += len(words)
        return lead + " ".join(words)
