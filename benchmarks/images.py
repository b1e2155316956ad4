#!/usr/bin/env python3
"""Images through lemonkit's API against the engines called directly, side by side in one run.

Sections (each a function taking the :class:`Bench`; add one to :data:`SECTIONS` to extend the run):

- ``generation``: seconds per image of the tiny random Stable Diffusion pipeline (:mod:`lemonkit.testing.
  tiny_diffusers`, registered as a user model) through ``POST /api/v1/images/generations`` of one ``lemonkit serve``
  subprocess, against lemonkit's diffusers engine called in this process with the same settings, runs interleaved;
  the ratio direct / API is the API's speed relative to the engine's (target >= 0.95). The tiny pipeline makes an
  image in a fraction of a second, so the figure is dominated by what the API adds (JSON, the sidecar hop, base64
  PNGs); a real model's seconds per image would hide it;
- ``upscale``: the bundled Real-ESRGAN networks through ``POST /api/v1/images/upscale`` against the ncnn engine in
  this process (``benchmarks/upscale_bench.py``).

    python benchmarks/images.py [--rounds 5] [--size 64x64] [--sections generation,upscale]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# OpenMP threads that spin after their work would steal the cores from the other path's next run (measured: the
# direct engine 10x slower right after an API request); set before torch loads here and in the server it starts
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import httpx
from embeddings import _serve  # one embedded `lemonkit serve` per benchmark, started alike
from upscale_bench import upscale_section

TINY_SD = "user.tiny-sd"
PROMPT = "a lighthouse on a cliff at dusk"
STEPS = 4


@dataclass
class Bench:
    """What every section uses: the API's client, lemonkit's cache, and the run's settings."""

    api: httpx.Client
    cache: Path
    rounds: int
    size: str


def _never() -> bool:
    return False


def generation(bench: Bench) -> None:
    """Seconds per image through the API vs the engine in this process (medians), one image per request."""
    from lemonkit.backends.images.diffusers_engine import DiffusersEngine
    from lemonkit.catalog.registry import Registry
    from lemonkit.testing.tiny_diffusers import write_tiny_pipeline

    folder = write_tiny_pipeline(bench.cache / "tiny-sd")
    Registry(bench.cache).register(TINY_SD, {"checkpoint": str(folder), "recipe": "diffusers", "labels": ["image"]})
    body = {"prompt": PROMPT, "size": bench.size, "steps": STEPS, "cfg_scale": 1.0, "seed": 1}
    options = {"steps": STEPS, "cfg_scale": 1.0}
    engine = DiffusersEngine({"model_path": str(folder), "type": "image", "options": options})

    def direct() -> None:
        engine.generate(dict(body), cancelled=_never)

    engine_walls: list[float] = []

    def through_api() -> None:
        response = bench.api.post("images/generations", json={"model": TINY_SD, **body})
        response.raise_for_status()
        stats = bench.api.get("stats").json()
        engine_walls.append(float(stats.get("wall_ms", 0.0)) / 1000)

    for run in (direct, through_api):  # warm both: the sidecar's load, the first call's allocations
        run()
    engine_walls.clear()
    runs: dict[str, list[float]] = {"direct": [], "api": []}
    for _ in range(bench.rounds):
        for name, run in (("direct", direct), ("api", through_api)):
            start = time.perf_counter()
            run()
            runs[name].append(time.perf_counter() - start)
    median = {name: statistics.median(times) for name, times in runs.items()}
    print(f"\n## generation: tiny SD pipeline, {bench.size}, {STEPS} steps, median of {bench.rounds} rounds")
    print(f"{'path':<8} {'s/image':>8}")
    for name, value in median.items():
        print(f"{name:<8} {value:8.3f}")
    print(f"API speed relative to direct: {median['direct'] / median['api']:.3f} (target >= 0.95)")
    if any(engine_walls):
        overhead = statistics.median(api - wall for api, wall in zip(runs["api"], engine_walls, strict=True))
        print(f"API time around the engine's own: {overhead * 1000:.1f} ms per request (median)")
    engine.close()
    bench.api.post("unload", json={"model_name": TINY_SD})


SECTIONS: dict[str, Callable[[Bench], None]] = {"generation": generation, "upscale": upscale_section}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--size", default="64x64", help="WIDTHxHEIGHT of the generated images")
    parser.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated: " + ", ".join(SECTIONS))
    args = parser.parse_args()
    chosen = [name.strip() for name in args.sections.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in SECTIONS]
    if unknown:
        parser.error(f"unknown sections: {', '.join(unknown)}")
    with tempfile.TemporaryDirectory(prefix="lemonkit-images-bench-") as tmp:
        server, url = _serve(Path(tmp))
        try:
            with httpx.Client(base_url=url, timeout=600) as api:
                for name in chosen:
                    SECTIONS[name](Bench(api, Path(tmp), args.rounds, args.size))
        finally:
            assert server.stdin is not None
            server.stdin.close()  # the embedded server exits when its stdin closes
            server.wait(30)


if __name__ == "__main__":
    main()
