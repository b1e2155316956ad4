"""``POST /v1/install`` / ``/v1/uninstall`` and ``state`` in ``/v1/system-info``, on both hosts, with real pip.

pip never touches the environment running the tests: both hosts of this module run in their own processes from
a throwaway virtual environment layered on this one (its packages on the path, see :func:`venv`), and a server
installs backends with its own interpreter's pip, into its own environment, where it reads backend states and
starts its engines. pip never touches llama-cpp-python either: the servers read a recipes file
(``LEMONKIT_RECIPES`` / ``c.LemonkitExtension.recipes_file``) that points ``llamacpp:cpu``
at ``lemonkit-probe-<id>``, a package the tests write as wheels (1.0 and 2.0) and pip installs
offline from a ``--find-links`` directory. Every test first checks that the backend it is
about to uninstall really is the probe.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import importlib.metadata
import json
import os
import site
import subprocess
import sys
import uuid
import zipfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.hosts import API_KEY, Host, Standalone
from tests.support.jupyter_process import JupyterServer
from tests.support.tiny_models import TINY

#: unique per session: concurrent test sessions sharing one environment must not install each other's probe
PROBE = f"lemonkit-probe-{uuid.uuid4().hex[:8]}"
MODULE = PROBE.replace("-", "_")


def _write_wheel(directory: Path, version: str) -> None:
    """A minimal pure-Python wheel of the probe (no build backend, so no network)."""
    info = f"{MODULE}-{version}.dist-info"
    files = {
        f"{MODULE}/__init__.py": f'__version__ = "{version}"\n',
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {PROBE}\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: lemonkit-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for name, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(text.encode())}")
    files[f"{info}/RECORD"] = "\n".join([*record, f"{info}/RECORD,,"]) + "\n"
    with zipfile.ZipFile(directory / f"{MODULE}-{version}-py3-none-any.whl", "w") as wheel:
        for name, text in files.items():
            wheel.writestr(name, text)


@pytest.fixture(scope="module")
def recipes_file(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    wheels = tmp_path_factory.mktemp("wheels")
    for version in ("1.0", "2.0"):
        _write_wheel(wheels, version)
    probe = {"distribution": PROBE, "module": MODULE, "pip_args": ["--no-index", "--find-links", str(wheels)]}
    table = {
        "llamacpp": {
            "backends": {
                # the real row, re-pointed: "extra": null drops lemonkit's own llama-cpp-python requirement, and
                # "build": null makes it a package pip installs rather than a llama.cpp build lemonkit compiles
                "cpu": {**probe, "extra": None, "build": None, "min_version": "2.0"},
                "probe-old": {**probe, "devices": ["cpu"], "requirement": f"{PROBE}==1.0"},
                "probe-missing": {**probe, "devices": ["cpu"], "requirement": f"{PROBE}==9.9"},
                "probe-gpu": {**probe, "devices": ["nvidia_gpu"], "missing": "No GPU found."},
            }
        }
    }
    path = tmp_path_factory.mktemp("config") / "recipes.json"
    path.write_text(json.dumps(table))
    return path


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A throwaway environment on top of this one; its ``python -m pip`` installs into it.

    ``--system-site-packages`` shows the base interpreter's packages, not a venv's: when the suite itself runs in a
    venv, lemonkit and pip are there. A ``.pth`` file puts this interpreter's own site directories on the new
    environment's path, after its own site-packages, so that what pip installs there comes first.
    """
    path = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(path)], check=True)
    python = _python(path)
    own = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    layers = [p for p in (*site.getsitepackages(), site.getusersitepackages()) if Path(p).is_dir()]
    (Path(own) / "_lemonkit_tests_parent.pth").write_text("".join(f"{p}\n" for p in layers), encoding="utf-8")
    probe = subprocess.run(
        [python, "-c", "import lemonkit, pip; print(lemonkit.__file__)"], capture_output=True, text=True
    )
    assert probe.returncode == 0, probe.stderr
    return path


def _python(venv: Path) -> str:
    return str(venv / ("Scripts/python.exe" if sys.platform == "win32" else "bin/python"))


@pytest.fixture(scope="module")
def standalone(recipes_file: Path, venv: Path) -> Iterator[Standalone]:
    """This module's own ``lemonkit serve``, in the venv (the session's knows nothing of the probe)."""
    server = Standalone({"LEMONADE_API_KEY": API_KEY, "LEMONKIT_RECIPES": str(recipes_file)}, python=_python(venv))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def jupyter_host(recipes_file: Path, venv: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Host]:
    """This module's own Jupyter server, in the venv."""
    config = {"LemonkitExtension": {"recipes_file": str(recipes_file)}}
    server = JupyterServer(tmp_path_factory.mktemp("jupyter"), config, python=_python(venv))
    yield Host("jupyter", server.base + "lemonkit/", server.token)
    server.stop()


def _installed_in_venv(venv: Path) -> list[str]:
    """The probe's versions installed in the venv's own site-packages."""
    return sorted(p.name for p in venv.glob(f"lib/python*/site-packages/{MODULE}-*.dist-info"))


@pytest.fixture(autouse=True)
def _tests_environment_untouched() -> Iterator[None]:
    yield
    assert list(importlib.metadata.distributions(name=PROBE)) == []  # neither here nor anywhere on sys.path


async def _backends(client: httpx.AsyncClient) -> dict[str, Any]:
    response = await client.get("system-info")
    assert response.status_code == 200, response.text
    backends: dict[str, Any] = response.json()["recipes"]["llamacpp"]["backends"]
    return backends


async def _post(client: httpx.AsyncClient, route: str, body: dict[str, Any]) -> httpx.Response:
    return await client.post(route, json={"recipe": "llamacpp", **body}, timeout=120)


def _events(response: httpx.Response) -> list[tuple[str, dict[str, Any]]]:
    assert response.headers["content-type"].startswith("text/event-stream"), response.text
    events = []
    for block in response.text.strip().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines())
        events.append((fields["event"], json.loads(fields["data"])))
    return events


@contextlib.asynccontextmanager
async def _probe(host: Host) -> AsyncIterator[httpx.AsyncClient]:
    """A client of ``host`` with the probe uninstalled, after making sure ``llamacpp:cpu`` is the probe."""
    async with host.client() as client:

        async def clean() -> None:
            cpu = (await _backends(client))["cpu"]
            # the guard: llama-cpp-python's own row would report its version (0.3.x) here
            assert cpu["state"] == "installable" or cpu.get("version") in ("1.0", "2.0"), cpu
            if cpu["state"] != "installable":
                assert (await _post(client, "uninstall", {"backend": "cpu"})).status_code == 200

        await clean()
        try:
            yield client
        finally:
            await clean()


async def test_install_update_uninstall(host: Host, venv: Path) -> None:
    async with _probe(host) as client:
        cpu = (await _backends(client))["cpu"]
        assert cpu == {
            "devices": ["cpu"],
            "state": "installable",
            "message": "Backend is supported but not installed.",
            "action": f"pip install {PROBE}",
        }
        assert _installed_in_venv(venv) == []

        # an old version: the backend needs an update
        assert (await _post(client, "install", {"backend": "probe-old"})).status_code == 200  # pins 1.0
        backends = await _backends(client)
        assert backends["probe-old"]["state"] == "installed" and backends["probe-old"]["version"] == "1.0"
        assert _installed_in_venv(venv) == [f"{MODULE}-1.0.dist-info"]  # in the server's environment, not ours
        cpu = backends["cpu"]
        assert (cpu["state"], cpu["version"], cpu["action"]) == ("update_required", "1.0", f"pip install -U {PROBE}")
        assert cpu["message"]

        # install updates it, streaming pip's lines
        response = await _post(client, "install", {"backend": "cpu", "stream": True})
        assert response.status_code == 200
        *progress, (last, done) = _events(response)
        assert progress and {name for name, _ in progress} == {"progress"}
        assert all(p["line"] and p["recipe"] == "llamacpp" and p["backend"] == "cpu" for _, p in progress)
        assert any(f"Successfully installed {PROBE}-2.0" in p["line"] for _, p in progress)
        assert last == "complete"
        assert done["status"] == "success" and done["state"] == "installed" and done["version"] == "2.0"
        assert done["percent"] == 100 and done["file"] == "llamacpp:cpu"
        cpu = (await _backends(client))["cpu"]
        assert (cpu["state"], cpu["version"], cpu["message"], cpu["action"]) == ("installed", "2.0", "", "")
        assert _installed_in_venv(venv) == [f"{MODULE}-2.0.dist-info"]

        # uninstall unloads the models running on it first
        assert (await client.post("load", json={"model_name": TINY})).status_code == 200
        assert [m["model_name"] for m in (await client.get("health")).json()["all_models_loaded"]] == [TINY]
        events = _events(await _post(client, "uninstall", {"backend": "cpu", "stream": True}))
        assert events[-1][0] == "complete" and events[-1][1]["state"] == "installable"
        assert any(f"Successfully uninstalled {PROBE}" in data["line"] for _, data in events[:-1])
        assert (await client.get("health")).json()["all_models_loaded"] == []
        assert (await _backends(client))["cpu"]["state"] == "installable"
        assert _installed_in_venv(venv) == []

        # the same without streams
        response = await _post(client, "install", {"backend": "cpu"})
        assert response.json() == {"status": "success", "recipe": "llamacpp", "backend": "cpu"}
        assert (await _backends(client))["cpu"]["state"] == "installed"
        response = await _post(client, "uninstall", {"backend": "cpu"})
        assert response.json() == {"status": "success", "recipe": "llamacpp", "backend": "cpu"}
        assert (await _backends(client))["cpu"]["state"] == "installable"


async def test_pip_failure(host: Host) -> None:
    async with _probe(host) as client:
        response = await _post(client, "install", {"backend": "probe-missing"})
        assert response.status_code == 500
        error = response.json()["error"]
        assert error["code"] == "install_error" and "9.9" in error["message"]

        events = _events(await _post(client, "install", {"backend": "probe-missing", "stream": True}))
        name, data = events[-1]
        assert name == "error" and data["error"]["code"] == "install_error" and data["error"]["status_code"] == 500
        assert all(name == "progress" for name, _ in events[:-1])
        assert (await _backends(client))["probe-missing"]["state"] == "installable"


async def test_unsupported_backend_is_refused_unless_forced(host: Host) -> None:
    async with _probe(host) as client:
        assert (await _backends(client))["probe-gpu"]["state"] == "unsupported"
        for stream in (False, True):
            response = await _post(client, "install", {"backend": "probe-gpu", "stream": stream})
            assert response.status_code == 400  # before any stream starts
            error = response.json()["error"]
            assert error["code"] == "backend_unsupported" and "force" in error["message"]

        response = await _post(client, "install", {"backend": "probe-gpu", "force": True})
        assert response.status_code == 200, response.text
        backends = await _backends(client)
        assert backends["probe-gpu"]["state"] == "unsupported"  # installed, but still no GPU to run on
        assert backends["cpu"]["state"] == "installed"  # the same package

        # a GPU build on a machine without that GPU: refused; forced, its missing prerequisites are named
        if Path("/opt/rocm").exists() or "ROCM_PATH" in os.environ:
            return  # a machine with ROCm may well build it
        for stream in (False, True):
            response = await _post(client, "install", {"backend": "rocm", "stream": stream})
            assert response.status_code == 400 and response.json()["error"]["code"] == "backend_unsupported"
            response = await _post(client, "install", {"backend": "rocm", "force": True, "stream": stream})
            error = response.json()["error"]
            assert response.status_code == 400 and error["code"] == "prerequisites_missing", error
            assert "ROCm" in error["message"] and "rocm.docs.amd.com" in error["message"]


@pytest.mark.parametrize(
    ("route", "body", "code"),
    [
        ("install", {"recipe": "no-such-recipe", "backend": "cpu"}, "invalid_argument"),
        ("install", {"backend": "no-such-backend"}, "invalid_argument"),
        ("install", {"backend": None}, "missing_argument"),
        ("install", {"backend": "cpu", "force": "yes"}, "invalid_argument"),
        ("uninstall", {"recipe": "no-such-recipe", "backend": "cpu"}, "invalid_argument"),
        ("uninstall", {"recipe": "remote", "backend": "http"}, "invalid_argument"),  # part of lemonkit
    ],
)
async def test_bad_requests(host: Host, route: str, body: dict[str, Any], code: str) -> None:
    async with host.client() as client:
        response = await _post(client, route, body)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == code


async def test_refused_without_credentials(host: Host) -> None:
    async with httpx.AsyncClient(base_url=host.api + "/") as client:
        for route in ("install", "uninstall"):
            response = await _post(client, route, {"backend": "cpu"})
            assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"


async def test_uninstalling_a_package_of_lemonkits_own_installation_keeps_it(host: Host) -> None:
    # onnxruntime serves the bundled embedding model: an uninstall through the API must not take it from the server
    async with host.client() as client:
        before = (await client.get("system-info")).json()["recipes"]["onnxruntime"]["backends"]["cpu"]
        assert before["state"] == "installed"
        response = await _post(client, "uninstall", {"recipe": "onnxruntime", "backend": "cpu", "stream": True})
        *lines, (last, done) = _events(response)
        assert last == "complete" and done["state"] == "installed" and done["version"] == before["version"]
        assert any("came with lemonkit's own installation" in data["line"] for _, data in lines)
        after = (await client.get("system-info")).json()["recipes"]["onnxruntime"]["backends"]["cpu"]
        assert after == before
    assert importlib.metadata.version("onnxruntime") == before["version"]
