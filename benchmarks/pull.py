"""Pull throughput through lemonkit vs a plain ``hf_hub_download`` of the same file, and bytes re-fetched on resume.

    python benchmarks/pull.py [--size-mb 512] [--rounds 3]

A local hub (``tests/support/hub_server.py``, in its own process, serving with ``sendfile``) holds one GGUF-named
file of random bytes. Round by round, interleaved so machine noise hits both alike:
- lemonkit: ``lemonkit serve`` in a subprocess, ``POST /api/v1/pull`` registering a model on that file (the time
  of the whole request: hub metadata, download, sha256 check, linking), then ``POST /api/v1/delete``;
- huggingface_hub: ``hf_hub_download`` of the file in this process into an empty cache (no checksum).
Then pause/resume: the hub holds the file at 40 %, the job is paused there, released and pulled again; the hub's
log gives the bytes sent twice. Targets: throughput ratio >= 0.9, 0 bytes re-fetched.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
HOME = Path(tempfile.gettempdir(), f"lemonkit-pull-bench-{os.getpid()}")  # made by main(), removed after
REPO = "bench/big-GGUF"
FILE = "big-Q4_K_M.gguf"


def _spawn(args: list[str], env: dict[str, str], marker: str, stream: str) -> tuple[subprocess.Popen[str], str]:
    process = subprocess.Popen(
        args,
        env=env,
        stdout=subprocess.PIPE if stream == "stdout" else subprocess.DEVNULL,
        stderr=subprocess.PIPE if stream == "stderr" else subprocess.DEVNULL,
        text=True,
    )
    pipe = process.stdout if stream == "stdout" else process.stderr
    assert pipe is not None
    for line in pipe:
        if marker in line:
            # keep reading, or a chatty process blocks on a full pipe
            threading.Thread(target=lambda: sum(1 for _ in pipe), daemon=True).start()
            return process, line.strip()
    raise RuntimeError(f"{args[0:3]} exited before saying {marker!r}")


def _write_file(size_mb: int) -> Path:
    folder = HOME / "repo"
    folder.mkdir(parents=True)
    path = folder / FILE
    with open(path, "wb") as f:
        f.write(b"GGUF")
        for _ in range(size_mb):
            f.write(os.urandom(1 << 20))
    return path


def _poll(check: Callable[[], Any], timeout: float = 120) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.02)
    raise TimeoutError


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    source = _write_file(args.size_mb)
    size = source.stat().st_size
    hub, line = _spawn(
        [sys.executable, str(ROOT / "tests" / "support" / "hub_server.py"), "--repo", f"{REPO}={source.parent}"],
        os.environ.copy(),
        "hub serving on",
        "stdout",
    )
    hub_url = line.rsplit(" ", 1)[1]
    env = {
        **os.environ,
        "HF_ENDPOINT": hub_url,
        "HF_HUB_OFFLINE": "0",
        "HF_HUB_DISABLE_XET": "1",
        "LEMONADE_CACHE_DIR": str(HOME / "cache"),
        "HF_HUB_CACHE": str(HOME / "lemonkit-hub"),
        "PYTHONPATH": str(ROOT),
    }
    env.pop("LEMONADE_API_KEY", None)
    server, line = _spawn(
        [sys.executable, "-m", "lemonkit.cli", "serve", "--port", "0"],
        env,
        "lemonkit serving on",
        "stderr",
    )
    api = line.split("serving on ", 1)[1].strip()
    os.environ.update({"HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_HUB_DISABLE_XET": "1"})
    from huggingface_hub import hf_hub_download

    client = httpx.Client(base_url=api + "/", timeout=600)
    model = {"checkpoint": f"{REPO}:{FILE}", "recipe": "llamacpp"}
    try:

        def lemonkit_pull(i: int) -> float:
            name = f"user.bench-{i}"
            started = time.perf_counter()
            response = client.post("pull", json={"model_name": name, **model})
            elapsed = time.perf_counter() - started
            response.raise_for_status()
            client.post("delete", json={"model_name": name}).raise_for_status()
            return elapsed

        def plain_download(i: int) -> float:
            cache = HOME / f"hf-{i}"
            started = time.perf_counter()
            path = hf_hub_download(REPO, FILE, cache_dir=cache, endpoint=hub_url)
            elapsed = time.perf_counter() - started
            assert Path(path).stat().st_size == size
            shutil.rmtree(cache)
            return elapsed

        lemonkit_pull(-1)  # warm both paths (imports, connections, page cache of the source)
        plain_download(-1)
        ours: list[float] = []
        theirs: list[float] = []
        for i in range(args.rounds):
            pair = [(ours, lemonkit_pull), (theirs, plain_download)]
            for times, run in pair if i % 2 == 0 else reversed(pair):
                times.append(run(i))
        mb = size / 1e6
        ours_rate, theirs_rate = mb / statistics.median(ours), mb / statistics.median(theirs)
        print(f"file: {mb:.0f} MB, {args.rounds} rounds, medians")
        print(f"  hf_hub_download      {theirs_rate:8.0f} MB/s  ({', '.join(f'{t:.2f}' for t in theirs)} s)")
        print(f"  lemonkit /v1/pull    {ours_rate:8.0f} MB/s  ({', '.join(f'{t:.2f}' for t in ours)} s)")
        print(f"  ratio lemonkit / hf_hub_download: {ours_rate / theirs_rate:.2f}  (target >= 0.9)")

        # pause at 40 % (the hub holds there, so the moment is exact), resume, count what was sent twice
        hold = int(size * 0.4)
        httpx.post(f"{hub_url}/_hub/control", json={"clear_log": True, "hold": {"at": hold, "path": FILE}})
        name = "user.bench-resume"
        client.post("pull", json={"model_name": name, **model, "stream": True, "subscribe": False})

        def job() -> dict[str, Any] | None:
            jobs = client.get("downloads").json()
            return next((j for j in jobs if j["model_name"] == name), None)

        _poll(lambda: (j := job()) and j["bytes_downloaded"] == hold)
        client.post("downloads/control", json={"id": f"model:{name}", "action": "pause"}).raise_for_status()
        _poll(lambda: (j := job()) and not j["running"])
        httpx.post(f"{hub_url}/_hub/control", json={"release": True})
        client.post("pull", json={"model_name": name}).raise_for_status()
        log = httpx.get(f"{hub_url}/_hub/log").json()
        gets = [e for e in log if e["method"] == "GET" and e["file"] == FILE]
        refetched = sum(e["sent"] for e in gets) - size
        print(
            f"pause at {hold} bytes, resume: {len(gets)} GETs, ranges from {[e['range_start'] for e in gets]}, "
            f"bytes re-fetched: {refetched}  (target 0)"
        )
    finally:
        client.close()
        for process in (server, hub):
            process.terminate()
            process.wait(30)
        shutil.rmtree(HOME, ignore_errors=True)


if __name__ == "__main__":
    main()
