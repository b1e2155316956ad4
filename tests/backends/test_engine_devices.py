"""Which device faster-whisper, ONNX Runtime and diffusers run on: what their installed builds report.

This project's machines have no GPU, so the real libraries answer "CPU" here (checked first); the GPU choices are
checked against stand-ins that report what a CUDA, ROCm or Apple build reports.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from lemonkit.backends.engine_devices import ctranslate2_device, onnx_providers, torch_device


def test_this_machine_keeps_every_engine_on_the_cpu() -> None:
    ctranslate2 = pytest.importorskip("ctranslate2")
    onnxruntime = pytest.importorskip("onnxruntime")
    if ctranslate2.get_cuda_device_count() == 0:
        assert ctranslate2_device(ctranslate2) == ("cpu", "default")
    if set(onnxruntime.get_available_providers()) <= {"CPUExecutionProvider", "AzureExecutionProvider"}:
        choice = onnx_providers(onnxruntime)
        assert (choice.providers, choice.device) == (["CPUExecutionProvider"], "cpu")


def _ct2(gpus: int, types: set[str]) -> Any:
    return SimpleNamespace(get_cuda_device_count=lambda: gpus, get_supported_compute_types=lambda device: types)


def test_ctranslate2_on_cuda_in_half_precision() -> None:
    assert ctranslate2_device(_ct2(1, {"float32", "float16", "int8_float16"}), {}) == ("cuda", "float16")
    assert ctranslate2_device(_ct2(1, {"float32", "int8_float16"}), {}) == ("cuda", "int8_float16")
    assert ctranslate2_device(_ct2(0, set()), {}) == ("cpu", "default")
    assert ctranslate2_device(_ct2(1, {"float16"}), {"LEMONKIT_ENGINE_DEVICE": "cpu"}) == ("cpu", "default")


@pytest.mark.parametrize(
    ("available", "first", "device"),
    [
        (["CUDAExecutionProvider", "CPUExecutionProvider"], "CUDAExecutionProvider", "gpu"),
        (["ROCMExecutionProvider", "CPUExecutionProvider"], "ROCMExecutionProvider", "gpu"),
        (["CoreMLExecutionProvider", "CPUExecutionProvider"], "CoreMLExecutionProvider", "gpu"),
        (["TensorrtExecutionProvider", "CPUExecutionProvider"], "CPUExecutionProvider", "cpu"),  # needs set-up
        (["CPUExecutionProvider"], "CPUExecutionProvider", "cpu"),
    ],
)
def test_onnxruntime_takes_the_gpu_provider_its_build_has(available: list[str], first: str, device: str) -> None:
    choice = onnx_providers(SimpleNamespace(get_available_providers=lambda: available), {})
    assert choice.providers[0] == first and choice.providers[-1] == "CPUExecutionProvider"
    assert choice.device == device


def _torch(cuda: bool, mps: bool) -> Any:
    return SimpleNamespace(
        cuda=SimpleNamespace(is_available=lambda: cuda),
        backends=SimpleNamespace(mps=SimpleNamespace(is_available=lambda: mps)),
    )


def test_torch_on_cuda_or_mps_in_float16() -> None:
    assert (torch_device(_torch(True, False), {}).device, torch_device(_torch(True, False), {}).dtype) == (
        "cuda",
        "float16",
    )
    assert torch_device(_torch(False, True), {}).device == "mps"
    assert (torch_device(_torch(False, False), {}).device, torch_device(_torch(False, False), {}).dtype) == (
        "cpu",
        "float32",
    )
    assert torch_device(_torch(True, True), {"LEMONKIT_ENGINE_DEVICE": "cpu"}).device == "cpu"
