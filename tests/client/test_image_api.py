"""The Python API's images (``lemonkit.generate_image``, ``edit_image``, ``vary_image``, ``upscale``) through
``lemonkit.Client`` and ``AsyncClient`` against both hosts, real HTTP: generation, edits (with a mask) and variations
on the tiny random diffusers pipeline registered as a user model (``n``, sizes, seeds that reproduce), upscaling a
PIL image 4x on the bundled Real-ESRGAN (close to a bicubic upscale: the picture, not noise), errors as lemonkit's
exceptions."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageDraw

import lemonkit
from lemonkit.catalog.config import DEFAULT_UPSCALE_MODEL
from lemonkit.catalog.registry import Registry
from lemonkit.client import AsyncClient, Client
from lemonkit.errors import InvalidArgument, ModelNotApplicable, ModelNotFound
from tests.client.test_audio_api import _in_thread
from tests.support.hosts import Host
from tests.support.session import CACHE_DIR, HF_CACHE
from tests.support.tiny_models import TINY

#: the tiny random pipeline (lemonkit.testing.tiny_diffusers) as a user model: 64x64 by default
TINY_IMAGE = "user.tiny-diffusers"
TINY_IMAGE_REPO = "lemonkit-test/tiny-diffusers"


def register_tiny_pipeline(hf_cache: Path, cache_dir: Path) -> str:
    """The tiny pipeline as :data:`TINY_IMAGE`: a downloaded hub repo in ``hf_cache``, registered in ``cache_dir``
    with its ``image_defaults`` (servers re-read ``user_models.json`` when it changes). Imports torch."""
    from lemonkit.testing.tiny_diffusers import TINY_SIZE, write_tiny_pipeline

    commit = "d" * 40
    snapshot = hf_cache / f"models--{TINY_IMAGE_REPO.replace('/', '--')}" / "snapshots" / commit
    write_tiny_pipeline(snapshot)
    (snapshot.parents[1] / "refs").mkdir(exist_ok=True)
    (snapshot.parents[1] / "refs" / "main").write_text(commit)
    defaults = {"width": TINY_SIZE, "height": TINY_SIZE, "steps": 2, "cfg_scale": 1.0}
    row = {"checkpoint": TINY_IMAGE_REPO, "recipe": "diffusers", "labels": ["image"], "image_defaults": defaults}
    cache_dir.mkdir(parents=True, exist_ok=True)
    Registry(cache_dir, hf_cache=hf_cache).register(TINY_IMAGE, row)
    return TINY_IMAGE


@pytest.fixture(scope="session")
def tiny_image() -> str:
    """The tiny pipeline registered for the session's servers (torch is imported only by the tests that ask)."""
    return register_tiny_pipeline(HF_CACHE, CACHE_DIR)


def picture(width: int = 40, height: int = 28) -> Image.Image:
    """A small drawing with smooth areas and edges (what Real-ESRGAN keeps), never blank."""
    image = Image.new("RGB", (width, height), (142, 202, 230))
    draw = ImageDraw.Draw(image)
    draw.rectangle([0, height * 2 // 3, width, height], fill=(58, 125, 68))
    draw.ellipse([width * 2 // 3, 2, width * 2 // 3 + height // 3, 2 + height // 3], fill=(255, 183, 3))
    draw.rectangle([width // 5, height // 3, width // 2, height * 3 // 4], fill=(230, 57, 70))
    return image


def pixels(image: Image.Image) -> np.ndarray:
    return np.asarray(image.convert("RGB"), dtype=np.float32)


def check_upscaled(result: lemonkit.Images, source: Image.Image) -> None:
    """One image, 4x the source, close to the source's bicubic upscale (not blank, not noise)."""
    assert isinstance(result, lemonkit.Images) and len(result) == 1
    (big,) = result
    assert big.size == (source.width * 4, source.height * 4)
    reference = pixels(source.resize(big.size, Image.Resampling.BICUBIC))
    difference = np.abs(pixels(big) - reference).mean()
    assert difference < 12, difference
    assert pixels(big).std() > 20  # the drawing's colours, not a flat image
    assert result.model == result.provenance["model"] == DEFAULT_UPSCALE_MODEL
    assert result.provenance["route"] == "images/upscale" and "image" not in result.provenance["request"]


@pytest.mark.slow
async def test_upscale_a_pil_image_a_path_and_jpeg_bytes(host: Host, tmp_path: Path) -> None:
    source = picture()
    path = tmp_path / "drawing.png"
    source.save(path)
    jpeg = tmp_path / "drawing.jpg"
    source.save(jpeg, quality=95)

    def calls(client: Client) -> tuple[lemonkit.Images, ...]:
        from_path = client.upscale(path, DEFAULT_UPSCALE_MODEL, factor=4)
        return client.upscale(source), from_path, client.upscale(jpeg.read_bytes())

    from_pil, from_path, from_jpeg = await _in_thread(host, calls)
    check_upscaled(from_pil, source)
    check_upscaled(from_path, source)
    assert np.array_equal(pixels(from_pil[0]), pixels(from_path[0]))  # the same PNG: the same pixels
    check_upscaled(from_jpeg, source)
    assert from_path.settings[0]["upscale_factor"] == 4 and from_path.provenance["request"]["upscale_factor"] == 4
    saved = from_pil.save(tmp_path / "out")
    assert [p.name for p in saved] == ["image-0.png"] and Image.open(saved[0]).size == (160, 112)


@pytest.mark.slow
async def test_generate_n_images_whose_seeds_reproduce(host: Host, tiny_image: str) -> None:
    def calls(client: Client) -> tuple[lemonkit.Images, ...]:
        two = client.generate_image("a red square", tiny_image, n=2, seed=5)
        again = client.generate_image("a red square", tiny_image, seed=6)
        sized = client.generate_image("a red square", tiny_image, size=(96, 64), steps=1, cfg_scale=2.0)
        return two, again, sized

    two, again, sized = await _in_thread(host, calls)
    assert len(two) == 2 and [i.size for i in two] == [(64, 64), (64, 64)]  # the model's own size
    assert two.seeds == [5, 6] and all(s["steps"] == 2 for s in two.settings)
    assert two.prompt == "a red square" and two.model == tiny_image and two.provenance["route"] == "images/generations"
    assert np.array_equal(pixels(again[0]), pixels(two[1]))  # seed 6 again: the same image
    assert not np.array_equal(pixels(two[0]), pixels(two[1]))
    assert sized[0].size == (96, 64) and sized.settings[0]["steps"] == 1 and sized.settings[0]["cfg_scale"] == 2.0
    seed = sized.seeds[0]
    assert isinstance(seed, int) and seed == sized.provenance["seed"]  # none named: a random one, recorded


@pytest.mark.slow
async def test_edit_with_and_without_a_mask_and_vary(host: Host, tiny_image: str) -> None:
    source = picture(64, 64)
    mask = Image.new("L", source.size, 0)
    ImageDraw.Draw(mask).rectangle([0, 0, 63, 31], fill=255)  # the top half is redrawn

    def calls(client: Client) -> tuple[lemonkit.Images, ...]:
        masked = client.edit_image(source, "a stormy sky", mask=mask, model=tiny_image, seed=1)
        whole = client.edit_image(source, "a stormy sky", model=tiny_image, n=2, seed=1)
        varied = client.vary_image(source, tiny_image, n=2, seed=3)
        return masked, whole, varied

    masked, whole, varied = await _in_thread(host, calls)
    assert masked[0].size == source.size and masked.settings[0]["masked"] is True and masked.seeds == [1]
    kept = np.abs(pixels(masked[0])[32:] - pixels(source)[32:]).mean()
    redrawn = np.abs(pixels(masked[0])[:32] - pixels(source)[:32]).mean()
    assert kept < 8 < redrawn, (kept, redrawn)  # black kept the drawing; white was redrawn (noise, here)
    assert len(whole) == 2 and whole.seeds == [1, 2] and whole.settings[0]["masked"] is False
    assert masked.provenance["request"]["files"] == ["image=image-0.png", "mask=mask.png"]
    assert len(varied) == 2 and varied.seeds == [3, 4] and varied.prompt is None
    assert varied.provenance["route"] == "images/variations"


@pytest.mark.slow
async def test_the_async_client(host: Host, tiny_image: str) -> None:
    async with AsyncClient(host.root, token=host.token) as client:
        made = await client.generate_image("a boat", tiny_image, seed=11)
        edited = await client.edit_image(made[0], "a green boat", model=tiny_image, seed=12)
        varied = await client.vary_image(made[0], tiny_image, seed=13)
        big = await client.upscale(made[0])
    assert made.seeds == [11] and edited.seeds == [12] and varied.seeds == [13]
    assert big[0].size == (256, 256) and big.model == DEFAULT_UPSCALE_MODEL


async def test_errors_are_lemonkit_exceptions(host: Host) -> None:
    def calls(client: Client) -> list[Exception]:
        errors: list[Exception] = []
        for call in (
            lambda: client.upscale(picture(), TINY),
            lambda: client.upscale(picture(), "user.no-such-model"),
            lambda: client.upscale(picture(), factor=3),
            lambda: client.upscale(b"not an image"),
            lambda: client.generate_image("a cat", DEFAULT_UPSCALE_MODEL, size="64x64"),
            lambda: client.generate_image("a cat", TINY, size="big"),
        ):
            with pytest.raises(lemonkit.LemonkitError) as caught:
                call()
            errors.append(caught.value)
        return errors

    llm, missing, factor, garbage, upscaler, size = await _in_thread(host, calls)
    assert isinstance(llm, ModelNotApplicable) and llm.status == 400
    assert isinstance(missing, ModelNotFound)
    assert isinstance(factor, InvalidArgument) and factor.status == 400 and "upscale_factor" in factor.message
    assert isinstance(garbage, InvalidArgument)  # refused before sending: not an image
    assert isinstance(upscaler, ModelNotApplicable)
    assert isinstance(size, InvalidArgument) and "size" in size.message
