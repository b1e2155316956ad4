"""Notebook 7 in a real browser: the quickstart runs in Jupyter Notebook's own interface (not JupyterLab's) with
the lemonkit extension, ``lemonkit.chat`` streams into its cell, the model browser renders as a widget and every
cell runs. Notebook 7 is built from JupyterLab's components, so the page's DOM is checked with the same helpers.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.jupyter_lab import LAB_CONFIG, Notebook, chromium_page, copy_notebook, unavailable
from tests.support.jupyter_process import JupyterServer
from tests.widgets.test_browser import QUICKSTART, TIMEOUT, WATCH_CHAT, check_quickstart_outputs, check_streamed_chat

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(unavailable() is not None and not os.environ.get("CI"), reason=str(unavailable())),
]

#: Jupyter Notebook 7 served by ``jupyter server`` (as ``jupyter notebook`` does), nothing reaching the internet
NOTEBOOK7_CONFIG: dict[str, Any] = {
    **LAB_CONFIG,
    "ServerApp": {"jpserver_extensions": {"lemonkit": True, "notebook": True}},
    "JupyterNotebookApp": {"news_url": None},
}


class ClassicNotebook(Notebook):
    """A notebook open in Notebook 7's single-document page (``/notebooks/<path>``)."""

    def open(self) -> None:
        self.page.goto(f"{self.server.base}notebooks/{self.path}?token={self.server.token}")
        self.wait_open()


@pytest.fixture
def notebook7_root(tmp_path: Path) -> Iterator[tuple[Path, dict[str, str]]]:
    if importlib.util.find_spec("notebook") is None and not os.environ.get("CI"):
        pytest.skip("Jupyter Notebook 7 is not installed (pip install -e '.[test]')")
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("LEMONKIT_DEFAULT_")},
        "LEMONADE_CACHE_DIR": str(tmp_path / "cache"),
        "HF_HUB_CACHE": str(tmp_path / "hf"),
        "HF_HUB_OFFLINE": "1",
        "LEMONKIT_UPDATE_CHECK_INTERVAL": "0",
    }
    for name in ("LEMONKIT_URL", "LEMONKIT_TOKEN", "LEMONADE_API_KEY"):
        env.pop(name, None)  # the kernel finds the extension of the server it runs in
    root = tmp_path / "nb"
    root.mkdir()
    yield root, env


def test_quickstart_in_notebook7(notebook7_root: tuple[Path, dict[str, str]], tmp_path: Path) -> None:
    root, env = notebook7_root
    shots = tmp_path / "screenshots"
    print(f"screenshots: {shots}")
    server = JupyterServer(root, config=NOTEBOOK7_CONFIG, env=env)
    with contextlib.ExitStack() as stack:
        stack.callback(server.stop)
        page = stack.enter_context(chromium_page())
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        notebook = ClassicNotebook(page, server, copy_notebook(QUICKSTART, root), screenshots=shots)
        notebook.open()
        assert page.locator("#jp-NotebookLogo, .jp-NotebookKernelStatus, #top-panel").count() >= 1  # Notebook 7
        assert "/lab" not in page.url
        page.evaluate(WATCH_CHAT)
        notebook.run_all()
        try:
            page.locator('.jp-OutputArea-output:has-text("ChatResult(")').wait_for(timeout=2 * TIMEOUT)
            notebook.screenshot("notebook7-ran")
            check_streamed_chat(page)
            check_quickstart_outputs(page)
            browser = page.locator(".lk-model-browser").first
            browser.locator('tr[data-model="SmolLM2-135M-Instruct-Bundled"]').wait_for(timeout=TIMEOUT)
        except Exception:
            notebook.screenshot("failure")
            print(notebook.output_text())
            raise
        assert not [e for e in errors if "lk-" in e or "anywidget" in e.lower()], errors
