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
from conftest import API_KEY, TINY, Host, Standalone

import lemonkit
from lemonkit.client import AsyncClient, Client, ServerUnavailable, api_root, host_root


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
    from lemonkit.client import _parse_events

    error = {"error": {"message": "engine died", "type": "backend_error", "code": "backend_error"}}
    lines = ['data: {"choices": []}', "", ": ping", f"data: {json.dumps(error)}"]
    events = _parse_events(lines, ["message"])
    assert next(events).data == {"choices": []}
    with pytest.raises(lemonkit.LemonkitError) as failed:
        next(events)
    assert type(failed.value).__name__ == "BackendError" and failed.value.message == "engine died"
    named = list(
        _parse_events(["event: error", 'data: {"error": "hub down"}', "data: [DONE]", "data: {}"], ["message"])
    )
    assert [(e.name, e.data) for e in named] == [("error", {"error": "hub down"})]  # a named event is the caller's


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


# -- a running standalone server -----------------------------------------------------------------------------------


def test_a_running_serve_of_this_user_is_found(monkeypatch: pytest.MonkeyPatch, standalone: Standalone) -> None:
    import lemonkit.client

    for name in ("LEMONKIT_URL", "LEMONKIT_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LEMONADE_API_KEY", API_KEY)
    monkeypatch.setattr(lemonkit.client, "DEFAULT_PORT", standalone.port)
    found = lemonkit.client.locate(start=False)
    assert (found.kind, found.api) == ("standalone", standalone.root + "api/v1")


@pytest.mark.skipif(not hasattr(os, "getuid") or os.getuid() != 0, reason="needs root to listen as another user")
@pytest.mark.skipif(not Path("/usr/bin/python3").exists(), reason="needs a Python every user may run")
def test_another_users_server_is_not_mine() -> None:
    from lemonkit.client import _listener_is_mine

    script = "import socket, sys; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); "
    script += "print(s.getsockname()[1], flush=True); sys.stdin.read()"
    other = subprocess.Popen(
        ["/usr/bin/python3", "-c", script], user=65534, stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd="/"
    )
    try:
        assert other.stdout is not None
        port = int(other.stdout.readline())  # listening as "nobody"
        with socket.socket() as own:
            own.bind(("127.0.0.1", 0))
            own.listen()
            assert _listener_is_mine(own.getsockname()[1])
        assert not _listener_is_mine(port)
    finally:
        other.kill()
        other.wait()


# -- the embedded server ------------------------------------------------------------------------------------------


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LEMONKIT_URL", "LEMONKIT_TOKEN", "LEMONADE_API_KEY")}
    try:
        httpx.get("http://127.0.0.1:13305/live", timeout=2)
    except httpx.TransportError:
        return env
    pytest.skip("a lemonkit server runs on this machine's default port, so nothing would be embedded")


def test_the_embedded_server_serves_and_dies_with_its_process() -> None:
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
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_clean_env()
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
        parent.send_signal(signal.SIGKILL)  # no atexit: the server sees its stdin close
        _, alive = psutil.wait_procs([server, sidecar], timeout=60)
        assert not alive
    finally:
        parent.kill()
        parent.wait()


def test_cli_without_a_server_runs_its_own() -> None:
    env = _clean_env()

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


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_kernel_finds_its_jupyter_server(tmp_path: Path) -> None:
    from jupyter_client.blocking import BlockingKernelClient

    config = tmp_path / "config"
    config.mkdir()
    (config / "jupyter_server_config.json").write_text(
        json.dumps({"ServerApp": {"jpserver_extensions": {"lemonkit": True}}})
    )
    env = {**_clean_env(), "JUPYTER_CONFIG_DIR": str(config), "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime")}
    port, token = _free_port(), "kernel-test-token"
    flags = ["--no-browser", "--allow-root", "--ip=127.0.0.1", f"--port={port}", "--ServerApp.base_url=/b/"]
    flags += [f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={tmp_path}"]
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyter_server", *flags],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    kernel_client = None
    try:
        assert server.stderr is not None
        log = []
        for line in server.stderr:
            log.append(line)
            if "is running at" in line:
                break
        else:
            pytest.fail("jupyter server did not start:\n" + "".join(log))
        base = f"http://127.0.0.1:{port}/b/"
        headers = {"Authorization": f"token {token}"}
        kernel = httpx.post(base + "api/kernels", headers=headers, json={}, timeout=60).json()["id"]
        kernel_client = BlockingKernelClient(connection_file=str(tmp_path / "runtime" / f"kernel-{kernel}.json"))
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
        server.terminate()
        server.wait(30)
