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

from lemonkit.backends import handoff, sidecar_env
from lemonkit.formats.headers import HANDOFF_HEADER
from tests.support.paths import REPO

LAUNCH = (
    "import sys; sys.path.insert(0, {repo!r}); import lemonkit.backends as b; "
    "b.RECIPES['stall'] = 'tests.support.fault_engines:StallEngine'; from lemonkit.backends.sidecar import main; main()"
)


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[tuple[httpx.Client, Path]]:
    gate = tmp_path / "gate"
    os.mkfifo(gate)
    sock = tmp_path / "s.sock"
    code = LAUNCH.format(repo=str(REPO))
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


def _hand_over(sock: Path, token: str, connection: socket.socket) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as channel:
        channel.connect(handoff.path_for(str(sock)))
        socket.send_fds(channel, [token.encode()], [connection.fileno()])


def _chunks(data: bytes) -> tuple[list[bytes], bool]:
    """The chunks of a chunked body, and whether it ended with the last chunk."""
    parts = []
    while data:
        size, _, rest = data.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            return parts, rest == b"\r\n"
        parts.append(rest[:n])
        assert rest[n : n + 2] == b"\r\n"
        data = rest[n + 2 :]
    return parts, False


def _read_all(connection: socket.socket) -> bytes:
    data = b""
    while part := connection.recv(65536):
        data += part
    return data


def test_a_handed_over_connection_gets_the_stream_in_chunks(sidecar: tuple[httpx.Client, Path], tmp_path: Path) -> None:
    client, gate = sidecar
    sock = tmp_path / "s.sock"  # the fixture's
    ours, theirs = socket.socketpair()
    body = {"messages": [], "stream": True}
    with client.stream("POST", "/v1/chat/completions", json=body, headers={HANDOFF_HEADER: "1"}) as response:
        assert response.status_code == 200
        _hand_over(sock, response.headers[HANDOFF_HEADER], theirs)
        theirs.close()
        assert ours.recv(64).startswith(b"8\r\n: ping\n\n\r\n")  # the sidecar writes now; the front stays silent
        _open_gate(gate, "hello")
        parts, complete = _chunks(_read_all(ours))  # ends: the sidecar closed its end
        answer = json.loads(response.read())
    assert complete and answer == {"ended": "done"}
    events = [p for p in parts if p != b": ping\n\n"]
    assert json.loads(events[0][6:])["choices"][0]["delta"]["content"] == "hello"
    assert events[-1] == b"data: [DONE]\n\n"


def test_a_client_that_leaves_ends_a_handed_over_stream(sidecar: tuple[httpx.Client, Path], tmp_path: Path) -> None:
    client, gate = sidecar
    sock = tmp_path / "s.sock"  # the fixture's
    ours, theirs = socket.socketpair()
    with client.stream(
        "POST", "/v1/chat/completions", json={"messages": [], "stream": True}, headers={HANDOFF_HEADER: "1"}
    ) as response:
        _hand_over(sock, response.headers[HANDOFF_HEADER], theirs)
        theirs.close()
        ours.recv(64)
        ours.close()
        answer = json.loads(response.read())
    assert answer == {"ended": "client"}
    _open_gate(gate, "late")  # the engine's thread was waiting for its cue; the stream was already stopped


def test_a_connection_for_no_waiting_answer_is_closed(sidecar: tuple[httpx.Client, Path], tmp_path: Path) -> None:
    client, _ = sidecar
    sock = tmp_path / "s.sock"  # the fixture's
    ours, theirs = socket.socketpair()
    _hand_over(sock, "no-such-token", theirs)
    theirs.close()
    assert _read_all(ours) == b""  # the sidecar closed the one copy left
    assert client.get("/health").json()["status"] == "ok"


def test_sidecar_env_asks_for_huge_pages_and_a_short_spin_for_llamacpp_only() -> None:
    assert sidecar_env("llamacpp", {"PATH": "/bin"}) == {
        "PATH": "/bin",
        "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1",
        "GOMP_SPINCOUNT": "10000",
    }
    joined = sidecar_env("llamacpp", {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert joined["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    # the operator's own choices stand, and an engine not measured with them keeps the server's environment
    mine = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0", "OMP_WAIT_POLICY": "ACTIVE"}
    assert sidecar_env("llamacpp", mine) == mine
    assert sidecar_env("llamacpp", {"GOMP_SPINCOUNT": "0"})["GOMP_SPINCOUNT"] == "0"
    assert sidecar_env("kokoro", {"PATH": "/bin"}) == {"PATH": "/bin"}
