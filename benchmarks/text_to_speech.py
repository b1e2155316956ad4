#!/usr/bin/env python3
"""Text-to-speech through lemonkit's API against the same engine called directly, side by side in one run.

For each bundled voice (Piper joe, Hibari heart, Kokoro int8), the same text is synthesised, alternately:

- direct: the engine adapter (:mod:`lemonkit.backends.tts`) in this process, as the sidecar runs it;
- API: ``POST /api/v1/audio/speech`` of one ``lemonkit serve --embedded`` subprocess (the model in its sidecar).

Measured: the real-time factor (wall seconds per second of audio; buffered ``pcm``, so no encoding cost on either
side) and the time to the first chunk of a raw PCM stream (``stream_format: "audio"``). The target is an API
throughput of at least 0.95 of the direct one (``direct RTF / API RTF``). :func:`tts_rows` is what
``benchmarks/audio.py`` runs as its ``tts`` section (``from text_to_speech import section``).

    python benchmarks/text_to_speech.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from embeddings import _serve  # one embedded `lemonkit serve` per benchmark, started alike

MODELS = ("Piper-Joe-Medium-Bundled", "Hibari-Bundled", "Kokoro-82M-Int8-Bundled")
TEXT = (
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step. "
    "She sells sea shells by the sea shore, and the shells she sells are surely sea shells."
)


def _never() -> bool:
    return False


def _direct(engine: Any, text: str) -> tuple[float, float, float]:
    """(wall seconds, audio seconds, seconds to the first streamed chunk) of the engine in this process."""
    start = time.perf_counter()
    pcm = engine.speak({"input": text, "response_format": "pcm"}, cancelled=_never).content
    wall = time.perf_counter() - start
    start = time.perf_counter()
    chunks = iter(engine.speak({"input": text, "stream_format": "audio"}, cancelled=_never).chunks)
    next(chunks)
    first = time.perf_counter() - start
    for _ in chunks:  # finish the stream, as the sidecar would
        pass
    return wall, len(pcm) / 2 / engine.sample_rate, first


def _api(client: httpx.Client, model: str, text: str, rate: int) -> tuple[float, float, float]:
    """The same three figures through the server."""
    body = {"model": model, "input": text, "response_format": "pcm"}
    start = time.perf_counter()
    answer = client.post("audio/speech", json=body)
    wall = time.perf_counter() - start
    answer.raise_for_status()
    start = time.perf_counter()
    with client.stream("POST", "audio/speech", json={**body, "stream_format": "audio"}) as stream:
        stream.raise_for_status()
        chunks = stream.iter_raw()
        next(chunks)
        first = time.perf_counter() - start
        for _ in chunks:
            pass
    return wall, len(answer.content) / 2 / rate, first


def tts_rows(client: httpx.Client, cache: Path, models: tuple[str, ...] = MODELS, repeats: int = 5) -> list[dict]:
    """One row per model: median RTF and time to first chunk, direct and through ``client`` (the API).

    Args:
        client: An httpx client whose base URL is the server's ``/api/v1/``.
        cache: The lemonkit cache dir the server uses (the direct engines load the same bundled files).
        models: Text-to-speech models to measure.
        repeats: Syntheses per path per model (after one warm-up each).
    """
    from lemonkit.backends import engine_class
    from lemonkit.catalog.registry import Registry

    registry = Registry(cache)
    rows = []
    for model in models:
        info = registry.get(model)
        engine = engine_class(info.recipe)({"model_path": str(registry.resolve(info).main), "type": "tts"})
        client.post("load", json={"model_name": model}).raise_for_status()
        _direct(engine, TEXT), _api(client, model, TEXT, engine.sample_rate)  # warm both
        direct, api = [], []
        for _ in range(repeats):  # alternated, so that both see the same machine
            direct.append(_direct(engine, TEXT))
            api.append(_api(client, model, TEXT, engine.sample_rate))
        client.post("unload", json={"model_name": model}).raise_for_status()
        engine.close()

        rows.append(
            {
                "model": model,
                "audio_s": api[0][1],
                "direct_rtf": statistics.median(wall / audio for wall, audio, _ in direct),
                "api_rtf": statistics.median(wall / audio for wall, audio, _ in api),
                "direct_first_ms": 1000 * statistics.median(first for *_, first in direct),
                "api_first_ms": 1000 * statistics.median(first for *_, first in api),
            }
        )
    return rows


def section(bench: Any) -> None:
    """``benchmarks/audio.py``'s ``tts`` section: ``bench`` has ``api`` (the client), ``cache`` and ``rounds``."""
    print(f"\n## text-to-speech: {len(TEXT)} characters, 3 sentences, median of {bench.rounds} rounds")
    print_rows(tts_rows(bench.api, bench.cache, repeats=bench.rounds))


def print_rows(rows: list[dict]) -> None:
    print(
        f"{'model':<26} {'audio s':>7} {'RTF direct':>10} {'RTF API':>8} {'API/direct':>10} "
        f"{'1st chunk direct ms':>19} {'1st chunk API ms':>16}"
    )
    for r in rows:
        ratio = r["direct_rtf"] / r["api_rtf"]
        print(
            f"{r['model']:<26} {r['audio_s']:>7.2f} {r['direct_rtf']:>10.4f} {r['api_rtf']:>8.4f} {ratio:>10.3f} "
            f"{r['direct_first_ms']:>19.1f} {r['api_first_ms']:>16.1f}"
        )
    print("API/direct is direct RTF / API RTF (throughput through the API relative to the engine; target >= 0.95)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="lemonkit-bench-") as tmp:
        server, api = _serve(Path(tmp))
        try:
            with httpx.Client(base_url=api, timeout=300) as client:
                rows = tts_rows(client, Path(tmp), tuple(args.models), args.repeats)
        finally:
            assert server.stdin is not None
            server.stdin.close()  # the embedded server exits when its stdin closes
            server.wait(30)
    print(f"{len(TEXT)} characters, 3 sentences, medians of {args.repeats}")
    print_rows(rows)


if __name__ == "__main__":
    main()
