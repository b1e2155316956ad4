"""``lemonkit serve --jupyterhub-service`` reads the environment a JupyterHub gives its managed services."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from lemonkit.catalog.config import DEFAULT_HUB_ADMIN_SCOPE, Settings
from lemonkit.server.jupyterhub import HubSettings


def test_the_hubs_variables_give_the_address_and_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JUPYTERHUB_SERVICE_URL", "http://127.0.0.1:10101")
    monkeypatch.setenv("JUPYTERHUB_API_TOKEN", "secret")
    monkeypatch.setenv("JUPYTERHUB_SERVICE_PREFIX", "/services/models")
    assert HubSettings.from_env() == HubSettings(prefix="/services/models/", host="127.0.0.1", port=10101)


@pytest.mark.parametrize("url", ["https://127.0.0.1:1", "http://127.0.0.1", "127.0.0.1:80"])
def test_a_malformed_service_url_is_refused(monkeypatch: pytest.MonkeyPatch, url: str) -> None:
    monkeypatch.setenv("JUPYTERHUB_SERVICE_URL", url)
    monkeypatch.setenv("JUPYTERHUB_API_TOKEN", "secret")
    with pytest.raises(ValueError, match="JUPYTERHUB_SERVICE_URL"):
        HubSettings.from_env()


def test_the_admin_scope_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LEMONKIT_HUB_ADMIN_SCOPE", raising=False)
    assert Settings().hub_admin_scope == DEFAULT_HUB_ADMIN_SCOPE == "custom:lemonkit:admin"
    monkeypatch.setenv("LEMONKIT_HUB_ADMIN_SCOPE", "custom:models:admin")
    assert Settings().hub_admin_scope == "custom:models:admin"


def test_serving_as_a_hub_service_outside_a_hub_says_what_is_missing() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JUPYTERHUB_")}
    done = subprocess.run(
        [sys.executable, "-m", "lemonkit", "serve", "--jupyterhub-service"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "JUPYTERHUB_SERVICE_URL" in done.stderr
    assert "c.JupyterHub.services" in done.stderr
    assert "Traceback" not in done.stderr
