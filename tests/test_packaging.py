"""Packaging tells the truth: the installed environment serves the Jupyter extension, and every module lemonkit
imports comes from a requirement pyproject.toml declares."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import lemonkit

REPO = Path(__file__).resolve().parents[1]
#: imported only when a kernel already loaded it (lemonkit.client finds its Jupyter server), when IPython runs
#: (lemonkit.magics, lemonkit.client.display), or inside the one function that needs it (``to_pandas()``,
#: ``lemonkit.openai_client()``): the ``notebook`` extra declares them
OPTIONAL_IMPORTS = {"ipykernel", "IPython", "pandas", "openai"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_the_jupyter_extension_is_enabled_and_valid() -> None:
    """What ``jupyter server extension list`` says about this interpreter's own environment: the install enabled
    lemonkit there (``etc/jupyter/jupyter_server_config.d``), and it loads."""
    done = subprocess.run(
        [sys.executable, "-m", "jupyter_server.extension.serverextension", "list"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = re.sub(r"\x1b\[[0-9;]*m", "", done.stdout + done.stderr)
    assert done.returncode == 0, output
    own = f"Config dir: {Path(sys.prefix) / 'etc' / 'jupyter'}\n"
    assert own in output, output
    section = output.split(own, 1)[1].split("Config dir:", 1)[0]
    assert re.search(r"^\s*lemonkit enabled$", section, re.M), output
    assert re.search(rf"^\s*lemonkit {re.escape(lemonkit.__version__)} OK$", section, re.M), output


def _imported_modules() -> set[str]:
    names = set()
    for path in (REPO / "lemonkit").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"__future__", "lemonkit"} - OPTIONAL_IMPORTS


def _declared() -> set[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    engines = [r for extra, reqs in project["optional-dependencies"].items() if extra != "test" for r in reqs]
    requirements = project["dependencies"] + engines  # an engine's imports come with its recipe's extra
    return {_norm(re.match(r"[A-Za-z0-9._-]+", r).group()) for r in requirements}  # type: ignore[union-attr]


def test_every_imported_module_is_declared() -> None:
    providers = importlib.metadata.packages_distributions()
    declared = _declared()
    undeclared = {
        module: providers.get(module)
        for module in _imported_modules()
        if not {_norm(d) for d in providers.get(module, [])} & declared
    }
    assert undeclared == {}


def test_huggingface_hub_floor_is_the_httpx2_one() -> None:
    """The downloader uses huggingface_hub's HTTP session and catches httpx2's errors: 2.0 is where the hub
    client moved to httpx2."""
    requirements = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]["dependencies"]
    assert "huggingface_hub>=2.0" in requirements and "httpx2>=2.0" in requirements
    assert any(_norm(r).startswith("httpx2") for r in importlib.metadata.requires("huggingface_hub") or [])
