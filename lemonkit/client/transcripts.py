"""What :func:`lemonkit.transcribe` and :func:`lemonkit.align` return: a :class:`Transcript` of timed words.

The server answers in one of three shapes, all read here into the same :class:`Transcript`:
``/v1/audio/transcriptions`` with ``response_format=verbose_json`` (segments in seconds, each with its words),
``/v1/audio/transcriptions/details`` (words and segments in samples, with ``sample_rate``) and
``/v1/audio/alignments`` (words in seconds and samples).
"""

from __future__ import annotations

import html
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lemonkit.client.audio_clips import AudioClip

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["Segment", "Transcript", "Word"]


@dataclass(frozen=True)
class Word:
    """One word with its time in the audio.

    Attributes:
        word: The word (without the leading space Whisper gives it).
        start: Where it starts, in seconds.
        end: Where it ends, in seconds.
        confidence: The model's probability for it (0-1), ``None`` when the model gives none.
    """

    word: str
    start: float
    end: float
    confidence: float | None = None


@dataclass(frozen=True)
class Segment:
    """A stretch of speech (a sentence or so) and its words.

    Attributes:
        id: Its position.
        start: Seconds.
        end: Seconds.
        text: What was said in it.
        words: Its words (empty when the model gave no word times).
        raw: The server's segment (``avg_logprob``, ``no_speech_prob``, ``tokens``, ...).
    """

    id: int
    start: float
    end: float
    text: str
    words: tuple[Word, ...] = ()
    raw: dict[str, Any] = field(default_factory=dict, compare=False)


def _seconds(entry: dict[str, Any], key: str, rate: float | None) -> float:
    if entry.get(key) is not None:
        return float(entry[key])
    sample = entry.get(f"{key}_sample")
    if sample is None or not rate:
        raise ValueError(f"A timed entry has neither {key!r} nor {key + '_sample'!r} with a sample_rate: {entry}")
    return float(sample) / rate


def _word(entry: dict[str, Any], rate: float | None) -> Word:
    confidence = entry.get("confidence", entry.get("probability"))
    return Word(
        word=str(entry.get("word", "")).strip(),
        start=_seconds(entry, "start", rate),
        end=_seconds(entry, "end", rate),
        confidence=None if confidence is None else float(confidence),
    )


def _segment(index: int, entry: dict[str, Any], rate: float | None, words: Iterable[Word] = ()) -> Segment:
    own = tuple(_word(w, rate) for w in entry.get("words") or ())
    return Segment(
        id=int(entry.get("id", index)),
        start=_seconds(entry, "start", rate),
        end=_seconds(entry, "end", rate),
        text=str(entry.get("text", "")).strip(),
        words=own or tuple(words),
        raw=entry,
    )


def _inside(words: list[Word], start: float, end: float) -> list[Word]:
    return [w for w in words if start <= (w.start + w.end) / 2 < end]


@dataclass
class Transcript:
    """Timed words of a recording, with where they came from.

    ``str(transcript)`` is its text; in a notebook it shows the words with their times on hover.

    Attributes:
        text: The whole transcript.
        segments: Its segments, each with its words.
        words: Every word, in order, with ``start``/``end`` seconds and ``confidence``.
        language: The language spoken (detected or given), when the model says.
        duration: Seconds of audio.
        model: The model that transcribed (or aligned) it.
        timing: The server's figures: ``wall_ms``, ``audio_duration_ms``, ``rtf``.
        provenance: Model, checkpoint, versions, wall time and the request (see :class:`~lemonkit.ChatResult`).
        raw: The server's answer.
    """

    text: str
    segments: list[Segment] = field(default_factory=list)
    words: list[Word] = field(default_factory=list)
    language: str | None = None
    duration: float | None = None
    model: str | None = None
    timing: dict[str, Any] | None = None
    provenance: dict[str, Any] = field(default_factory=dict)
    raw: dict[str, Any] = field(default_factory=dict, repr=False)
    source: AudioClip | bytes | None = field(default=None, repr=False)

    # -- reading the server's answers ------------------------------------------------------------------------------

    @classmethod
    def from_answer(cls, body: dict[str, Any], **extra: Any) -> Transcript:
        """A transcript from any of the three answers (see the module doc); ``extra`` sets more fields
        (``model``, ``provenance``, ``source``).

        Raises:
            ValueError: A timed entry without a time.
        """
        rate = body.get("sample_rate")
        loose = [_word(w, rate) for w in body.get("words") or ()]
        segments = [
            _segment(i, s, rate, _inside(loose, _seconds(s, "start", rate), _seconds(s, "end", rate)))
            for i, s in enumerate(body.get("segments") or ())
        ]
        words = loose or [w for s in segments for w in s.words]
        text = body.get("text")
        timing = body.get("timing")
        duration = body.get("duration")
        if duration is None and timing and timing.get("audio_duration_ms") is not None:
            duration = timing["audio_duration_ms"] / 1000
        return cls(
            text=str(text if text is not None else " ".join(w.word for w in words)).strip(),
            segments=segments,
            words=words,
            language=body.get("language"),
            duration=None if duration is None else float(duration),
            model=extra.pop("model", None) or body.get("model"),
            timing=timing,
            raw=body,
            **extra,
        )

    # -- the audio it came from --------------------------------------------------------------------------------------

    @property
    def audio(self) -> AudioClip | None:
        """The audio transcribed (decoded on first use), ``None`` when it was not kept."""
        if isinstance(self.source, bytes):
            self.source = AudioClip.from_bytes(self.source)
        return self.source

    # -- views -------------------------------------------------------------------------------------------------------

    def subtitle_segments(self) -> list[dict[str, Any]]:
        """The segments as ``{"id", "start", "end", "text"}`` dicts (one per word-less answer's whole text)."""
        if self.segments:
            return [{"id": s.id, "start": s.start, "end": s.end, "text": s.text} for s in self.segments]
        end = self.words[-1].end if self.words else self.duration or 0.0
        return [{"id": 0, "start": self.words[0].start if self.words else 0.0, "end": end, "text": self.text}]

    def to_srt(self) -> str:
        """The transcript as SubRip subtitles, one cue per segment.

        Example:
            >>> print(lemonkit.transcribe("talk.wav").to_srt())
            1
            00:00:00,000 --> 00:00:02,380
            The quick brown fox.
        """
        from lemonkit.formats import subtitles

        return subtitles.to_srt(self.subtitle_segments())

    def to_vtt(self) -> str:
        """The transcript as WebVTT subtitles, one cue per segment."""
        from lemonkit.formats import subtitles

        return subtitles.to_vtt(self.subtitle_segments())

    def to_pandas(self) -> Any:
        """One row per word: ``word``, ``start``, ``end``, ``duration``, ``confidence``, ``segment``."""
        import pandas as pd

        segment_of = {id(w): s.id for s in self.segments for w in s.words}
        rows = [
            {
                "word": w.word,
                "start": w.start,
                "end": w.end,
                "duration": w.end - w.start,
                "confidence": w.confidence,
                "segment": segment_of.get(id(w)),
            }
            for w in self.words
        ]
        return pd.DataFrame(rows, columns=["word", "start", "end", "duration", "confidence", "segment"])

    def plot(self, ax: Axes | None = None) -> Figure:
        """The word-timing figure: the waveform (when the audio was kept), each word on the time axis as a band
        shaded by its confidence, and the word above it.

        Args:
            ax: Draw into these axes (default: a new figure).

        Returns:
            The matplotlib ``Figure``.

        Example:
            >>> lemonkit.transcribe("talk.wav").plot().savefig("timing.png")
        """
        from lemonkit.client.plots import word_timing

        return word_timing(self, ax)

    def __str__(self) -> str:
        return self.text

    def __repr__(self) -> str:
        text = self.text if len(self.text) <= 60 else self.text[:57] + "..."
        seconds = f"{self.duration:.2f} s" if self.duration is not None else "? s"
        return f"Transcript(text={text!r}, words={len(self.words)}, {seconds}, model={self.model!r})"

    def _repr_html_(self) -> str:
        spans = []
        for w in self.words:
            tip = f"{w.start:.2f} to {w.end:.2f} s"
            doubt = 0.0
            if w.confidence is not None:
                tip += f" · confidence {w.confidence:.0%}"
                doubt = max(0.0, min(1.0, 1.0 - w.confidence))
            style = f"background: rgba(245, 124, 0, {doubt * 0.6:.2f}); border-radius: 2px; cursor: help"
            spans.append(
                f'<span class="lk-word" title="{html.escape(tip)}" data-start="{w.start:.3f}" '
                f'data-end="{w.end:.3f}" style="{style}">{html.escape(w.word)}</span>'
            )
        body = " ".join(spans) if spans else html.escape(self.text)
        facts = [self.model, self.language, f"{self.duration:.2f} s" if self.duration is not None else None]
        caption = html.escape(" · ".join(str(f) for f in facts if f) + f" · {len(self.words)} words")
        return (
            f'<div class="lk-transcript"><div style="font-size: 0.85em; opacity: 0.7">{caption}</div>'
            f'<p style="line-height: 1.8">{body}</p></div>'
        )
