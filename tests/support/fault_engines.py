"""Engines that only inject faults into the sidecar's machinery (no inference)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from lemonkit.errors import InvalidArgument


class StallEngine:
    """Streams one chunk only after a line arrives on the FIFO named by the model path: a long prompt, on cue."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.gate = spec["model_path"]
        self.cancelled = 0

    def chat(self, body: dict[str, Any], *, cancelled: Any) -> Iterator[dict[str, Any]] | dict[str, Any]:
        if body.get("messages") == "refuse":
            raise InvalidArgument("refused up front")
        if body.get("messages") == "until-cancelled":  # a long non-streamed answer: says when it starts
            with open(self.gate, "w") as gate:
                gate.write("started\n")
            deadline = time.monotonic() + 30
            while not cancelled() and time.monotonic() < deadline:
                time.sleep(0.005)  # an engine between two tokens
            self.cancelled += bool(cancelled())
            return {"cancelled": bool(cancelled())}
        if body.get("messages") == "count-cancelled":
            return {"cancelled": self.cancelled}
        return self._stream(body)

    def _stream(self, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        with open(self.gate) as gate:
            cue = gate.readline().strip()
        if cue == "fail":
            raise RuntimeError("engine failed mid-stream")
        yield {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": cue}}]}

    def stats(self) -> dict[str, Any]:
        return {}

    def info(self) -> dict[str, Any]:
        return {"device": "cpu"}

    def close(self) -> None:
        pass
