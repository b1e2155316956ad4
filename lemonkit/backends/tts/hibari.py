"""The ``hibari`` recipe: Hibari (``hibari-tts``), a 7.9 MB English model distilled from Kokoro, 24 kHz.

Every Hibari voice is a whole model file; the package ships ``heart`` (American English, female) as
``hibari/assets/hibari.onnx``, which ``Hibari-Bundled`` loads. A model file the package's voice registry
names (``bf_emma.int8.onnx``...) speaks as that voice, with that voice's (British or American) G2P; any other
ONNX file with Hibari's inputs and outputs speaks as ``heart``. The package downloads other voices on demand from
the hub; lemonkit never lets it (a voice is a model: register and pull it).

``speed`` is the model's own input, 0.5 to 2.0; ``seed`` fixes the noise of its vocoder.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from lemonkit.backends.protocol import LoadSpec
from lemonkit.backends.tts import SpeechEngine, package_version
from lemonkit.errors import ModelLoadError

__all__ = ["HibariEngine"]


class HibariEngine(SpeechEngine):
    """One Hibari voice model (see :class:`~lemonkit.backends.tts.SpeechEngine`).

    Args:
        spec: ``model_path`` (the ``.onnx`` file, or a directory holding one), ``options.n_threads``.

    Raises:
        ModelLoadError: No model file, or onnxruntime cannot load it.
    """

    speed_range = (0.5, 2.0)

    def __init__(self, spec: LoadSpec) -> None:
        super().__init__(spec)
        from hibari import SAMPLE_RATE, Hibari
        from hibari.voices import DEFAULT, VOICES

        path = Path(spec["model_path"])
        if path.is_dir():
            found = sorted(path.rglob("*.onnx"))
            if len(found) != 1:
                raise ModelLoadError(f"{path} must hold one Hibari .onnx model, found {len(found)}")
            path = found[0]
        voice = next((name for name, v in VOICES.items() if v["file"] == path.name), DEFAULT)
        try:
            self._tts = Hibari(voice=voice, model=str(path), threads=self.n_threads)
        except Exception as exc:  # onnxruntime's own errors
            raise ModelLoadError(f"hibari could not load {path}: {exc}") from exc
        self.sample_rate = SAMPLE_RATE
        self.voice_genders = {voice: VOICES[voice]["gender"]}
        self.engine = f"hibari-tts-{package_version('hibari-tts')}"

    def synthesize(self, text: str, voice: str, speed: float, seed: int | None) -> np.ndarray:
        result: np.ndarray = self._tts(text, speed=speed, seed=seed)
        return result
