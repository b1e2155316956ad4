"""A real JupyterHub in its own process, running lemonkit as its managed service, for the shared-server tests.

``JupyterHub(directory)`` starts ``python -m jupyterhub`` with everything in ``directory``: its sqlite database,
cookie secret, configurable-http-proxy (from npm, on ``PATH``) on free ports, ``DummyAuthenticator`` with one
password for everyone, ``SimpleLocalProcessSpawner`` with homes under ``directory/home``, and the service
``lemonkit`` (``python -m lemonkit serve --jupyterhub-service``, this interpreter and this ``PYTHONPATH``) with its
own model cache. It returns once ``/services/lemonkit/live`` answers through the proxy.

Users: ``admin`` (a hub admin), ``alice`` and ``bob`` (the default ``user`` role plus the service's access scope),
and ``operator``, who is no hub admin but holds the service's admin scope (:data:`ADMIN_SCOPE`). A user's
single-user server (``SimpleLocalProcessSpawner``, this interpreter, ``--allow-root``) gets a
``$JUPYTERHUB_API_TOKEN`` that holds the access scope too (``Spawner.server_token_scopes``), so their kernels may
call the service.

Use it from a module-scoped fixture::

    @pytest.fixture(scope="module")
    def hub(tmp_path_factory):
        with JupyterHub(tmp_path_factory.mktemp("hub")) as running:
            yield running

then ``hub.service_url`` (``<public>/services/lemonkit/``), ``hub.api`` (its ``api/v1`` base) and
``hub.token("alice")`` (a token with all of alice's scopes), ``hub.token("alice", scopes=[...])`` (only those),
``hub.headers("alice")`` (``Authorization`` with a new token), ``hub.logs()`` (the hub's and the service's output),
``hub.login("alice")`` (an ``httpx.Client`` that logged in at ``/hub/login`` like a browser and holds the hub's
cookies; close it, e.g. ``with contextlib.closing(hub.login("alice")) as browser:``), ``hub.start_server("alice")``
(her single-user server, ready; returns its URL) and ``hub.stop_server("alice")``.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from tests.support.jupyter_process import free_port
from tests.support.system_tools import tool

__all__ = ["ACCESS_SCOPE", "ADMIN_SCOPE", "PASSWORD", "SERVICE", "USERS", "JupyterHub"]

SERVICE = "lemonkit"
PASSWORD = "hub-test-password"
#: the scope a token needs to use the service at all
ACCESS_SCOPE = f"access:services!service={SERVICE}"
#: the custom scope that makes a hub user an admin of the service
ADMIN_SCOPE = "custom:lemonkit:admin"
USERS = ("alice", "bob", "operator")

_CONFIG = """
import json, sys
settings = json.loads({settings!r})
c = get_config()
c.JupyterHub.ip = "127.0.0.1"
c.JupyterHub.port = settings["proxy_port"]
c.JupyterHub.hub_ip = "127.0.0.1"
c.JupyterHub.hub_port = settings["hub_port"]
c.JupyterHub.db_url = "sqlite:///" + settings["dir"] + "/jupyterhub.sqlite"
c.JupyterHub.cookie_secret_file = settings["dir"] + "/cookie_secret"
c.JupyterHub.pid_file = settings["dir"] + "/jupyterhub.pid"
c.ConfigurableHTTPProxy.api_url = "http://127.0.0.1:%d" % settings["proxy_api_port"]
c.ConfigurableHTTPProxy.auth_token = settings["proxy_token"]
c.ConfigurableHTTPProxy.pid_file = settings["dir"] + "/proxy.pid"
c.JupyterHub.authenticator_class = "dummy"
c.DummyAuthenticator.password = settings["password"]
c.Authenticator.admin_users = {{"admin"}}
c.Authenticator.allowed_users = set(settings["users"])
c.JupyterHub.spawner_class = "simple"
c.SimpleLocalProcessSpawner.home_dir_template = settings["dir"] + "/home/{{username}}"
c.Spawner.args = ["--allow-root"]  # the tests may run as root
# a kernel's $JUPYTERHUB_API_TOKEN (its single-user server's token) may call the service too
c.Spawner.server_token_scopes = ["users:activity!user", "access:servers!server", settings["access_scope"]]
c.JupyterHub.custom_scopes = {{
    settings["admin_scope"]: {{"description": "Administer the lemonkit service: pull, delete, install models"}},
}}
c.JupyterHub.load_roles = [
    {{"name": "user", "scopes": ["self", settings["access_scope"]]}},
    {{"name": "lemonkit-admins", "scopes": [settings["admin_scope"]], "users": ["operator"]}},
]
c.JupyterHub.services = [
    {{
        "name": settings["service"],
        "url": "http://127.0.0.1:%d" % settings["service_port"],
        "command": settings["command"],
        "environment": settings["environment"],
        "oauth_no_confirm": True,
        # a browser's OAuth token carries the admin scope too when its user holds it
        "oauth_client_allowed_scopes": [settings["admin_scope"]],
    }},
]
"""


class JupyterHub:
    """A running JupyterHub with the lemonkit service; a context manager that stops it.

    Args:
        directory: Everything of this hub goes here (database, secrets, homes, the service's cache, logs).
        environment: More environment variables for the service (``LEMONKIT_*`` settings, ``HF_ENDPOINT``...).
        service_args: More ``lemonkit serve`` arguments (``--load MODEL``, ``--hub-admin-scope S``...).
        timeout: Seconds the hub and its service may take to answer through the proxy.
        extra_config: Python appended to ``jupyterhub_config.py`` (``c`` is the config), e.g. spawner settings.

    Raises:
        RuntimeError: The hub or the service did not come up (the message ends with their log).
    """

    def __init__(
        self,
        directory: Path,
        environment: dict[str, str] | None = None,
        service_args: list[str] | tuple[str, ...] = (),
        timeout: float = 180,
        extra_config: str = "",
    ) -> None:
        tool("configurable-http-proxy")  # the hub starts it: skip, naming its install, rather than time out
        self.directory = directory
        self.cache_dir = directory / "lemonkit-cache"
        self.proxy_port, self.service_port = free_port(), free_port()
        self.public_url = f"http://127.0.0.1:{self.proxy_port}"
        self.service_url = f"{self.public_url}/services/{SERVICE}/"
        self.api = f"{self.service_url}api/v1"
        self.hub_api = f"{self.public_url}/hub/api"
        self._log_path = directory / "hub.log"
        service_env = {
            "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
            "LEMONADE_CACHE_DIR": str(self.cache_dir),
            "HF_HOME": str(directory / "hf-home"),
            "HF_HUB_OFFLINE": "1",
            **(environment or {}),
        }
        settings = {
            "dir": str(directory),
            "proxy_port": self.proxy_port,
            "proxy_api_port": free_port(),
            "proxy_token": secrets.token_hex(16),
            "hub_port": free_port(),
            "service_port": self.service_port,
            "password": PASSWORD,
            "users": [*USERS],
            "service": SERVICE,
            "access_scope": ACCESS_SCOPE,
            "admin_scope": ADMIN_SCOPE,
            "command": [sys.executable, "-m", "lemonkit", "serve", "--jupyterhub-service", *service_args],
            "environment": service_env,
        }
        config = directory / "jupyterhub_config.py"
        config.write_text(_CONFIG.format(settings=json.dumps(settings)) + extra_config)
        with self._log_path.open("wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "jupyterhub", "-f", str(config)],
                cwd=directory,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # stop() signals the hub; it stops the proxy and the service itself
            )
        self.http = httpx.Client(timeout=60)
        try:
            self._wait_ready(timeout)
            self.admin_token = self._login_token("admin")
        except BaseException:
            self.stop()
            raise

    # -- readiness -------------------------------------------------------------------------------------------------

    def _wait_ready(self, timeout: float) -> None:
        """Poll the service's ``/live`` through the proxy (connection refused, then the proxy's 503 while the
        service starts, then 200)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.http.get(f"{self.service_url}live", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if self.process.poll() is not None:
                raise RuntimeError(f"jupyterhub exited with {self.process.returncode}:\n{self.logs()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the lemonkit service did not answer within {timeout} s:\n{self.logs()}")
            time.sleep(0.1)  # polling HTTP readiness: nothing to wait on

    def logs(self) -> str:
        """Everything the hub, its proxy and the service printed so far."""
        return self._log_path.read_text(errors="replace")

    # -- credentials -----------------------------------------------------------------------------------------------

    def _login_token(self, user: str) -> str:
        """A token of ``user`` that the hub gives for their password (``POST /hub/api/users/<u>/tokens``)."""
        body = {"auth": {"username": user, "password": PASSWORD}, "note": "lemonkit tests"}
        response = self.http.post(f"{self.hub_api}/users/{user}/tokens", json=body)
        response.raise_for_status()
        return str(response.json()["token"])

    def token(self, user: str, scopes: list[str] | None = None) -> str:
        """A new API token of ``user``, created by the admin through the hub's REST API.

        Args:
            user: ``admin``, ``alice``, ``bob`` or ``operator``.
            scopes: The token's scopes (``None``: all of the user's, the access scope included). A list without
                :data:`ACCESS_SCOPE` (e.g. ``["read:users:name!user"]``) makes a token the service refuses (403).
        """
        body: dict[str, Any] = {"note": "lemonkit tests"}
        if scopes is not None:
            body["scopes"] = scopes
        response = self.http.post(
            f"{self.hub_api}/users/{user}/tokens", json=body, headers={"Authorization": f"token {self.admin_token}"}
        )
        if response.status_code != 201:
            raise RuntimeError(f"the hub refused a token for {user}: {response.status_code} {response.text}")
        return str(response.json()["token"])

    def headers(self, user: str, scopes: list[str] | None = None) -> dict[str, str]:
        """``Authorization`` for a new token of ``user`` (see :meth:`token`)."""
        return {"Authorization": f"token {self.token(user, scopes)}"}

    def login(self, user: str) -> httpx.Client:
        """An ``httpx.Client`` that logged in at ``/hub/login`` as a browser does (form with the hub's XSRF
        token); it follows redirects, so its first request to the service completes the OAuth flow."""
        client = httpx.Client(base_url=self.public_url, follow_redirects=True, timeout=60)
        page = client.get("/hub/login")
        page.raise_for_status()
        xsrf = client.cookies.get("_xsrf", path="/hub/")
        form = {"username": user, "password": PASSWORD, **({"_xsrf": xsrf} if xsrf else {})}
        answer = client.post("/hub/login", data=form)
        if answer.status_code >= 400 or "jupyterhub-session-id" not in client.cookies:
            client.close()
            raise RuntimeError(f"logging in as {user} failed: {answer.status_code} {answer.text[:300]}")
        return client

    # -- users' servers -------------------------------------------------------------------------------------------

    def start_server(self, user: str, timeout: float = 120) -> str:
        """Start ``user``'s single-user server (``jupyterhub-singleuser``, lemonkit's extension in it) and wait
        until the hub reports it ready.

        Returns:
            Its URL through the proxy (``<public>/user/<name>/``).
        """
        admin = {"Authorization": f"token {self.admin_token}"}
        response = self.http.post(f"{self.hub_api}/users/{user}/server", headers=admin, timeout=timeout)
        if response.status_code not in (201, 202):
            raise RuntimeError(f"starting {user}'s server failed: {response.status_code} {response.text}")
        deadline = time.monotonic() + timeout
        while True:
            model = self.http.get(f"{self.hub_api}/users/{user}", headers=admin).json()
            server = model.get("servers", {}).get("", {})
            if server.get("ready"):
                return f"{self.public_url}{server['url']}"
            if time.monotonic() > deadline:
                raise RuntimeError(f"{user}'s server was not ready within {timeout} s:\n{self.logs()}")
            time.sleep(0.1)  # polling the hub's REST API: nothing to wait on

    def stop_server(self, user: str) -> None:
        """Stop ``user``'s single-user server (the hub waits for it to end)."""
        admin = {"Authorization": f"token {self.admin_token}"}
        self.http.delete(f"{self.hub_api}/users/{user}/server", headers=admin, timeout=120)

    # -- stopping --------------------------------------------------------------------------------------------------

    def stop(self) -> None:
        """SIGTERM the hub, which stops the service and the proxy; kill what is left after 30 s."""
        self.http.close()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                proxy = self._proxy_pid()  # read before the kill: a hub that stops cleanly removes the file
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
                if proxy is not None:  # it runs in its own session, so it outlives a killed hub
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(proxy, signal.SIGTERM)

    def _proxy_pid(self) -> int | None:
        try:
            return int((self.directory / "proxy.pid").read_text().strip())
        except (OSError, ValueError):
            return None

    def __enter__(self) -> JupyterHub:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
