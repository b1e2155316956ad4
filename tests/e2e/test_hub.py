"""The JupyterHub service against a real JupyterHub (tests/hub_process.py): hub tokens and OAuth cookies, the
access scope, admin-only routes, through the hub's proxy at ``/services/lemonkit/``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.hub_process import JupyterHub

pytestmark = [pytest.mark.hub, pytest.mark.slow]


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[JupyterHub]:
    with JupyterHub(tmp_path_factory.mktemp("hub")) as running:
        yield running


def _error(response: httpx.Response) -> dict[str, Any]:
    assert response.headers["Content-Type"].startswith("application/json"), response.text
    error: dict[str, Any] = response.json()["error"]
    return error


def test_a_users_token_lists_models_through_the_proxy(hub: JupyterHub) -> None:
    response = httpx.get(f"{hub.api}/models", headers=hub.headers("alice"), timeout=60)
    assert response.status_code == 200, hub.logs()[-3000:]
    ids = [m["id"] for m in response.json()["data"]]
    assert "SmolLM2-135M-Instruct-Bundled" in ids
