"""Finding the lemonkit server a client without a URL talks to: :func:`locate`, which takes the first of:

1. ``LEMONKIT_URL`` (a host root such as ``http://127.0.0.1:13305``, a Jupyter server's
   ``http://host:8888/lemonkit``, or a full ``.../api/v1``), with ``LEMONKIT_TOKEN`` or ``LEMONADE_API_KEY``;
2. under JupyterHub, the hub's shared lemonkit service (``LEMONKIT_HUB_SERVICE``, default ``lemonkit``), found
   through the hub's REST API with this user's ``JUPYTERHUB_API_TOKEN`` (see :mod:`lemonkit.serving.hub_discovery`);
3. the Jupyter server this kernel belongs to, with its token (JupyterHub's API token when it has none);
4. a ``lemonkit serve`` of this user, the one on port 13305 first, found through its record in Jupyter's runtime
   directory (with its key; see :mod:`lemonkit.serving.server_records`): a server no record vouches for, such as
   another user's on a shared machine, is never used;
5. an embedded standalone server started in the background on a free port, with a random key, that exits with
   this process (it watches its stdin).
"""

from __future__ import annotations

import atexit
import json
import os
import re
import secrets
import selectors
import subprocess
import sys
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

import httpx

from lemonkit.catalog.config import DEFAULT_PORT
from lemonkit.errors import ServerUnavailable
from lemonkit.serving import hub_discovery, server_records

__all__ = ["Server", "api_root", "host_root", "locate"]

#: how long a probe of a candidate server may take before the next candidate is tried
_PROBE_TIMEOUT = 3.0
#: how long an embedded server may take to start listening
_START_TIMEOUT = 120.0


@dataclass(frozen=True)
class Server:
    """Where a client sends its requests.

    Attributes:
        api: The API root, ending ``/api/v1``.
        token: Sent as ``Authorization: <scheme> <token>``; ``None`` sends nothing.
        kind: How it was found: ``"url"``, ``"jupyterhub"``, ``"jupyter"``, ``"standalone"`` or ``"embedded"``.
        scheme: The Authorization scheme (JupyterHub's own is ``token``).
    """

    api: str
    token: str | None
    kind: str
    scheme: str = "Bearer"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"{self.scheme} {self.token}"} if self.token else {}


def api_root(url: str) -> str:
    """``url`` as an API root: a host root gets ``/api/v1``, a URL already ending in a version is kept."""
    url = url.rstrip("/")
    return url if re.search(r"/(api/)?v[01]$", url) else url + "/api/v1"


def host_root(api: str) -> str:
    """The mount point an API root hangs off (where ``/live`` is): ``api_root``'s inverse."""
    return re.sub(r"/(api/)?v[01]$", "", api.rstrip("/"))


def locate(*, start: bool = True) -> Server:
    """Find the server a client without a URL talks to (the module doc gives the order).

    Args:
        start: Start the embedded server when nothing else answers.

    Raises:
        ServerUnavailable: ``LEMONKIT_URL`` does not answer, or nothing does and ``start`` is false, or the
            embedded server failed to start.
        HubServiceError: Under JupyterHub, the hub's service is required but missing, or it is there for this
            user but cannot be read or reached (see :mod:`lemonkit.serving.hub_discovery`).
    """
    token = os.environ.get("LEMONKIT_TOKEN") or os.environ.get("LEMONADE_API_KEY") or None
    url = os.environ.get("LEMONKIT_URL")
    if url:
        server = Server(api_root(url), token, "url")
        if not _answers(server):
            raise ServerUnavailable(f"LEMONKIT_URL names {url}, but no lemonkit server answers there")
        return server
    hub = hub_discovery.find()
    if hub is not None:
        return Server(hub.root + "/api/v1", hub.token, "jupyterhub", scheme="token")
    found = _jupyter_server()
    if found is not None:
        return found
    local = _recorded(token)
    if local is not None:
        return local
    if not start:
        raise ServerUnavailable(
            f"No lemonkit server is running (none at LEMONKIT_URL, this kernel's Jupyter server or port "
            f"{DEFAULT_PORT}); start one with `lemonkit serve`"
        )
    return _embedded()


def _answers(server: Server) -> bool:
    """Whether a lemonkit server listens at ``server`` (``/live`` needs no credentials)."""
    try:
        response = httpx.get(host_root(server.api) + "/live", timeout=_PROBE_TIMEOUT)
    except httpx.HTTPError:
        return False
    return response.status_code == 200


def _recorded(token: str | None) -> Server | None:
    """This user's recorded ``lemonkit serve`` (the one on the default port first), if it answers."""
    record = server_records.find(DEFAULT_PORT)
    if record is None:
        return None
    server = Server(api_root(record.url), record.key or token, "standalone")
    return server if _answers(server) else None


# -- the Jupyter server of this kernel ----------------------------------------------------------------------------


def _kernel_id() -> str | None:
    """This kernel's id, from its connection file's name; ``None`` outside a kernel."""
    if "ipykernel" not in sys.modules:  # never import it: outside a kernel it is only cost
        return None
    try:
        from ipykernel.connect import get_connection_file

        name = Path(get_connection_file()).name
    except Exception:
        return None
    match = re.fullmatch(r"kernel-(.+)\.json", name)
    return match.group(1) if match else None


def _jupyter_server() -> Server | None:
    """The Jupyter server that started this kernel, when it runs the lemonkit extension."""
    kernel = _kernel_id()
    if kernel is None:
        return None
    from jupyter_server.serverapp import list_running_servers

    parent = os.environ.get("JPY_PARENT_PID")
    hub_token = os.environ.get("JUPYTERHUB_API_TOKEN")
    for info in list_running_servers():
        token = info.get("token") or hub_token
        base = info["url"].rstrip("/") + "/"
        if str(info.get("pid")) != parent and not _owns_kernel(base, token, kernel):
            continue
        server = Server(base + "lemonkit/api/v1", token, "jupyter")
        if _answers(server):
            return server
        warnings.warn(
            f"The Jupyter server at {base} runs this kernel but not the lemonkit extension "
            "(`jupyter server extension enable lemonkit`); using a standalone server instead",
            stacklevel=4,
        )
        return None
    return None


def _owns_kernel(base: str, token: str | None, kernel: str) -> bool:
    headers = {"Authorization": f"token {token}"} if token else {}
    try:
        response = httpx.get(f"{base}api/kernels/{kernel}", headers=headers, timeout=_PROBE_TIMEOUT)
    except httpx.HTTPError:
        return False
    return response.status_code == 200


# -- the embedded server ------------------------------------------------------------------------------------------

_embedded_lock = threading.Lock()
_embedded_server: Server | None = None
_embedded_process: subprocess.Popen[str] | None = None


def _embedded() -> Server:
    """This process's embedded standalone server, started on first use."""
    global _embedded_server, _embedded_process
    with _embedded_lock:
        if _embedded_server is not None and _embedded_process is not None and _embedded_process.poll() is None:
            return _embedded_server
        key = secrets.token_urlsafe(24)  # the port is open to every local user: only this process gets the key
        process = subprocess.Popen(
            [sys.executable, "-m", "lemonkit.cli", "serve", "--embedded", "--port", "0", "--log-level", "warning"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "LEMONADE_API_KEY": key},
        )
        port = _announced_port(process)
        _embedded_process = process
        _embedded_server = Server(f"http://127.0.0.1:{port}/api/v1", key, "embedded")
        atexit.register(_stop_embedded, process, os.getpid())
        return _embedded_server


def _announced_port(process: subprocess.Popen[str]) -> int:
    """The port the embedded server prints once it listens."""
    assert process.stdout is not None
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        ready = selector.select(_START_TIMEOUT)
    line = process.stdout.readline() if ready else ""
    try:
        return int(json.loads(line)["port"])
    except (ValueError, KeyError, TypeError):
        _stop_embedded(process)
        raise ServerUnavailable(
            f"The embedded lemonkit server did not start (exit status {process.poll()}); its errors are above"
        ) from None


def _stop_embedded(process: subprocess.Popen[str], owner: int | None = None) -> None:
    """Close its stdin (it unloads its models and exits), then make sure it is gone; a forked child of the
    owner leaves it alone."""
    if owner is not None and os.getpid() != owner:
        return
    if process.stdin is not None and not process.stdin.closed:
        process.stdin.close()
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
