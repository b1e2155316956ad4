"""Under a real JupyterHub (tests/support/hub_process.py): a user's kernel finds the hub's lemonkit service before
anything of its own, and a single-user server set to forward (``LEMONKIT_FORWARD_TO_HUB=1``) hands every
``lemonkit/`` route to the service. Also the discovery's decisions (found, not configured, required but missing, no
read scope) against the same hub."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from websockets.sync.client import connect

from lemonkit.catalog.config import DEFAULT_CHAT_MODEL
from lemonkit.client import ServerUnavailable, locate
from lemonkit.client import discovery as client_module
from lemonkit.errors import HubServiceError
from lemonkit.serving import hub_discovery
from lemonkit.serving.hub_discovery import HubEnvironment
from tests.support.hub_process import ACCESS_SCOPE, SERVICE, JupyterHub
from tests.support.session import HF_CACHE
from tests.support.tiny_models import TEST_REPO

pytestmark = [pytest.mark.hub, pytest.mark.slow]

#: a model registered only in the service's cache: seen through alice's server, it can only come from the service
SERVICE_ONLY = "only-on-service"
READ_SCOPE = f"read:services!service={SERVICE}"
#: the tests' tiny random model (tests/support/tiny_models.py), registered in the service's cache:
#: it never stops by itself
TINY_NAME = "tiny-llama"

#: what a deployment adds for its users' kernels and single-user servers (the README's snippet says the same)
_EXTRA_CONFIG = """
for role in c.JupyterHub.load_roles:
    if role["name"] == "user":
        role["scopes"].append({read!r})
c.Spawner.server_token_scopes = ["access:servers!server", "users:activity!user", {access!r}, {read!r}]
c.Spawner.environment = {environment!r}
"""


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[JupyterHub]:
    directory = tmp_path_factory.mktemp("hub")
    cache = directory / "lemonkit-cache"
    cache.mkdir()
    rows = {
        SERVICE_ONLY: {"checkpoint": "nobody/nothing-GGUF:nothing.gguf", "recipe": "llamacpp", "labels": ["chat"]},
        TINY_NAME: {"checkpoint": f"{TEST_REPO}:tiny-llama.gguf", "recipe": "llamacpp", "labels": ["chat"]},
    }
    (cache / "user_models.json").write_text(json.dumps(rows))
    environment = {
        "PATH": os.environ["PATH"],
        "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
        "JUPYTER_RUNTIME_DIR": str(directory / "runtime"),
        "LEMONKIT_FORWARD_TO_HUB": "1",
    }
    extra = _EXTRA_CONFIG.format(read=READ_SCOPE, access=ACCESS_SCOPE, environment=environment)
    with JupyterHub(directory, environment={"HF_HUB_CACHE": str(HF_CACHE)}, extra_config=extra) as running:
        yield running


@pytest.fixture(scope="module")
def alice(hub: JupyterHub) -> Iterator[str]:
    """Alice's single-user server, started through the hub's REST API; yields its public base URL."""
    yield hub.start_server("alice")
    hub.stop_server("alice")


# -- a kernel in alice's server ------------------------------------------------------------------------------------


def _run_in_kernel(hub: JupyterHub, base: str, code: str) -> str:
    from jupyter_client.blocking import BlockingKernelClient

    headers = {"Authorization": f"token {hub.token('alice')}"}
    started = httpx.post(f"{base}api/kernels", headers=headers, json={}, timeout=60)
    assert started.status_code == 201, started.text
    kernel = started.json()["id"]
    kernel_client = BlockingKernelClient(connection_file=str(hub.directory / "runtime" / f"kernel-{kernel}.json"))
    kernel_client.load_connection_file()
    kernel_client.start_channels()
    output: list[str] = []

    def collect(msg: dict[str, Any]) -> None:
        if msg["msg_type"] == "stream":
            output.append(msg["content"]["text"])
        elif msg["msg_type"] == "error":
            output.append("\n".join(msg["content"]["traceback"]))

    try:
        kernel_client.wait_for_ready(timeout=60)
        reply = kernel_client.execute_interactive(code, output_hook=collect, timeout=240)
        assert reply["content"]["status"] == "ok", "".join(output)
    finally:
        kernel_client.stop_channels()
        httpx.delete(f"{base}api/kernels/{kernel}", headers=headers, timeout=60)
    return "".join(output)


def test_a_kernel_finds_the_hub_service(hub: JupyterHub, alice: str) -> None:
    code = (
        "import lemonkit\n"
        "c = lemonkit.Client()\n"
        "print(c.server.kind, c.server.api)\n"
        "print(repr(lemonkit.chat('Say hello', stream=False, max_tokens=16).text))\n"
        "%load_ext lemonkit\n"
        "%lemonkit status\n"
    )
    lines = _run_in_kernel(hub, alice, code).splitlines()
    direct = f"http://127.0.0.1:{hub.service_port}/services/{SERVICE}/api/v1"  # where the service listens
    assert lines[0].split() == ["jupyterhub", direct]
    answer = eval(lines[1])  # the repr of the answer's text
    assert isinstance(answer, str) and answer.strip()
    assert lines[2].startswith("lemonkit ") and lines[2].endswith(f"at {direct} (jupyterhub)")
    # the answer came from the service: its model is loaded there
    health = httpx.get(f"{hub.api}/health", headers=hub.headers("alice"), timeout=30).json()
    assert DEFAULT_CHAT_MODEL in [m["model_name"] for m in health["all_models_loaded"]]


# -- alice's server forwards --------------------------------------------------------------------------------------


def test_the_extension_forwards_models_and_errors(hub: JupyterHub, alice: str) -> None:
    headers = hub.headers("alice")
    api = f"{alice}lemonkit/api/v1"
    listed = httpx.get(f"{api}/models", params={"show_all": "true"}, headers=headers, timeout=60)
    assert listed.status_code == 200 and listed.headers["content-type"].startswith("application/json")
    assert f"user.{SERVICE_ONLY}" in [m["id"] for m in listed.json()["data"]]
    missing = httpx.get(f"{api}/models/user.nothing-here", headers=headers, timeout=60)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    bad = httpx.post(f"{api}/chat/completions", content=b"{not json", headers=headers, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json"
    # alice's own server checks who asks before anything is forwarded
    anonymous = httpx.get(f"{api}/models", timeout=60, follow_redirects=False)
    assert anonymous.status_code in (401, 403) and "data" not in anonymous.text
    bob = httpx.get(f"{api}/models", headers=hub.headers("bob"), timeout=60, follow_redirects=False)
    assert bob.status_code in (401, 403) and "data" not in bob.text
    live = httpx.get(f"{alice}lemonkit/live", timeout=60)  # open, like every host's
    assert live.status_code == 200


def test_the_extension_streams_a_chat(hub: JupyterHub, alice: str) -> None:
    sdk = openai.OpenAI(base_url=f"{alice}lemonkit/api/v1", api_key=hub.token("alice"), max_retries=0)
    stream = sdk.chat.completions.create(
        model=DEFAULT_CHAT_MODEL, messages=[{"role": "user", "content": "Count to five."}], max_tokens=24, stream=True
    )
    pieces = [chunk.choices[0].delta.content for chunk in stream if chunk.choices and chunk.choices[0].delta.content]
    assert len(pieces) >= 2 and "".join(pieces).strip()


async def test_a_client_that_leaves_stops_the_forwarded_generation(hub: JupyterHub, alice: str) -> None:
    headers = hub.headers("alice")
    chat = {"model": f"user.{TINY_NAME}", "messages": [{"role": "user", "content": "go"}], "temperature": 0}
    admin = {"Authorization": f"token {hub.admin_token}"}  # only an admin may load with options on the service
    load = {"model_name": f"user.{TINY_NAME}", "ctx_size": 4096}
    loaded = httpx.post(f"{hub.api}/load", json=load, headers=admin, timeout=120)
    assert loaded.status_code == 200, loaded.text
    async with httpx.AsyncClient(base_url=f"{alice}lemonkit/api/v1/", headers=headers, timeout=120) as forwarded:
        async with forwarded.stream("POST", "chat/completions", json={**chat, "max_tokens": 4000, "stream": True}) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            lines = r.aiter_lines()
            for _ in range(3):
                await anext(lines)
    # the engine serves one request at a time: this one starts only once the abandoned one has stopped
    async with httpx.AsyncClient(base_url=f"{hub.api}/", headers=headers, timeout=120) as service:
        async with service.stream("POST", "chat/completions", json={**chat, "max_tokens": 3000, "stream": True}) as r:
            await anext(r.aiter_lines())
            stats = (await service.get("stats")).json()
    assert 0 < stats.get("output_tokens", 0) < 1000, stats  # the abandoned request stopped long before its 4000 tokens


def test_the_extension_bridges_the_log_websocket(hub: JupyterHub, alice: str) -> None:
    url = f"{alice.replace('http', 'ws', 1)}lemonkit/logs/stream"
    with connect(url, additional_headers={"Authorization": f"token {hub.token('alice')}"}, open_timeout=60) as ws:
        ws.send("{not json")
        refused = json.loads(ws.recv(timeout=60))  # the service's own answer to a bad message, passed back
        assert refused["type"] == "error" and refused["error"]["code"] == "invalid_json"
        ws.send(json.dumps({"type": "logs.subscribe"}))
        snapshot = json.loads(ws.recv(timeout=60))
        assert snapshot["type"] == "logs.snapshot" and isinstance(snapshot["entries"], list)


# -- the discovery's decisions ---------------------------------------------------------------------------------------


@pytest.fixture
def fresh() -> Iterator[None]:
    hub_discovery.forget()
    yield
    hub_discovery.forget()


def test_the_service_is_found_where_it_listens(hub: JupyterHub, fresh: None) -> None:
    found = hub_discovery.find(HubEnvironment(hub.hub_api, hub.token("alice")))
    assert found is not None and found.root == f"http://127.0.0.1:{hub.service_port}/services/{SERVICE}"
    models = httpx.get(f"{found.root}/api/v1/models", params={"show_all": "true"}, headers=found.headers, timeout=60)
    assert f"user.{SERVICE_ONLY}" in [m["id"] for m in models.json()["data"]]


def test_a_service_that_is_not_configured_is_skipped_unless_required(hub: JupyterHub, fresh: None) -> None:
    nowhere = HubEnvironment(hub.hub_api, hub.admin_token, service="no-such-service")
    assert hub_discovery.find(nowhere) is None
    with pytest.raises(HubServiceError, match="no service named 'no-such-service'") as raised:
        hub_discovery.find(HubEnvironment(hub.hub_api, hub.admin_token, service="no-such-service", required=True))
    assert raised.value.code == "hub_service_not_found" and raised.value.status == 404
    # a token that may neither read nor use the service: not meant for this user
    outsider = hub.token("alice", scopes=["read:users:name!user"])
    assert hub_discovery.find(HubEnvironment(hub.hub_api, outsider)) is None
    with pytest.raises(HubServiceError, match="no access to the service") as raised:
        hub_discovery.find(HubEnvironment(hub.hub_api, outsider, required=True))
    assert raised.value.code == "hub_access_denied"


def test_a_token_that_may_use_but_not_read_the_service_is_an_error(hub: JupyterHub, fresh: None) -> None:
    token = hub.token("alice", scopes=[ACCESS_SCOPE])
    with pytest.raises(HubServiceError, match=f"grant '{READ_SCOPE}'") as raised:
        hub_discovery.find(HubEnvironment(hub.hub_api, token))
    assert raised.value.code == "hub_access_denied" and raised.value.status == 403
    # with the hub's public URL known, the service's fixed prefix is reached through the proxy instead
    public = HubEnvironment(hub.hub_api, token, public_hub_url=f"{hub.public_url}/hub/")
    found = hub_discovery.find(public)
    assert found is not None and found.root == f"{hub.public_url}/services/{SERVICE}"
    assert httpx.get(f"{found.root}/api/v1/health", headers=found.headers, timeout=60).status_code == 200


def test_locate_asks_the_hub_before_anything_local(
    hub: JupyterHub, fresh: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path))  # no recorded local server either
    monkeypatch.delenv("LEMONKIT_URL", raising=False)
    monkeypatch.setenv("JUPYTERHUB_API_URL", hub.hub_api)
    monkeypatch.setenv("JUPYTERHUB_API_TOKEN", hub.token("alice"))
    server = locate(start=False)
    assert (server.kind, server.api) == ("jupyterhub", f"http://127.0.0.1:{hub.service_port}/services/lemonkit/api/v1")
    assert server.headers == {"Authorization": f"token {os.environ['JUPYTERHUB_API_TOKEN']}"}
    monkeypatch.setenv("LEMONKIT_URL", hub.service_url)  # an explicit URL still wins
    assert locate(start=False).kind == "url"
    monkeypatch.delenv("LEMONKIT_URL")
    # the user asked for a service the hub does not have: an error, never an embedded server of its own
    monkeypatch.setenv("LEMONKIT_HUB_SERVICE", "no-such-service")
    with pytest.raises(HubServiceError, match="no-such-service"):
        locate(start=True)
    assert client_module._embedded_server is None
    monkeypatch.delenv("LEMONKIT_HUB_SERVICE")
    # a token the service is not meant for: discovery moves on (here to nothing, as it may not start one)
    monkeypatch.setenv("JUPYTERHUB_API_TOKEN", hub.token("alice", scopes=["read:users:name!user"]))
    with pytest.raises(ServerUnavailable):
        locate(start=False)


def test_lemonkit_status_names_the_hub_service(hub: JupyterHub, tmp_path: Path) -> None:
    env = {
        **os.environ,
        "JUPYTER_RUNTIME_DIR": str(tmp_path),
        "JUPYTERHUB_API_URL": hub.hub_api,
        "JUPYTERHUB_API_TOKEN": hub.token("alice"),
    }
    env.pop("LEMONKIT_URL", None)
    shown = subprocess.run(
        [sys.executable, "-m", "lemonkit", "status"], env=env, capture_output=True, text=True, timeout=120
    )
    assert shown.returncode == 0, shown.stderr
    first, loaded = shown.stdout.splitlines()
    api = f"http://127.0.0.1:{hub.service_port}/services/{SERVICE}/api/v1"
    assert first.startswith("lemonkit ") and first.endswith(f"at {api} (jupyterhub)") and loaded.startswith("loaded: ")
    # the user asked for a service the hub does not have: exit 2 with the hub's reason, and no server started
    env["LEMONKIT_HUB_SERVICE"] = "no-such-service"
    refused = subprocess.run(
        [sys.executable, "-m", "lemonkit", "status"], env=env, capture_output=True, text=True, timeout=120
    )
    assert refused.returncode == 2 and "no service named 'no-such-service'" in refused.stderr
    assert refused.stderr.count("\n") == 1  # one line, no traceback
