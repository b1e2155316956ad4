"""The notebook path: time to the first token of ``lemonkit.chat()`` in a fresh kernel, and its streaming rate.

    python benchmarks/notebook.py [--model user.tiny-llama] [--rounds 5] [--tokens 1000]

1. Time to first token, measured from outside a real kernel (``jupyter_client``): from the kernel starting the cell
   ``import lemonkit; lemonkit.chat(...)`` (its ``execute_input`` message) to the first display update that
   holds answer text. ``cold``: a fresh kernel with no server anywhere, so the embedded server starts and loads
   the model; ``warm``: a second ``lemonkit.chat()`` in that kernel; ``fresh kernel, running server``: a new kernel
   whose ``LEMONKIT_URL`` names a ``lemonkit serve`` with the model loaded (the Jupyter case: the server is up).
2. Decode tokens/s of ``lemonkit.chat()`` (plain-text path: each token is printed, here into a sink that stamps
   it) vs the ``openai`` SDK streaming the same request (same prompt, seed, token count) from the same server,
   interleaved round by round; prints the ratio (target >= 0.98).

The default model is the tiny generated llama, which decodes thousands of tokens a second: the client's own cost
per token shows most there. ``--model SmolLM2-135M-Instruct-Bundled`` (or any registered chat model) measures a
real one.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import httpx
from llm_overhead import BENCH_HOME, CACHE, HF_CACHE, TINY, _free_port, _setup_models, _wait_live

PROMPT = "Tell me about the history of the printing press."


def _env(model: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LEMONKIT_URL", "LEMONKIT_TOKEN", "LEMONADE_API_KEY")}
    return {
        **env,
        "HF_HUB_CACHE": str(HF_CACHE),
        "HF_HUB_OFFLINE": "1",
        "LEMONADE_CACHE_DIR": str(CACHE),
        "JUPYTER_RUNTIME_DIR": str(BENCH_HOME / "runtime"),  # no recorded server to find: the embedded one starts
        "LEMONKIT_DEFAULT_CHAT_MODEL": model,
    }


class Kernel:
    """A fresh IPython kernel; :meth:`first_token` runs a cell and times its first answer text."""

    def __init__(self, env: dict[str, str]) -> None:
        from jupyter_client.manager import start_new_kernel

        self.manager, self.client = start_new_kernel(env=env)

    def first_token(self, code: str) -> float:
        """Seconds from the cell starting to the first display update with text; the cell must succeed."""
        msg_id = self.client.execute(code)
        started = first = None
        while True:
            msg = self.client.get_iopub_msg(timeout=600)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "execute_input":
                started = time.perf_counter()
            elif kind in ("display_data", "update_display_data") and first is None:
                if content["data"].get("text/plain"):
                    first = time.perf_counter()
            elif kind == "error":
                raise RuntimeError("\n".join(content["traceback"]))
            elif kind == "status" and content["execution_state"] == "idle":
                break
        if started is None or first is None:
            raise RuntimeError("the cell showed no answer")
        return first - started

    def close(self) -> None:
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=True)


def time_to_first_token(model: str, base: str) -> dict[str, float]:
    cell = f"import lemonkit\nlemonkit.chat({PROMPT!r}, max_tokens=16)"
    cold = Kernel(_env(model))
    try:
        results = {"cold (embedded server starts, model loads)": cold.first_token(cell)}
        results["warm (same kernel, second chat)"] = cold.first_token(f"lemonkit.chat({PROMPT!r}, max_tokens=16)")
    finally:
        cold.close()
    running = Kernel({**_env(model), "LEMONKIT_URL": base})
    try:
        results["fresh kernel, running server"] = running.first_token(cell)
    finally:
        running.close()
    return results


class _Stamps(io.TextIOBase):
    """A stdout that records when each write arrives (lemonkit.chat writes each token as it comes)."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def write(self, text: str) -> int:
        if text:  # one write per token with text, as the openai side counts chunks with content
            self.stamps.append(time.perf_counter())
        return len(text)


def _rate(stamps: list[float]) -> float:
    """Decode rate at the client: first token to last."""
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def _via_lemonkit(client: Any, model: str, tokens: int) -> list[float]:
    sink, stdout = _Stamps(), sys.stdout
    sys.stdout = sink
    try:
        client.chat(PROMPT, model, max_tokens=tokens, seed=7, temperature=0.8)
    finally:
        sys.stdout = stdout
    return sink.stamps[:-1]  # the last write is the closing newline


def _via_openai(oai: Any, model: str, tokens: int) -> list[float]:
    stamps = []
    messages = [{"role": "user", "content": PROMPT}]
    stream = oai.chat.completions.create(
        model=model, messages=messages, max_tokens=tokens, seed=7, temperature=0.8, stream=True
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            stamps.append(time.perf_counter())
    return stamps


def tokens_per_second(base: str, model: str, rounds: int, tokens: int) -> None:
    """Each round runs both, in alternating order; the ratio is the median of the rounds' ratios (the machine's
    load drifts between rounds, less within one). Client CPU time per token is the cost each adds itself."""
    import openai

    import lemonkit

    client = lemonkit.Client(base)
    oai = openai.OpenAI(base_url=base + "/api/v1", api_key="none", max_retries=0)
    runs = {
        "lemonkit.chat": lambda: _via_lemonkit(client, model, tokens),
        "openai SDK": lambda: _via_openai(oai, model, tokens),
    }
    for run in runs.values():
        run()  # warm up
    rates: dict[str, list[float]] = {name: [] for name in runs}
    cpu: dict[str, list[float]] = {name: [] for name in runs}
    counts: dict[str, int] = {}
    order = list(runs)
    for round_ in range(rounds):
        for name in order[round_ % 2 :] + order[: round_ % 2]:
            started = time.process_time()
            stamps = runs[name]()
            cpu[name].append((time.process_time() - started) / len(stamps) * 1e6)
            rates[name].append(_rate(stamps))
            counts[name] = len(stamps)
    print(f"  tokens seen per run: {counts}")
    for name in runs:
        rate, per_token = statistics.median(rates[name]), statistics.median(cpu[name])
        print(f"  {name:<15} {rate:9.1f} tok/s   client CPU {per_token:6.1f} us/token")
    ratios = [a / b for a, b in zip(rates["lemonkit.chat"], rates["openai SDK"], strict=True)]
    print(
        f"  ratio lemonkit.chat / openai SDK: median of rounds {statistics.median(ratios):.3f} "
        f"(min {min(ratios):.3f}, max {max(ratios):.3f}; target >= 0.98)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=TINY)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=1000)
    args = parser.parse_args()
    _setup_models()
    env = _env(args.model)
    os.environ.update({k: env[k] for k in ("HF_HUB_CACHE", "HF_HUB_OFFLINE", "LEMONADE_CACHE_DIR")})
    port = _free_port()
    # its record goes elsewhere: the cold kernel must find no server and start its embedded one
    serve_env = {**env, "JUPYTER_RUNTIME_DIR": str(BENCH_HOME / "serve-runtime")}
    serve = subprocess.Popen(
        [sys.executable, "-m", "lemonkit.cli", "serve", "--port", str(port), "--log-level", "warning"], env=serve_env
    )
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_live(base + "/live", serve)
        load = {"model_name": args.model, "ctx_size": 4096}
        httpx.post(base + "/api/v1/load", json=load, timeout=600).raise_for_status()
        print(f"model: {args.model}")
        print("\ntime to first token in a real kernel (cell start -> first answer text in the display):")
        for name, seconds in time_to_first_token(args.model, base).items():
            print(f"  {name:<45} {seconds * 1000:8.1f} ms")
        print(f"\nstreamed decode rate, {args.tokens} tokens, {args.rounds} rounds, medians:")
        tokens_per_second(base, args.model, args.rounds, args.tokens)
    finally:
        serve.terminate()
        serve.wait(30)
    import platform

    print(f"\nmachine: {os.cpu_count()} logical CPUs, python {platform.python_version()}; {json.dumps(args.__dict__)}")


if __name__ == "__main__":
    main()
