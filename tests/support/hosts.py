"""The lemonkit servers the tests talk to: :class:`Host`, one running server as a client sees it (either host:
the in-process Jupyter server's extension or a standalone ``lemonkit serve``), and :class:`Standalone`,
``lemonkit serve`` in a subprocess. The fixtures that start them are in ``tests/conftest.py``."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Any

import httpx
import openai

from tests.support.processes import stop_process

__all__ = ["API_KEY", "Host", "Standalone"]

#: the key the tests' standalone servers require
API_KEY = "sk-lemonkit-test"


@dataclass
class Host:
    """One running lemonkit server, as a client sees it."""

    kind: str
    root: str  # ends with "/": the host's mount point
    token: str | None

    @property
    def api(self) -> str:
        return self.root + "api/v1"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def client(self, **kwargs: Any) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.api + "/", headers=self.headers, timeout=120, **kwargs)

    def openai(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.api, api_key=self.token or "none", max_retries=0, timeout=120)


class Standalone:
    """``lemonkit serve`` in a subprocess, for as long as a fixture needs it."""

    def __init__(
        self, env: dict[str, str] | None = None, python: str = sys.executable, args: tuple[str, ...] = ()
    ) -> None:
        self.env = {**os.environ, **(env or {})}
        self.process = subprocess.Popen(
            [python, "-m", "lemonkit.cli", "serve", "--port", "0", *args],
            env=self.env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.port: int | None = None
        self.log: list[str] = []
        self._ready = threading.Event()
        self._drainer = threading.Thread(target=self._drain, daemon=True)
        self._drainer.start()
        if not self._ready.wait(60) or self.port is None:
            self.stop()
            raise RuntimeError("lemonkit serve did not start:\n" + "".join(self.log))

    def _drain(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.log.append(line)
            if "lemonkit serving on" in line and self.port is None:
                self.port = int(line.rsplit(":", 1)[1].split("/")[0])
                self._ready.set()
        self._ready.set()

    @property
    def root(self) -> str:
        return f"http://127.0.0.1:{self.port}/"

    def stop(self) -> None:
        stop_process(self.process)
        self._drainer.join(10)  # every line it wrote is in self.log
