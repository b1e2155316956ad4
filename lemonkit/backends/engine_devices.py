"""Which device the engines other than llama.cpp run on: what their installed build offers, asked of the library.

faster-whisper (CTranslate2), ONNX Runtime and diffusers (torch) each ship CPU and GPU builds; an engine uses the
GPU its installed build can reach, in half precision where that is the GPU's fast path, and the CPU everywhere
else, as before. ``LEMONKIT_ENGINE_DEVICE=cpu`` keeps every one of them on the CPU (a GPU left to llama.cpp). Each
reports the device it chose in ``/v1/health``. The ONNX engines (embeddings, Kokoro, Piper) open their sessions
here too (:func:`onnx_session`), so that they run alike.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["OnnxChoice", "TorchChoice", "ctranslate2_device", "onnx_providers", "onnx_session", "torch_device"]

#: ONNX Runtime's providers lemonkit uses, best first; TensorRT and OpenVINO need set-up of their own
_ONNX_GPU = ("CUDAExecutionProvider", "ROCMExecutionProvider", "DmlExecutionProvider", "CoreMLExecutionProvider")


def _cpu_only(environ: Mapping[str, str] | None) -> bool:
    return (os.environ if environ is None else environ).get("LEMONKIT_ENGINE_DEVICE", "auto").lower() == "cpu"


def ctranslate2_device(ctranslate2: Any, environ: Mapping[str, str] | None = None) -> tuple[str, str]:
    """``(device, compute_type)`` for a CTranslate2 model: CUDA in float16 (int8 with float16 where the GPU has no
    fast float16) when the installed CTranslate2 sees a GPU, else the CPU with its default type."""
    if _cpu_only(environ) or ctranslate2.get_cuda_device_count() < 1:
        return "cpu", "default"
    types = set(ctranslate2.get_supported_compute_types("cuda"))
    for compute_type in ("float16", "int8_float16", "float32"):
        if compute_type in types:
            return "cuda", compute_type
    return "cuda", "default"


@dataclass(frozen=True)
class OnnxChoice:
    """ONNX Runtime's execution providers for a session, and the device they mean for ``/v1/health``."""

    providers: list[str]
    device: str


def onnx_providers(onnxruntime: Any, environ: Mapping[str, str] | None = None) -> OnnxChoice:
    """The best GPU provider the installed ONNX Runtime offers (``onnxruntime-gpu``: CUDA; ROCm, DirectML or
    CoreML builds theirs), with the CPU after it for the operators it lacks; the CPU alone otherwise."""
    available = set(onnxruntime.get_available_providers())
    gpu = [] if _cpu_only(environ) else [p for p in _ONNX_GPU if p in available]
    if gpu:
        return OnnxChoice([gpu[0], "CPUExecutionProvider"], "gpu")
    return OnnxChoice(["CPUExecutionProvider"], "cpu")


def onnx_session(onnxruntime: Any, model: str | os.PathLike[str], threads: int) -> tuple[Any, OnnxChoice]:
    """An ONNX Runtime session of ``model`` on :func:`onnx_providers`' choice, and that choice: ``threads`` within
    an operator, one operator at a time, errors only in its log (the shape-merge warnings of hand-built graphs are
    noise). The one way every ONNX engine opens its model."""
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    placed = onnx_providers(onnxruntime)
    return onnxruntime.InferenceSession(str(model), options, providers=placed.providers), placed


@dataclass(frozen=True)
class TorchChoice:
    """torch's device for a pipeline and its dtype's name."""

    device: str
    dtype: str


def torch_device(torch: Any, environ: Mapping[str, str] | None = None) -> TorchChoice:
    """CUDA (NVIDIA, or AMD through ROCm's torch) or Apple's MPS in float16 where torch reaches one, else the CPU
    in float32 (half precision on a CPU is slower and less exact)."""
    if not _cpu_only(environ):
        if torch.cuda.is_available():
            return TorchChoice("cuda", "float16")
        mps = getattr(torch.backends, "mps", None)
        if mps is not None and mps.is_available():
            return TorchChoice("mps", "float16")
    return TorchChoice("cpu", "float32")
