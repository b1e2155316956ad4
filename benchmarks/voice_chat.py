#!/usr/bin/env python3
"""The voice-chat recipe against the same turn made of three calls, side by side in one run.

One ``lemonkit serve --embedded`` subprocess on the bundled models (Whisper tiny.en, SmolLM2-135M, Piper joe). The
question is Piper's own "Tell me a story about a cat." (made once through the server). Alternately, ``--repeats``
times each, with the models loaded:

- recipe: ``POST /api/v1/recipes/run`` with ``stream: true``: the reply's first audio arrives with the first
  ``tts`` event, while the reply is still being generated;
- three calls: ``audio/transcriptions``, then ``chat/completions`` (not streamed), then ``audio/speech`` of the
  whole reply: the first audio is the last answer.

Printed: medians of the seconds to the first audio and to the end of the turn, and their ratios (three calls /
recipe). The same greedy reply both ways (``temperature: 0``, the same ``max_tokens``).

    python benchmarks/voice_chat.py [--repeats 3] [--max-tokens 80]
"""

from __future__ import annotations

import argparse
import base64
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx
from embeddings import _serve  # one embedded `lemonkit serve` per benchmark, started alike

ASR, CHAT, TTS = "Whisper-Tiny-En-Bundled", "SmolLM2-135M-Instruct-Bundled", "Piper-Joe-Medium-Bundled"
QUESTION = "Tell me a story about a cat."
SYSTEM = "You are a helpful assistant in a spoken conversation. Answer in plain sentences, without lists or markdown."


def recipe(client: httpx.Client, wav: bytes, max_tokens: int) -> tuple[float, float]:
    """(seconds to the first audio, seconds to the end) of one streamed recipe run."""
    options = {"conversation.temperature": 0, "conversation.max_tokens": max_tokens}
    body = {
        "recipe": "voice-chat",
        "stream": True,
        "request": {"audio_base64": base64.b64encode(wav).decode(), "options": options},
    }
    start, first = time.perf_counter(), None
    with client.stream("POST", "recipes/run", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if first is None and line.startswith("data: {") and '"role": "tts", "audio"' in line:
                first = time.perf_counter() - start
    assert first is not None, "no audio"
    return first, time.perf_counter() - start


def three_calls(client: httpx.Client, wav: bytes, max_tokens: int) -> tuple[float, float]:
    """The same turn as transcription, chat and speech, one after the other."""
    start = time.perf_counter()
    heard = client.post("audio/transcriptions", data={"model": ASR}, files={"file": ("q.wav", wav)})
    heard.raise_for_status()
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": heard.json()["text"].strip()}]
    chat = client.post(
        "chat/completions", json={"model": CHAT, "messages": messages, "temperature": 0, "max_tokens": max_tokens}
    )
    chat.raise_for_status()
    reply = chat.json()["choices"][0]["message"]["content"]
    client.post("audio/speech", json={"model": TTS, "input": reply, "response_format": "pcm"}).raise_for_status()
    wall = time.perf_counter() - start
    return wall, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=80)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        server, api = _serve(Path(cache))
        try:
            with httpx.Client(base_url=api, timeout=600) as client:
                speech = client.post("audio/speech", json={"model": TTS, "input": QUESTION, "response_format": "wav"})
                speech.raise_for_status()
                wav = speech.content
                recipe(client, wav, args.max_tokens)  # loads the three models
                runs: dict[str, list[tuple[float, float]]] = {"recipe": [], "three calls": []}
                for _ in range(args.repeats):
                    runs["recipe"].append(recipe(client, wav, args.max_tokens))
                    runs["three calls"].append(three_calls(client, wav, args.max_tokens))
        finally:
            server.terminate()
            server.wait(30)
    medians = {
        name: (statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows))
        for name, rows in runs.items()
    }
    for name, (first, wall) in medians.items():
        print(f"{name:12s} first audio {first:6.2f} s   whole turn {wall:6.2f} s")
    ratios = [medians["three calls"][i] / medians["recipe"][i] for i in (0, 1)]
    print(json.dumps({"first_audio_ratio": round(ratios[0], 2), "whole_turn_ratio": round(ratios[1], 2)}))


if __name__ == "__main__":
    main()
