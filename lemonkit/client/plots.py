"""Matplotlib figures of the Python API's results: the word-timing plot of a transcript (``Transcript.plot()``, and
the picture the transcription panel shows)."""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from lemonkit.client.transcripts import Transcript

__all__ = ["png", "word_timing"]

#: the waveform is drawn as a min/max envelope over this many columns (a minute at 16 kHz is ~1M samples)
_ENVELOPE_COLUMNS = 2000


def _envelope(samples: np.ndarray, rate: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Times, lows and highs of the waveform in at most ``_ENVELOPE_COLUMNS`` columns."""
    width = max(1, len(samples) // _ENVELOPE_COLUMNS)
    usable = len(samples) - len(samples) % width or len(samples)
    blocks = samples[:usable].reshape(-1, width)
    times = (np.arange(len(blocks)) * width + width / 2) / rate
    return times, blocks.min(axis=1), blocks.max(axis=1)


def word_timing(transcript: Transcript, ax: Axes | None = None) -> Figure:
    """The waveform with each word as a band over its time, shaded by confidence (dark: sure), its text above.

    Args:
        transcript: The words to draw (its audio, when it kept it).
        ax: Draw into these axes (default: a new figure, closed in pyplot so that a notebook shows it once: as the
            cell's value).

    Returns:
        The figure drawn into.
    """
    import matplotlib.pyplot as plt
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    if ax is None:
        created, ax = plt.subplots(figsize=(10, 3), layout="constrained")
        plt.close(created)
    figure = ax.get_figure(root=True)
    assert isinstance(figure, Figure)
    clip = transcript.audio
    end = max([transcript.duration or 0.0, *(w.end for w in transcript.words)])
    peak = 1.0
    if clip is not None:
        times, lows, highs = _envelope(clip.samples, clip.sample_rate)
        peak = float(max(np.abs(lows).max(), np.abs(highs).max(), 1e-3))
        ax.fill_between(times, lows, highs, color="0.35", linewidth=0, zorder=3, label="waveform")
        end = max(end, clip.duration)
    shades = colormaps["Blues"]
    for i, word in enumerate(transcript.words):
        confidence = 1.0 if word.confidence is None else word.confidence
        ax.axvspan(word.start, word.end, color=shades(0.25 + 0.7 * confidence), alpha=0.55, linewidth=0)
        height = peak * (1.08 if i % 2 == 0 else 1.28)  # alternate rows: neighbouring short words stay readable
        ax.text((word.start + word.end) / 2, height, word.word, ha="center", va="bottom", fontsize=8)
    ax.set_xlim(0, end or 1.0)
    ax.set_ylim(-peak * 1.1, peak * 1.55)
    ax.set_xlabel("time (s)")
    ax.set_yticks([])
    title = f"{transcript.model} · " if transcript.model else ""
    ax.set_title(f"{title}{len(transcript.words)} words (band shade: confidence)", fontsize=9)
    return figure


def png(figure: Figure, dpi: int = 100) -> bytes:
    """``figure`` as PNG bytes."""
    out = io.BytesIO()
    figure.savefig(out, format="png", dpi=dpi)
    return out.getvalue()
