"""The options chain, the automatic context size and the checks on a saved change (lemonkit.options)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lemonkit.config import Settings
from lemonkit.errors import InvalidArgument
from lemonkit.options import (
    DEFAULT_CTX_SIZE,
    apply_changes,
    is_unset,
    llamacpp_context_size,
    load_body,
    parse_changes,
    resolve_options,
    resolved_ctx_size,
)
from lemonkit.registry import ModelInfo


def _info(**recipe_options: object) -> ModelInfo:
    return ModelInfo(id="m", checkpoint="o/r:Q4_0", recipe="llamacpp", recipe_options=recipe_options)


def _settings(tmp_path: Path, ctx_size: int | None = None, llamacpp_args: str = "") -> Settings:
    return Settings(cache_dir=tmp_path, ctx_size=ctx_size, llamacpp_args=llamacpp_args)


def test_chain_lowest_to_highest(tmp_path: Path) -> None:
    settings = _settings(tmp_path, ctx_size=8192, llamacpp_args="--seed 1")
    info = _info(llamacpp_args="--seed 2")
    resolved = resolve_options(info, settings, {})
    assert resolved.defaults == {"ctx_size": 8192, "llamacpp_backend": "cpu", "llamacpp_args": "--seed 2"}
    assert resolved.effective == resolved.defaults
    resolved = resolve_options(info, settings, {"ctx_size": -1, "pinned": True}, {"llamacpp_args": "--seed 3"})
    assert resolved.effective == {"ctx_size": -1, "llamacpp_backend": "cpu", "llamacpp_args": "--seed 3"}
    assert resolved.defaults["ctx_size"] == 8192  # what erasing the saved entry gives back


def test_unset_spellings_fall_through(tmp_path: Path) -> None:
    saved = {"llamacpp_backend": "auto", "llamacpp_args": "", "ctx_size": None, "steps": 20}
    resolved = resolve_options(_info(), _settings(tmp_path, llamacpp_args="--seed 1"), saved, {"llamacpp_args": -1})
    assert resolved.effective == {"ctx_size": -1, "llamacpp_backend": "cpu", "llamacpp_args": "--seed 1"}
    assert is_unset("ctx_size", None) and not is_unset("ctx_size", -1) and not is_unset("ctx_size", "")
    assert is_unset("llamacpp_args", -1.0) and not is_unset("llamacpp_args", False)


@pytest.mark.parametrize(
    ("ctx_size", "n_ctx_train", "expected"),
    [
        (-1, 32768, DEFAULT_CTX_SIZE),  # capped
        (None, 512, 512),  # a small trained context is used whole
        (-1, 300, 512),  # padded to 256
        (-1, None, DEFAULT_CTX_SIZE),  # unknown
        (0, 32768, 32768),  # 0: the whole trained context
        (1000, 32768, 1024),
    ],
)
def test_llamacpp_context_size(ctx_size: int | None, n_ctx_train: int | None, expected: int) -> None:
    assert llamacpp_context_size(ctx_size, n_ctx_train) == expected


def test_resolved_ctx_size() -> None:
    info = _info()
    assert resolved_ctx_size(info, {"ctx_size": -1}, 512) == 512
    assert resolved_ctx_size(info, {"ctx_size": 1000}, 512) == 1000  # the spec: the effective value itself
    assert resolved_ctx_size(info, {}, 512) is None


def test_parse_and_apply_changes() -> None:
    changes, dry_run = parse_changes(
        "llamacpp", {"model_name": "x", "ctx_size": 4096.0, "llamacpp_args": "", "llamacpp_backend": None}
    )
    assert changes == {"ctx_size": 4096, "llamacpp_args": None, "llamacpp_backend": None} and not dry_run
    assert isinstance(changes["ctx_size"], int)
    saved = {"llamacpp_args": "--seed 1", "pinned": True}
    assert apply_changes(saved, changes) == {"ctx_size": 4096, "pinned": True}
    assert parse_changes("llamacpp", {"dry_run": True}) == ({}, True)
    assert load_body("x", {"ctx_size": 1, "a": 2}) == {"a": 2, "ctx_size": 1, "model_name": "x"}


@pytest.mark.parametrize(
    "body",
    [
        {"pinned": True},
        {"whispercpp_args": "x"},
        {"ctx_size": 0},
        {"ctx_size": "auto"},
        {"llamacpp_backend": "vulkan"},
        {"llamacpp_args": "--bogus"},
        {"llamacpp_args": "--ctx-size 5"},
    ],
)
def test_parse_changes_refuses(body: dict[str, object]) -> None:
    with pytest.raises(InvalidArgument):
        parse_changes("llamacpp", body)
