"""Streamed tokens/s through each host vs direct llama-cpp-python, side by side in one run.

    python benchmarks/llm_overhead.py [--rounds 5] [--tokens 128]

Runs, interleaved round by round so that machine noise hits every contender alike:
- direct: ``llama_cpp.Llama.create_completion(stream=True)`` and the bare ``generate`` loop, in this process, with the
  engine's own defaults (physical cores, flash attention, weights on huge pages: ``benchmarks/sidecar_memory.py``);
- standalone: ``lemonkit serve`` in a subprocess, ``POST /api/v1/completions`` streamed;
- jupyter: ``jupyter server`` with the extension, ``POST /lemonkit/api/v1/completions`` streamed.
Same model (the bundled Gemma 3 270M), prompt, greedy sampling and token count. Decode rate is
measured at the client, first token to last. Then the same on the tiny generated model, where
the engine is so fast that the difference shows the per-token cost the HTTP path adds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import httpx
from sidecar_memory import run_as_sidecar, server_env

PROMPT = "The history of the printing press begins"
BENCH_HOME = Path(tempfile.gettempdir(), f"lemonkit-bench-{os.getpid()}")  # made by main(), removed after
HF_CACHE = BENCH_HOME / "hub"
CACHE = BENCH_HOME / "cache"
TOKEN = "bench-token"
TINY = "user.tiny-llama"
GEMMA = "Gemma-3-270m-GGUF"


def _setup_models() -> Path:
    from lemonkit.testing.tiny_gguf import write_tiny_llama

    snapshot = HF_CACHE / "models--bench--tiny-GGUF" / "snapshots" / ("b" * 40)
    snapshot.mkdir(parents=True)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("b" * 40)
    tiny = write_tiny_llama(snapshot / "tiny.gguf")
    CACHE.mkdir(parents=True)
    entry = {"checkpoint": "bench/tiny-GGUF:tiny.gguf", "recipe": "llamacpp", "labels": ["chat"]}
    (CACHE / "user_models.json").write_text(json.dumps({"tiny-llama": entry}))
    return tiny


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _wait_live(url: str, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.2)  # a start-up poll, not a measurement
    raise RuntimeError(f"{url} did not come up")


def _start_hosts(
    env: dict[str, str], processes: list[subprocess.Popen[bytes]]
) -> tuple[dict[str, tuple[str, dict[str, str]]], list[subprocess.Popen[bytes]]]:
    sa_port, jp_port = _free_port(), _free_port()
    standalone = subprocess.Popen(
        [sys.executable, "-m", "lemonkit.cli", "serve", "--port", str(sa_port), "--log-level", "warning"], env=env
    )
    jupyter = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jupyter_server",
            f"--port={jp_port}",
            "--no-browser",
            f"--IdentityProvider.token={TOKEN}",
            "--ServerApp.jpserver_extensions={'lemonkit': True}",
            f"--ServerApp.root_dir={BENCH_HOME}",
            "--ServerApp.log_level=WARN",
            *(["--allow-root"] if os.geteuid() == 0 else []),
        ],
        env=env,
        stderr=subprocess.DEVNULL,
    )
    processes += [standalone, jupyter]
    hosts = {
        "standalone": (f"http://127.0.0.1:{sa_port}/api/v1", {}),
        "jupyter": (f"http://127.0.0.1:{jp_port}/lemonkit/api/v1", {"Authorization": f"Bearer {TOKEN}"}),
    }
    _wait_live(f"http://127.0.0.1:{sa_port}/live", standalone)
    _wait_live(f"http://127.0.0.1:{jp_port}/lemonkit/live", jupyter)
    return hosts, processes


def _decode_rate(stamps: list[float]) -> float:
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def _via_api(base: str, headers: dict[str, str], model: str, tokens: int) -> tuple[float, int]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "stream": True}
    stamps: list[float] = []
    with httpx.stream("POST", f"{base}/completions", json=body, headers=headers, timeout=None) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: {") and '"text": ""' not in line:
                stamps.append(time.perf_counter())
    return _decode_rate(stamps), len(stamps)


def _direct_stream(llm: object, tokens: int) -> Iterator[dict[str, object]]:
    return llm.create_completion(PROMPT, max_tokens=tokens, temperature=0, stream=True)  # type: ignore[attr-defined]


def _direct_generate(llm: Any, tokens: int) -> tuple[float, int]:
    """The raw limit: llama-cpp-python's token loop with per-token detokenisation and nothing else."""
    stamps: list[float] = []
    eos = llm.token_eos()
    for token in llm.generate(llm.tokenize(PROMPT.encode()), temp=0.0, reset=True):
        if token == eos or len(stamps) == tokens:
            break
        llm.detokenize([token])
        stamps.append(time.perf_counter())
    return _decode_rate(stamps), len(stamps)


def _direct(llm: object, tokens: int) -> tuple[float, int]:
    stamps = [time.perf_counter() for chunk in _direct_stream(llm, tokens) if chunk["choices"][0]["text"]]  # type: ignore[index]
    return _decode_rate(stamps), len(stamps)


def _engine_llm(model_path: Path, chat_format: str | None = None) -> object:
    """A Llama built exactly as the sidecar builds it: the engine adapter's own construction."""
    from lemonkit.backends.llamacpp import LlamaCppEngine

    engine = LlamaCppEngine(
        {
            "model_name": "direct",
            "recipe": "llamacpp",
            "type": "llm",
            "model_path": str(model_path),
            "chat_format": chat_format,
            "options": {},
        }
    )
    engine._gen.close()  # its decode thread ends (it probes the context at start): this process decodes alone
    engine._closed = True
    return engine._llm


def _bench(
    name: str, model: str, model_path: Path, hosts: dict[str, tuple[str, dict[str, str]]], rounds: int, tokens: int
) -> dict[str, float]:
    for base, headers in hosts.values():
        httpx.post(f"{base}/load", json={"model_name": model}, headers=headers, timeout=600).raise_for_status()
        _via_api(base, headers, model, 8)  # warm up
    llm = _engine_llm(model_path)
    _direct(llm, 8)
    rates: dict[str, list[float]] = {"direct": [], "generate": [], **{h: [] for h in hosts}}
    counts: dict[str, int] = {}
    runs: dict[str, Callable[[], tuple[float, int]]] = {
        "direct": partial(_direct, llm, tokens),
        "generate": partial(_direct_generate, llm, tokens),
        **{host: partial(_via_api, base, headers, model, tokens) for host, (base, headers) in hosts.items()},
    }
    order = list(runs)
    for round_ in range(rounds):
        # rotate who goes first: whatever the previous run leaves behind (a sidecar's engine threads still
        # polling for work, a cooling core) must not always land on the same contender
        for contender in order[round_ % len(order) :] + order[: round_ % len(order)]:
            rate, counts[contender] = runs[contender]()
            rates[contender].append(rate)
    medians = {k: statistics.median(v) for k, v in rates.items()}
    print(f"\n{name}: {tokens} tokens, {rounds} rounds, medians of decode tok/s (tokens seen: {counts})")
    print("  direct = create_completion(stream=True); generate = the bare token loop (the engine's own path)")
    direct = medians["direct"]
    for contender, rate in medians.items():
        added = (1 / rate - 1 / direct) * 1000
        print(f"  {contender:<11} {rate:8.1f} tok/s   ratio {rate / direct:5.3f}   added {added:+.3f} ms/token")
    for base, headers in hosts.values():
        httpx.post(f"{base}/unload", json={}, headers=headers, timeout=60)
    del llm
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    run_as_sidecar()  # the direct runs build the engine in this process

    tiny = _setup_models()
    env = {
        **server_env(),
        "HF_HUB_CACHE": str(HF_CACHE),
        "HF_HUB_OFFLINE": "1",
        "LEMONADE_CACHE_DIR": str(CACHE),
        "JUPYTER_CONFIG_DIR": str(BENCH_HOME / "jupyter"),
        "LEMONADE_API_KEY": "",
    }
    os.environ.update({k: env[k] for k in ("HF_HUB_CACHE", "LEMONADE_CACHE_DIR")})
    from lemonkit.catalog.registry import Registry

    registry = Registry(CACHE)
    gemma_path = registry.resolve(registry.get(GEMMA)).main
    processes: list[subprocess.Popen[bytes]] = []
    try:
        hosts, processes = _start_hosts(env, processes)
        _bench("Gemma 3 270M (bundled)", GEMMA, gemma_path, hosts, args.rounds, args.tokens)
        _bench("tiny generated llama", TINY, tiny, hosts, args.rounds, 1000)
    finally:
        for process in processes:
            process.terminate()
            process.wait(30)
    import platform

    print(
        f"\nmachine: {os.cpu_count()} logical CPUs, {platform.processor() or platform.machine()}, "
        f"python {platform.python_version()}"
    )


if __name__ == "__main__":
    try:
        main()
    finally:
        shutil.rmtree(BENCH_HOME, ignore_errors=True)
