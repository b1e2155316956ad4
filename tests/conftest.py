"""Shared fixtures: generated tiny models in a Hugging Face cache, and both hosts serving them.

The environment is fixed before lemonkit or huggingface_hub is imported: every
host of the session (the in-process Jupyter server and the standalone
subprocess) sees the same HF cache and lemonkit cache dir, offline.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(tempfile.mkdtemp(prefix="lemonkit-tests-"))
HF_CACHE = ROOT / "hub"
CACHE_DIR = ROOT / "cache"
os.environ["HF_HUB_CACHE"] = str(HF_CACHE)
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["LEMONADE_CACHE_DIR"] = str(CACHE_DIR)
os.environ["JUPYTER_RUNTIME_DIR"] = str(ROOT / "runtime")  # server records: the session's servers only
os.environ.pop("LEMONADE_API_KEY", None)

import httpx  # noqa: E402
import openai  # noqa: E402
from hub_server import HubServer, tiny_gguf_repo  # noqa: E402
from llama_cpp_server import LlamaCppServer  # noqa: E402
from processes import stop_process  # noqa: E402

from lemonkit.testing.tiny_gguf import (  # noqa: E402
    write_tiny_bert_embedding,
    write_tiny_bert_reranker,
    write_tiny_llama,
    write_tiny_mmproj,
)

pytest_plugins = ["jupyter_server.pytest_plugin"]

API_KEY = "sk-lemonkit-test"
TEST_REPO = "lemonkit-test/tiny-GGUF"
TINY = "user.tiny-llama"
TINY_B = "user.tiny-llama-b"
EMBED = "user.tiny-embed"
RERANK = "user.tiny-rerank"
VISION = "user.tiny-vision"
GEMMA = "Gemma-3-270m-GGUF"


def _write_models() -> None:
    snapshot = HF_CACHE / f"models--{TEST_REPO.replace('/', '--')}" / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("a" * 40)
    write_tiny_llama(snapshot / "tiny-llama.gguf")
    write_tiny_llama(snapshot / "tiny-llama-b.gguf", seed=1)
    write_tiny_bert_embedding(snapshot / "tiny-embed.gguf")
    write_tiny_bert_reranker(snapshot / "tiny-rerank.gguf")
    write_tiny_mmproj(snapshot / "mmproj-tiny.gguf")
    (snapshot / "not-gguf.gguf").write_bytes(b"<html>this is not a model</html>")
    (snapshot / "broken-gguf.gguf").write_bytes(b"GGUF" + bytes(60))
    CACHE_DIR.mkdir(parents=True)
    entries = {
        "tiny-llama": {"checkpoint": f"{TEST_REPO}:tiny-llama.gguf", "recipe": "llamacpp", "labels": ["chat"]},
        "tiny-llama-b": {"checkpoint": f"{TEST_REPO}:tiny-llama-b.gguf", "recipe": "llamacpp", "labels": ["chat"]},
        "tiny-embed": {"checkpoint": f"{TEST_REPO}:tiny-embed.gguf", "recipe": "llamacpp", "labels": ["embeddings"]},
        "tiny-rerank": {"checkpoint": f"{TEST_REPO}:tiny-rerank.gguf", "recipe": "llamacpp", "labels": ["reranking"]},
        "tiny-vision": {
            "checkpoint": f"{TEST_REPO}:tiny-llama.gguf",
            "mmproj": "mmproj-tiny.gguf",
            "recipe": "llamacpp",
            "labels": ["chat", "vision"],
        },
        "not-gguf": {"checkpoint": f"{TEST_REPO}:not-gguf.gguf", "recipe": "llamacpp", "labels": ["chat"]},
        "broken-gguf": {"checkpoint": f"{TEST_REPO}:broken-gguf.gguf", "recipe": "llamacpp", "labels": ["chat"]},
    }
    (CACHE_DIR / "user_models.json").write_text(json.dumps(entries, indent=2))


_write_models()


#: fixtures that run the bundled Gemma 270M: a test using one is marked ``gemma`` (``pytest -m "not gemma"`` skips it)
GEMMA_FIXTURES = {"gemma", "gemma_path", "bundled_cache"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if GEMMA_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.gemma)


def pytest_sessionfinish(session: pytest.Session) -> None:
    shutil.rmtree(ROOT, ignore_errors=True)


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


@pytest.fixture(scope="session")
def standalone() -> Iterator[Standalone]:
    server = Standalone({"LEMONADE_API_KEY": API_KEY})
    yield server
    server.stop()


@pytest.fixture
def jp_server_config() -> dict[str, Any]:
    return {"ServerApp": {"jpserver_extensions": {"lemonkit": True}}}


@pytest.fixture
def jupyter_host(jp_serverapp: Any, http_server: Any, jp_http_port: int, jp_base_url: str) -> Host:
    """The in-process Jupyter server (``http_server`` makes it listen), with its token."""
    return Host(
        "jupyter", f"http://127.0.0.1:{jp_http_port}{jp_base_url}lemonkit/", jp_serverapp.identity_provider.token
    )


@pytest.fixture(params=["jupyter", "standalone"])
def host(request: pytest.FixtureRequest) -> Iterator[Host]:
    """Each test using this runs against both hosts, through real HTTP."""
    if request.param == "jupyter":
        yield request.getfixturevalue("jupyter_host")
        return
    server: Standalone = request.getfixturevalue("standalone")
    host = Host("standalone", server.root, API_KEY)
    yield host
    # leave the shared server as the next test expects it: nothing loaded
    httpx.post(host.api + "/unload", headers=host.headers, timeout=60).raise_for_status()


@pytest.fixture(scope="module")
def counted_standalone() -> Iterator[Standalone]:
    """A ``lemonkit serve`` whose operator set a fixed count, one model per type, instead of memory alone."""
    server = Standalone({"LEMONADE_API_KEY": API_KEY, "LEMONADE_MAX_LOADED_MODELS": "1"})
    yield server
    server.stop()


@pytest.fixture(params=["jupyter", "standalone"])
def counted_host(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Host]:
    """Each host, its operator having set ``LEMONADE_MAX_LOADED_MODELS=1`` (Lemonade's count per type)."""
    if request.param == "jupyter":
        monkeypatch.setenv("LEMONADE_MAX_LOADED_MODELS", "1")  # read when the extension starts
        yield request.getfixturevalue("jupyter_host")
        return
    server: Standalone = request.getfixturevalue("counted_standalone")
    host = Host("standalone", server.root, API_KEY)
    yield host
    httpx.post(host.api + "/unload", headers=host.headers, timeout=60).raise_for_status()


@pytest.fixture
def hub() -> Iterator[HubServer]:
    """A local hub speaking the Hugging Face protocol (``HF_ENDPOINT`` for the code under test)."""
    with HubServer() as server:
        yield server


@pytest.fixture(scope="module")
def allowed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A root holding ``allowed/``, the operator's allowed directory, and ``outside/``, a directory that is not.

    Modules override it to put their files in them.
    """
    root = tmp_path_factory.mktemp("local-files")
    (root / "allowed").mkdir()
    (root / "outside").mkdir()
    return root


@pytest.fixture(scope="module")
def allowed_standalone(allowed: Path) -> Iterator[Standalone]:
    """A ``lemonkit serve`` for one module whose operator allowed ``allowed/allowed`` (its models stay loaded)."""
    server = Standalone({"LEMONADE_API_KEY": API_KEY, "LEMONKIT_ALLOWED_DIRS": str(allowed / "allowed")})
    yield server
    server.stop()


@pytest.fixture(params=["jupyter", "standalone"])
def allowed_host(request: pytest.FixtureRequest, allowed: Path, monkeypatch: pytest.MonkeyPatch) -> Host:
    """Each host, its operator having allowed ``allowed/allowed`` for server-local files."""
    if request.param == "jupyter":
        monkeypatch.setenv("LEMONKIT_ALLOWED_DIRS", str(allowed / "allowed"))  # read when the extension starts
        host: Host = request.getfixturevalue("jupyter_host")
        return host
    server: Standalone = request.getfixturevalue("allowed_standalone")
    return Host("standalone", server.root, API_KEY)


@pytest.fixture(scope="module")
def module_hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HubServer]:
    """A local hub shared by one module's tests (each adds its own repos)."""
    with HubServer(root=tmp_path_factory.mktemp("hub-objects")) as server:
        yield server


@pytest.fixture(scope="module")
def repo_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The files of a tiny GGUF repo, for a module's tests to publish on a hub."""
    return tiny_gguf_repo(tmp_path_factory.mktemp("repo"))


@pytest.fixture(scope="module")
def upstream() -> Iterator[LlamaCppServer]:
    """llama-cpp-python's own OpenAI server with the bundled SmolLM2, as a ``remote`` upstream."""
    server = LlamaCppServer()
    yield server
    server.stop()


@pytest.fixture
def hf_online(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lift the session's HF_HUB_OFFLINE for this process: huggingface_hub read it at import."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
