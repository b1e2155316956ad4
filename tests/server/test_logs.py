"""``WS /logs/stream`` on both hosts: where health says it is, snapshot, live entries, resume with ``after_seq``,
bad messages, auth."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from tornado.httpclient import HTTPClientError, HTTPRequest
from tornado.websocket import WebSocketClientConnection, websocket_connect

from tests.support.hosts import Host
from tests.support.tiny_models import TINY

FIELDS = {"seq", "timestamp", "severity", "tag", "line"}
TIMESTAMP = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}")


def _url(host: Host, query: str = "") -> str:
    return host.root.replace("http://", "ws://", 1) + "logs/stream" + query


async def _connect(host: Host, *, how: str = "header") -> WebSocketClientConnection:
    """Open the stream with the host's credentials in a header, in the query (``?api_key=`` / ``?token=``)
    or (``how="none"``) without any."""
    if how == "query":
        name = "api_key" if host.kind == "standalone" else "token"
        return await websocket_connect(_url(host, f"?{name}={host.token}"))
    headers = host.headers if how == "header" else {}
    return await websocket_connect(HTTPRequest(_url(host), headers=headers))


async def _recv(ws: WebSocketClientConnection, timeout: float = 20) -> dict[str, Any]:
    raw = await asyncio.wait_for(ws.read_message(), timeout)
    assert raw is not None, "the server closed the stream"
    message: dict[str, Any] = json.loads(raw)
    return message


async def _subscribe(ws: WebSocketClientConnection, after_seq: int | None = None) -> list[dict[str, Any]]:
    await ws.write_message(json.dumps({"type": "logs.subscribe", "after_seq": after_seq}))
    snapshot = await _recv(ws)
    assert snapshot["type"] == "logs.snapshot"
    entries: list[dict[str, Any]] = snapshot["entries"]
    return entries


async def _until(ws: WebSocketClientConnection, needle: str) -> tuple[dict[str, Any], list[int]]:
    """Live entries up to the first whose line contains ``needle``: that entry, and every seq seen."""
    seqs = []
    while True:
        message = await _recv(ws)
        assert message["type"] == "logs.entry", message
        seqs.append(message["entry"]["seq"])
        if needle in message["entry"]["line"]:
            return message["entry"], seqs


def _check_entry(entry: dict[str, Any]) -> None:
    assert set(entry) == FIELDS
    assert isinstance(entry["seq"], int) and TIMESTAMP.fullmatch(entry["timestamp"])
    assert entry["severity"] in {"Trace", "Debug", "Info", "Warning", "Error", "Fatal"}
    assert entry["line"].startswith(f"{entry['timestamp']} [{entry['severity']}] ({entry['tag']}) ")


async def test_snapshot_then_live_entries(host: Host) -> None:
    ws = await _connect(host)
    try:
        async with host.client() as client:
            await client.get("health")  # something in the history even on a fresh server
            entries = await _subscribe(ws)
            for entry in entries:
                _check_entry(entry)
            seqs = [e["seq"] for e in entries]
            assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)

            # a request that logs, and a sidecar whose stderr speaks (llama.cpp's verbose log)
            response = await client.post("load", json={"model_name": TINY, "llamacpp_args": "-v"})
            assert response.status_code == 200, response.text
        loaded, live = await _until(ws, f"loaded {TINY}")
        _check_entry(loaded)
        assert loaded["severity"] == "Info" and loaded["tag"] == "manager"
        assert live == sorted(live) and (not seqs or live[0] > seqs[-1])
    finally:
        ws.close()
    # the sidecar's output came in under the model's name, before the manager saw it ready
    ws = await _connect(host)
    try:
        history = await _subscribe(ws, live[0] - 1)
        assert any(e["tag"] == TINY for e in history if e["seq"] < loaded["seq"])
    finally:
        ws.close()


async def test_health_advertises_where_the_stream_is(host: Host) -> None:
    root = urlsplit(host.root)
    async with host.client() as client:
        health = (await client.get("health")).json()
        # the same answer under every prefix: the path is found from the route, not from the prefix asked
        for prefix in ("v0/", "v1/", "api/v0/"):
            other = (await client.get(host.root + prefix + "health")).json()
            assert (other["websocket_port"], other["websocket_path"]) == (
                health["websocket_port"],
                health["websocket_path"],
            )
    # the port this test connected to (the standalone's was OS-assigned: --port 0), and the path under the
    # host's mount: the spec's /logs/stream standalone, {base_url}lemonkit/logs/stream in Jupyter
    assert health["websocket_port"] == root.port and isinstance(health["websocket_port"], int)
    assert health["websocket_path"] == root.path + "logs/stream"
    if host.kind == "standalone":
        assert health["websocket_path"] == "/logs/stream"
    # a client that only follows health's fields reaches the stream
    url = f"ws://{root.hostname}:{health['websocket_port']}{health['websocket_path']}"
    ws = await websocket_connect(HTTPRequest(url, headers=host.headers))
    try:
        await _subscribe(ws)
    finally:
        ws.close()


async def test_reconnect_with_after_seq_gets_only_newer_entries(host: Host) -> None:
    ws = await _connect(host)
    entries = await _subscribe(ws)
    last = entries[-1]["seq"] if entries else 0
    ws.close()

    async with host.client() as client:  # logged while nobody listens: a refused unload
        assert (await client.post("unload", json={"model_name": TINY})).status_code == 404

    ws = await _connect(host, how="query")
    try:
        newer = await _subscribe(ws, last)
        assert newer and all(e["seq"] > last for e in newer)
        assert newer[0]["seq"] == last + 1  # nothing skipped either
        assert any("/unload -> 404" in e["line"] for e in newer)
        # subscribing again on the same socket starts over from its after_seq
        assert await _subscribe(ws, newer[-1]["seq"]) == []
        # an after_seq from an earlier server process (beyond the last seq) gets the whole history
        everything = await _subscribe(ws, 10**12)
        assert everything and everything[-1]["seq"] >= newer[-1]["seq"]
    finally:
        ws.close()


@pytest.mark.parametrize(
    ("message", "code"),
    [
        ("not json", "invalid_json"),
        ('["logs.subscribe"]', "invalid_json"),
        ('{"type": "logs.unsubscribe"}', "invalid_argument"),
        ('{"after_seq": 3}', "invalid_argument"),
        ('{"type": "logs.subscribe", "after_seq": "3"}', "invalid_argument"),
        ('{"type": "logs.subscribe", "after_seq": true}', "invalid_argument"),
        ('{"type": "logs.subscribe", "after_seq": 2.5}', "invalid_argument"),
        ("[" * 5000 + "]" * 5000, "invalid_json"),
        ('{"type": "logs.subscribe", "after_seq": ' + "[" * 3000 + "]" * 3000 + "}", "invalid_json"),
    ],
)
async def test_bad_message_is_an_error_message(host: Host, message: str, code: str) -> None:
    ws = await _connect(host)
    try:
        await ws.write_message(message)
        error = await _recv(ws)
        assert error["type"] == "error" and error["error"]["code"] == code and error["error"]["message"]
        assert error["error"]["type"] == "invalid_request_error"
        await _subscribe(ws)  # the connection is still good
    finally:
        ws.close()


async def test_refused_without_credentials(host: Host) -> None:
    for request in (_url(host), _url(host, "?api_key=wrong&token=wrong")):
        with pytest.raises(HTTPClientError) as refused:
            await websocket_connect(request)
        assert refused.value.code == 401
        assert refused.value.response is not None
        assert json.loads(refused.value.response.body)["error"]["code"] == "invalid_api_key"
    with pytest.raises(HTTPClientError) as refused:
        await websocket_connect(HTTPRequest(_url(host), headers={"Authorization": "Bearer wrong"}))
    assert refused.value.code == 401


async def test_plain_http_request_is_a_json_error(host: Host) -> None:
    async with httpx.AsyncClient(headers=host.headers) as client:
        response = await client.get(_url(host).replace("ws://", "http://", 1))
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "not_websocket"


async def test_cross_origin_upgrades(host: Host) -> None:
    evil = HTTPRequest(_url(host), headers={**host.headers, "Origin": "http://evil.example"})
    if host.kind == "jupyter":
        # Jupyter checks origins only for cookie-authenticated requests: a token is no ambient credential
        (await websocket_connect(evil)).close()
    else:
        with pytest.raises(HTTPClientError) as refused:
            await websocket_connect(evil)
        assert refused.value.code == 403 and refused.value.response is not None
        assert json.loads(refused.value.response.body)["error"]["code"] == "forbidden_origin"
    root = urlsplit(host.root)
    same = HTTPRequest(_url(host), headers={**host.headers, "Origin": f"{root.scheme}://{root.netloc}"})
    (await websocket_connect(same)).close()


async def test_a_snapshot_fits_what_websocket_clients_take(jupyter_host: Host) -> None:
    """However much the history holds, the snapshot is the newest entries within 1 MB, which Python's websockets
    client (1 MiB by default) reads; an entry is at most 8 KB whatever was logged."""
    import websockets

    from lemonkit.server.logs import SNAPSHOT_BYTES
    from lemonkit.serving.log_store import MAX_LINE, STORE

    for i in range(1500):
        STORE.add("Info", "bulk", f"{i:05d} " + "y" * 4000)
    huge = STORE.add("Info", "bulk", "z" * 2_000_000)  # a request echoing a 2 MB name
    assert len(huge["line"]) < MAX_LINE + 200 and huge["line"].endswith("more characters)")
    async with websockets.connect(_url(jupyter_host), additional_headers=jupyter_host.headers) as ws:
        await ws.send(json.dumps({"type": "logs.subscribe", "after_seq": None}))
        raw = await asyncio.wait_for(ws.recv(), 20)
    assert len(raw) <= SNAPSHOT_BYTES
    snapshot = json.loads(raw)
    seqs = [e["seq"] for e in snapshot["entries"]]
    assert (
        snapshot["type"] == "logs.snapshot" and seqs[-1] == huge["seq"] and seqs == list(range(seqs[0], seqs[-1] + 1))
    )
    assert 100 < len(seqs) < 1500  # the newest that fit, not all


async def test_slow_subscriber_skips_instead_of_queueing(jupyter_host: Host) -> None:
    """A subscriber that stops reading costs no memory: once the socket buffers are full its sender waits, and
    what scrolls out of the 5000-entry window meanwhile is skipped (a gap in seq), never queued for it."""
    from lemonkit.serving.log_store import CAPACITY, STORE  # the Jupyter host runs in this process

    ws = await _connect(jupyter_host)
    try:
        await _subscribe(ws)
        first = STORE.last_seq + 1
        flood = 20 * CAPACITY
        for i in range(flood):  # ~1 KB a line: far more than the socket buffers hold
            STORE.add("Info", "flood", f"{i:06d} " + "x" * 1000)
            if i % 200 == 0:
                await asyncio.sleep(0)  # let the sender run (and block on the full socket)
        seqs = []
        while not seqs or seqs[-1] < first + flood - 1:
            message = await _recv(ws)
            if message["entry"]["tag"] == "flood":
                seqs.append(message["entry"]["seq"])
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
        assert len(seqs) < flood  # some were skipped...
        assert seqs[-CAPACITY:] == list(range(first + flood - CAPACITY, first + flood))  # ...never the newest
    finally:
        ws.close()
