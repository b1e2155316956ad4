"""A Jupyter server in its own process (``python -m jupyter_server``), for tests that need one outside pytest's:
a kernel that must find it, or a server running in another Python environment."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class JupyterServer:
    """``jupyter server`` with lemonkit enabled, ``config`` merged into its config, a token and base URL ``/b/``.

    Args:
        directory: Its config, runtime and root directories go here.
        config: More ``jupyter_server_config.json`` settings (e.g. ``{"LemonkitExtension": {...}}``).
        env: The process's environment (default: this one's).
        python: The interpreter that runs it.
        base_url: Its base URL (JupyterHub's single-user servers run under ``/user/<name>/``).
    """

    token = "process-test-token"

    def __init__(
        self,
        directory: Path,
        config: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
        python: str = sys.executable,
        base_url: str = "/b/",
    ) -> None:
        self.base_url = base_url
        self.config_dir, self.runtime_dir = directory / "config", directory / "runtime"
        self.config_dir.mkdir(parents=True)
        settings = {"ServerApp": {"jpserver_extensions": {"lemonkit": True}}, **(config or {})}
        (self.config_dir / "jupyter_server_config.json").write_text(json.dumps(settings))
        env = {**(os.environ if env is None else env), "JUPYTER_CONFIG_DIR": str(self.config_dir)}
        env["JUPYTER_RUNTIME_DIR"] = str(self.runtime_dir)
        self.port = free_port()
        flags = [
            "--no-browser",
            "--allow-root",
            "--ip=127.0.0.1",
            f"--port={self.port}",
            "--ServerApp.port_retries=0",  # a taken port fails loudly instead of moving silently
            f"--ServerApp.base_url={base_url}",
        ]
        flags += [f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={directory}"]
        self.process = subprocess.Popen(
            [python, "-m", "jupyter_server", *flags],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.process.stderr is not None
        log = []
        for line in self.process.stderr:
            log.append(line)
            if "is running at" in line:
                break
        else:
            self.stop()
            raise RuntimeError("jupyter server did not start:\n" + "".join(log))
        self._wait_listening(log)

    def _wait_listening(self, log: list[str], timeout: float = 60) -> None:
        """Until the port takes connections: the "running at" line can come before the socket listens."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("jupyter server did not listen:\n" + "".join(log)) from None
                time.sleep(0.05)  # polling a port: nothing to wait on

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}{self.base_url}"

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
