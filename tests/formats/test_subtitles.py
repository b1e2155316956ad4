"""SubRip and WebVTT from transcript segments (lemonkit.formats.subtitles)."""

from __future__ import annotations

from lemonkit.formats.subtitles import timestamp, to_srt, to_vtt

SEGMENTS = [
    {"start": 0.0, "end": 2.5, "text": " Hello there."},
    {"start": 2.5, "end": 2.9, "text": "  "},  # no words: no cue
    {"start": 3661.0016, "end": 3662.25, "text": " An hour later."},
]


def test_timestamps_round_to_milliseconds() -> None:
    assert timestamp(0) == "00:00:00,000"
    assert timestamp(3661.0016) == "01:01:01,002"
    assert timestamp(59.9996, separator=".") == "00:01:00.000"
    assert timestamp(-0.2) == "00:00:00,000"


def test_srt() -> None:
    assert to_srt(SEGMENTS) == (
        "1\n00:00:00,000 --> 00:00:02,500\nHello there.\n\n2\n01:01:01,002 --> 01:01:02,250\nAn hour later.\n"
    )
    assert to_srt([]) == ""


def test_vtt() -> None:
    assert to_vtt(SEGMENTS) == (
        "WEBVTT\n\n00:00:00.000 --> 00:00:02.500\nHello there.\n\n01:01:01.002 --> 01:01:02.250\nAn hour later.\n"
    )
    assert to_vtt([]) == "WEBVTT\n"
