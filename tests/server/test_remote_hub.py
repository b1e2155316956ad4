"""The ``remote`` recipe on a shared server: the JupyterHub service (tests/support/hub_process.py) in front of a real
``llama_cpp.server``. Only admins register remote models, within the operator's allowed hosts; every user then
chats with them through the hub with their own token."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from openai import OpenAI

from tests.support.hub_process import JupyterHub
from tests.support.llama_cpp_server import MODEL_ID, LlamaCppServer

pytestmark = [pytest.mark.hub, pytest.mark.slow]

NAME = "user.hub-remote"


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[JupyterHub]:
    environment = {"LEMONKIT_REMOTE_ALLOWED_HOSTS": "127.0.0.1"}
    with JupyterHub(tmp_path_factory.mktemp("hub-remote"), environment=environment) as running:
        yield running


def test_admins_register_remote_models_and_users_chat_with_them(hub: JupyterHub, upstream: LlamaCppServer) -> None:
    body = {"model_name": NAME, "recipe": "remote", "checkpoint": MODEL_ID, "remote_url": upstream.url}
    refused = httpx.post(f"{hub.api}/pull", json=body, headers=hub.headers("alice"), timeout=60)
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "admin_required"
    far = {**body, "remote_url": "http://localhost:8000/v1"}
    refused = httpx.post(f"{hub.api}/pull", json=far, headers=hub.headers("admin"), timeout=60)
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "remote_host_not_allowed"

    registered = httpx.post(f"{hub.api}/pull", json=body, headers=hub.headers("admin"), timeout=60)
    assert registered.status_code == 200, registered.text
    for user in ("alice", "bob"):
        client = OpenAI(base_url=f"{hub.service_url}v1", api_key=hub.token(user), max_retries=0)
        assert NAME in [m.id for m in client.models.list()]
        messages = [{"role": "user", "content": "Say hello."}]
        answer = client.chat.completions.create(model=NAME, messages=messages, max_tokens=8)  # type: ignore[arg-type]
        assert (answer.choices[0].message.content or "").strip()
        stream = client.chat.completions.create(model=NAME, messages=messages, max_tokens=8, stream=True)  # type: ignore[arg-type]
        assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices).strip()

    health = httpx.get(f"{hub.api}/health", headers=hub.headers("admin"), timeout=60).json()
    entry = next(m for m in health["all_models_loaded"] if m["model_name"] == NAME)
    assert [(e["url"], e["state"], e["requests"]) for e in entry["endpoints"]] == [(upstream.url, "ok", 4)]
