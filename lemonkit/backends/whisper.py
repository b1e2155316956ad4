"""The ``faster-whisper`` recipe's speech-to-text engine: a Whisper model converted to CTranslate2, on the CPU.

The model is a directory in the layout of the CTranslate2 hub repos (``Systran/faster-whisper-*``): ``model.bin``,
``config.json``, ``tokenizer.json``, ``vocabulary.*`` and, optionally, ``preprocessor_config.json`` (the mel
settings; Whisper's 80-bin defaults without it).

Three calls (see :mod:`lemonkit.backends.protocol`): :meth:`FasterWhisperEngine.transcribe` (one upload, a JSON answer
or ``transcript.text.*`` events), :meth:`~FasterWhisperEngine.align` (forced alignment of a known text with
CTranslate2's ``Whisper.align``) and :meth:`~FasterWhisperEngine.transcribe_batch` (several uploads through
faster-whisper's batched pipeline, one event per file as it is done); and the generic tasks of audio-api.md
(:meth:`~FasterWhisperEngine.run_task`, :meth:`~FasterWhisperEngine.run_task_batch`), which map onto the same calls.
Times in answers are seconds; the front turns them into samples where a route wants them.
"""

from __future__ import annotations

import bisect
import json
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lemonkit.backends.engine_devices import ctranslate2_device
from lemonkit.backends.protocol import Cancelled, LoadSpec, Upload, positive_option, thread_count
from lemonkit.backends.task_engine import TaskRequest, artifact, batch_requests, stream_events
from lemonkit.errors import InvalidArgument, MissingArgument, ModelLoadError
from lemonkit.formats.audio_codec import WHISPER_RATE, Decoded, decode

__all__ = ["FasterWhisperEngine"]

#: beam width: measured on espeak-ng speech, beam 5 transcribes exactly where greedy decoding slips, at +15% time
BEAM_SIZE = 5
#: Whisper's window: alignment and one batched chunk cover at most this much audio
WINDOW_SECONDS = 30
#: chunks decoded together by the batched pipeline
BATCH_SIZE = 8
#: ``options`` a task takes (audio-api.md's ``/v1/tasks/run``), with what each does
TASK_OPTIONS = {
    "language": "'auto' or a language code",
    "prompt": "text that primes the decoder",
    "temperature": "0 to 1; absent: Whisper's fallback schedule",
    "word_timestamps": "true: each word's time, and a transcript_alignment artifact",
}
#: ``meta.format`` of the ``transcript_alignment`` artifact: JSON ``{"sample_rate", "words": [...]}``
ALIGNMENT_FORMAT = "lemonkit.transcript_alignment/1"


@dataclass
class _Request:
    """The transcription fields of a request body, checked."""

    language: str | None
    prompt: str | None
    temperature: float | list[float]
    word_timestamps: bool

    @classmethod
    def parse(cls, body: dict[str, Any], languages: list[str]) -> _Request:
        language = body.get("language")
        if language in (None, "", "auto"):
            language = None
        elif not isinstance(language, str) or language.lower() not in languages:
            raise InvalidArgument(
                f"language must be 'auto' or one of the model's languages ({', '.join(languages[:12])}"
                f"{', ...' if len(languages) > 12 else ''}), not {language!r}"
            )
        else:
            language = language.lower()
        prompt = body.get("prompt")
        if prompt is not None and not isinstance(prompt, str):
            raise InvalidArgument("prompt must be a string")
        temperature: Any = body.get("temperature")
        if temperature is None:
            temperature = [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]  # Whisper's fallback schedule
        elif isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 <= temperature <= 1:
            raise InvalidArgument(f"temperature must be a number from 0 to 1, not {temperature!r}")
        else:
            temperature = float(temperature)
        return cls(language, prompt or None, temperature, bool(body.get("word_timestamps")))

    @property
    def decoding(self) -> dict[str, Any]:
        """These fields as faster-whisper's ``transcribe`` arguments (the model's and the batched pipeline's)."""
        return {
            "language": self.language,
            "initial_prompt": self.prompt,
            "temperature": self.temperature,
            "word_timestamps": self.word_timestamps,
        }


def _timing(start: float, duration: float) -> dict[str, float]:
    wall = time.perf_counter() - start
    return {
        "wall_ms": round(wall * 1000, 3),
        "audio_duration_ms": round(duration * 1000, 3),
        "rtf": round(wall / duration, 5) if duration else 0.0,
    }


def _segment(index: int, segment: Any, offset: float = 0.0) -> dict[str, Any]:
    """A faster-whisper ``Segment`` as the answer's dict; ``offset`` seconds are taken off its times."""
    out = {
        "id": index,
        "seek": segment.seek,
        "start": round(max(segment.start - offset, 0.0), 3),
        "end": round(max(segment.end - offset, 0.0), 3),
        "text": segment.text,
        "tokens": list(segment.tokens),
        "temperature": segment.temperature,
        "avg_logprob": segment.avg_logprob,
        "compression_ratio": segment.compression_ratio,
        "no_speech_prob": segment.no_speech_prob,
    }
    if segment.words is not None:
        out["words"] = [
            {
                "word": w.word,
                "start": round(max(w.start - offset, 0.0), 3),
                "end": round(max(w.end - offset, 0.0), 3),
                "probability": round(float(w.probability), 4),
            }
            for w in segment.words
        ]
    return out


def _answer(segments: list[dict[str, Any]], language: str, duration: float) -> dict[str, Any]:
    return {
        "text": "".join(s["text"] for s in segments).strip(),
        "language": language,
        "duration": round(duration, 3),
        "segments": segments,
    }


def _bound_edges(words: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The first and last word shortened to twice the median word length (at most 1.4 s), as faster-whisper does for
    transcripts: Whisper's attention alignment gives leading and trailing silence to the words next to it."""
    durations = [float(w["end"] - w["start"]) for w in words if w["end"] > w["start"]]
    if not durations:
        return words
    longest = 2 * min(0.7, float(np.median(durations)))
    words[0]["start"] = max(float(words[0]["start"]), float(words[0]["end"]) - longest)
    words[-1]["end"] = min(float(words[-1]["end"]), float(words[-1]["start"]) + longest)
    return words


def _aligned_word(word: dict[str, Any], duration: float) -> dict[str, Any]:
    start, end = min(float(word["start"]), duration), min(float(word["end"]), duration)
    return {
        "word": word["word"],
        "start": round(start, 3),
        "end": round(end, 3),
        "start_sample": round(start * WHISPER_RATE),
        "end_sample": round(end * WHISPER_RATE),
        "confidence": round(float(word["probability"]), 4),
    }


def _task_word(word: dict[str, Any], duration: float) -> dict[str, Any]:
    return {**_aligned_word(word, duration), "word": str(word["word"]).strip()}


def _task_result(segments: list[dict[str, Any]], language: str, duration: float, *, words: bool) -> dict[str, Any]:
    """A task's result (see :meth:`FasterWhisperEngine.run_task`) from the transcript's segments."""
    result: dict[str, Any] = {
        "text": "".join(s["text"] for s in segments).strip(),
        "language": language,
        "duration": round(duration, 3),
        "artifacts": [],
    }
    if words:
        timed = [_task_word(w, duration) for s in segments for w in s.get("words", [])]
        result["word_timestamps"] = timed
        result["sample_rate"] = WHISPER_RATE
        # the words' times as an artifact too, so that a client can keep them with other artifacts and send them on
        payload = json.dumps({"sample_rate": WHISPER_RATE, "words": timed}).encode()
        meta = {"format": ALIGNMENT_FORMAT, "sample_rate": str(WHISPER_RATE)}
        result["artifacts"] = [artifact("whisper.words", "transcript_alignment", payload, meta)]
    return result


def _audio(upload: Upload, what: str = "the audio") -> Decoded:
    decoded = decode(upload.content, sample_rate=WHISPER_RATE)
    if decoded.duration <= 0:
        raise InvalidArgument(f"{what} holds no samples")
    return decoded


def _first_upload(body: dict[str, Any]) -> Upload:
    files = body.get("files") or []
    if not files:
        raise MissingArgument("an audio file is required ('file')")
    upload: Upload = files[0]
    return upload


class FasterWhisperEngine:
    """One CTranslate2 Whisper model (see :class:`lemonkit.backends.protocol.Engine`).

    Args:
        spec: ``model_path`` (the model directory), ``type`` (must be ``transcription``), optional ``options``
            (``n_threads``, ``compute_type``, ``beam_size``, ``batch_size``).

    Raises:
        ModelLoadError: The directory holds no CTranslate2 Whisper model, or CTranslate2 cannot load it.
        InvalidArgument: An option has the wrong type.
    """

    def __init__(self, spec: LoadSpec) -> None:
        from faster_whisper import BatchedInferencePipeline, WhisperModel

        if spec.get("type") != "transcription":
            raise ModelLoadError(
                f"lemonkit's faster-whisper engine serves transcription models, not {spec.get('type')!r}"
            )
        root = Path(spec["model_path"])
        if not (root / "model.bin").is_file():
            raise ModelLoadError(f"{root} holds no CTranslate2 model.bin")
        options = spec.get("options") or {}
        self._threads = thread_count(options)
        self._beam = positive_option(options, "beam_size", BEAM_SIZE)
        self._batch = positive_option(options, "batch_size", BATCH_SIZE)
        import ctranslate2

        self._device, best_type = ctranslate2_device(ctranslate2)
        compute_type = options.get("compute_type") or best_type
        try:
            self._model = WhisperModel(
                str(root), device=self._device, compute_type=compute_type, cpu_threads=self._threads
            )
        except Exception as exc:  # CTranslate2 raises RuntimeError/ValueError for missing or foreign files
            raise ModelLoadError(f"faster-whisper could not load {root}: {exc}") from exc
        self._pipeline = BatchedInferencePipeline(self._model)
        self._languages = self._model.supported_languages
        self._stats: dict[str, Any] = {}
        import faster_whisper

        self._fingerprint = f"faster-whisper-{faster_whisper.__version__}+ctranslate2-{ctranslate2.__version__}"

    # -- transcription ---------------------------------------------------------------------------------------

    def transcribe(self, body: dict[str, Any], *, cancelled: Cancelled) -> dict[str, Any] | Iterator[dict[str, Any]]:
        """``/v1/audio/transcriptions``: ``body["files"][0]`` to text, segments (and words) with times in seconds.

        Args:
            body: ``files`` (one :class:`Upload`), ``language`` (``None``/``"auto"``: detected), ``prompt``,
                ``temperature`` (``None``: Whisper's fallback schedule), ``word_timestamps``, ``stream``.
            cancelled: Checked between segments; decoding stops at the next one once it is true.

        Returns:
            ``{"text", "language", "duration", "segments", "timing"}``, or with ``stream`` the events
            ``transcript.text.delta`` (one per segment) and then ``transcript.text.done`` carrying those fields.

        Raises:
            UndecodableAudio: The upload is not audio (400 ``invalid_audio``).
            InvalidArgument: A field has a wrong value.
        """
        request = _Request.parse(body, self._languages)
        audio = _audio(_first_upload(body))
        if body.get("stream"):
            return self._stream(audio, request, cancelled)
        done: dict[str, Any] = {}
        for event in self._run(audio, request, cancelled):
            done = event
        done.pop("type", None)
        done.pop("delta", None)
        return done

    def _stream(self, audio: Decoded, request: _Request, cancelled: Cancelled) -> Iterator[dict[str, Any]]:
        for event in self._run(audio, request, cancelled):
            if event["type"] == "transcript.text.delta" and not event["delta"]:
                continue
            yield event

    def _decode(
        self, audio: Decoded, request: _Request, *, max_new_tokens: int | None = None
    ) -> tuple[Iterator[dict[str, Any]], str]:
        """The segments of ``audio`` as each is decoded (lazily: decoding stops when the caller stops asking), and
        the language (given, or detected before the first segment)."""
        pieces, info = self._model.transcribe(
            audio.samples, **request.decoding, beam_size=self._beam, max_new_tokens=max_new_tokens
        )
        return (_segment(index, piece) for index, piece in enumerate(pieces)), info.language

    def _run(self, audio: Decoded, request: _Request, cancelled: Cancelled) -> Iterator[dict[str, Any]]:
        start = time.perf_counter()
        pieces, language = self._decode(audio, request)
        segments: list[dict[str, Any]] = []
        first: float | None = None
        for segment in pieces:
            delta = segment["text"].lstrip() if not segments else segment["text"]
            segments.append(segment)
            first = first if first is not None else time.perf_counter() - start
            yield {"type": "transcript.text.delta", "delta": delta}
            if cancelled():
                return
        answer = _answer(segments, language, audio.duration)
        answer["timing"] = _timing(start, audio.duration)
        self._record(answer["timing"], first, sum(len(s["tokens"]) for s in segments))
        yield {"type": "transcript.text.done", **answer}

    def _record(self, timing: dict[str, float], first: float | None, tokens: int) -> None:
        self._stats = {
            "input_tokens": 0,
            "output_tokens": tokens,
            "time_to_first_token": first if first is not None else timing["wall_ms"] / 1000,
            "audio_duration_ms": timing["audio_duration_ms"],
            "wall_ms": timing["wall_ms"],
            "rtf": timing["rtf"],
        }

    # -- forced alignment ------------------------------------------------------------------------------------

    def align(self, body: dict[str, Any], *, cancelled: Cancelled) -> dict[str, Any]:
        """``/v1/audio/alignments``: the words of a known ``text`` placed on ``body["files"][0]``'s time line.

        Args:
            body: ``files`` (one :class:`Upload`, at most 30 s), ``text``, ``language`` (``None``/``"auto"``:
                detected).
            cancelled: Unused: one alignment is one CTranslate2 call.

        Returns:
            ``{"text", "language", "duration", "sample_rate", "words": [{"word", "start", "end", "start_sample",
            "end_sample", "confidence"}], "timing"}``.

        Raises:
            MissingArgument: No ``text`` or no audio.
            InvalidArgument: The audio is longer than 30 s, or a field has a wrong value.
            UndecodableAudio: The upload is not audio.
        """
        from faster_whisper.tokenizer import Tokenizer

        text = body.get("text")
        if not isinstance(text, str) or not text.strip():
            raise MissingArgument("'text' (the transcript to align) is required")
        request = _Request.parse(body, self._languages)
        audio = _audio(_first_upload(body))
        if audio.duration > WINDOW_SECONDS:
            raise InvalidArgument(
                f"alignment takes audio of at most {WINDOW_SECONDS} s; this is {audio.duration:.1f} s"
            )
        start = time.perf_counter()
        model = self._model
        features = model.feature_extractor(audio.samples)
        frames = min(features.shape[-1] - 1, WINDOW_SECONDS * model.frames_per_second)
        window = np.zeros((features.shape[0], WINDOW_SECONDS * model.frames_per_second), dtype=features.dtype)
        window[:, :frames] = features[:, :frames]
        encoded = model.encode(window)
        language = request.language or self._detect(encoded)
        tokenizer = Tokenizer(model.hf_tokenizer, model.model.is_multilingual, task="transcribe", language=language)
        tokens = tokenizer.encode(" " + text.strip())
        found = _bound_edges(model.find_alignment(tokenizer, [tokens], encoded, frames)[0])
        words = [_aligned_word(w, audio.duration) for w in found]
        timing = _timing(start, audio.duration)
        self._record(timing, None, len(tokens))
        return {
            "text": text.strip(),
            "language": language,
            "duration": round(audio.duration, 3),
            "sample_rate": WHISPER_RATE,
            "words": words,
            "timing": timing,
        }

    def _detect(self, encoded: Any) -> str:
        if not self._model.model.is_multilingual:
            return "en"
        best = self._model.model.detect_language(encoded)[0][0][0]  # [(token "<|en|>", probability), ...]
        return str(best).strip("<|>")

    # -- batches ---------------------------------------------------------------------------------------------

    def transcribe_batch(self, body: dict[str, Any], *, cancelled: Cancelled) -> Iterator[dict[str, Any]]:
        """``/v1/batches/transcriptions``: every upload's speech in one batched pipeline run.

        The files' speech (found by the Silero VAD that ships with faster-whisper) is cut into chunks of at most
        30 s that are decoded ``batch_size`` at a time, across files; a file's result is sent once the chunks after
        it started, so results arrive in upload order as soon as each is complete.

        Args:
            body: ``files`` (one or more :class:`Upload`), ``language``, ``prompt``, ``temperature``,
                ``word_timestamps`` (all applied to every file).
            cancelled: Checked between segments.

        Returns:
            Events ``batch.transcription.result`` (``index``, ``filename``, and the fields of a transcription)
            and then ``batch.transcription.done`` (``result_count``, aggregate ``timing``).

        Raises:
            MissingArgument: No files.
            UndecodableAudio: A file is not audio (the message names it).
        """
        request = _Request.parse(body, self._languages)
        files: list[Upload] = body.get("files") or []
        if not files:
            raise MissingArgument("at least one audio file is required ('file')")
        audios = []
        for index, upload in enumerate(files):
            try:
                audios.append(_audio(upload, f"file {index} ({upload.filename})"))
            except InvalidArgument as exc:
                exc.message = f"file {index} ({upload.filename}): {exc.message}"
                raise
        return self._batch_events(files, audios, request, cancelled)

    def _batch_events(
        self, files: list[Upload], audios: list[Decoded], request: _Request, cancelled: Cancelled
    ) -> Iterator[dict[str, Any]]:
        start = time.perf_counter()
        offsets = list(np.cumsum([0.0] + [a.duration for a in audios[:-1]]))
        clips = [clip for i, audio in enumerate(audios) for clip in self._speech_clips(audio, offsets[i])]
        per_file: list[list[Any]] = [[] for _ in files]
        language = request.language or "en"
        sent = 0

        def result(index: int) -> dict[str, Any]:
            segments = [_segment(i, s, offsets[index]) for i, s in enumerate(per_file[index])]
            answer = _answer(segments, language, audios[index].duration)
            return {"type": "batch.transcription.result", "index": index, "filename": files[index].filename, **answer}

        if clips:
            joined = np.concatenate([a.samples for a in audios])
            pieces, info = self._pipeline.transcribe(
                joined, **request.decoding, beam_size=self._beam, batch_size=self._batch, clip_timestamps=clips
            )
            language = info.language
            for piece in pieces:
                # the middle, not the start: faster-whisper rounds times to ms, which can put a start before its file
                owner = max(bisect.bisect_right(offsets, (piece.start + piece.end) / 2) - 1, 0)
                while sent < owner:
                    yield result(sent)
                    sent += 1
                per_file[owner].append(piece)
                if cancelled():
                    return
        while sent < len(files):
            yield result(sent)
            sent += 1
        total = sum(a.duration for a in audios)
        timing = _timing(start, total)
        self._record(timing, None, sum(len(s.tokens) for f in per_file for s in f))
        yield {"type": "batch.transcription.done", "result_count": len(files), "timing": timing}

    @staticmethod
    def _speech_clips(audio: Decoded, offset: float) -> Iterable[dict[str, float]]:
        """The speech of one file as clips of at most 30 s, in seconds from the start of the joined audio."""
        from faster_whisper.vad import VadOptions, get_speech_timestamps

        spans = get_speech_timestamps(
            audio.samples, VadOptions(max_speech_duration_s=WINDOW_SECONDS, min_silence_duration_ms=160)
        )
        group: list[int] | None = None
        for span in spans:
            if group is not None and span["end"] - group[0] <= WINDOW_SECONDS * WHISPER_RATE:
                group[1] = span["end"]
                continue
            if group is not None:
                yield {"start": offset + group[0] / WHISPER_RATE, "end": offset + group[1] / WHISPER_RATE}
            group = [span["start"], span["end"]]
        if group is not None:
            yield {"start": offset + group[0] / WHISPER_RATE, "end": offset + group[1] / WHISPER_RATE}

    # -- generic tasks (audio-api.md's /v1/tasks/*) ----------------------------------------------------------

    def run_task(self, body: dict[str, Any], *, cancelled: Cancelled) -> dict[str, Any] | Iterator[dict[str, Any]]:
        """``/v1/tasks/run`` and ``/stream``: the task's audio to text (see :mod:`lemonkit.backends.task_engine`).

        ``options``: :data:`TASK_OPTIONS`. ``max_tokens`` bounds the tokens decoded per 30-s window; ``text``,
        ``seed``, ``voice_ref`` and artifacts are not read (Whisper has no use for them).

        Returns:
            ``{"text", "language", "duration", "artifacts", "timing"}``, with ``options.word_timestamps`` also
            ``word_timestamps`` (``word``, ``start``/``end`` in seconds, ``start_sample``/``end_sample``,
            ``confidence``), ``sample_rate`` and a ``transcript_alignment`` artifact of those words; with ``stream``
            the events of :func:`~lemonkit.backends.task_engine.stream_events`, one per segment (its ``partial_text``).

        Raises:
            MissingArgument: No audio.
            UndecodableAudio: The audio is not audio.
            InvalidArgument: An option Whisper does not take, or a wrong value.
        """
        task = TaskRequest.parse(body)
        request = self._task_request(task)
        if task.audio is None:
            raise MissingArgument("request.audio (a server-local path) or request.audio_base64 is required")
        audio = _audio(task.audio, "request audio")
        start = time.perf_counter()
        # Whisper decodes at most max_length tokens per window, half of them the prompt's: a larger bound is no bound
        most = self._model.max_length // 2 - 8
        bound = min(task.max_tokens, most) if task.max_tokens is not None else None
        pieces, language = self._decode(audio, request, max_new_tokens=bound)
        segments: list[dict[str, Any]] = []

        def events() -> Iterator[dict[str, Any]]:
            for segment in pieces:
                text = segment["text"].lstrip() if not segments else segment["text"]
                segments.append(segment)
                event: dict[str, Any] = {"partial_text": {"text": text, "language": language}}
                if request.word_timestamps:
                    event["word_timestamps"] = [_task_word(w, audio.duration) for w in segment.get("words", [])]
                yield event
                if cancelled():
                    return

        def finish() -> dict[str, Any]:
            result = _task_result(segments, language, audio.duration, words=request.word_timestamps)
            result["timing"] = _timing(start, audio.duration)
            self._record(result["timing"], None, sum(len(s["tokens"]) for s in segments))
            return result

        if task.stream:
            return stream_events(events(), finish, include_artifacts=task.include_artifacts, start=start)
        for _ in events():
            pass
        return finish()

    def run_task_batch(self, body: dict[str, Any], *, cancelled: Cancelled) -> Iterator[dict[str, Any]]:
        """``/v1/tasks/batch``: every entry's audio through the batched pipeline of :meth:`transcribe_batch`.

        One native batch decodes with one set of options, so every entry must carry the same ``options``.

        Returns:
            Events ``task.batch.result`` (``index``, ``result``: the fields of :meth:`run_task`'s result, ``timing``
            ``null``) in entry order as each is done, then ``task.batch.done`` (``result_count``, aggregate
            ``timing``).

        Raises:
            MissingArgument: An entry without audio.
            InvalidArgument: Entries with different options, or an option Whisper does not take.
            UndecodableAudio: An entry's audio is not audio (the message names the entry).
        """
        tasks = batch_requests(body)
        for index, task in enumerate(tasks):
            if task.audio is None:
                raise MissingArgument(f"requests[{index}].audio: each entry needs its audio (a server-local path)")
            if task.options != tasks[0].options:
                raise InvalidArgument(
                    f"requests[{index}].options: one native Whisper batch decodes every entry with the same options; "
                    f"entry 0 has {tasks[0].options}, this one {task.options}"
                )
        request = self._task_request(tasks[0])
        files = [task.audio for task in tasks if task.audio is not None]
        audios = []
        for index, upload in enumerate(files):
            try:
                audios.append(_audio(upload))
            except InvalidArgument as exc:
                exc.message = f"requests[{index}].audio: {exc.message}"
                raise
        return self._task_batch_events(self._batch_events(files, audios, request, cancelled), request)

    @staticmethod
    def _task_batch_events(events: Iterator[dict[str, Any]], request: _Request) -> Iterator[dict[str, Any]]:
        for event in events:
            if event["type"] == "batch.transcription.result":
                result = _task_result(
                    event["segments"], event["language"], event["duration"], words=request.word_timestamps
                )
                yield {"type": "task.batch.result", "index": event["index"], "result": {**result, "timing": None}}
            else:
                yield {"type": "task.batch.done", "result_count": event["result_count"], "timing": event["timing"]}

    def _task_request(self, task: TaskRequest) -> _Request:
        """A task's options as a transcription request.

        Raises:
            InvalidArgument: An option Whisper does not take, or a wrong value.
        """
        task.check_options(TASK_OPTIONS, "Whisper")
        fields = {
            "language": task.options.get("language"),
            "prompt": task.options.get("prompt"),
            "temperature": task.number("temperature", 0, 1),
            "word_timestamps": task.flag("word_timestamps"),
        }
        return _Request.parse(fields, self._languages)

    # -- the rest of the engine protocol ---------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        return dict(self._stats)

    def info(self) -> dict[str, Any]:
        return {
            "type": "transcription",
            "n_threads": self._threads,
            "device": "gpu" if self._device == "cuda" else "cpu",
            "engine": self._fingerprint,
            "multilingual": bool(self._model.model.is_multilingual),
            "sample_rate": WHISPER_RATE,
        }

    def close(self) -> None:
        self._pipeline = None
        self._model = None
