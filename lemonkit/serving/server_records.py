"""Server records: how a client finds a local lemonkit server without trusting whoever holds a port.

Every ``lemonkit serve`` (and every embedded server) writes ``lemonkit-<pid>.json`` into Jupyter's runtime
directory (this user's, 0700), as Jupyter servers write ``jpserver-<pid>.json``: its pid, its URL and its key
(``null`` without one), mode 0600, written atomically, removed when it stops. A client believes a record only
while its process is alive, is this user's and still listens on the record's port; records of dead processes
are removed. Another user's server on the default port has no record here, so it is never used.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from lemonkit.formats.files import atomic_write_text

__all__ = ["Record", "find", "live_records", "local_url", "record_dir", "remove", "write"]

_PREFIX = "lemonkit-"


@dataclass(frozen=True)
class Record:
    """One running server, as its record describes it.

    Attributes:
        pid: The server's process.
        url: Its host root, e.g. ``http://127.0.0.1:13305``.
        key: Its ``LEMONADE_API_KEY``; ``None`` when it requires none.
        kind: ``"standalone"`` (``lemonkit serve``) or ``"embedded"`` (lives as long as the process that started it).
        path: The record file.
    """

    pid: int
    url: str
    key: str | None
    kind: str
    path: Path

    @property
    def port(self) -> int:
        return urlsplit(self.url).port or 80


def record_dir() -> Path:
    """Jupyter's runtime directory (``JUPYTER_RUNTIME_DIR``, else this user's)."""
    from jupyter_core.paths import jupyter_runtime_dir

    return Path(jupyter_runtime_dir())


def local_url(host: str, port: int) -> str:
    """The URL a local client reaches a server bound to ``host``:``port`` at (a wildcard bind answers on loopback)."""
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def write(url: str, key: str | None, kind: str = "standalone") -> Path:
    """Record this process's server; returns the record's path (pass it to :func:`remove`)."""
    directory = record_dir()
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = directory / f"{_PREFIX}{os.getpid()}.json"
    body = json.dumps({"pid": os.getpid(), "url": url, "key": key, "kind": kind}, indent=1)
    atomic_write_text(path, body)  # its temp file is created 0600: the record holds the key
    return path


def remove(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def _read(path: Path) -> Record | None:
    try:
        if hasattr(os, "getuid") and path.stat().st_uid != os.getuid():
            return None  # a record planted by someone else says nothing about our servers
        data = json.loads(path.read_text(encoding="utf-8"))
        return Record(int(data["pid"]), str(data["url"]), data.get("key"), str(data.get("kind", "standalone")), path)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _listens(record: Record) -> bool | None:
    """Whether the record's process is ours and listens on its port; ``None`` when the process is gone."""
    import psutil

    try:
        process = psutil.Process(record.pid)
        if hasattr(os, "getuid") and process.uids().real != os.getuid():
            return False
        return any(
            c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == record.port
            for c in process.net_connections(kind="tcp")
        )
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return None
    except psutil.AccessDenied:
        return False


def live_records() -> Iterator[Record]:
    """The records whose server is alive and listening, removing those whose process is gone."""
    directory = record_dir()
    for path in sorted(directory.glob(f"{_PREFIX}*.json")):
        record = _read(path)
        if record is None:
            continue
        listening = _listens(record)
        if listening is None:
            remove(path)
        elif listening:
            yield record


def find(port: int) -> Record | None:
    """The standalone server to use: the one on ``port`` if it is recorded, else any recorded one."""
    standalone = [r for r in live_records() if r.kind == "standalone"]
    return next((r for r in standalone if r.port == port), standalone[0] if standalone else None)
