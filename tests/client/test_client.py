"""``lemonkit.Client`` / ``AsyncClient``: requests, streams and errors against both hosts, and finding a server
(``LEMONKIT_URL``, the kernel's Jupyter server, the embedded one)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import psutil
import pytest

import lemonkit
from lemonkit.client import AsyncClient, Client, ServerUnavailable, discovery
from lemonkit.client.discovery import api_root, host_root
from tests.support.hosts import API_KEY, Host, Standalone
from tests.support.jupyter_process import JupyterServer
from tests.support.tiny_models import TINY


def _chat(client: Client) -> str:
    body = {"model": TINY, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True}
    events = list(client.events("chat/completions", body))
    assert events and all(e.name == "message" for e in events)
    return "".join(e.data["choices"][0]["delta"].get("content") or "" for e in events if e.data["choices"])


async def test_client_on_both_hosts(host: Host) -> None:
    def calls() -> None:
        with Client(host.root, token=host.token) as client:
            assert client.server.api == host.api and client.server.kind == "url"
            assert TINY in [m["id"] for m in client.models()]
            assert client.model(TINY)["downloaded"] is True
            assert client.load(TINY, ctx_size=512)["status"] == "success"
            assert client.health()["model_loaded"] == TINY
            assert len(_chat(client)) > 0
            with pytest.raises(lemonkit.ModelNotFound) as missing:
                client.load("user.no-such-model")
            assert (missing.value.status, missing.value.code) == (404, "model_not_found")
            with pytest.raises(lemonkit.InvalidRequest) as bad:
                client.load(TINY, ctx_size="big")
            assert bad.value.code == "invalid_argument" and isinstance(bad.value, ValueError)
            assert client.unload()["status"] == "success"

    await asyncio.to_thread(calls)


async def test_async_client_on_both_hosts(host: Host) -> None:
    async with AsyncClient(host.root, token=host.token) as client:
        assert (await client.model(TINY))["id"] == TINY
        body = {"model": TINY, "prompt": "one two", "max_tokens": 4, "stream": True}
        chunks = [event.data async for event in client.events("completions", body)]
        assert len(chunks) >= 4 and chunks[0]["object"] == "text_completion"
        with pytest.raises(lemonkit.ModelNotFound):
            await client.delete("user.no-such-model")
        await client.unload()


async def test_wrong_credentials_raise_unauthorized(host: Host) -> None:
    def call() -> None:
        with Client(host.root, token="wrong") as client, pytest.raises(lemonkit.Unauthorized) as refused:
            client.models()
        assert refused.value.status == 401 and isinstance(refused.value, PermissionError)

    await asyncio.to_thread(call)


def test_an_error_event_raises_its_class() -> None:
    from httpx_sse import ServerSentEvent

    from lemonkit.client._client import _event

    error = {"error": {"message": "engine died", "type": "backend_error", "code": "backend_error"}}
    assert _event(ServerSentEvent(data='{"choices": []}')).data == {"choices": []}  # type: ignore[union-attr]
    with pytest.raises(lemonkit.LemonkitError) as failed:
        _event(ServerSentEvent(data=json.dumps(error)))
    assert type(failed.value).__name__ == "BackendError" and failed.value.message == "engine died"
    named = _event(ServerSentEvent(event="error", data='{"error": "hub down"}'))
    assert named is not None and (named.name, named.data) == ("error", {"error": "hub down"})  # the caller's
    assert _event(ServerSentEvent(data="[DONE]")) is None


def test_api_root_spellings() -> None:
    assert api_root("http://h:1") == "http://h:1/api/v1"
    assert api_root("http://h:8888/base/lemonkit/") == "http://h:8888/base/lemonkit/api/v1"
    assert api_root("http://h:1/v1") == "http://h:1/v1"
    assert api_root("http://h:1/api/v0/") == "http://h:1/api/v0"
    for url in ("http://h:1/v1", "http://h:1/api/v1", "http://h:1", "http://h:1/v0/"):
        assert host_root(api_root(url)) == "http://h:1"
    assert host_root(api_root("http://h:8888/b/lemonkit")) == "http://h:8888/b/lemonkit"


async def test_lemonkit_url_may_name_any_prefix(host: Host, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LEMONKIT_TOKEN", host.token or "")
    for prefix in ("v1", "api/v0"):
        monkeypatch.setenv("LEMONKIT_URL", host.root + prefix)
        with Client() as client:
            assert TINY in [m["id"] for m in await asyncio.to_thread(client.models)]


def test_an_unreachable_lemonkit_url_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LEMONKIT_URL", "http://127.0.0.1:9")
    with Client() as client, pytest.raises(ServerUnavailable) as unreachable:
        client.models()
    assert "LEMONKIT_URL" in str(unreachable.value) and isinstance(unreachable.value, ConnectionError)


# -- a running standalone server, found through its record ---------------------------------------------------------


def _records(runtime: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(runtime.glob("lemonkit-*.json"))]


def test_a_running_serve_of_this_user_is_found(monkeypatch: pytest.MonkeyPatch, standalone: Standalone) -> None:

    for name in ("LEMONKIT_URL", "LEMONKIT_TOKEN", "LEMONADE_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", standalone.env["JUPYTER_RUNTIME_DIR"])  # where it keeps its record
    monkeypatch.setattr(discovery, "DEFAULT_PORT", standalone.port)
    found = discovery.locate(start=False)
    assert (found.kind, found.api, found.token) == ("standalone", standalone.root + "api/v1", API_KEY)  # its key
    with Client() as client:
        assert TINY in [m["id"] for m in client.models()]


def test_serve_records_itself_until_it_stops(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:

    runtime = tmp_path / "runtime"
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(runtime))
    for name in ("LEMONKIT_URL", "LEMONKIT_TOKEN", "LEMONADE_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    server = Standalone({"JUPYTER_RUNTIME_DIR": str(runtime)})  # no key: other local clients use it as before
    try:
        path = runtime / f"lemonkit-{server.process.pid}.json"
        assert path.stat().st_mode & 0o777 == 0o600
        assert _records(runtime) == [
            {"pid": server.process.pid, "url": server.root.rstrip("/"), "key": None, "kind": "standalone"}
        ]
        monkeypatch.setattr(discovery, "DEFAULT_PORT", server.port)
        with Client() as client:
            assert (client.server.kind, client.server.token) == ("standalone", None)
            assert TINY in [m["id"] for m in client.models()]
    finally:
        server.stop()
    assert server.process.returncode == 0 and not path.exists()  # a clean exit takes its record along


def test_stale_and_unvouched_records_are_not_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lemonkit.serving import server_records

    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path))
    monkeypatch.delenv("LEMONKIT_URL", raising=False)
    with socket.socket() as sock:  # a port that this process holds but where no lemonkit server listens
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        monkeypatch.setattr(discovery, "DEFAULT_PORT", port)
        dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
        stale = tmp_path / f"lemonkit-{dead.stdout.strip()}.json"
        stale.write_text(json.dumps({"pid": int(dead.stdout), "url": f"http://127.0.0.1:{port}", "key": None}))
        elsewhere = tmp_path / "lemonkit-1.json"  # alive, but pid 1 does not listen there
        elsewhere.write_text(json.dumps({"pid": 1, "url": f"http://127.0.0.1:{port}", "key": None}))
        with pytest.raises(ServerUnavailable):
            discovery.locate(start=False)
        assert not stale.exists() and elsewhere.exists()  # the dead process's record is removed
        # this process listens on the port, but its record leads to no lemonkit server: not used either
        server_records.write(f"http://127.0.0.1:{port}", None)
        assert [r.pid for r in server_records.live_records()] == [os.getpid()]
        with pytest.raises(ServerUnavailable):
            discovery.locate(start=False)


@pytest.mark.skipif(not hasattr(os, "getuid") or os.getuid() != 0, reason="needs root to listen as another user")
@pytest.mark.skipif(not Path("/usr/bin/python3").exists(), reason="needs a Python every user may run")
def test_another_users_server_is_never_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lemonkit.serving import server_records

    # "nobody" serves /live on a port, as another user's `lemonkit serve` on the default port would
    script = textwrap.dedent(
        """
        import http.server, sys, threading
        class Live(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200); self.end_headers()
        server = http.server.HTTPServer(("127.0.0.1", 0), Live)
        print(server.server_address[1], flush=True)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        sys.stdin.read()
        """
    )
    other = subprocess.Popen(
        ["/usr/bin/python3", "-c", script], user=65534, stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd="/"
    )
    try:
        assert other.stdout is not None
        port = int(other.stdout.readline())
        assert httpx.get(f"http://127.0.0.1:{port}/live").status_code == 200
        monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path))
        monkeypatch.delenv("LEMONKIT_URL", raising=False)
        monkeypatch.setattr(discovery, "DEFAULT_PORT", port)
        with pytest.raises(ServerUnavailable):  # no record of ours names it
            discovery.locate(start=False)
        # nor does a record of ours naming that process (its pid reused, say): it is not this user's
        record = tmp_path / f"lemonkit-{other.pid}.json"
        record.write_text(json.dumps({"pid": other.pid, "url": f"http://127.0.0.1:{port}", "key": None}))
        assert list(server_records.live_records()) == []
        with pytest.raises(ServerUnavailable):
            discovery.locate(start=False)
    finally:
        other.kill()
        other.wait()


# -- the embedded server ------------------------------------------------------------------------------------------


def _clean_env(runtime: Path) -> dict[str, str]:
    """No server to find: no URL, no key, and a runtime directory without records (a server on the default port
    without a record here is not used)."""
    env = {k: v for k, v in os.environ.items() if k not in ("LEMONKIT_URL", "LEMONKIT_TOKEN", "LEMONADE_API_KEY")}
    return {**env, "JUPYTER_RUNTIME_DIR": str(runtime)}


def test_the_embedded_server_serves_and_dies_with_its_process(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import json, sys, lemonkit
        client = lemonkit.default_client()
        print(json.dumps({{"kind": client.server.kind, "api": client.server.api, "token": client.server.token,
                          "models": [m["id"] for m in client.models()]}}), flush=True)
        print(client.load({TINY!r})["message"], flush=True)
        sys.stdin.read()
        """
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", script],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=_clean_env(tmp_path),
    )
    try:
        assert parent.stdout is not None
        found = json.loads(parent.stdout.readline())
        assert found["kind"] == "embedded" and TINY in found["models"]
        assert parent.stdout.readline().strip() == f"Loaded model: {TINY}"
        # the port is open to every local user, but only the parent has the key
        assert httpx.get(found["api"] + "/models", timeout=10).status_code == 401
        health = httpx.get(found["api"] + "/health", headers={"Authorization": f"Bearer {found['token']}"}).json()
        sidecar = psutil.Process(health["all_models_loaded"][0]["pid"])
        server = next(p for p in psutil.Process(parent.pid).children() if "--embedded" in p.cmdline())
        # recorded, with its key, but as embedded: another process's client does not adopt it
        assert _records(tmp_path) == [
            {"pid": server.pid, "url": host_root(found["api"]), "key": found["token"], "kind": "embedded"}
        ]
        parent.send_signal(signal.SIGKILL)  # no atexit: the server sees its stdin close
        _, alive = psutil.wait_procs([server, sidecar], timeout=60)
        assert not alive and _records(tmp_path) == []
    finally:
        parent.kill()
        parent.wait()


def test_cli_without_a_server_runs_its_own(tmp_path: Path) -> None:
    env = _clean_env(tmp_path)

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "lemonkit.cli", *args], env=env, capture_output=True, text=True, timeout=120
        )

    listed = cli("list")
    assert listed.returncode == 0, listed.stderr
    assert "runs its own" in listed.stderr
    assert any(line.split()[:2] == [TINY, "yes"] for line in listed.stdout.splitlines())
    pulled = cli("pull", TINY)  # already downloaded: complete at once, offline
    assert pulled.returncode == 0 and pulled.stdout.strip() == f"Installed model: {TINY}", pulled.stderr
    # a model loaded into a server that exits with the command would be gone at once: refuse instead
    load = cli("load", TINY)
    assert load.returncode == 2 and f"lemonkit serve --load {TINY}" in load.stderr


# -- the kernel's Jupyter server ----------------------------------------------------------------------------------


def test_a_kernel_finds_its_jupyter_server(tmp_path: Path) -> None:
    from jupyter_client.blocking import BlockingKernelClient

    server = JupyterServer(tmp_path, env=_clean_env(tmp_path / "runtime"))
    kernel_client = None
    try:
        base, token = server.base, server.token
        headers = {"Authorization": f"token {token}"}
        kernel = httpx.post(base + "api/kernels", headers=headers, json={}, timeout=60).json()["id"]
        kernel_client = BlockingKernelClient(connection_file=str(server.runtime_dir / f"kernel-{kernel}.json"))
        kernel_client.load_connection_file()
        kernel_client.start_channels()
        kernel_client.wait_for_ready(timeout=60)
        output: list[str] = []

        def collect(msg: dict) -> None:
            if msg["msg_type"] == "stream":
                output.append(msg["content"]["text"])
            elif msg["msg_type"] == "error":
                output.append("\n".join(msg["content"]["traceback"]))

        code = (
            "import lemonkit\n"
            "client = lemonkit.Client()\n"
            "print(client.server.kind, client.server.api)\n"
            f"print(client.model({TINY!r})['downloaded'])\n"
        )
        reply = kernel_client.execute_interactive(code, output_hook=collect, timeout=120)
        assert reply["content"]["status"] == "ok", "".join(output)
        assert "".join(output).split() == ["jupyter", base + "lemonkit/api/v1", "True"]
    finally:
        if kernel_client is not None:
            kernel_client.stop_channels()
        server.stop()
