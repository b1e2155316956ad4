"""``lemonkit serve --embedded`` in a subprocess for a benchmark: offline, on its own cache dir, no API key."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

__all__ = ["embedded_server"]


@contextlib.contextmanager
def embedded_server(cache: Path, **env: str) -> Iterator[str]:
    """Serve with ``cache`` as lemonkit's cache dir (and ``env`` added); yields the API's base URL (``.../api/v1/``)."""
    environment = {**os.environ, "LEMONADE_CACHE_DIR": str(cache), "HF_HUB_OFFLINE": "1", **env}
    environment.pop("LEMONADE_API_KEY", None)
    server = subprocess.Popen(
        [sys.executable, "-m", "lemonkit.cli", "serve", "--port", "0", "--embedded"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=environment,
    )
    assert server.stdin is not None and server.stdout is not None
    try:
        yield f"http://127.0.0.1:{json.loads(server.stdout.readline())['port']}/api/v1/"
    finally:
        server.stdin.close()  # the embedded server exits when its stdin closes
        server.wait(30)
