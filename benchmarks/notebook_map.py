"""Notebook-scale row work: ``lemonkit.map`` against llama.cpp's own ``llama-server`` fed by the best client a user
writes themselves, side by side in one run.

    python benchmarks/notebook_map.py [--rows 1000] [--parallel 8] [--threads 2] [--tokens 6]
                                      [--sections map,rerun,kill,ttft]

Every contender serves the embedded default chat model (SmolLM2 135M Instruct, the bundled GGUF) with ``--threads``
engine threads and ``--parallel`` slots. Each row is a short classification: one instruction shared by every row
(~60 tokens) and the row's own text (~20), greedy, ``--tokens`` tokens.

map: rows/s of ``lemonkit.map(template, rows)`` (the answer cache emptied first: every row computed) against
    ``llama-server --parallel N`` fed by a 16-way asyncio httpx client posting each row to ``/v1/chat/completions``.
rerun: the same ``lemonkit.map`` again (every row in the answer cache): its time against the first run's.
kill: the map's batch with the server SIGKILLed once half of its rows are done, a new server started on the same
    cache, the batch finished: the engines' generations over both lives (``lemonkit_generations_total``), against
    the rows (an uninterrupted run generates once per row).
ttft: time to first token of a streamed chat while a batch of the rows runs, against the same chat on the idle
    server (medians of 5).

``llama-server`` is built once as ``benchmarks/concurrency.py`` builds it; without it the llama-server column is
skipped. Compare ratios measured in one run, not absolute figures across runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' helpers
sys.path.insert(0, str(Path(__file__).resolve().parent))
from concurrency import _wait_ready, llama_server_binary, llama_server_cpu_flags
from sidecar_memory import server_env

import lemonkit
from lemonkit.catalog.config import DEFAULT_CHAT_MODEL
from lemonkit.client import Client
from tests.support.llama_cpp_server import free_port

SECTIONS = ("map", "rerun", "kill", "ttft")
INSTRUCTION = (
    "You are a careful sentiment classifier for customer reviews of household products. Read the review that "
    "follows and answer with exactly one word, positive, negative or neutral, in lower case, with no explanation, "
    "no punctuation and nothing else. Review: {}"
)
ADJECTIVES = ["sturdy", "flimsy", "quiet", "noisy", "bright", "dull", "cheap", "pricey", "soft", "rough"]
NOUNS = ["kettle", "lamp", "blender", "vacuum", "toaster", "fan", "heater", "mixer", "iron", "scale"]
VERBS = ["worked well", "broke quickly", "arrived late", "looked fine", "smelled odd", "saved time"]


def rows(n: int) -> list[str]:
    """``n`` distinct short reviews (~20 tokens each)."""
    out = []
    for i in range(n):
        adjective, noun = ADJECTIVES[i % len(ADJECTIVES)], NOUNS[(i // 10) % len(NOUNS)]
        out.append(f"Order {i}: the {adjective} {noun} {VERBS[i % len(VERBS)]} and I would rate it {i % 5 + 1} stars.")
    return out


class Server:
    """``lemonkit serve`` on a cache of its own, SmolLM2 loaded with the benchmark's slots and threads."""

    def __init__(self, cache: Path, parallel: int, threads: int, extra: str = "") -> None:
        self.cache, self.parallel, self.threads, self.extra = cache, parallel, threads, extra
        env = {**server_env(), "LEMONADE_CACHE_DIR": str(cache), "HF_HUB_OFFLINE": "1"}
        env.pop("LEMONADE_API_KEY", None)
        self.port = free_port()
        command = [sys.executable, "-m", "lemonkit.cli", "serve", "--port", str(self.port), "--log-level", "warning"]
        self.process = subprocess.Popen(command, env=env, stdin=subprocess.PIPE)
        self.root = f"http://127.0.0.1:{self.port}/"
        self.api = self.root + "api/v1"
        _wait_ready(self.root + "live", self.process)
        args = f"--parallel {parallel} -t {threads} {extra}".strip()
        body = {"model_name": DEFAULT_CHAT_MODEL, "llamacpp_args": args}
        httpx.post(f"{self.api}/load", json=body, timeout=600).raise_for_status()

    def client(self) -> Client:
        return Client(self.root)

    def generations(self) -> int:
        text = httpx.get(self.root + "metrics", timeout=30).text
        total = 0
        for line in text.splitlines():
            if line.startswith("lemonkit_generations_total{"):
                total += int(float(line.rsplit(" ", 1)[1]))
        return total

    def kill(self) -> None:
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait(30)

    def stop(self) -> None:
        if self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.close()
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()

    def gguf(self) -> Path:
        from lemonkit.catalog.registry import Registry

        registry = Registry(self.cache)
        return Path(registry.resolve(registry.get(DEFAULT_CHAT_MODEL)).main)


def _cpu(pid: int) -> float:
    """CPU seconds of a process and its children (the server and its sidecars)."""
    process = psutil.Process(pid)
    total = sum(process.cpu_times()[:2])
    for child in process.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            total += sum(child.cpu_times()[:2])
    return total


def lemonkit_map(server: Server, texts: list[str], tokens: int) -> tuple[float, Any]:
    process = psutil.Process(server.process.pid)
    with server.client() as client:
        front, start = sum(process.cpu_times()[:2]), time.perf_counter()
        whole = _cpu(server.process.pid)
        out = lemonkit.map(INSTRUCTION, texts, client=client, max_tokens=tokens, temperature=0, progress=False)
        elapsed = time.perf_counter() - start
        out.stats["server_cpu_seconds"] = round(sum(process.cpu_times()[:2]) - front, 2)
        out.stats["all_cpu_seconds"] = round(_cpu(server.process.pid) - whole, 2)
    assert not out.errors, out.errors[:3]
    return elapsed, out


async def _client_run(api: str, model: str, texts: list[str], tokens: int, width: int) -> float:
    """A user's own 16-way asyncio client: every row posted to ``chat/completions``, ``width`` at a time."""
    gate = asyncio.Semaphore(width)
    limits = httpx.Limits(max_connections=width, max_keepalive_connections=width)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def one(text: str) -> None:
            body = {
                "model": model,
                "messages": [{"role": "user", "content": INSTRUCTION.format(text)}],
                "max_tokens": tokens,
                "temperature": 0,
            }
            async with gate:
                response = await client.post(f"{api}/chat/completions", json=body)
                response.raise_for_status()

        start = time.perf_counter()
        await asyncio.gather(*(one(t) for t in texts))
        return time.perf_counter() - start


def llama_server_rows(gguf: Path, texts: list[str], args: Any) -> float | None:
    binary = llama_server_binary(jobs=2)
    if binary is None:
        return None
    port = free_port()
    command = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(args.threads)]
    command += ["-tb", str(args.threads), "-c", str(4096), "--parallel", str(args.parallel), "-kvu"]
    command += ["--no-webui", *llama_server_cpu_flags()]
    process = subprocess.Popen(command, env=server_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        base = f"http://127.0.0.1:{port}"
        _wait_ready(f"{base}/health", process)
        asyncio.run(_client_run(f"{base}/v1", "smollm2", texts[:16], args.tokens, 16))  # warm
        elapsed = asyncio.run(_client_run(f"{base}/v1", "smollm2", texts, args.tokens, 16))
        return len(texts) / elapsed
    finally:
        process.terminate()
        process.wait(30)


def _ttft(api: str) -> float:
    body = {
        "model": DEFAULT_CHAT_MODEL,
        "messages": [{"role": "user", "content": "Say hello to the reader."}],
        "max_tokens": 8,
        "temperature": 0,
        "stream": True,
    }
    start = time.perf_counter()
    with httpx.stream("POST", f"{api}/chat/completions", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:]).get("choices"):
                delta = json.loads(line[6:])["choices"][0].get("delta") or {}
                if delta.get("content"):
                    return time.perf_counter() - start
    raise RuntimeError("no token came")


def _submit(server: Server, texts: list[str], tokens: int) -> str:
    """Submit the rows as a batch through the OpenAI SDK (as a user's evaluation script does); its id."""
    from openai import OpenAI

    client = OpenAI(base_url=server.api, api_key="none")
    lines = [
        {
            "custom_id": str(i),
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": DEFAULT_CHAT_MODEL,
                "messages": [{"role": "user", "content": INSTRUCTION.format(t)}],
                "max_tokens": tokens,
                "temperature": 0,
                "cache": False,
            },
        }
        for i, t in enumerate(texts)
    ]
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    upload = client.files.create(file=("rows.jsonl", data), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    return batch.id


def _batch(server: Server, batch_id: str) -> dict[str, Any]:
    answer: dict[str, Any] = httpx.get(f"{server.api}/batches/{batch_id}", timeout=60).json()
    return answer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1000)
    parser.add_argument("--parallel", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=6)
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument(
        "--lemonkit-args", default="", help='more llama.cpp flags for lemonkit ("--no-batch-invariant")'
    )
    args = parser.parse_args()
    sections = args.sections.split(",")
    texts = rows(args.rows)
    print(f"load averages before: {os.getloadavg()}")
    with tempfile.TemporaryDirectory(prefix="lemonkit-bench-map-") as home:
        cache = Path(home) / "cache"
        server = Server(cache, args.parallel, args.threads, args.lemonkit_args)
        try:
            with server.client() as client:
                client.chat("Warm up.", stream=False, max_tokens=2)
                client.cache_clear()
            first, out = lemonkit_map(server, texts, args.tokens)
            if "map" in sections or "lemonkit" in sections:
                print(f"\nmap: {args.rows} rows, {args.tokens} tokens, --parallel {args.parallel} -t {args.threads}")
                print(f"  lemonkit.map          {args.rows / first:8.1f} rows/s   (stats: {out.stats})")
                ls = llama_server_rows(server.gguf(), texts, args) if "map" in sections else None
                if ls is not None:
                    print(f"  llama-server + client {ls:8.1f} rows/s")
                    print(f"  lemonkit.map / llama-server: {args.rows / first / ls:.2f}")
            if "rerun" in sections:
                again, out = lemonkit_map(server, texts, args.tokens)
                print(f"\nrerun: first {first:.2f} s, again {again:.3f} s ({out.stats['cache_hits']} from the cache)")
                print(f"  first / again: {first / again:.0f}x")
            if "ttft" in sections:
                idle = statistics.median(_ttft(server.api) for _ in range(5))
                batch_id = _submit(server, texts, args.tokens)
                while _batch(server, batch_id)["request_counts"]["completed"] < 2 * args.parallel:
                    time.sleep(0.05)
                busy = statistics.median(_ttft(server.api) for _ in range(5))
                with server.client() as client:
                    client.cancel_batch(batch_id)
                print(f"\nttft: idle {idle * 1000:.0f} ms, during a batch {busy * 1000:.0f} ms: {busy / idle:.2f}x")
            if "kill" in sections:
                batch_id = _submit(server, texts, args.tokens)
                before = server.generations()
                while _batch(server, batch_id)["request_counts"]["completed"] < args.rows // 2:
                    time.sleep(0.02)
                killed_at = server.generations() - before
                server.kill()
                server = Server(cache, args.parallel, args.threads, args.lemonkit_args)
                after_start = server.generations()
                while (batch := _batch(server, batch_id))["status"] not in ("completed", "failed", "cancelled"):
                    time.sleep(0.1)
                second = server.generations() - after_start
                print(f"\nkill: {killed_at} generations before the kill, {second} after ({batch['status']})")
                print(f"  engine work / one uninterrupted run: {(killed_at + second) / args.rows:.3f}")
        finally:
            server.stop()
    print(f"\nload averages after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
