"""Speculative decoding and the RAM prompt cache: lemonkit against ``llama-server``, side by side in one run.

    python benchmarks/speculative.py [--rounds 3] [--tokens 128] [--threads 2] [--ctx 4096] [--draft-max 16]
                                     [--sections decode,cache] [--no-llama-server]

Everything on the bundled Gemma 3 270M (``Gemma-3-270m-GGUF``), greedy, one stream, the same GGUF, threads and
context for every contender, and the same prompts (llama-server formats chats with its built-in Gemma template, as
lemonkit does); ``llama-server`` is built as ``benchmarks/concurrency.py`` builds it.

decode: three workloads, each request sent to every contender in turn (rounds interleave them), after one request
    of each workload that is not measured:
    edit (a text to copy with one word changed, ``/v1/completions``), extract (``json_schema`` fields copied from a
    document, ``/v1/chat/completions``) and chat (free generation). Contenders: lemonkit without speculation,
    with ``--spec-type ngram-simple``, with ``ngram-mod`` and with ``ngram-simple`` on ggml's fast kernels
    (``--no-batch-invariant``), llama-server with its defaults, and llama-server with the same speculative flags
    when its build knows them (no bundled pair of models shares a vocabulary, so draft models are not here). Per
    workload and contender: the engine's decode rate (``timings.predicted_per_second``, which both servers report
    the same way), the end-to-end rate at the client (completion tokens / the request's wall time) and, with
    drafts, the share of drafted tokens accepted; ratios against llama-server's defaults.
cache: two long contexts alternated in one slot (``--parallel 1``), each asked again with a new last line: the time
    to first token (at the client, streamed) and the prompt tokens evaluated, with ``--cache-ram`` and without
    (both ``--swa-full``: Gemma 3's sliding-window cache keeps too little to continue from an earlier prefix).

Compare ratios measured in one run; the load averages are printed before and after.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from concurrency import (
    GEMMA,
    Contender,
    Lemonkit,
    _cache_root,
    _loadavg,
    _wait_ready,
    llama_server_binary,
    llama_server_cpu_flags,
)

from tests.support.llama_cpp_server import free_port

SECTIONS = ("decode", "cache")
PARAGRAPH = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the wick, polished the "
    "brass, and wound the clockwork that turned the great lens. Ships far out at sea saw the blue beam sweep across "
    "the water and knew the rocks were near. In the morning he wrote the weather in his log: the wind, the swell, "
    "the colour of the sky, and the names of the boats that passed."
)
EDIT = f"Original: {PARAGRAPH}\nThe same text with 'blue' changed to 'white':\n"
DOCUMENT = (
    "Invoice 20931 was issued on 4 March 2026 by Harbour Supplies Ltd, 12 Quay Street, Port Ellen, to Marta "
    "Lindqvist (marta.lindqvist@example.org). It lists 40 brass fittings and 12 lens cloths, 318.40 euros in all, "
    "payable within 30 days to account GB29 NWBK 6016 1331 9268 19."
)
EXTRACT_SCHEMA = {
    "type": "json_schema",
    "json_schema": {
        "name": "invoice",
        "schema": {
            "type": "object",
            "properties": {
                "number": {"type": "string"},
                "date": {"type": "string"},
                "seller": {"type": "string"},
                "address": {"type": "string"},
                "buyer": {"type": "string"},
                "email": {"type": "string"},
                "total": {"type": "string"},
                "account": {"type": "string"},
            },
            "required": ["number", "date", "seller", "address", "buyer", "email", "total", "account"],
        },
    },
}


def _llama_server(binary: Path, gguf: Path, args: Any, extra: list[str]) -> Contender | None:
    port = free_port()
    command = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(args.threads)]
    command += ["-tb", str(args.threads), "-c", str(args.ctx), "--parallel", "1", "-fa", "on", "--no-webui"]
    # the GGUF carries no chat template: llama-server would fall back to ChatML where lemonkit formats Gemma's turns
    # (its catalog's chat_format), and the two would answer different prompts. Its built-in "gemma" template writes
    # the same 21 prompt tokens (builtin names need --no-jinja: with jinja "gemma" is read as a template's text)
    command += ["--no-jinja", "--chat-template", "gemma"]
    command += [*llama_server_cpu_flags(), *extra]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    contender = Contender("llama-server " + " ".join(extra), f"{base}/v1", f"{base}/health", process, "gemma")
    try:
        _wait_ready(contender.probe, process, timeout=120)
    except RuntimeError:
        contender.stop()
        return None  # this build does not know the flags
    return contender


#: one per round, so no round is an exact repeat of another: ngram-mod's pool outlives requests, and a request asked
#: again would copy its own earlier answer from it
_VARIANTS = (("white", "20931", "a storm"), ("green", "31842", "a whale"), ("red", "42753", "a lost ship"))
#: the request each contender answers once before the rounds, unmeasured: a server's first requests carry its
#: start-up work (lemonkit's step planner tries its thread counts, ggml sizes its buffers for new batch shapes)
_WARM_UP = ("yellow", "53664", "a fog")


def _requests(model: str, tokens: int, round_: int = 0) -> dict[str, tuple[str, dict[str, Any]]]:
    colour, number, topic = _WARM_UP if round_ < 0 else _VARIANTS[round_ % len(_VARIANTS)]
    greedy = {"model": model, "max_tokens": tokens, "temperature": 0}
    edit = EDIT.replace("'white'", f"'{colour}'")
    document = DOCUMENT.replace("20931", number)
    extract = [{"role": "user", "content": f"Copy the invoice's fields as JSON.\n\n{document}"}]
    story = [{"role": "user", "content": f"Tell a short story about a lighthouse keeper and {topic}."}]
    return {
        "edit": ("completions", {**greedy, "prompt": edit}),
        "extract": ("chat/completions", {**greedy, "messages": extract, "response_format": EXTRACT_SCHEMA}),
        "chat": ("chat/completions", {**greedy, "messages": story}),
    }


def _measure(contender: Contender, route: str, body: dict[str, Any]) -> dict[str, float]:
    start = time.perf_counter()
    response = httpx.post(f"{contender.api}/{route}", json={**body, "model": contender.model}, timeout=None)
    wall = time.perf_counter() - start
    response.raise_for_status()
    answer = response.json()
    timings, n = answer.get("timings") or {}, answer["usage"]["completion_tokens"]
    drafted = timings.get("draft_n") or 0
    return {
        "engine": float(timings.get("predicted_per_second") or 0.0),
        "client": n / wall if wall > 0 else 0.0,
        "accepted": (timings.get("draft_n_accepted") or 0) / drafted if drafted else float("nan"),
        "tokens": n,
    }


def bench_decode(lemonkits: list[tuple[str, Lemonkit]], servers: list[Contender], args: Any) -> None:
    contenders = [(name, lk.contender) for name, lk in lemonkits] + [(c.name, c) for c in servers]
    results: dict[str, dict[str, list[dict[str, float]]]] = {}
    for route, body in _requests(GEMMA, args.tokens, -1).values():
        for _, contender in contenders:
            _measure(contender, route, body)
    for workload in _requests(GEMMA, args.tokens):
        for round_ in range(args.rounds):
            route, body = _requests(GEMMA, args.tokens, round_)[workload]
            for name, contender in contenders:
                results.setdefault(workload, {}).setdefault(name, []).append(_measure(contender, route, body))
    base = servers[0].name if servers else contenders[0][0]
    print(f"\ndecode, one stream, {args.tokens} tokens, medians of {args.rounds} (ratios against {base}):")
    print(f"{'workload':<9}{'contender':<50}{'engine tok/s':>13}{'client tok/s':>13}{'accepted':>9}{'ratio':>7}")
    for workload, by in results.items():
        ref = statistics.median(r["engine"] for r in by[base])
        for name, runs in by.items():
            engine = statistics.median(r["engine"] for r in runs)
            client = statistics.median(r["client"] for r in runs)
            accepted = statistics.median(r["accepted"] for r in runs)
            share = "" if accepted != accepted else f"{accepted:.0%}"
            print(f"{workload:<9}{name:<50}{engine:>13.1f}{client:>13.1f}{share:>9}{engine / ref:>7.3f}")


def _ttft(contender: Contender, prompt: str) -> tuple[float, int]:
    body = {"model": contender.model, "prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": True}
    body["stream_options"] = {"include_usage": True}
    start, first, evaluated = time.perf_counter(), 0.0, 0
    with httpx.stream("POST", f"{contender.api}/completions", json=body, timeout=None) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if not first and chunk.get("choices"):
                first = time.perf_counter() - start
            if chunk.get("timings"):
                evaluated = int(chunk["timings"].get("prompt_n", 0))
    return first, evaluated


def bench_cache(home: Path, args: Any) -> None:
    # under Gemma 3's 512-token window: past it, neither its slot nor the RAM cache continues from a prefix (its
    # sliding-window cells are gone even with --swa-full here: to be looked into)
    a = " ".join([PARAGRAPH] * 4)
    b = " ".join([DOCUMENT] * 5)
    print("\ncache: two long contexts alternated in one slot, each asked again with a new last line")
    print(f"{'contender':<40}{'ttft ms':>10}{'prompt tokens evaluated':>26}")
    # Gemma 3 attends through a sliding window: a cache that keeps only the window cannot continue from an earlier
    # prefix (llama-server's rule too), so both contenders keep the whole context (--swa-full)
    for name, extra in (
        ("lemonkit --swa-full", "--swa-full"),
        ("lemonkit --swa-full --cache-ram 256", "--swa-full --cache-ram 256"),
    ):
        lk = Lemonkit(home, args.threads, args.ctx, f"{extra}".strip())
        try:
            lk.load(1)
            times, evaluated = [], []
            for round_ in range(args.rounds + 1):
                for context in (a, b):
                    first, n = _ttft(lk.contender, f"{context}\nQuestion {round_}:")
                    if round_:  # round 0 fills the caches
                        times.append(first)
                        evaluated.append(n)
            print(f"{name:<40}{statistics.median(times) * 1000:>10.1f}{statistics.median(evaluated):>26.0f}")
        finally:
            lk.contender.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ctx", type=int, default=4096)
    parser.add_argument("--draft-max", type=int, default=16)
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--no-llama-server", action="store_true")
    args = parser.parse_args()
    sections = [s for s in args.sections.split(",") if s]
    print(f"load averages at start: {_loadavg()}")
    home = _cache_root()
    home.mkdir(parents=True, exist_ok=True)
    # llama-server's current spellings, which lemonkit takes too (the old --draft-max is gone from llama-server)
    sizes = f"--spec-draft-n-max {args.draft_max} --spec-draft-n-min 0"
    simple = f"--spec-type ngram-simple {sizes}"
    pooled = f"--spec-type ngram-mod {sizes} --spec-ngram-mod-n-match 6 --spec-ngram-mod-n-min 2"
    if "decode" in sections:
        started: list[tuple[str, Lemonkit]] = []
        servers: list[Contender] = []
        try:
            # lemonkit's default kernels are batch-invariant; --no-batch-invariant takes ggml's fast ones, as
            # llama-server does
            for extra in ("", simple, pooled, f"--no-batch-invariant {simple}"):
                lk = Lemonkit(home, args.threads, args.ctx, extra)
                started.append((f"lemonkit {extra}".strip(), lk))
                lk.load(1)
            binary = None if args.no_llama_server else llama_server_binary()
            if binary is not None:
                gguf = started[0][1].model_path()
                for flags in ([], simple.split(), pooled.split()):
                    server = _llama_server(binary, gguf, args, flags)
                    if server is None:
                        print(f"llama-server {' '.join(flags)}: this build does not start with these flags")
                    else:
                        servers.append(server)
            bench_decode(started, servers, args)
        finally:
            for _, lk in started:
                lk.contender.stop()
            for server in servers:
                server.stop()
    if "cache" in sections:
        bench_cache(home, args)
    print(f"\nload averages at end: {_loadavg()}")


if __name__ == "__main__":
    main()
