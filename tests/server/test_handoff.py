"""A stream's connection handed to the model's sidecar (lemonkit.backends.handoff), on both hosts.

The sidecar-killed and client-leaves cases of a handed-off stream are in test_lifecycle.py; they run this path.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import json
import ssl
from pathlib import Path
from typing import Any

import httpx
import psutil
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from tornado.httpserver import HTTPServer
from tornado.netutil import bind_sockets

from tests.support.hosts import Host
from tests.support.tiny_models import TINY

CHAT = {"model": TINY, "messages": [{"role": "user", "content": "go"}], "temperature": 0, "seed": 7}


def _text(events: list[dict]) -> str:
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices"))


def _events(body: bytes | str) -> list[dict]:
    text = body.decode() if isinstance(body, bytes) else body
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


async def _sidecar(client: httpx.AsyncClient) -> psutil.Process:
    await client.post("load", json={"model_name": TINY, "ctx_size": 4096})
    (loaded,) = (await client.get("health")).json()["all_models_loaded"]
    return psutil.Process(loaded["pid"])


async def _raw_stream(host: Host, version: str, body: dict) -> bytes:
    """POST ``body`` to chat/completions over a bare socket and read until the connection closes."""
    url = httpx.URL(host.api + "/chat/completions")
    payload = json.dumps(body).encode()
    head = [
        f"POST {url.raw_path.decode()} {version}",
        f"Host: {url.host}:{url.port}",
        "Content-Type: application/json",
        f"Content-Length: {len(payload)}",
        *(f"{name}: {value}" for name, value in host.headers.items()),
    ]
    reader, writer = await asyncio.open_connection(url.host, url.port)
    writer.write("\r\n".join(head).encode() + b"\r\n\r\n" + payload)
    answer = await reader.read()
    writer.close()
    return answer


async def test_the_sidecar_writes_the_stream_to_the_client(host: Host) -> None:
    async with host.client() as client:
        sidecar = await _sidecar(client)
        # long enough to be still streaming when the test looks (the tiny model writes thousands of tokens/s)
        alone = (await client.post("chat/completions", json={**CHAT, "max_tokens": 3000})).json()
        body = {**CHAT, "max_tokens": 3000, "stream": True, "stream_options": {"include_usage": True}}
        async with client.stream("POST", "chat/completions", json=body) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            assert response.headers["connection"] == "close"
            assert response.headers["transfer-encoding"] == "chunked"
            lines = response.aiter_lines()
            first = await anext(lines)
            mine = response.extensions["network_stream"].get_extra_info("client_addr")
            # the client's connection is open in the sidecar's process: its events come from there
            held = [c for c in sidecar.net_connections(kind="tcp") if c.raddr and c.raddr[:2] == mine[:2]]
            assert len(held) == 1 and held[0].status == psutil.CONN_ESTABLISHED
            rest = [line async for line in lines]
    events = _events("\n".join([first, *rest]))
    assert [line for line in rest if line][-1] == "data: [DONE]"
    assert _text(events) == alone["choices"][0]["message"]["content"]
    assert events[-1]["usage"]["completion_tokens"] == alone["usage"]["completion_tokens"]
    assert not [c for c in sidecar.net_connections(kind="tcp") if c.raddr and c.raddr[:2] == mine[:2]]


async def test_an_http_1_0_client_gets_the_stream_relayed(host: Host) -> None:
    """An HTTP/1.0 response is not chunked: the server relays the stream itself, closing the connection at its end."""
    async with host.client() as client:
        await _sidecar(client)
        alone = (await client.post("chat/completions", json={**CHAT, "max_tokens": 40})).json()
    answer = await _raw_stream(host, "HTTP/1.0", {**CHAT, "max_tokens": 40, "stream": True})
    headers, _, body = answer.partition(b"\r\n\r\n")
    assert headers.startswith(b"HTTP/1.1 200")
    assert b"transfer-encoding" not in headers.lower()
    assert body.rstrip().endswith(b"data: [DONE]")
    assert _text(_events(body)) == alone["choices"][0]["message"]["content"]


async def test_streams_handed_off_together_all_complete(host: Host) -> None:
    async def one(client: httpx.AsyncClient, seed: int) -> tuple[str, str]:
        body = {**CHAT, "seed": seed, "temperature": 0.8, "max_tokens": 30}
        alone = (await client.post("chat/completions", json=body)).json()["choices"][0]["message"]["content"]
        async with client.stream("POST", "chat/completions", json={**body, "stream": True}) as response:
            streamed = _text(_events(await response.aread()))
        return alone, streamed

    async with host.client() as client:
        await _sidecar(client)
        pairs = await asyncio.gather(*(one(client, seed) for seed in range(4)))
    assert all(alone and alone == streamed for alone, streamed in pairs)


def _self_signed(directory: Path) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    encoding, fmt = serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8
    key_path.write_bytes(key.private_bytes(encoding, fmt, serialization.NoEncryption()))
    return cert_path, key_path


async def test_a_tls_connection_gets_the_stream_relayed(
    jupyter_host: Host, jp_serverapp: Any, jp_base_url: str, tmp_path: Path
) -> None:
    """A Jupyter server with a certificate: the sidecar cannot write into the server's TLS session, so the server
    relays the stream, and the connection stays open for the next request."""
    cert, key = _self_signed(tmp_path)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    sockets = bind_sockets(0, "127.0.0.1")
    server = HTTPServer(jp_serverapp.web_app, ssl_options=context)
    server.add_sockets(sockets)
    root = f"https://127.0.0.1:{sockets[0].getsockname()[1]}{jp_base_url}lemonkit/api/v1/"
    trust = ssl.create_default_context(cafile=str(cert))
    try:
        async with httpx.AsyncClient(base_url=root, headers=jupyter_host.headers, verify=trust, timeout=120) as client:
            sidecar = await _sidecar(client)
            alone = (await client.post("chat/completions", json={**CHAT, "max_tokens": 40})).json()
            body = {**CHAT, "max_tokens": 40, "stream": True}
            async with client.stream("POST", "chat/completions", json=body) as response:
                assert response.status_code == 200 and "connection" not in response.headers
                lines = response.aiter_lines()
                first = await anext(lines)
                mine = response.extensions["network_stream"].get_extra_info("client_addr")
                assert not [c for c in sidecar.net_connections(kind="tcp") if c.raddr and c.raddr[:2] == mine[:2]]
                rest = [line async for line in lines]
            assert _text(_events("\n".join([first, *rest]))) == alone["choices"][0]["message"]["content"]
            assert (await client.get("health")).status_code == 200
    finally:
        server.stop()
        await server.close_all_connections()


async def test_a_handed_off_stream_counts_as_jupyter_activity(jupyter_host: Host, jp_serverapp: Any) -> None:
    """JupyterHub's idle culler reads the server's last API activity; a stream the sidecar wrote still records it."""
    settings = jp_serverapp.web_app.settings
    async with jupyter_host.client() as client:
        await _sidecar(client)
    before = settings["api_last_activity"]
    # read until both the sidecar and the server have closed the connection
    answer = await _raw_stream(jupyter_host, "HTTP/1.1", {**CHAT, "max_tokens": 20, "stream": True})
    assert b"connection: close" in answer.partition(b"\r\n\r\n")[0].lower()  # handed off
    assert answer.endswith(b"0\r\n\r\n")
    assert settings["api_last_activity"] > before
