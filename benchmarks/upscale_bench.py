#!/usr/bin/env python3
"""Upscaling through lemonkit's API against the same engine called directly, side by side in one run.

For each case (a bundled Real-ESRGAN network and an input size), the same PNG is upscaled, alternately:

- direct: the engine adapter (:class:`lemonkit.backends.ncnn_upscale.NcnnUpscaleEngine`) in this process, called
  as the sidecar calls it: on one worker thread (ncnn's OpenMP threads run measurably slower under the main
  thread), decode, tiled network, PNG encode, base64;
- API: ``POST /api/v1/images/upscale`` of one ``lemonkit serve --embedded`` subprocess (the model in its
  sidecar, loaded by the warm-up request: upscalers are on-demand, ``/v1/load`` refuses them).

Reported: median wall seconds of each path, and direct / API (the API's throughput relative to the engine's;
target >= 0.95). :func:`upscale_section` is the ``upscale`` section of ``benchmarks/images.py``
(``from upscale_bench import upscale_section``); it takes any object with ``api`` (an httpx client on the
server's ``/api/v1/``), ``cache`` (its lemonkit cache dir) and ``rounds``.

    python benchmarks/upscale_bench.py [--rounds 3] [--models RealESRGAN-x4plus ...]
"""

from __future__ import annotations

import argparse
import base64
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the test picture: tests/support/upscale_images.py
from embeddings import _serve  # one embedded `lemonkit serve` per benchmark, started alike

from tests.support.upscale_images import picture, png

#: (model, input width, input height): the fast anime-video network, and Real-ESRGAN x4plus (the default)
CASES = (("realesr-animevideov3-x4", 256, 256), ("realesr-animevideov3-x2", 256, 256), ("RealESRGAN-x4plus", 128, 96))


@dataclass
class Bench:
    """What a section uses: the API's client, lemonkit's cache, and the number of rounds."""

    api: httpx.Client
    cache: Path
    rounds: int


def _never() -> bool:
    return False


def _direct(worker: ThreadPoolExecutor, engine: Any, image: bytes) -> float:
    from lemonkit.backends.protocol import Upload

    start = time.perf_counter()
    answer = worker.submit(engine.upscale, {"files": [Upload("image", image)]}, cancelled=_never).result()
    wall = time.perf_counter() - start
    assert answer["data"][0]["b64_json"]
    return wall


def _api(client: httpx.Client, model: str, image: str) -> float:
    start = time.perf_counter()
    response = client.post("images/upscale", json={"model": model, "image": image})
    wall = time.perf_counter() - start
    response.raise_for_status()
    return wall


def upscale_rows(
    client: httpx.Client, cache: Path, cases: tuple[tuple[str, int, int], ...] = CASES, rounds: int = 3
) -> list[dict[str, Any]]:
    """One row per case: median wall seconds direct and through ``client``.

    Args:
        client: An httpx client whose base URL is the server's ``/api/v1/``.
        cache: The lemonkit cache dir the server uses (the direct engine loads the same bundled files).
        cases: (model, width, height) to measure.
        rounds: Upscales per path per case (after one warm-up each, which also loads the API's sidecar).
    """
    from lemonkit.backends import engine_class
    from lemonkit.catalog.registry import Registry

    registry = Registry(cache)
    worker = ThreadPoolExecutor(max_workers=1)  # the sidecar's engine thread
    rows = []
    for model, width, height in cases:
        info = registry.get(model)
        engine = engine_class(info.recipe)({"model_name": model, "model_path": str(registry.resolve(info).main)})
        image = png(picture(width, height))
        encoded = base64.b64encode(image).decode()
        _direct(worker, engine, image), _api(client, model, encoded)  # warm both; the API's loads the sidecar
        direct, api = [], []
        for _ in range(rounds):  # alternated, so that both see the same machine
            direct.append(_direct(worker, engine, image))
            api.append(_api(client, model, encoded))
        client.post("unload", json={"model_name": model}).raise_for_status()
        engine.close()
        rows.append(
            {
                "model": model,
                "input": f"{width}x{height}",
                "output": f"{width * engine.scale}x{height * engine.scale}",
                "direct_s": statistics.median(direct),
                "api_s": statistics.median(api),
            }
        )
    worker.shutdown()
    return rows


def print_rows(rows: list[dict[str, Any]]) -> None:
    print(f"{'model':<26} {'input':>8} {'output':>10} {'direct s':>9} {'API s':>8} {'direct/API':>10}")
    for r in rows:
        ratio = r["direct_s"] / r["api_s"]
        sizes = f"{r['model']:<26} {r['input']:>8} {r['output']:>10}"
        print(f"{sizes} {r['direct_s']:>9.3f} {r['api_s']:>8.3f} {ratio:>10.3f}")
    print("direct/API is the API's throughput relative to the engine's (target >= 0.95)")


def upscale_section(bench: Any) -> None:
    """``benchmarks/images.py``'s ``upscale`` section: ``bench`` has ``api`` (the client), ``cache`` and ``rounds``."""
    print(f"\n## upscale: POST /v1/images/upscale vs the ncnn engine in-process, median of {bench.rounds} rounds")
    print_rows(upscale_rows(bench.api, bench.cache, rounds=bench.rounds))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--models", nargs="*", default=[model for model, *_ in CASES], help="the cases of these")
    args = parser.parse_args()
    cases = tuple(case for case in CASES if case[0] in args.models)
    with tempfile.TemporaryDirectory(prefix="lemonkit-upscale-bench-") as tmp:
        server, url = _serve(Path(tmp))
        try:
            with httpx.Client(base_url=url, timeout=600) as client:
                print(f"median of {args.rounds} rounds")
                print_rows(upscale_rows(client, Path(tmp), cases, args.rounds))
        finally:
            assert server.stdin is not None
            server.stdin.close()  # the embedded server exits when its stdin closes
            server.wait(30)


if __name__ == "__main__":
    main()
