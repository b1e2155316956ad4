"""The image panel driven from Python against both hosts, as the page drives it (its messages), the page's side being
tests/widgets/test_image_browser.py: the pickers keep image models and upscalers apart; generate fills the grid with
each image's PNG and caption; a picked image is upscaled 4x, edited and varied; errors go to the banner."""

from __future__ import annotations

import asyncio
from concurrent.futures import Future
from typing import Any

import numpy as np
import pytest
from PIL import Image

import lemonkit
from lemonkit.catalog.config import DEFAULT_UPSCALE_MODEL
from lemonkit.client.image_results import open_image
from lemonkit.widgets import ImagePanel
from lemonkit.widgets.assets import esm
from tests.client.test_image_api import picture, tiny_image  # noqa: F401  (the fixture, requested by name)
from tests.support.hosts import Host
from tests.widgets.test_audio_widgets import client_of, done


def send(panel: ImagePanel, action: str, *args: Any) -> None:
    """What the page sends: ``{"action", "args"}``."""
    panel._on_message(panel, {"action": action, "args": list(args)}, [])


async def settled(panel: ImagePanel, before: int) -> lemonkit.Images:
    """The result the page's last action made (it gets no future: wait for the panel's history to grow)."""
    result: Future[lemonkit.Images] = Future()

    def grown(_: Any = None) -> None:
        if len(panel.history) > before and not panel.busy and not result.done():
            result.set_result(panel.history[-1])

    panel.observe(grown, names="busy")
    grown()
    try:
        return await asyncio.wait_for(asyncio.wrap_future(result), 120)
    finally:
        panel.unobserve(grown, names="busy")


def test_the_image_panel_inlines_the_shared_building_blocks() -> None:
    code = esm("image_panel")
    assert "./shared.js" not in code and code.count("export function bytesUrl(") == 1
    assert code.count("export default") == 1 and lemonkit.ImagePanel is ImagePanel


async def test_upscaling_a_picture_the_panel_was_given(host: Host) -> None:
    source = picture(32, 24)
    panel = ImagePanel(client=client_of(host), images=[source])
    await done(panel.ready)
    assert DEFAULT_UPSCALE_MODEL in panel.upscalers and panel.upscaler in panel.upscalers
    assert not set(panel.upscalers) & set(panel.models)  # upscalers draw nothing from a prompt
    assert panel.selected == 0 and len(panel.images) == 1 and panel.captions == ["32x24"]

    big = await done(panel.upscale())
    assert big[0].size == (128, 96) and panel.result is big and panel.history == [panel.history[0], big]
    assert [open_image(png).size for png in panel.images] == [(128, 96)] and panel.captions == ["128x96"]
    assert not panel.busy and panel.activity == "" and panel.error is None

    send(panel, "vary", 3)  # no image 3
    assert panel.error == {"message": "Pick an image first", "code": lemonkit.InvalidRequest.code}


@pytest.mark.slow
async def test_generate_pick_upscale_edit_and_vary(host: Host, tiny_image: str) -> None:  # noqa: F811
    panel = ImagePanel(client=client_of(host), model=tiny_image, prompt="a lighthouse")
    await done(panel.ready)
    assert tiny_image in panel.models and DEFAULT_UPSCALE_MODEL not in panel.models
    panel.n, panel.seed, panel.steps, panel.size = 2, 21, 1, "64x48"

    send(panel, "generate", "a lighthouse at dawn")
    made = await settled(panel, 0)
    assert made.seeds == [21, 22] and made.prompt == "a lighthouse at dawn" == panel.prompt
    assert [open_image(png).size for png in panel.images] == [(64, 48), (64, 48)]
    assert panel.captions == [made.caption(0), made.caption(1)] and panel.captions[1].startswith("seed 22 · 1 steps")
    assert np.array_equal(np.asarray(open_image(panel.images[1])), np.asarray(made[1]))
    assert panel.selected == -1

    send(panel, "upscale", 1)  # the page picked image 1
    big = await settled(panel, 1)
    assert big[0].size == (256, 192) and open_image(panel.images[0]).size == (256, 192)
    np.testing.assert_allclose(  # the picked one, upscaled: close to its bicubic upscale
        np.asarray(big[0], dtype=np.float32).mean(),
        np.asarray(made[1].resize((256, 192), Image.Resampling.BICUBIC), dtype=np.float32).mean(),
        atol=12,
    )

    panel.result, panel.selected = made, 0
    edited = await done(panel.edit("a lighthouse in a storm"))
    assert edited.seeds == [21, 22] and edited.prompt == "a lighthouse in a storm" and edited[0].size == (64, 48)
    varied = await done(panel.vary(0))
    assert len(varied) == 2 and varied.prompt is None and panel.history[-1] is varied


async def test_errors_in_the_banner(host: Host) -> None:
    panel = ImagePanel(client=client_of(host), model="user.no-such-model", prompt="a cat")
    await done(panel.ready)
    failed = panel.generate()
    with pytest.raises(lemonkit.ModelNotFound):
        await done(failed)
    assert panel.error is not None and panel.error["code"] == "model_not_found" and not panel.busy
    send(panel, "upscale")  # nothing in the grid
    assert panel.error is not None and panel.error["message"] == "Pick an image first"
    panel.prompt = " "
    with pytest.raises(lemonkit.InvalidRequest, match="no prompt"):
        panel.generate()
