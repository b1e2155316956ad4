"""The sidecar process on its own: framing, heartbeats and failures, with a fault-injecting engine."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

LAUNCH = (
    "import sys; sys.path.insert(0, {tests!r}); import lemonkit.backends as b; "
    "b.RECIPES['stall'] = 'fault_engines:StallEngine'; from lemonkit.backends.sidecar import main; main()"
)


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[tuple[httpx.Client, Path]]:
    gate = tmp_path / "gate"
    os.mkfifo(gate)
    sock = tmp_path / "s.sock"
    code = LAUNCH.format(tests=str(Path(__file__).parent))
    process = subprocess.Popen(
        [sys.executable, "-c", code, "--socket", str(sock), "--ping-interval", "0.05"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert process.stdin and process.stdout
    process.stdin.write(json.dumps({"recipe": "stall", "model_path": str(gate), "type": "llm"}).encode() + b"\n")
    process.stdin.flush()
    ready = json.loads(process.stdout.readline())
    assert ready["ready"] and ready["pid"] == process.pid
    assert sock.stat().st_mode & 0o777 == 0o600
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://sidecar", timeout=30) as client:
        yield client, gate
    process.stdin.close()  # the sidecar exits when its parent's pipe closes
    assert process.wait(10) == 0


def _open_gate(gate: Path, cue: str) -> None:
    with open(gate, "w") as f:
        f.write(cue + "\n")


def test_pings_while_the_engine_is_silent(sidecar: tuple[httpx.Client, Path]) -> None:
    client, gate = sidecar
    body = {"model": "m", "messages": [], "stream": True}
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(lines) == ": ping"  # headers went out and the client hears from us during the stall
        _open_gate(gate, "hello")
        rest = [line for line in lines if line and line != ": ping"]
    assert json.loads(rest[0][6:])["choices"][0]["delta"]["content"] == "hello"
    assert rest[-1] == "data: [DONE]"


def test_engine_failure_mid_stream_is_one_error_event(sidecar: tuple[httpx.Client, Path]) -> None:
    client, gate = sidecar
    with client.stream("POST", "/v1/chat/completions", json={"messages": [], "stream": True}) as response:
        lines = response.iter_lines()
        assert next(lines) == ": ping"
        _open_gate(gate, "fail")
        rest = [line for line in lines if line and line != ": ping"]
    assert len(rest) == 1 and "[DONE]" not in rest[0]
    error = json.loads(rest[0][6:])["error"]
    assert error["type"] == "backend_error" and "engine failed" in error["message"]


def test_error_before_streaming_keeps_its_status(sidecar: tuple[httpx.Client, Path]) -> None:
    client, _ = sidecar
    response = client.post("/v1/chat/completions", json={"messages": "refuse", "stream": True})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_argument"


def test_a_client_that_leaves_a_non_streamed_answer_stops_the_engine(sidecar: tuple[httpx.Client, Path]) -> None:
    client, gate = sidecar
    body = json.dumps({"messages": "until-cancelled"}).encode()
    request = b"POST /v1/chat/completions HTTP/1.1\r\nHost: sidecar\r\nContent-Type: application/json\r\n"
    request += b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    sock_path = str(gate.parent / "s.sock")
    with socket.socket(socket.AF_UNIX) as leaving:
        leaving.connect(sock_path)
        leaving.sendall(request)
        with open(gate) as cue:
            assert cue.readline().strip() == "started"  # the engine is generating
    # one worker, first come first served: this answer comes once the abandoned one has stopped
    counted = client.post("/v1/chat/completions", json={"messages": "count-cancelled"})
    assert counted.json() == {"cancelled": 1}


def test_health(sidecar: tuple[httpx.Client, Path]) -> None:
    client, _ = sidecar
    assert client.get("/health").json()["status"] == "ok"
