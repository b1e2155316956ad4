"""A real browser: JupyterLab (with the lemonkit extension) in Debian's headless chromium runs a notebook whose
widgets talk to the extension through the kernel, and the page's DOM shows it working: a ``lemonkit.pull``
progress bar that reached the end, the model browser's rows (search, Tab order), a pull started by clicking the
browser's button that progressed to done, and a chat answer streaming into the chat panel until Stop. The same for
``notebooks/quickstart.ipynb``: its ``lemonkit.chat`` output grew as tokens streamed, every cell ran, and a catalog
row pulled from the model browser that ``lemonkit.models()`` displays reached done.

Pulls come from the local test hub (``HF_ENDPOINT``); nothing leaves the machine. Screenshots go to the test's
tmp directory (printed on failure: ``-rA`` shows them for a passing run too).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.hub_server import HubServer, tiny_gguf_repo
from tests.support.jupyter_lab import Notebook, chromium_page, copy_notebook, lab_server, unavailable
from tests.support.jupyter_process import JupyterServer

#: skipped where chromium or playwright is missing, except in CI (.ci/run installs them: a skip there would hide)
pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(unavailable() is not None and not os.environ.get("CI"), reason=str(unavailable())),
]

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "widgets.ipynb"
QUICKSTART = Path(__file__).resolve().parents[2] / "notebooks" / "quickstart.ipynb"
CATALOG_ROW = "SmolLM2-135M-Instruct-GGUF"  # a catalog row; its repo on the local hub holds a tiny generated GGUF
CATALOG_REPO, CATALOG_FILE = "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF", "tiny-Q8_0.gguf"  # the row's :Q8_0
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
    root, env, hub = lab_root
    with running(root, env, NOTEBOOK, tmp_path / "screenshots") as (page, server, notebook):
        check_download_bar(page)
        check_model_browser(page, server)
        notebook.screenshot("model-browser")
        check_pull_from_the_browser(page, notebook, hub)
        notebook.screenshot("pulled")
        check_chat(page)
        notebook.screenshot("chat")


@contextlib.contextmanager
def running(
    root: Path,
    env: dict[str, str],
    source: Path,
    shots: Path,
    prepare: str | None = None,
    browser_args: tuple[str, ...] = (),
) -> Iterator[tuple[Any, JupyterServer, Notebook]]:
    """A copy of ``source`` open in JupyterLab in chromium (launched with ``browser_args`` too), all its cells run
    (``prepare`` evaluated in the page first); a failure's screenshot and outputs are kept, and widget errors in the
    page fail the test."""
    assert unavailable() is None, unavailable()
    print(f"screenshots: {shots}")
    with lab_server(root, env) as server, chromium_page(args=browser_args) as page:
        notebook = Notebook(page, server, copy_notebook(source, root), screenshots=shots)
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        notebook.open()
        if prepare is not None:
            page.evaluate(prepare)
        notebook.run_all()
        try:
            yield page, server, notebook
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
    stop = panel.get_by_role("button", name="Stop generating")
    where = stop.bounding_box()
    page.wait_for_function(
        "n => (document.querySelector('.lk-chat-panel .lk-live .lk-content')?.textContent || '').length > n",
        arg=len(first),
        timeout=TIMEOUT,
    )  # more tokens arrived: it streams
    assert stop.bounding_box() == where  # the growing answer does not push Stop from under the pointer
    stop.click()
    page.wait_for_selector('.lk-chat-panel[data-streaming="false"] .lk-assistant .lk-note', timeout=TIMEOUT)
    answer = panel.locator(".lk-assistant:not(.lk-live)").last
    assert answer.locator(".lk-note").inner_text() == "stopped"
    assert answer.locator(".lk-content").inner_text().strip().startswith(first.strip()[:10])
    assert panel.locator(".lk-user .lk-content").inner_text() == "Count to a thousand."
    copy = panel.get_by_role("button", name="Copy this answer")
    copy.click()
    page.wait_for_function(
        "() => document.querySelector('.lk-chat-panel .lk-assistant .lk-button')?.textContent === 'Copied'"
    )
    assert page.evaluate("() => navigator.clipboard.readText()") == answer.locator(".lk-content").text_content()


@pytest.fixture
def quickstart_root(tmp_path: Path) -> Iterator[tuple[Path, dict[str, str], HubServer]]:
    """A JupyterLab root with a copy of the quickstart; chat and embeddings are the bundled models, and the hub
    serves a catalog row's repo (a tiny GGUF in place of its weights) for a pull from the model browser."""
    from lemonkit.testing.tiny_gguf import write_tiny_llama

    weights = write_tiny_llama(tmp_path / "weights" / CATALOG_FILE)
    with HubServer(root=tmp_path / "hub-objects") as hub:
        hub.add_repo(CATALOG_REPO, {CATALOG_FILE: weights})
        hub.throttle = 150_000  # bytes/s: the page sees the bar move
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("LEMONKIT_DEFAULT_")},
            "HF_ENDPOINT": hub.url,
            "HF_HUB_OFFLINE": "0",
            "HF_HUB_CACHE": str(tmp_path / "hf"),
            "LEMONADE_CACHE_DIR": str(tmp_path / "cache"),
            "LEMONKIT_UPDATE_CHECK_INTERVAL": "0",
        }
        for name in ("LEMONKIT_URL", "LEMONKIT_TOKEN", "LEMONADE_API_KEY"):
            env.pop(name, None)  # the kernel finds the extension of the server it runs in
        root = tmp_path / "lab"
        root.mkdir()
        yield root, env, hub


#: records the length of the chat cell's output text each time the DOM changes (the cell that runs lemonkit.chat)
WATCH_CHAT = """() => {
  window.__chatLengths = [];
  const output = () => {
    for (const cell of document.querySelectorAll('.jp-NotebookPanel .jp-CodeCell')) {
      if ((cell.querySelector('.jp-InputArea')?.textContent || '').includes('lemonkit.chat("Explain entropy')) {
        return cell.querySelector('.jp-OutputArea');
      }
    }
    return null;
  };
  new MutationObserver(() => {
    const n = (output()?.textContent || '').length;
    const seen = window.__chatLengths;
    if (n !== (seen.length ? seen[seen.length - 1] : 0)) seen.push(n);
  }).observe(document.body, { subtree: true, childList: true, characterData: true });
}"""


def test_quickstart_in_jupyterlab(quickstart_root: tuple[Path, dict[str, str], HubServer], tmp_path: Path) -> None:
    root, env, hub = quickstart_root
    with running(root, env, QUICKSTART, tmp_path / "screenshots", prepare=WATCH_CHAT) as (page, _, notebook):
        page.locator('.jp-OutputArea-output:has-text("ChatResult(")').wait_for(timeout=2 * TIMEOUT)  # the last
        notebook.screenshot("quickstart-ran")
        check_streamed_chat(page)
        check_quickstart_outputs(page)
        check_catalog_pull(page, notebook, hub)
        notebook.screenshot("quickstart-pulled")


def check_streamed_chat(page: Any) -> None:
    """The chat cell's output showed part of the answer while it streamed, then held the whole answer. (How many
    partial states the browser shows depends on the machine's speed: redraws are throttled to 10 per second, and a
    fast model answers the quickstart's question in a few of them.)"""
    lengths = page.evaluate("() => window.__chatLengths")
    shown = [n for n in lengths if n > 0]
    assert len(shown) >= 2 and shown[0] < max(shown), lengths  # a partial answer first, in one output
    cell = page.locator(".jp-CodeCell", has_text='lemonkit.chat("Explain entropy')
    outputs = cell.locator(".jp-OutputArea-output")
    assert outputs.count() == 1 and len((outputs.text_content() or "").split()) >= 5
    assert outputs.get_attribute("data-mime-type") == "text/markdown"  # rendered as Markdown once complete


def check_quickstart_outputs(page: Any) -> None:
    """No cell failed; replay matched; embeddings have 384 dimensions."""
    assert (
        page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']")
        .filter(has_text="Traceback")
        .count()
        == 0
    )
    assert not page.locator(".jp-OutputArea-output .ansi-red-fg, .jp-OutputArea-output:has-text('Error:')").count()
    assert page.locator(".jp-OutputArea-output", has_text="matched").count() >= 1
    assert page.locator(".jp-OutputArea-output", has_text="(4, 384)").count() == 1


def check_catalog_pull(page: Any, notebook: Notebook, hub: HubServer) -> None:
    """``lemonkit.models()`` rendered the model browser with the catalog's rows; pulling one of them from it shows
    the download moving, then done."""
    browser = page.locator(".lk-model-browser").first
    browser.scroll_into_view_if_needed()
    rows = browser.locator("tr[data-model]")
    rows.nth(10).wait_for(timeout=TIMEOUT)  # the catalog: many rows
    bundled = browser.locator('tr[data-model="SmolLM2-135M-Instruct-Bundled"]')
    assert bundled.get_attribute("data-state") in ("downloaded", "loaded")
    browser.get_by_label("Search models").fill(CATALOG_ROW)
    row = browser.locator(f'tr[data-model="{CATALOG_ROW}"]')
    row.wait_for()
    assert row.get_attribute("data-state") == "not downloaded"
    notebook.screenshot("quickstart-model-browser")
    hub.hold(at=100_000, path=CATALOG_FILE)  # the download waits there until the page has shown it moving
    row.get_by_role("button", name=f"Pull {CATALOG_ROW}").click()
    row.locator('.lk-progress[data-status="downloading"] [role="progressbar"]').wait_for(timeout=TIMEOUT)
    page.wait_for_function(
        "row => Number(document.querySelector(row + ' [role=progressbar]')?.getAttribute('aria-valuenow')) > 0",
        arg=f'.lk-model-browser tr[data-model="{CATALOG_ROW}"]',
        timeout=TIMEOUT,
    )
    notebook.screenshot("quickstart-pulling")
    hub.release()
    done = f'[data-model="{CATALOG_ROW}"][data-state="downloaded"] .lk-progress[data-status="completed"]'
    page.wait_for_selector(f".lk-model-browser tr{done}", timeout=TIMEOUT)
    assert row.locator('[role="progressbar"]').get_attribute("aria-valuenow") == "100"
    assert not row.locator(".lk-error").count()
