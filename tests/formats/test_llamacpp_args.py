"""``llamacpp_args`` strings: the flag table, and the one forbidden-flag list the schema and the engine share."""

from __future__ import annotations

import shlex

import pytest

from lemonkit.errors import InvalidArgument
from lemonkit.formats import llamacpp_args, schemas
from lemonkit.formats.llamacpp_args import FORBIDDEN_LLAMACPP_FLAGS, merge_llamacpp_args, parse_llamacpp_args
from lemonkit.formats.schemas import validate


def test_parse_llamacpp_args():
    args = parse_llamacpp_args("--flash-attn off --no-mmap -t 4 -b 256 --temp 0.7 --top-k=20 -ctk q8_0 -np 2 -fa")
    assert args == {
        "flash_attn": True,
        "use_mmap": False,
        "n_threads": 4,
        "n_batch": 256,
        "temperature": 0.7,
        "top_k": 20,
        "type_k": 8,
        "n_parallel": 2,
    }
    assert parse_llamacpp_args("") == {}
    assert parse_llamacpp_args("-fa auto --seed 5")["seed"] == 5
    assert parse_llamacpp_args("-nr --no-batch-invariant") == {"repack": False, "batch_invariant": False}
    assert parse_llamacpp_args("--no-repack --repack --batch-invariant") == {"repack": True, "batch_invariant": True}
    assert merge_llamacpp_args("--no-batch-invariant -t 2", "--batch-invariant") == "-t 2 --batch-invariant"
    for bad in (
        "--frobnicate",
        "-t",
        "-t four",
        "--ctx-size 512",
        "-m x.gguf",
        "--mmproj a",
        "-fa sometimes",
        "--cache-type-k q9",
        "'unclosed",
    ):
        with pytest.raises(InvalidArgument):
            parse_llamacpp_args(bad)


def test_load_mode_sets_mmap_and_mlock_in_order() -> None:
    # llama-server's --load-mode replaced --[no-]mmap and --mlock; either spelling works, the last one wins
    assert parse_llamacpp_args("-lm none") == {"use_mmap": False, "use_mlock": False}
    assert parse_llamacpp_args("--load-mode=mmap+mlock") == {"use_mmap": True, "use_mlock": True}
    assert parse_llamacpp_args("--mlock -lm mmap") == {"use_mmap": True, "use_mlock": False}
    assert parse_llamacpp_args("-lm mlock --mmap") == {"use_mmap": True, "use_mlock": True}
    assert parse_llamacpp_args("--no-mmap -lm auto -t 2") == {"n_threads": 2}  # auto: the engine's default
    assert merge_llamacpp_args("--no-mmap --mlock -t 4", "-lm mmap") == "-t 4 -lm mmap"
    assert merge_llamacpp_args("-lm mlock", "--mmap") == "-lm mlock --mmap"
    with pytest.raises(InvalidArgument, match=r"bad value 'dio' for -lm \(one of auto, none, mmap, mlock"):
        parse_llamacpp_args("-lm dio")


def test_one_forbidden_list() -> None:
    assert schemas.FORBIDDEN_LLAMACPP_FLAGS is llamacpp_args.FORBIDDEN_LLAMACPP_FLAGS
    # a forbidden flag is not also one the parser would take
    known = set(llamacpp_args._VALUE_FLAGS) | set(llamacpp_args._SWITCHES) | {"-fa", "--flash-attn"}
    assert not FORBIDDEN_LLAMACPP_FLAGS & known


@pytest.mark.parametrize("flag", sorted(FORBIDDEN_LLAMACPP_FLAGS))
def test_schema_and_engine_refuse_the_same_flags(flag: str) -> None:
    args = f"--no-mmap {flag} x"
    with pytest.raises(InvalidArgument) as by_schema:
        validate("load", {"model_name": "m", "llamacpp_args": args})
    with pytest.raises(InvalidArgument) as by_parser:
        parse_llamacpp_args(args)
    with pytest.raises(InvalidArgument) as by_merge:
        merge_llamacpp_args("-t 2", args)
    message = f"llamacpp_args: {flag} is not allowed (lemonkit sets it)"
    assert by_schema.value.message == by_parser.value.message == by_merge.value.message == message


@pytest.mark.parametrize("flag", ["--model-draft-url", "-mdu", "--lora", "--chat-template-file"])
def test_flags_naming_server_files_are_forbidden(flag: str) -> None:
    # like the model and its mmproj, these come from the registry, never from a request: it would name a file on the
    # server
    assert flag in FORBIDDEN_LLAMACPP_FLAGS
    with pytest.raises(InvalidArgument, match="is not allowed"):
        validate("load", {"model_name": "m", "llamacpp_args": f"{flag}=/etc/passwd"})


@pytest.mark.parametrize("flag", ["--model-draft", "-md", "--spec-draft-model"])
@pytest.mark.parametrize("value", ["/etc/passwd", "../models/x.gguf", "x.gguf", "C:\\models\\x"])
def test_a_draft_model_is_named_as_a_registered_model_never_as_a_path(flag: str, value: str) -> None:
    with pytest.raises(InvalidArgument, match="registered model"):
        parse_llamacpp_args(f"{flag} {shlex.quote(value)}")
    assert parse_llamacpp_args(f"{flag} user.tiny-llama") == {"model_draft": "user.tiny-llama"}


def test_speculative_flags_take_llama_servers_spellings_old_and_new() -> None:
    new = parse_llamacpp_args(
        "--spec-type ngram-mod,draft-simple --spec-draft-n-max 8 --spec-draft-n-min 2 --spec-draft-p-min 0.5 "
        "--spec-ngram-simple-size-n 4 --spec-ngram-simple-size-m 24 --spec-ngram-mod-n-match 12 "
        "--spec-ngram-mod-n-min 3 --spec-ngram-mod-n-max 32"
    )
    assert new == {
        "spec_type": ("ngram-mod", "draft-simple"),
        "draft_max": 8,
        "draft_min": 2,
        "draft_p_min": 0.5,
        "ngram_n": 4,
        "ngram_m": 24,
        "ngram_mod_match": 12,
        "ngram_mod_min": 3,
        "ngram_mod_max": 32,
    }
    old = parse_llamacpp_args("--spec-type ngram-simple --draft-max 8 --draft-min 2 --draft-p-min 0.5")
    assert old == {"spec_type": ("ngram-simple",), "draft_max": 8, "draft_min": 2, "draft_p_min": 0.5}
    assert parse_llamacpp_args("--spec-type none")["spec_type"] == ()
    assert merge_llamacpp_args("--draft-max 4 -t 2", "--spec-draft-n-max 8") == "-t 2 --spec-draft-n-max 8"
    for bad in ("--spec-type draft-eagle3", "--spec-type ngram-simple,mystery", "--draft-p-min -0.1"):
        with pytest.raises(InvalidArgument):
            parse_llamacpp_args(bad)


def test_merge_replaces_flags_by_setting() -> None:
    assert merge_llamacpp_args("--threads 4 --no-mmap", "-t 2") == "--no-mmap -t 2"
    assert merge_llamacpp_args("--no-mmap -cb", "--mmap -nocb") == "--mmap -nocb"
    assert merge_llamacpp_args("", "-t 2") == "-t 2" and merge_llamacpp_args("-t 2", "") == "-t 2"


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ("-ngl 99", {"n_gpu_layers": 99}),
        ("--n-gpu-layers all", {"n_gpu_layers": "all"}),
        ("--gpu-layers=auto", {"n_gpu_layers": "auto"}),
        ("-ngl -1", {"n_gpu_layers": "all"}),  # llama.cpp reads a negative count as every layer
        ("-ngl 0", {"n_gpu_layers": 0}),
        ("--device Vulkan0,Vulkan1", {"devices": ["Vulkan0", "Vulkan1"]}),
        ("-dev none", {"devices": []}),
        ("-sm row -mg 1", {"split_mode": 2, "main_gpu": 1}),
        ("--split-mode none", {"split_mode": 0}),
        ("-ts 3,1", {"tensor_split": [3.0, 1.0]}),
        ("--tensor-split 1/1", {"tensor_split": [1.0, 1.0]}),
        ("-nkvo", {"offload_kqv": False}),
        ("--no-kv-offload --kv-offload", {"offload_kqv": True}),
    ],
)
def test_offload_flags(args: str, expected: dict[str, object]) -> None:
    assert parse_llamacpp_args(args) == expected


@pytest.mark.parametrize(
    "args", ["-ngl many", "-ngl", "--device", "--device 'Vulkan 0'", "-sm diagonal", "-ts 0,0", "-ts a,b", "-mg -1"]
)
def test_offload_flags_refused(args: str) -> None:
    with pytest.raises(InvalidArgument):
        parse_llamacpp_args(args)


def test_offload_flags_merge_by_setting() -> None:
    assert merge_llamacpp_args("-ngl 10 -t 2", "--n-gpu-layers all") == "-t 2 --n-gpu-layers all"
    assert merge_llamacpp_args("--device Vulkan0", "-dev none") == "-dev none"


@pytest.mark.parametrize("args", ["-np 2 -kvu", "--kv-unified", "--no-context-shift --no-mmap"])
def test_the_specs_examples_parse(args: str) -> None:
    parsed = parse_llamacpp_args(args)  # what the engine always does: nothing to set
    assert set(parsed) <= {"n_parallel", "use_mmap"}


@pytest.mark.parametrize(("flag", "why"), [("--no-kv-unified", "unified KV cache"), ("--context-shift", "ctx_size")])
def test_what_the_engine_does_not_do_is_refused_with_why(flag: str, why: str) -> None:
    with pytest.raises(InvalidArgument, match=why):
        parse_llamacpp_args(flag)
