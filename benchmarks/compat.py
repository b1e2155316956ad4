"""The Ollama and Anthropic routes against the OpenAI route, on the same server and model, side by side.

    python benchmarks/compat.py [--rounds 5] [--tokens 128]

One ``lemonkit serve``; per round, interleaved so that machine noise hits each route alike, one greedy stream of
``--tokens`` tokens through each of ``POST /api/v1/chat/completions`` (SSE, which the sidecar writes to the client
itself), ``POST /api/chat`` (Ollama's NDJSON) and ``POST /v1/messages`` (Anthropic's events), the last two
translated by the server chunk by chunk. Decode rate is measured at the client, first token to last; printed per
route: tok/s, the ratio to the OpenAI route and the time each token costs beyond it. Twice: on the tiny generated
model, where the engine is so fast that the difference is the translation's cost, and on the bundled SmolLM2 135M.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' helpers: tests/support/
from concurrency import _wait_ready

from tests.support.llama_cpp_server import free_port

HOME = Path(tempfile.gettempdir(), f"lemonkit-bench-compat-{os.getpid()}")
TINY = "user.tiny-llama"
SMOLLM2 = "SmolLM2-135M-Instruct-Bundled"
PROMPT = "Tell me about the history of the printing press."


def _setup() -> dict[str, str]:
    from lemonkit.testing.tiny_gguf import write_tiny_llama

    snapshot = HOME / "hub" / "models--bench--tiny-GGUF" / "snapshots" / ("c" * 40)
    snapshot.mkdir(parents=True)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("c" * 40)
    write_tiny_llama(snapshot / "tiny.gguf")
    (HOME / "cache").mkdir()
    entry = {"checkpoint": "bench/tiny-GGUF:tiny.gguf", "recipe": "llamacpp", "labels": ["chat"]}
    (HOME / "cache" / "user_models.json").write_text(json.dumps({"tiny-llama": entry}))
    return {
        **os.environ,
        "HF_HUB_CACHE": str(HOME / "hub"),
        "HF_HUB_OFFLINE": "1",
        "LEMONADE_CACHE_DIR": str(HOME / "cache"),
        "LEMONADE_API_KEY": "",
    }


def _openai(base: str, model: str, tokens: int) -> Iterator[None]:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream("POST", f"{base}/api/v1/chat/completions", json=body, timeout=600) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                choices = json.loads(line[6:]).get("choices") or [{}]
                if choices[0].get("delta", {}).get("content"):
                    yield None


def _ollama(base: str, model: str, tokens: int) -> Iterator[None]:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "options": {"num_predict": tokens, "temperature": 0},
    }
    with httpx.stream("POST", f"{base}/api/chat", json=body, timeout=600) as response:
        for line in response.iter_lines():
            if line and json.loads(line).get("message", {}).get("content"):
                yield None


def _anthropic(base: str, model: str, tokens: int) -> Iterator[None]:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream("POST", f"{base}/v1/messages", json=body, timeout=600) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and '"text_delta"' in line:
                yield None


ROUTES: dict[str, Callable[[str, str, int], Iterator[None]]] = {
    "openai": _openai,
    "ollama": _ollama,
    "anthropic": _anthropic,
}


def _rate(route: Callable[[str, str, int], Iterator[None]], base: str, model: str, tokens: int) -> tuple[float, int]:
    """(tokens per second from the first token to the last, tokens seen)."""
    first = last = 0.0
    count = 0
    for _ in route(base, model, tokens):
        last = time.perf_counter()
        if count == 0:
            first = last
        count += 1
    return ((count - 1) / (last - first) if count > 1 and last > first else 0.0), count


def _measure(base: str, model: str, tokens: int, rounds: int) -> None:
    for route in ROUTES.values():  # load the model and warm each path
        _rate(route, base, model, 8)
    rates: dict[str, list[float]] = {name: [] for name in ROUTES}
    counts: dict[str, int] = {}
    for _ in range(rounds):
        for name, route in ROUTES.items():
            rate, counts[name] = _rate(route, base, model, tokens)
            rates[name].append(rate)
    reference = statistics.median(rates["openai"])
    print(f"\n{model}: {tokens} tokens asked, {rounds} rounds (median tok/s, first token to last)")
    for name, values in rates.items():
        rate = statistics.median(values)
        extra = (1 / rate - 1 / reference) * 1000 if rate and reference else float("nan")
        print(
            f"  {name:10s} {rate:8.1f} tok/s   {rate / reference:5.3f} of openai   {extra:+.3f} ms/token"
            f"   ({counts[name]} tokens)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    env = _setup()
    port = free_port()
    command = [sys.executable, "-m", "lemonkit.cli", "serve", "--port", str(port), "--log-level", "warning"]
    server = subprocess.Popen(command, env=env, stdin=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(f"{base}/live", server)
        for model in (TINY, SMOLLM2):
            _measure(base, model, args.tokens, args.rounds)
    finally:
        server.terminate()
        server.wait(30)
        shutil.rmtree(HOME, ignore_errors=True)


if __name__ == "__main__":
    main()
