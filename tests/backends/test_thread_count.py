"""Every engine takes its threads through one check (``backends.protocol.thread_count``): the option, else a ``-t``
among its arguments, else one per physical core; anything but a positive integer is a 400 before a model loads."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import psutil
import pytest

from lemonkit.backends.onnx_embeddings import OnnxEmbeddingEngine
from lemonkit.backends.protocol import physical_cores, positive_option, thread_count
from lemonkit.errors import InvalidArgument


def test_the_option_then_the_fallback_then_the_physical_cores() -> None:
    assert physical_cores() == (psutil.cpu_count(logical=False) or psutil.cpu_count())
    assert thread_count({"n_threads": 3}, 5) == 3
    assert thread_count({}, 5) == 5
    assert thread_count({"n_threads": None}) == physical_cores()
    assert positive_option({"tile": 0}, "tile", 7) == 7  # 0 asks for the default, as llama.cpp's -t 0 does


@pytest.mark.parametrize("value", [-1, 1.5, "2", True, [2]])
def test_anything_but_a_positive_integer_is_refused_by_name(value: Any) -> None:
    with pytest.raises(
        InvalidArgument, match=re.escape(f"n_threads must be a positive integer, got {value!r}")
    ) as caught:
        thread_count({"n_threads": value})
    assert caught.value.status == 400 and caught.value.code == "invalid_argument"


def test_an_engine_refuses_bad_threads_before_it_loads(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="n_threads must be a positive integer"):
        OnnxEmbeddingEngine({"model_path": str(tmp_path), "type": "embedding", "options": {"n_threads": "many"}})
