"""The options chain, the automatic context size and the checks on a saved change (lemonkit.catalog.recipe_options)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lemonkit.catalog.config import Settings
from lemonkit.catalog.recipe_options import (
    DEFAULT_CTX_SIZE,
    apply_changes,
    check_runnable,
    is_unset,
    llamacpp_context_size,
    load_body,
    parse_changes,
    resolve_options,
    resolved_ctx_size,
)
from lemonkit.catalog.registry import ModelInfo
from lemonkit.errors import InvalidArgument


def _info(**recipe_options: object) -> ModelInfo:
    return ModelInfo(id="m", checkpoint="o/r:Q4_0", recipe="llamacpp", recipe_options=recipe_options)


def _settings(tmp_path: Path, ctx_size: int | None = None, llamacpp_args: str = "") -> Settings:
    return Settings(cache_dir=tmp_path, ctx_size=ctx_size, llamacpp_args=llamacpp_args)


def test_chain_lowest_to_highest(tmp_path: Path) -> None:
    settings = _settings(tmp_path, ctx_size=8192, llamacpp_args="--seed 1")
    info = _info(llamacpp_args="--seed 2")
    resolved = resolve_options(info, settings, {})
    assert resolved.defaults == {
        "ctx_size": 8192,
        "llamacpp_backend": "cpu",
        "llamacpp_args": "--seed 2",
        "merge_args": True,
    }
    assert resolved.effective == resolved.defaults
    resolved = resolve_options(info, settings, {"ctx_size": -1, "pinned": True}, {"llamacpp_args": "--seed 3"})
    assert resolved.effective == {
        "ctx_size": -1,
        "llamacpp_backend": "cpu",
        "llamacpp_args": "--seed 3",
        "merge_args": True,
    }
    assert resolved.defaults["ctx_size"] == 8192  # what erasing the saved entry gives back


def test_unset_spellings_fall_through(tmp_path: Path) -> None:
    saved = {"llamacpp_backend": "auto", "llamacpp_args": "", "ctx_size": None, "steps": 20}
    resolved = resolve_options(_info(), _settings(tmp_path, llamacpp_args="--seed 1"), saved, {"llamacpp_args": -1})
    assert resolved.effective == {
        "ctx_size": -1,
        "llamacpp_backend": "cpu",
        "llamacpp_args": "--seed 1",
        "merge_args": True,
    }
    assert is_unset("ctx_size", None) and not is_unset("ctx_size", -1) and not is_unset("ctx_size", "")
    assert is_unset("llamacpp_args", -1.0) and not is_unset("llamacpp_args", False)
    # a boolean has no "auto": only null leaves merge_args to the next layer
    assert is_unset("merge_args", None) and not is_unset("merge_args", False)
    assert not any(is_unset("merge_args", v) for v in (-1, "", "auto"))


# -- merge_args ---------------------------------------------------------------------------------------------------

SERVER_ARGS = "-t 1 --no-mmap --top-k 30 -np 2"


@pytest.mark.parametrize(
    ("model_args", "merged"),
    [
        # the same flag under another spelling replaces the server's; flags only the server sets stay, first
        ("--threads 2", "--no-mmap --top-k 30 -np 2 --threads 2"),
        ("--top-k=5 -t 3", "--no-mmap -np 2 --top-k=5 -t 3"),
        # opposite switches set one thing: the model's --mmap replaces the server's --no-mmap
        ("--mmap", "-t 1 --top-k 30 -np 2 --mmap"),
        ("--parallel 1 --seed 4", "-t 1 --no-mmap --top-k 30 --parallel 1 --seed 4"),
        # quoting survives the merge
        ("--chat-template '{{ x }}'", "-t 1 --no-mmap --top-k 30 -np 2 --chat-template '{{ x }}'"),
    ],
)
def test_merge_args_merges_per_flag(tmp_path: Path, model_args: str, merged: str) -> None:
    settings = _settings(tmp_path, llamacpp_args=SERVER_ARGS)
    for row, saved, request in (
        ({"llamacpp_args": model_args}, {}, {}),
        ({}, {"llamacpp_args": model_args}, {}),
        ({"llamacpp_args": "--seed 9"}, {"llamacpp_args": "--top-p 0.5"}, {"llamacpp_args": model_args}),
    ):
        # the model's string is its highest layer's, whole: only the server's string merges under it
        resolved = resolve_options(_info(**row), settings, saved, request)
        assert resolved.effective["llamacpp_args"] == merged and resolved.effective["merge_args"] is True
    from lemonkit.formats.llamacpp_args import parse_llamacpp_args

    # what the engine makes of the merged string is what the server's then the model's flags make
    assert parse_llamacpp_args(merged) == parse_llamacpp_args(f"{SERVER_ARGS} {model_args}")


def test_merge_args_layers(tmp_path: Path) -> None:
    settings = _settings(tmp_path, llamacpp_args="-t 1 --no-mmap")
    info = _info(llamacpp_args="-t 2")
    resolved = resolve_options(info, settings, {})
    assert resolved.defaults["llamacpp_args"] == resolved.effective["llamacpp_args"] == "--no-mmap -t 2"
    # merge_args false: the model's string replaces the server's entirely, from whichever layer says so
    for saved, request in (
        ({"merge_args": False}, {}),
        ({}, {"merge_args": False}),
        ({"merge_args": True}, {"merge_args": False}),
    ):
        resolved = resolve_options(info, settings, saved, request)
        assert resolved.effective["llamacpp_args"] == "-t 2" and resolved.effective["merge_args"] is False
        assert resolved.defaults == {**resolved.effective, "llamacpp_args": "--no-mmap -t 2", "merge_args": True}
    # the request's true beats a saved false; null and the other unset spellings fall through to the layer below
    assert resolve_options(info, settings, {"merge_args": False}, {"merge_args": True}).effective["merge_args"] is True
    assert resolve_options(info, settings, {"merge_args": False}, {"merge_args": None}).effective["merge_args"] is False
    # without a model string the server's applies whole either way, and without a server string the model's
    for merge in (True, False):
        assert (
            resolve_options(_info(), settings, {}, {"merge_args": merge}).effective["llamacpp_args"] == "-t 1 --no-mmap"
        )
    assert resolve_options(info, _settings(tmp_path), {}).effective["llamacpp_args"] == "-t 2"
    # a merged string posted back as the model's resolves to itself (the options routes' effective replays)
    assert (
        resolve_options(_info(llamacpp_args="--no-mmap -t 2"), settings, {}).effective["llamacpp_args"]
        == "--no-mmap -t 2"
    )


@pytest.mark.parametrize(
    ("server", "model"),
    [("-t 1", "--bogus"), ("-t 1", "-t"), ("-t 1", "--seed 'open"), ("-t 1", "--ctx-size 5")],
)
def test_unmergeable_args_are_refused_at_the_load(tmp_path: Path, server: str, model: str) -> None:
    resolved = resolve_options(_info(), _settings(tmp_path, llamacpp_args=server), {}, {"llamacpp_args": model})
    # resolving never fails (the options routes still describe the model), the load's check refuses it
    assert resolved.effective["llamacpp_args"] == f"{server} {model}"
    with pytest.raises(InvalidArgument, match="llamacpp_args"):
        check_runnable(resolved.effective)


def test_bad_server_wide_args_are_refused_at_start(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"LEMONADE_LLAMACPP_ARGS.*--bogus"):
        _settings(tmp_path, llamacpp_args="-t 1 --bogus")


def test_merging_imports_no_inference_library() -> None:
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from lemonkit.catalog.config import Settings\n"
        "from lemonkit.catalog.recipe_options import resolve_options\n"
        "from lemonkit.catalog.registry import ModelInfo\n"
        "info = ModelInfo(id='m', checkpoint='o/r:Q4_0', recipe='llamacpp', recipe_options={'llamacpp_args': '-t 2'})\n"
        "settings = Settings(cache_dir=Path('.'), llamacpp_args='--threads 1 --no-mmap')\n"
        "assert resolve_options(info, settings, {}).effective['llamacpp_args'] == '--no-mmap -t 2'\n"
        "assert 'llama_cpp' not in sys.modules, 'llama_cpp imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parent)


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


@pytest.mark.parametrize(
    ("ctx_size", "n_ctx_train", "limit", "expected"),
    [
        (-1, 32768, 16384, 16384),  # the memory's cap
        (None, 8192, 10**6, 8192),  # room for all of it: the trained context
        (0, 32768, 4096, 32768),  # 0 asks for the whole trained context, whatever the memory
        (2048, 32768, 10**6, 2048),  # a number is itself
    ],
)
def test_an_automatic_context_is_the_trained_one_within_memory(
    ctx_size: int | None, n_ctx_train: int, limit: int, expected: int
) -> None:
    assert llamacpp_context_size(ctx_size, n_ctx_train, auto_limit=limit) == expected


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
    # merge_args: false is a value to save, null removes it
    assert parse_changes("llamacpp", {"merge_args": False}) == ({"merge_args": False}, False)
    assert parse_changes("llamacpp", {"merge_args": None}) == ({"merge_args": None}, False)
    assert apply_changes({"merge_args": False, "pinned": True}, {"merge_args": None}) == {"pinned": True}
    assert load_body("x", {"ctx_size": 1, "a": 2}) == {"a": 2, "ctx_size": 1, "model_name": "x"}


@pytest.mark.parametrize(
    "body",
    [
        {"pinned": True},
        {"whispercpp_args": "x"},
        {"ctx_size": 0},
        {"ctx_size": "auto"},
        {"llamacpp_args": "--bogus"},
        {"llamacpp_args": "--ctx-size 5"},
        {"merge_args": "auto"},  # only null removes a boolean
        {"merge_args": ""},
        {"merge_args": -1},
        {"merge_args": 0},
        {"merge_args": "false"},
    ],
)
def test_parse_changes_refuses(body: dict[str, object]) -> None:
    with pytest.raises(InvalidArgument):
        parse_changes("llamacpp", body)
