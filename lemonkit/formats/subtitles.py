"""Subtitles from transcript segments: SubRip (``.srt``) and WebVTT (``.vtt``).

Shared by the ``response_format`` ``srt``/``vtt`` of ``/v1/audio/transcriptions`` and the notebook's
``Transcript.to_srt()``/``to_vtt()``. A segment is any mapping with ``start`` and ``end`` (seconds) and ``text``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["timestamp", "to_srt", "to_vtt"]

Segment = Mapping[str, Any]


def timestamp(seconds: float, *, separator: str = ",") -> str:
    """``HH:MM:SS,mmm`` (SubRip) or, with ``separator="."``, ``HH:MM:SS.mmm`` (WebVTT)."""
    millis = max(round(seconds * 1000), 0)
    hours, millis = divmod(millis, 3_600_000)
    minutes, millis = divmod(millis, 60_000)
    secs, millis = divmod(millis, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{separator}{millis:03d}"


def _cues(segments: Iterable[Segment], separator: str) -> list[str]:
    cues = []
    for segment in segments:
        text = str(segment["text"]).strip()
        if text:
            start = timestamp(float(segment["start"]), separator=separator)
            end = timestamp(float(segment["end"]), separator=separator)
            cues.append(f"{start} --> {end}\n{text}\n")
    return cues


def to_srt(segments: Iterable[Segment]) -> str:
    """SubRip text: numbered cues from 1, times ``HH:MM:SS,mmm``, a blank line between cues.

    Args:
        segments: Mappings with ``start``, ``end`` (seconds) and ``text``; segments with empty text are skipped.

    Returns:
        The ``.srt`` file's text (empty when there is no cue).
    """
    return "\n".join(f"{i}\n{cue}" for i, cue in enumerate(_cues(segments, ","), 1))


def to_vtt(segments: Iterable[Segment]) -> str:
    """WebVTT text: the ``WEBVTT`` header, then cues with times ``HH:MM:SS.mmm``.

    Args:
        segments: Mappings with ``start``, ``end`` (seconds) and ``text``; segments with empty text are skipped.

    Returns:
        The ``.vtt`` file's text.
    """
    return "\n".join(["WEBVTT\n", *_cues(segments, ".")])
