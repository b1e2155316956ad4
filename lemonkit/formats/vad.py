"""A small energy (RMS) voice activity detector: where speech starts and stops in a stream of samples.

The realtime WebSocket's server VAD (spec: ``WS /realtime``, "VAD Configuration") and the live route's utterance
cuts. Audio is judged in 10 ms frames: a frame is voiced when its RMS reaches ``threshold``. Speech starts once a
run of voiced frames, with gaps shorter than ``silence_duration_ms``, holds ``prefix_padding_ms`` of voiced audio
(a click or a cough is not speech); it stops after ``silence_duration_ms`` without a voiced frame.

Pure numpy on tiny arrays (one frame's sum of squares each): cheap enough for an event loop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from lemonkit.errors import InvalidArgument

__all__ = ["FRAME_MS", "RmsVad", "VadEvent", "VadSettings"]

#: the length of the frames whose energy is judged
FRAME_MS = 10


@dataclass(frozen=True)
class VadSettings:
    """``turn_detection`` of a realtime session; the defaults are the spec's."""

    threshold: float = 0.01
    silence_duration_ms: int = 800
    prefix_padding_ms: int = 250

    def updated(self, changes: dict[str, Any]) -> VadSettings:
        """These settings with the fields of a ``turn_detection`` object applied (unknown keys, like OpenAI's
        ``type``, are ignored).

        Raises:
            InvalidArgument: A value is not a non-negative number (``threshold`` below 1).
        """
        values = {
            "threshold": self.threshold,
            "silence_duration_ms": self.silence_duration_ms,
            "prefix_padding_ms": self.prefix_padding_ms,
        }
        for name in values:
            if name not in changes:
                continue
            value = changes[name]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise InvalidArgument(f"turn_detection.{name}: expected a non-negative number, got {value!r}")
            values[name] = value
        if values["threshold"] >= 1:
            raise InvalidArgument(f"turn_detection.threshold: an RMS level below 1, got {values['threshold']!r}")
        return VadSettings(
            float(values["threshold"]), int(values["silence_duration_ms"]), int(values["prefix_padding_ms"])
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "type": "server_vad",
            "threshold": self.threshold,
            "silence_duration_ms": self.silence_duration_ms,
            "prefix_padding_ms": self.prefix_padding_ms,
        }


class VadEvent(NamedTuple):
    """``kind`` ``"start"`` or ``"stop"`` at ``sample`` (counted from the first sample fed).

    A start is reported where its run of speech began (earlier than the sample that confirmed it); a stop where
    the silence that ended it began.
    """

    kind: str
    sample: int


class RmsVad:
    """Speech boundaries in mono float32 samples fed in pieces of any size.

    Args:
        settings: Threshold and durations.
        sample_rate: Samples per second of what is fed.
    """

    def __init__(self, settings: VadSettings, sample_rate: int) -> None:
        self.settings = settings
        self.frame = max(1, sample_rate * FRAME_MS // 1000)
        self._needed = max(1, math.ceil(settings.prefix_padding_ms / FRAME_MS))
        self._patience = max(1, math.ceil(settings.silence_duration_ms / FRAME_MS))
        self._pending = np.zeros(0, dtype=np.float32)
        self._position = 0  # sample index of the first pending sample
        self.speaking = False
        self._run_start: int | None = None  # first voiced sample of the run being judged (or spoken)
        self._voiced = 0  # voiced frames in that run
        self._silent = 0  # frames since the last voiced one
        self._silence_start = 0

    @property
    def candidate_start(self) -> int | None:
        """Where the run of voiced audio now being judged (or spoken) began, if there is one."""
        return self._run_start

    def feed(self, samples: np.ndarray) -> list[VadEvent]:
        """Judge ``samples``, which follow what was fed before; the boundaries they complete, in order."""
        audio = np.concatenate([self._pending, samples]) if self._pending.size else samples
        whole = len(audio) // self.frame * self.frame
        events: list[VadEvent] = []
        if whole:
            frames = audio[:whole].reshape(-1, self.frame).astype(np.float64)
            voiced = np.sqrt(np.mean(frames * frames, axis=1)) >= self.settings.threshold
            for i, is_voiced in enumerate(voiced.tolist()):
                event = self._frame(self._position + i * self.frame, is_voiced)
                if event is not None:
                    events.append(event)
        self._pending = np.array(audio[whole:], dtype=np.float32)
        self._position += whole
        return events

    def _frame(self, start: int, voiced: bool) -> VadEvent | None:
        if voiced:
            if self._run_start is None:
                self._run_start = start
            self._voiced += 1
            self._silent = 0
            if not self.speaking and self._voiced >= self._needed:
                self.speaking = True
                return VadEvent("start", self._run_start)
            return None
        if self._run_start is None:
            return None
        if self._silent == 0:
            self._silence_start = start
        self._silent += 1
        if self._silent < self._patience:
            return None
        was_speaking = self.speaking
        self.speaking, self._run_start, self._voiced, self._silent = False, None, 0, 0
        return VadEvent("stop", self._silence_start) if was_speaking else None

    def reset(self) -> None:
        """Forget any speech in progress (the buffer was cleared or committed by hand)."""
        self.speaking, self._run_start, self._voiced, self._silent = False, None, 0, 0
