"""JupyterLab in a real browser for tests: Debian's chromium (``apt-get install chromium``), headless, driven by
playwright's Python package. Nothing is downloaded at run time (no ``playwright install``): the browser is the
system's and JupyterLab's assets ship in its wheel.

    with lab_server(tmp, env) as server, chromium_page() as page:
        notebook = Notebook(page, server, "widgets.ipynb")
        notebook.open()
        notebook.run_all()
"""

from __future__ import annotations

import contextlib
import importlib.util
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.support.jupyter_process import JupyterServer
from tests.support.system_tools import INSTALL, missing

__all__ = ["CHROMIUM", "Notebook", "chromium_page", "lab_server", "unavailable"]

CHROMIUM = Path("/usr/bin/chromium")
#: a container (root, no GPU, a small /dev/shm) and no network besides loopback
FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
]
#: JupyterLab served by ``jupyter server`` (as ``jupyter lab`` does), with nothing that would reach the internet
LAB_CONFIG: dict[str, Any] = {
    "ServerApp": {"jpserver_extensions": {"lemonkit": True, "jupyterlab": True}},
    "LabApp": {"news_url": None, "check_for_updates_class": "jupyterlab.NeverCheckForUpdate"},
}


def unavailable() -> str | None:
    """Why a browser test cannot run here, or ``None``."""
    if not CHROMIUM.exists():
        return f"no {CHROMIUM}: {missing('chromium') or 'run `' + INSTALL['chromium'] + '`'}"
    for module in ("playwright", "jupyterlab"):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed (pip install -e '.[test]')"
    return None


@contextlib.contextmanager
def lab_server(directory: Path, env: dict[str, str]) -> Iterator[JupyterServer]:
    """JupyterLab with lemonkit, its root ``directory``, in a process with environment ``env``."""
    server = JupyterServer(directory, config=LAB_CONFIG, env=env)
    try:
        yield server
    finally:
        server.stop()


@contextlib.contextmanager
def chromium_page(width: int = 1400, height: int = 1000, args: tuple[str, ...] = ()) -> Iterator[Any]:
    """A page of a fresh headless chromium (playwright's ``Page``), launched with ``args`` besides :data:`FLAGS`."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=[*FLAGS, *args], headless=True)
        try:
            context = browser.new_context(viewport={"width": width, "height": height})
            context.grant_permissions(["clipboard-read", "clipboard-write"])
            yield context.new_page()
        finally:
            browser.close()


class Notebook:
    """A notebook opened in JupyterLab by ``page``.

    Args:
        page: A playwright page.
        server: The JupyterLab server.
        path: The notebook's path under the server's root.
        screenshots: Where :meth:`screenshot` saves.
    """

    def __init__(self, page: Any, server: JupyterServer, path: str, screenshots: Path | None = None) -> None:
        self.page, self.server, self.path = page, server, path
        self.screenshots = screenshots

    def open(self) -> None:
        """Open the notebook, accepting the kernel dialog a fresh JupyterLab shows."""
        page = self.page
        page.goto(f"{self.server.base}lab/tree/{self.path}?token={self.server.token}")
        self.wait_open()

    def wait_open(self) -> None:
        """Wait for the notebook's cells (after :meth:`open` or a reload)."""
        page = self.page
        page.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=120_000)
        with contextlib.suppress(Exception):  # a notebook with a running kernel opens without asking
            page.locator(".jp-Dialog .jp-mod-accept").click(timeout=10_000)

    def save(self) -> None:
        """Save the notebook (a reloaded page shows what was saved, its widgets rendered from the kernel)."""
        page = self.page
        page.locator(".jp-NotebookPanel").first.click(position={"x": 5, "y": 5})
        with page.expect_response(
            lambda r: r.request.method == "PUT" and f"/api/contents/{self.path}" in r.url, timeout=60_000
        ) as saved:
            page.keyboard.press("Control+s")
        assert saved.value.ok, saved.value.status  # written: a reload now reads what was saved

    def run_all(self) -> None:
        """Run → Run All Cells (cells queue until the kernel is up)."""
        page = self.page
        page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
        page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()

    def screenshot(self, name: str) -> Path | None:
        if self.screenshots is None:
            return None
        self.screenshots.mkdir(parents=True, exist_ok=True)
        path = self.screenshots / f"{name}.png"
        self.page.screenshot(path=str(path), full_page=True)
        return path

    def output_text(self) -> str:
        return str(self.page.locator(".jp-NotebookPanel .jp-OutputArea").all_inner_texts())


def copy_notebook(source: Path, directory: Path) -> str:
    """Put ``source`` in the server's root; its path there."""
    shutil.copy(source, directory / source.name)
    return source.name
