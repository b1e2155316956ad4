"""A real browser: JupyterLab (with the lemonkit extension) in Debian's headless chromium runs a notebook whose
widgets talk to the extension through the kernel, and the page's DOM shows it working: a ``lemonkit.pull``
progress bar that reached the end, the model browser's rows (search, Tab order), a pull started by clicking the
browser's button that progressed to done, and a chat answer streaming into the chat panel until Stop.

Pulls come from the local test hub (``HF_ENDPOINT``); nothing leaves the machine. Screenshots go to the test's
tmp directory (printed on failure: ``-rA`` shows them for a passing run too).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hub_server import HubServer, tiny_gguf_repo
from jupyter_lab import Notebook, chromium_page, copy_notebook, lab_server, unavailable

#: skipped where chromium or playwright is missing, except in CI (.ci/run installs them: a skip there would hide)
pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(unavailable() is not None and not os.environ.get("CI"), reason=str(unavailable())),
]

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "widgets.ipynb"
CHAT = "user.browser-chat"  # pulled by the notebook's lemonkit.pull (its DownloadBar), then chatted with
PULLED = "user.browser-pull"  # pulled by clicking in the model browser
PLAIN = "tiny-Q4_K_M.gguf"  # the file of the models' Q4_K_M quant in tiny_gguf_repo
HELD = "293.0 KB"  # how the progress bar shows 300_000 bytes
TIMEOUT = 120_000  # ms: a kernel start and a model load on 2 busy cores


@pytest.fixture
def lab_root(tmp_path: Path) -> Iterator[tuple[Path, dict[str, str], HubServer]]:
    """A JupyterLab root whose lemonkit pulls two registered models from a local hub (slowed: progress shows)."""
    files = tiny_gguf_repo(tmp_path / "repo")
    cache = tmp_path / "cache"
    cache.mkdir()
    with HubServer(root=tmp_path / "hub-objects") as hub:
        rows = {}
        for name in (CHAT, PULLED):
            repo = f"lemonkit/{name.removeprefix('user.')}-GGUF"
            hub.add_repo(repo, files)
            row = {"checkpoint": f"{repo}:Q4_K_M", "recipe": "llamacpp", "labels": ["chat"]}
            rows[name.removeprefix("user.")] = row
        (cache / "user_models.json").write_text(json.dumps(rows))
        hub.throttle = 150_000  # bytes/s: a few seconds per model, so the page sees the bars move
        env = {
            **os.environ,
            "HF_ENDPOINT": hub.url,
            "HF_HUB_OFFLINE": "0",
            "HF_HUB_CACHE": str(tmp_path / "hf"),
            "LEMONADE_CACHE_DIR": str(cache),
            "LEMONKIT_UPDATE_CHECK_INTERVAL": "0",
        }
        env.pop("LEMONKIT_URL", None)  # the kernel finds the extension of the server it runs in
        root = tmp_path / "lab"
        root.mkdir()
        yield root, env, hub


def test_notebook_widgets_in_jupyterlab(lab_root: tuple[Path, dict[str, str], HubServer], tmp_path: Path) -> None:
    assert unavailable() is None, unavailable()
    root, env, hub = lab_root
    shots = tmp_path / "screenshots"
    print(f"screenshots: {shots}")
    with lab_server(root, env) as server, chromium_page() as page:
        notebook = Notebook(page, server, copy_notebook(NOTEBOOK, root), screenshots=shots)
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        notebook.open()
        notebook.run_all()
        try:
            check_download_bar(page)
            check_model_browser(page, server)
            notebook.screenshot("model-browser")
            check_pull_from_the_browser(page, notebook, hub)
            notebook.screenshot("pulled")
            check_chat(page)
            notebook.screenshot("chat")
        except Exception:
            notebook.screenshot("failure")
            print(notebook.output_text())
            raise
        assert not [e for e in errors if "lk-" in e or "anywidget" in e.lower()], errors


def check_download_bar(page: Any) -> None:
    """``lemonkit.pull`` in a notebook shows a DownloadBar that ends complete."""
    bar = page.locator(".lk-download-bar")
    bar.locator('.lk-progress[data-status="completed"]').wait_for(timeout=TIMEOUT)
    assert CHAT in bar.inner_text() and "100%" in bar.inner_text()
    assert bar.locator('[role="progressbar"]').get_attribute("aria-valuenow") == "100"


def check_model_browser(page: Any, server: Any) -> None:
    """Its rows are the server's models; search narrows them; Tab walks its controls."""
    listed = httpx.get(
        f"{server.base}lemonkit/api/v1/models",
        params={"show_all": "true"},
        headers={"Authorization": f"token {server.token}"},
        timeout=30,
    ).json()["data"]
    browser = page.locator(".lk-model-browser")
    rows = browser.locator("tr[data-model]")
    rows.nth(len(listed) - 1).wait_for(timeout=TIMEOUT)
    assert sorted(rows.evaluate_all("rows => rows.map(r => r.dataset.model)")) == sorted(m["id"] for m in listed)
    assert browser.locator(f'tr[data-model="{CHAT}"]').get_attribute("data-state") == "downloaded"
    assert browser.locator(f'tr[data-model="{PULLED}"]').get_attribute("data-state") == "not downloaded"

    search = browser.get_by_label("Search models")
    search.fill("browser-pull")
    page.wait_for_function(
        "() => document.querySelectorAll('.lk-model-browser tr[data-model]').length === 1", timeout=30_000
    )
    assert rows.first.get_attribute("data-model") == PULLED
    search.focus()
    focused = []
    for _ in range(3):
        page.keyboard.press("Tab")
        focused.append(page.evaluate("() => document.activeElement.getAttribute('aria-label')"))
    assert focused == ["Filter by label", "Refresh the model list", f"Pull {PULLED}"], focused


def check_pull_from_the_browser(page: Any, notebook: Notebook, hub: HubServer) -> None:
    """Clicking Pull shows the download moving; reloading the tab shows it still going (the state is the kernel's),
    then the row downloaded with a full bar."""
    row = page.locator(f'.lk-model-browser tr[data-model="{PULLED}"]')
    hub.hold(at=300_000, path=PLAIN)  # the download waits there until the reloaded page has seen it
    row.get_by_role("button", name=f"Pull {PULLED}").click()
    bar = row.locator('.lk-progress[data-status="downloading"] [role="progressbar"]')
    bar.wait_for(timeout=TIMEOUT)
    row.get_by_role("button", name=f"Pause download of {PULLED}").wait_for()  # reachable while it runs
    page.wait_for_selector(f'.lk-model-browser tr[data-model="{PULLED}"] .lk-progress-text:has-text("{HELD}")')
    notebook.screenshot("pulling")

    notebook.save()
    page.reload()
    notebook.wait_open()
    row.locator('.lk-progress[data-status="downloading"]').wait_for(timeout=TIMEOUT)  # re-rendered from the kernel
    assert HELD in row.locator(".lk-progress-text").inner_text()
    assert row.get_attribute("data-state") == "not downloaded"
    notebook.screenshot("reloaded")
    hub.release()
    page.wait_for_selector(
        f'.lk-model-browser tr[data-model="{PULLED}"][data-state="downloaded"] .lk-progress[data-status="completed"]',
        timeout=TIMEOUT,
    )
    assert row.locator('[role="progressbar"]').get_attribute("aria-valuenow") == "100"
    assert not row.locator(".lk-error").count()


def check_chat(page: Any) -> None:
    """A question streams an answer in (the live message grows) until Stop, which keeps what came."""
    panel = page.locator(".lk-chat-panel")
    picker = panel.get_by_label("Chat model")
    picker.wait_for(timeout=TIMEOUT)
    assert picker.input_value() == CHAT
    panel.get_by_label("Message", exact=True).fill("Count to a thousand.")
    panel.get_by_label("Message", exact=True).press("Enter")
    live = panel.locator(".lk-live .lk-content")
    page.wait_for_function(
        "() => (document.querySelector('.lk-chat-panel .lk-live .lk-content')?.textContent || '').length > 0",
        timeout=TIMEOUT,
    )
    first = live.inner_text()
    page.wait_for_function(
        "n => (document.querySelector('.lk-chat-panel .lk-live .lk-content')?.textContent || '').length > n",
        arg=len(first),
        timeout=TIMEOUT,
    )  # more tokens arrived: it streams
    panel.get_by_role("button", name="Stop generating").click()
    page.wait_for_selector('.lk-chat-panel[data-streaming="false"] .lk-assistant .lk-note', timeout=TIMEOUT)
    answer = panel.locator(".lk-assistant:not(.lk-live)").last
    assert answer.locator(".lk-note").inner_text() == "stopped"
    assert answer.locator(".lk-content").inner_text().startswith(first.strip()[:10])
    assert panel.locator(".lk-user .lk-content").inner_text() == "Count to a thousand."
    copy = panel.get_by_role("button", name="Copy this answer")
    copy.click()
    page.wait_for_function(
        "() => document.querySelector('.lk-chat-panel .lk-assistant .lk-button')?.textContent === 'Copied'"
    )
    assert page.evaluate("() => navigator.clipboard.readText()") == answer.locator(".lk-content").text_content()
