"""The JupyterHub service against a real JupyterHub (tests/support/hub_process.py): hub tokens and OAuth cookies, the
access scope, admin-only routes, through the hub's proxy at ``/services/lemonkit/``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import closing
from typing import Any

import httpx
import pytest
from openai import NotFoundError, OpenAI, PermissionDeniedError
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect
from websockets.typing import Origin

from lemonkit.catalog.config import DEFAULT_CHAT_MODEL
from tests.support.hub_process import JupyterHub

pytestmark = [pytest.mark.hub, pytest.mark.slow]

CHAT = {"model": DEFAULT_CHAT_MODEL, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8}


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[JupyterHub]:
    with JupyterHub(tmp_path_factory.mktemp("hub")) as running:
        yield running


@pytest.fixture(scope="module")
def alice(hub: JupyterHub) -> dict[str, str]:
    return hub.headers("alice")


@pytest.fixture(scope="module")
def admin(hub: JupyterHub) -> dict[str, str]:
    return hub.headers("admin")


def _error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["Content-Type"].startswith("application/json"), response.text
    error: dict[str, Any] = response.json()["error"]
    assert set(error) >= {"message", "type", "code"}
    return error


def _ws_url(hub: JupyterHub, path: str) -> str:
    return hub.service_url.replace("http://", "ws://") + path


def test_a_users_token_lists_models_through_the_proxy(hub: JupyterHub, alice: dict[str, str]) -> None:
    response = httpx.get(f"{hub.api}/models", headers=alice, timeout=60)
    assert response.status_code == 200, hub.logs()[-3000:]
    ids = [m["id"] for m in response.json()["data"]]
    assert DEFAULT_CHAT_MODEL in ids


def test_the_openai_sdk_chats_with_a_users_hub_token(hub: JupyterHub) -> None:
    for user in ("alice", "bob"):
        client = OpenAI(base_url=f"{hub.service_url}v1", api_key=hub.token(user), max_retries=0)
        answer = client.chat.completions.create(**CHAT)
        assert answer.model == DEFAULT_CHAT_MODEL
        assert answer.choices[0].message.content
        stream = client.chat.completions.create(**CHAT, stream=True)
        text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        assert text.strip()


def test_ollamas_client_lists_and_chats_with_a_users_hub_token(hub: JupyterHub) -> None:
    import ollama

    client = ollama.Client(host=hub.service_url.rstrip("/"), headers=hub.headers("alice"), timeout=120)
    assert f"{DEFAULT_CHAT_MODEL}:latest" in {m.model for m in client.list().models}
    messages = [{"role": "user", "content": "Say hello."}]
    answer = client.chat(DEFAULT_CHAT_MODEL, messages=messages, options={"num_predict": 8})
    assert answer.done and answer.message.content
    streamed = "".join(
        part.message.content or ""
        for part in client.chat(DEFAULT_CHAT_MODEL, messages=messages, stream=True, options={"num_predict": 8})
    )
    assert streamed.strip()
    with pytest.raises(ollama.ResponseError) as refused:
        client.pull(DEFAULT_CHAT_MODEL)  # a user may not change what everyone shares
    assert refused.value.status_code == 403


def test_the_bearer_scheme_works_too(hub: JupyterHub) -> None:
    response = httpx.get(f"{hub.api}/health", headers={"Authorization": f"Bearer {hub.token('bob')}"}, timeout=60)
    assert response.status_code == 200, response.text


def test_no_token_is_a_json_401_and_live_stays_open(hub: JupyterHub) -> None:
    assert _error(httpx.get(f"{hub.api}/models", timeout=60), 401)["code"] == "invalid_api_key"
    assert _error(httpx.post(f"{hub.api}/chat/completions", json=CHAT, timeout=60), 401)["type"] == (
        "authentication_error"
    )
    bad = {"Authorization": "token not-a-hub-token"}
    assert _error(httpx.get(f"{hub.api}/models", headers=bad, timeout=60), 401)["code"] == "invalid_api_key"
    assert httpx.get(f"{hub.service_url}live", timeout=60).json() == {"status": "ok"}


def test_a_token_without_the_access_scope_is_a_json_403(hub: JupyterHub) -> None:
    token = hub.token("alice", scopes=["read:users:name!user=alice"])
    error = _error(httpx.get(f"{hub.api}/models", headers={"Authorization": f"token {token}"}, timeout=60), 403)
    assert error["code"] == "forbidden"
    assert "access:services!service=lemonkit" in error["message"]
    client = OpenAI(base_url=f"{hub.service_url}v1", api_key=token, max_retries=0)
    with pytest.raises(PermissionDeniedError):
        client.chat.completions.create(**CHAT)


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("pull", {"model_name": DEFAULT_CHAT_MODEL}),
        ("pull", {"model_name": "user.Mine", "recipe": "llamacpp", "checkpoint": "owner/repo:Q4_0"}),
        ("delete", {"model_name": DEFAULT_CHAT_MODEL}),
        ("install", {"recipe": "llamacpp", "backend": "cpu"}),
        ("uninstall", {"recipe": "llamacpp", "backend": "cpu"}),
        ("downloads/control", {"id": "model:x", "action": "cancel"}),
        ("unload", {"model_name": DEFAULT_CHAT_MODEL}),
        ("tasks/unload_models", {"model_ids": [DEFAULT_CHAT_MODEL]}),
        ("tasks/unload_all_models", {}),
        ("load", {"model_name": DEFAULT_CHAT_MODEL, "ctx_size": 512}),
        ("load", {"model_name": DEFAULT_CHAT_MODEL, "pinned": True}),
        (f"models/{DEFAULT_CHAT_MODEL}/options", {"ctx_size": 512}),
    ],
)
def test_a_user_may_not_change_what_everyone_shares(
    hub: JupyterHub, alice: dict[str, str], route: str, body: dict[str, Any]
) -> None:
    response = httpx.post(f"{hub.api}/{route}", json=body, headers=alice, timeout=60)
    error = _error(response, 403)
    assert error["code"] == "admin_required"
    assert error["type"] == "permission_error"


def test_admins_pull_and_load_with_options(hub: JupyterHub, admin: dict[str, str]) -> None:
    operator = hub.headers("operator")  # no hub admin, but holds the service's admin scope
    for headers in (admin, operator):
        response = httpx.post(f"{hub.api}/pull", json={"model_name": DEFAULT_CHAT_MODEL}, headers=headers, timeout=60)
        assert response.status_code == 200, response.text
        assert response.json()["status"] == "success"
    body = {"model_name": DEFAULT_CHAT_MODEL, "ctx_size": 1024}
    response = httpx.post(f"{hub.api}/load", json=body, headers=operator, timeout=120)
    assert response.status_code == 200, response.text
    health = httpx.get(f"{hub.api}/health", headers=operator, timeout=60).json()
    loaded = {m["model_name"]: m for m in health["all_models_loaded"]}
    assert loaded[DEFAULT_CHAT_MODEL]["recipe_options"]["ctx_size"] == 1024


def test_a_user_loads_a_downloaded_model_with_its_saved_options(hub: JupyterHub, alice: dict[str, str]) -> None:
    response = httpx.post(f"{hub.api}/load", json={"model_name": DEFAULT_CHAT_MODEL}, headers=alice, timeout=120)
    assert response.status_code == 200, response.text


def test_a_user_cannot_start_a_download_by_first_use(
    hub: JupyterHub, alice: dict[str, str], admin: dict[str, str]
) -> None:
    every = httpx.get(f"{hub.api}/models", params={"show_all": "true"}, headers=alice, timeout=60).json()["data"]
    missing = next(m["id"] for m in every if m["recipe"] == "llamacpp" and not m["downloaded"])
    body = {**CHAT, "model": missing}
    error = _error(httpx.post(f"{hub.api}/chat/completions", json=body, headers=alice, timeout=60), 403)
    assert error["code"] == "admin_required"
    assert missing in error["message"]
    error = _error(httpx.post(f"{hub.api}/load", json={"model_name": missing}, headers=alice, timeout=60), 403)
    assert error["code"] == "admin_required"
    jobs = httpx.get(f"{hub.api}/downloads", headers=admin, timeout=60).json()
    assert all(missing not in str(job) for job in jobs)


def test_a_browser_logs_in_through_the_hub_and_uses_its_cookie(hub: JupyterHub) -> None:
    with closing(hub.login("alice")) as browser:
        page = browser.get(f"{hub.api}/models", headers={"Accept": "text/html"})  # login redirect, OAuth, back
        assert page.status_code == 200, page.text
        assert [r.url.path for r in page.history][-1] == "/services/lemonkit/oauth_callback"
        assert DEFAULT_CHAT_MODEL in [m["id"] for m in page.json()["data"]]
        api = browser.get(f"{hub.api}/health", headers={"Accept": "application/json"})
        assert api.status_code == 200, api.text
        # a cookie alone does not make a write: jupyterhub requires its XSRF token too
        assert _error(browser.post(f"{hub.api}/chat/completions", json=CHAT), 403)["code"] == "xsrf_required"
        # nor may a page of another origin read with it
        foreign = browser.get(f"{hub.api}/models", headers={"Origin": "http://evil.example"})
        assert _error(foreign, 403)["code"] == "forbidden_origin"
        assert browser.get(f"{hub.api}/models", headers={"Origin": hub.public_url}).status_code == 200


def test_an_api_client_without_a_token_is_not_redirected(hub: JupyterHub) -> None:
    response = httpx.get(f"{hub.api}/models", headers={"Accept": "application/json"}, timeout=60)
    assert response.status_code == 401
    page = httpx.get(f"{hub.api}/models", headers={"Accept": "text/html"}, timeout=60)
    assert page.status_code == 302
    assert "/hub/api/oauth2/authorize" in page.headers["Location"]


def test_the_log_stream_needs_a_token(hub: JupyterHub) -> None:
    with pytest.raises(InvalidStatus) as refused:
        connect(_ws_url(hub, "logs/stream"), open_timeout=60)
    assert refused.value.response.status_code == 401
    token = hub.token("alice", scopes=["read:users:name!user=alice"])
    with pytest.raises(InvalidStatus) as refused:
        connect(_ws_url(hub, f"logs/stream?token={token}"), open_timeout=60)
    assert refused.value.response.status_code == 403
    for url, headers in (
        (_ws_url(hub, f"logs/stream?token={hub.token('alice')}"), None),
        (_ws_url(hub, "logs/stream"), {"Authorization": f"token {hub.token('bob')}"}),
    ):
        with connect(url, additional_headers=headers, open_timeout=60) as ws:
            ws.send('{"type": "logs.subscribe"}')
            assert '"logs.snapshot"' in str(ws.recv(timeout=60))


def test_a_browser_page_writes_with_the_xsrf_token_and_admins_keep_their_rights(hub: JupyterHub) -> None:
    for user, status in (("alice", 403), ("admin", 200), ("operator", 200)):
        with closing(hub.login(user)) as browser:
            page = browser.get(f"{hub.api}/models", headers={"Accept": "text/html"})
            assert page.status_code == 200, page.text
            xsrf = browser.cookies.get("_xsrf", path="/services/lemonkit/")
            assert xsrf, browser.cookies
            pull = browser.post(
                f"{hub.api}/pull", json={"model_name": DEFAULT_CHAT_MODEL}, headers={"X-XSRFToken": xsrf}
            )
            assert pull.status_code == status, pull.text


def test_a_websocket_from_another_origin_needs_a_token_not_a_cookie(hub: JupyterHub) -> None:
    foreign = {"Origin": "http://evil.example"}
    with connect(_ws_url(hub, f"logs/stream?token={hub.token('alice')}"), origin=Origin(foreign["Origin"])) as ws:
        ws.send('{"type": "logs.subscribe"}')
        assert '"logs.snapshot"' in str(ws.recv(timeout=60))
    with closing(hub.login("alice")) as browser:
        browser.get(f"{hub.api}/models", headers={"Accept": "text/html"}).raise_for_status()
        cookie = "; ".join(f"{c.name}={c.value}" for c in browser.cookies.jar if c.path.startswith("/services/"))
    with pytest.raises(InvalidStatus) as refused:
        connect(_ws_url(hub, "logs/stream"), additional_headers={"Cookie": cookie, **foreign}, open_timeout=60)
    assert refused.value.response.status_code == 403
    with connect(_ws_url(hub, "logs/stream"), additional_headers={"Cookie": cookie}, open_timeout=60) as ws:
        ws.send('{"type": "logs.subscribe"}')
        assert '"logs.snapshot"' in str(ws.recv(timeout=60))


def test_the_lemonkit_command_pulls_through_the_service_with_an_admins_token(hub: JupyterHub) -> None:
    for user, status in (("admin", 0), ("alice", 2)):
        env = {**os.environ, "LEMONKIT_URL": hub.service_url.rstrip("/"), "LEMONKIT_TOKEN": hub.token(user)}
        done = subprocess.run(
            [sys.executable, "-m", "lemonkit", "pull", DEFAULT_CHAT_MODEL],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == status, done.stdout + done.stderr
        if status:
            assert "admin" in done.stderr


def test_a_realtime_session_cannot_start_a_download_either(
    hub: JupyterHub, alice: dict[str, str], admin: dict[str, str]
) -> None:
    every = httpx.get(f"{hub.api}/models", params={"show_all": "true"}, headers=alice, timeout=60).json()["data"]
    missing = next(
        m["id"]
        for m in every
        if "realtime-transcription" in m.get("labels", []) and not m["downloaded"] and not m.get("unsupported_reason")
    )
    url = _ws_url(hub, f"realtime?model={missing}&token={hub.token('alice')}")
    with connect(url, open_timeout=60) as ws:
        messages = [json.loads(ws.recv(timeout=60)) for _ in range(2)]
    assert messages[0]["type"] == "session.created"
    assert messages[1]["type"] == "error"
    assert messages[1]["error"]["code"] == "admin_required"
    jobs = httpx.get(f"{hub.api}/downloads", headers=admin, timeout=60).json()
    assert all(missing not in str(job) for job in jobs)


def test_a_users_server_token_may_call_the_service(hub: JupyterHub) -> None:
    """The token a user's kernels inherit (their server's ``$JUPYTERHUB_API_TOKEN``), read from the server's
    process: the one whose ``HOME`` is this hub's home of bob."""
    url = hub.start_server("bob")
    try:
        assert url.endswith("/user/bob/")
        home = str(hub.directory / "home" / "bob")
        tokens = {env["JUPYTERHUB_API_TOKEN"] for env in _environments() if env.get("HOME") == home}
        assert tokens
        for token in tokens:
            response = httpx.get(f"{hub.api}/models", headers={"Authorization": f"token {token}"}, timeout=60)
            assert response.status_code == 200, response.text
    finally:
        hub.stop_server("bob")


def _environments() -> Iterator[dict[str, str]]:
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as raw:
                pairs = raw.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        yield dict(pair.split("=", 1) for pair in pairs if "=" in pair)


def test_a_users_files_and_batches_are_their_own(hub: JupyterHub) -> None:
    """Alice's file and batch run as hers (the embedded default answers) and are a 404 to Bob, in lists too."""
    alice = OpenAI(base_url=f"{hub.service_url}v1", api_key=hub.token("alice"), max_retries=0, timeout=120)
    bob = OpenAI(base_url=f"{hub.service_url}v1", api_key=hub.token("bob"), max_retries=0, timeout=120)
    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {**CHAT, "temperature": 0}}
    upload = alice.files.create(file=("rows.jsonl", (json.dumps(line) + "\n").encode()), purpose="batch")
    batch = alice.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    for call in (
        lambda: bob.files.retrieve(upload.id),
        lambda: bob.files.content(upload.id),
        lambda: bob.files.delete(upload.id),
        lambda: bob.batches.retrieve(batch.id),
        lambda: bob.batches.cancel(batch.id),
        lambda: bob.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"),
    ):
        with pytest.raises(NotFoundError):
            call()
    assert upload.id not in [f.id for f in bob.files.list()]
    assert batch.id not in [b.id for b in bob.batches.list()]
    deadline = time.monotonic() + 120
    while (done := alice.batches.retrieve(batch.id)).status in ("validating", "in_progress", "finalizing"):
        assert time.monotonic() < deadline, done
        time.sleep(0.05)  # polling, as `tests.support.waiting.until` does
    assert done.status == "completed" and done.request_counts.completed == 1, (done, hub.logs()[-3000:])  # type: ignore[union-attr]
    output = alice.files.content(done.output_file_id).text  # type: ignore[arg-type]
    assert json.loads(output)["response"]["body"]["choices"][0]["message"]["content"]
    with pytest.raises(NotFoundError):
        bob.files.content(done.output_file_id)  # type: ignore[arg-type]
    # the answer cache is per user too: alice's row is in hers, and bob's lookup of the same request finds nothing
    lookup = {"endpoint": "/v1/chat/completions", "requests": [line["body"]]}
    mine = httpx.post(f"{hub.api}/cache/lookup", json=lookup, headers=hub.headers("alice"), timeout=120).json()
    theirs = httpx.post(f"{hub.api}/cache/lookup", json=lookup, headers=hub.headers("bob"), timeout=120).json()
    assert mine["hits"] == 1 and mine["data"][0]["choices"] and theirs == {"object": "list", "data": [None], "hits": 0}
