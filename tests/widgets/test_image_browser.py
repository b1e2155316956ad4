"""A real browser runs ``notebooks/images.ipynb`` in JupyterLab (chromium, headless, offline), with the tiny random
diffusers pipeline registered as the one image model, and uses its image panel the way a person would: every cell
ran (the upscale's grid, the generated, edited and varied grids); typing a prompt and a count and clicking Generate
fills the grid with that many captioned images; clicking one picks it, and Upscale shows it 4x larger.

Screenshots go to the test's tmp directory (printed; ``-rA`` shows them for a passing run).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tests.client.test_image_api import register_tiny_pipeline
from tests.support.jupyter_lab import unavailable
from tests.widgets.test_audio_browser import _env  # the lab's environment: its own caches, no server but its own
from tests.widgets.test_browser import TIMEOUT, running

pytestmark = [
    pytest.mark.browser,
    pytest.mark.slow,
    pytest.mark.skipif(unavailable() is not None and not os.environ.get("CI"), reason=str(unavailable())),
]

IMAGES = Path(__file__).resolve().parents[2] / "notebooks" / "images.ipynb"


def test_image_notebook_panel_in_jupyterlab(tmp_path: Path) -> None:
    register_tiny_pipeline(tmp_path / "hf", tmp_path / "cache")
    root = tmp_path / "lab"
    root.mkdir()
    with running(root, _env(tmp_path), IMAGES, tmp_path / "screenshots") as (page, _, notebook):
        page.locator(".lk-image-panel .lk-image").first.wait_for(timeout=3 * TIMEOUT)  # the last cell's output
        notebook.screenshot("images-ran")
        check_cells(page)
        check_generate_pick_upscale(page)
        notebook.screenshot("upscaled")


def check_cells(page: Any) -> None:
    """Every cell ran: no traceback; the upscale's grid, and with the tiny model the generation cells' grids."""
    errors = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']")
    assert errors.filter(has_text="Traceback").count() == 0
    assert page.locator(".jp-OutputArea-output", has_text="Generating with user.tiny-diffusers").count() == 1
    grids = page.locator(".jp-OutputArea-output .lk-images")
    # upscale; generated; edited, varied, upscaled
    assert grids.count() == 5
    assert grids.first.locator("img").evaluate("i => [i.naturalWidth, i.naturalHeight]") == [384, 256]
    assert grids.nth(1).locator("figcaption").all_inner_texts() == [
        "seed 42 · 2 steps · cfg 1.0 · 64x64",
        "seed 43 · 2 steps · cfg 1.0 · 64x64",
    ]
    assert page.locator(".jp-OutputArea-output", has_text="the same seed again gives the same image: True").count() == 1


def check_generate_pick_upscale(page: Any) -> None:
    panel = page.locator(".lk-image-panel")
    assert panel.get_attribute("data-images") == "1"  # the drawing the panel was given
    panel.get_by_label("Prompt", exact=True).fill("a red boat on a lake")
    panel.get_by_label("Number of images", exact=True).fill("3")
    panel.get_by_label("Seed", exact=True).fill("5")
    panel.get_by_role("button", name="Generate images from the prompt").click()
    page.wait_for_function(
        "() => { const p = document.querySelector('.lk-image-panel').dataset;"
        " return p.busy === 'false' && p.images === '3'; }",
        timeout=TIMEOUT,
    )
    figures = panel.locator(".lk-image")
    assert figures.locator("figcaption").all_inner_texts() == [
        f"seed {seed} · 2 steps · cfg 1.0 · 64x64" for seed in (5, 6, 7)
    ]
    page.wait_for_function(
        "() => [...document.querySelectorAll('.lk-image-panel .lk-grid-image')].every(i => i.naturalWidth === 64)",
        timeout=30_000,
    )
    upscale = panel.get_by_role("button", name="Upscale the picked image")
    assert upscale.is_disabled()  # nothing picked yet

    figures.nth(1).click()
    page.wait_for_function("() => document.querySelector('.lk-image-panel').dataset.selected === '1'", timeout=30_000)
    assert figures.nth(1).get_attribute("aria-selected") == "true"
    upscale.click()
    page.wait_for_function(
        "() => { const p = document.querySelector('.lk-image-panel');"
        " const img = p.querySelector('.lk-grid-image');"
        " return p.dataset.busy === 'false' && p.dataset.images === '1' && img && img.naturalWidth === 256; }",
        timeout=TIMEOUT,
    )
    shown = panel.locator(".lk-grid-image")
    assert shown.evaluate("i => [i.naturalWidth, i.naturalHeight]") == [256, 256]
    assert shown.evaluate("i => i.getBoundingClientRect().width") > 128  # shown larger than the 64 px images were
    assert panel.locator("figcaption").inner_text() == "256x256"
