#!/usr/bin/env python3
"""Audio through lemonkit's API against the engines called directly, side by side in one run.

Sections (each a function taking the :class:`Bench`; add one to :data:`SECTIONS` to extend the run):

- ``transcription``: real-time factor (wall time / audio duration) of the bundled Whisper tiny.en on espeak-ng
  speech through ``POST /api/v1/audio/transcriptions`` of one ``lemonkit serve`` subprocess, against faster-whisper
  called in this process with the engine's settings (beam 5, 2 threads), runs interleaved; the ratio
  direct / API is the API's speed relative to the engine's (target >= 0.95);
- ``wer``: word error rate of each bundled Whisper model on the espeak-ng sentences of ``tests/support/speech.py``;
- ``realtime``: time to the first interim delta and to the completed transcript on ``WS /realtime``, speech sent in
  real time as a microphone would;
- ``tts``: text-to-speech RTF through ``POST /api/v1/audio/speech`` against each engine called directly, and time to
  the first streamed chunk (``benchmarks/text_to_speech.py``).

    python benchmarks/audio.py [--rounds 5] [--sections transcription,wer,realtime,tts]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the espeak-ng sentences of tests/support/speech.py
from embeddings import _serve  # one embedded `lemonkit serve` per benchmark, started alike
from text_to_speech import section as tts

from tests.support.speech import SENTENCES, speech_wav, word_error_rate

WHISPER_MODELS = ("Whisper-Tiny-En-Bundled", "Whisper-Base-Bundled")
THREADS = 2
BEAM = 5


@dataclass
class Bench:
    """What every section uses: the API's client, lemonkit's cache, and the run's settings."""

    api: httpx.Client
    cache: Path
    rounds: int


def _request(api: httpx.Client, model: str, audio: bytes) -> dict[str, Any]:
    response = api.post("audio/transcriptions", data={"model": model}, files={"file": ("speech.wav", audio)})
    response.raise_for_status()
    answer: dict[str, Any] = response.json()
    return answer


def _transcribe(api: httpx.Client, model: str, audio: bytes) -> str:
    return str(_request(api, model, audio)["text"])


def _model_dir(cache: Path, name: str) -> str:
    from lemonkit.catalog.registry import Registry

    registry = Registry(cache, hf_cache=cache / "hub")
    return str(registry.resolve(registry.get(name)).main)


def transcription(bench: Bench) -> None:
    """RTF through the API vs faster-whisper in this process, on one clip of every sentence (medians)."""
    from faster_whisper import WhisperModel

    from lemonkit.formats.audio_codec import decode

    model = WHISPER_MODELS[0]
    clip = speech_wav(" ".join(SENTENCES))
    duration = decode(clip).duration
    direct_model = WhisperModel(_model_dir(bench.cache, model), device="cpu", cpu_threads=THREADS)

    def direct() -> None:
        samples = decode(clip).samples  # the sidecar decodes the upload too
        segments, _ = direct_model.transcribe(samples, beam_size=BEAM)
        "".join(s.text for s in segments)

    engine_walls: list[float] = []

    def through_api() -> None:
        engine_walls.append(_request(bench.api, model, clip)["timing"]["wall_ms"] / 1000)

    runs: dict[str, list[float]] = {"direct": [], "api": []}
    for run in (direct, through_api):  # warm both: the sidecar's load, the first call's allocations
        run()
    engine_walls.clear()
    for _ in range(bench.rounds):
        for name, run in (("direct", direct), ("api", through_api)):
            start = time.perf_counter()
            run()
            runs[name].append(time.perf_counter() - start)
    rtf = {name: statistics.median(times) / duration for name, times in runs.items()}
    # what the API adds around the engine (upload, base64 hop, decode, answer), measured per request: unlike the
    # RTF ratio, it does not move when other processes compete for the cores between two runs
    overhead = statistics.median(api - engine for api, engine in zip(runs["api"], engine_walls, strict=True))
    print(f"\n## transcription: {model}, {duration:.1f} s of espeak-ng speech, median of {bench.rounds} rounds")
    print(f"{'path':<8} {'RTF':>7}")
    for name, value in rtf.items():
        print(f"{name:<8} {value:7.3f}")
    print(f"API speed relative to direct: {rtf['direct'] / rtf['api']:.3f} (target >= 0.95)")
    print(f"API time around the engine's own: {overhead * 1000:.1f} ms per request (median)")


def wer(bench: Bench) -> None:
    """Word error rate of each bundled Whisper model on each sentence, through the API."""
    clips = [speech_wav(sentence) for sentence in SENTENCES]
    print(f"\n## word error rate on {len(SENTENCES)} espeak-ng sentences")
    print(f"{'model':<26} {'mean WER':>9} {'exact':>6}")
    for model in WHISPER_MODELS:
        rates = [word_error_rate(s, _transcribe(bench.api, model, c)) for s, c in zip(SENTENCES, clips, strict=True)]
        exact = sum(rate == 0 for rate in rates)
        print(f"{model:<26} {statistics.mean(rates):9.3f} {exact:>3}/{len(rates)}")
        bench.api.post("unload", json={"model_name": model})


def realtime(bench: Bench) -> None:
    """Time to the first interim delta and to the completed transcript on ``/realtime``, speech sent as a microphone
    would: 100 ms chunks of PCM16 at 16 kHz, in real time, then a second of silence for the server's VAD."""
    import base64
    import json

    import numpy as np
    from websockets.sync.client import connect

    from lemonkit.formats.audio_codec import decode, pcm16

    model = WHISPER_MODELS[0]
    speech = decode(speech_wav(SENTENCES[0]), sample_rate=16000).samples
    samples = np.concatenate([speech, np.zeros(16000, dtype=np.float32)])
    chunk = 1600
    url = str(bench.api.base_url).replace("http://", "ws://") + f"realtime?model={model}"
    bench.api.post("load", json={"model_name": model}).raise_for_status()
    firsts, finals = [], []
    for _ in range(bench.rounds):
        with connect(url, open_timeout=60) as ws:
            json.loads(ws.recv())  # session.created
            start = time.perf_counter()
            first = end_of_speech = None
            for i in range(0, len(samples), chunk):
                audio = base64.b64encode(pcm16(samples[i : i + chunk])).decode()
                ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": audio}))
                if i + chunk >= len(speech) and end_of_speech is None:
                    end_of_speech = time.perf_counter()
                deadline = start + (i + chunk) / 16000
                while (wait := deadline - time.perf_counter()) > 0:
                    try:
                        event = json.loads(ws.recv(timeout=wait))
                    except TimeoutError:
                        break
                    if event["type"].endswith("transcription.delta") and first is None:
                        first = time.perf_counter() - start
            while True:
                event = json.loads(ws.recv(timeout=120))
                if event["type"].endswith("transcription.delta") and first is None:
                    first = time.perf_counter() - start
                if event["type"].endswith("transcription.completed"):
                    assert end_of_speech is not None
                    finals.append(time.perf_counter() - end_of_speech)
                    break
            if first is not None:
                firsts.append(first)
    print(f"\n## realtime: {len(speech) / 16000:.1f} s of speech sent in real time, median of {bench.rounds} sessions")
    if firsts:
        print(f"first interim delta after the first audio: {statistics.median(firsts) * 1000:.0f} ms")
    print(
        f"completed transcript after the speech ended: {statistics.median(finals) * 1000:.0f} ms (VAD silence included)"
    )
    bench.api.post("unload", json={"model_name": model})


SECTIONS: dict[str, Callable[[Bench], None]] = {
    "transcription": transcription,
    "wer": wer,
    "realtime": realtime,
    "tts": tts,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated: " + ", ".join(SECTIONS))
    args = parser.parse_args()
    chosen = [name.strip() for name in args.sections.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in SECTIONS]
    if unknown:
        parser.error(f"unknown sections: {', '.join(unknown)}")
    with tempfile.TemporaryDirectory(prefix="lemonkit-audio-bench-") as tmp:
        server, url = _serve(Path(tmp))
        try:
            with httpx.Client(base_url=url, timeout=600) as api:
                for name in chosen:
                    SECTIONS[name](Bench(api, Path(tmp), args.rounds))
        finally:
            assert server.stdin is not None
            server.stdin.close()  # the embedded server exits when its stdin closes
            server.wait(timeout=60)


if __name__ == "__main__":
    main()
