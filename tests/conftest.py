"""Shared fixtures: generated tiny models in a Hugging Face cache, and both hosts serving them.

The environment is fixed before lemonkit or huggingface_hub is imported (:mod:`tests.support.session`, imported
first): every host of the session (the in-process Jupyter server and the standalone subprocess) sees the same HF
cache and lemonkit cache dir, offline. The helpers the fixtures are built on are in ``tests/support/``.
"""

from __future__ import annotations

from tests.support.session import ROOT  # first: it sets the session's environment

# isort: split

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.hosts import API_KEY, Host, Standalone
from tests.support.hub_server import HubServer, tiny_gguf_repo
from tests.support.llama_cpp_server import LlamaCppServer
from tests.support.tiny_models import write_models

pytest_plugins = ["jupyter_server.pytest_plugin"]


#: fixtures that run the bundled Gemma 270M: a test using one is marked ``gemma`` (``pytest -m "not gemma"`` skips it)
GEMMA_FIXTURES = {"gemma", "gemma_path", "bundled_cache"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if GEMMA_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.gemma)


def pytest_configure(config: pytest.Config) -> None:
    write_models()  # once, before anything is collected


def pytest_sessionfinish(session: pytest.Session) -> None:
    shutil.rmtree(ROOT, ignore_errors=True)


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
