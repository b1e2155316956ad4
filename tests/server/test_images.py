"""``POST /v1/images/generations``, ``/edits`` and ``/variations`` through both hosts, on a tiny random Stable
Diffusion pipeline (:mod:`lemonkit.testing.tiny_diffusers`) registered as a user model in the session's Hugging Face
cache: sizes, ``n``, seeds, edits with and without a mask, variations, the OpenAI SDK, and every error the spec
lists. The pipeline's images are noise; what is checked is their shape, that a seed makes the same pixels again,
and that a mask keeps what it covers in black."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from lemonkit.catalog.registry import Registry
from lemonkit.testing.tiny_diffusers import TINY_SIZE, write_tiny_pipeline
from tests.support.hosts import Host
from tests.support.session import CACHE_DIR, HF_CACHE
from tests.support.tiny_models import TINY

pytestmark = pytest.mark.slow  # every test loads the pipeline's sidecar (torch) in each host

TINY_SD = "user.tiny-sd"
#: the same pipeline with a small soft_pixel_cap (an edit's default size) and no image_defaults
CAPPED_SD = "user.tiny-sd-capped"
#: the same pipeline labelled an upscaler: the generation routes must refuse it
UPSCALER = "user.tiny-sd-upscaling"
TINY_SD_REPO = "lemonkit-test/tiny-sd"
DEFAULTS = {"steps": 2, "cfg_scale": 1.0, "width": TINY_SIZE, "height": TINY_SIZE}


@pytest.fixture(scope="session", autouse=True)
def tiny_sd() -> Iterator[str]:
    """The tiny pipeline as a downloaded hub repo, registered as ``user.tiny-sd`` with its ``image_defaults``."""
    snapshot = HF_CACHE / f"models--{TINY_SD_REPO.replace('/', '--')}" / "snapshots" / ("b" * 40)
    if not (snapshot / "model_index.json").exists():
        write_tiny_pipeline(snapshot)
        (snapshot.parents[1] / "refs").mkdir(exist_ok=True)
        (snapshot.parents[1] / "refs" / "main").write_text("b" * 40)
    registry = Registry(CACHE_DIR, hf_cache=HF_CACHE)
    row = {"checkpoint": TINY_SD_REPO, "recipe": "diffusers", "labels": ["image"]}
    registry.register(TINY_SD, {**row, "image_defaults": DEFAULTS})
    registry.register(CAPPED_SD, {**row, "recipe_options": {"soft_pixel_cap": 48 * 32, "steps": 1}})
    registry.register(UPSCALER, {**row, "labels": ["image", "upscaling"]})
    yield TINY_SD


def png(width: int = TINY_SIZE, height: int = TINY_SIZE, *, seed: int = 0, kind: str = "PNG") -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format=kind)
    return out.getvalue()


def half_mask(width: int = TINY_SIZE, height: int = TINY_SIZE) -> bytes:
    """White (edited) on the left half, black (kept) on the right."""
    mask = Image.new("L", (width, height), 0)
    mask.paste(255, (0, 0, width // 2, height))
    out = io.BytesIO()
    mask.save(out, format="PNG")
    return out.getvalue()


def pixels(b64: str) -> np.ndarray:
    data = base64.b64decode(b64)
    assert data.startswith(b"\x89PNG")
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB")).astype(int)


def assert_error(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "code"} and error["code"] == code, error
    return error


def check_answer(answer: dict[str, Any], n: int, width: int, height: int) -> list[np.ndarray]:
    assert isinstance(answer["created"], int) and answer["output_format"] == "png"
    assert len(answer["data"]) == n
    images = []
    for item in answer["data"]:
        image = pixels(item["b64_json"])
        assert image.shape == (height, width, 3)
        assert image.std() > 0  # an image, not a blank
        info = item["generation_info"]
        assert (info["width"], info["height"]) == (width, height) and isinstance(info["seed"], int)
        images.append(image)
    return images


async def generate(client: httpx.AsyncClient, **body: Any) -> httpx.Response:
    return await client.post("images/generations", json={"model": TINY_SD, "prompt": "a red barn", **body})


async def test_generations_sizes_n_and_seeds(host: Host) -> None:
    async with host.client() as client:
        pair = await generate(client, n=2, seed=7)
        assert pair.status_code == 200, pair.text
        first, second = check_answer(pair.json(), 2, TINY_SIZE, TINY_SIZE)
        assert [d["generation_info"]["seed"] for d in pair.json()["data"]] == [7, 8]
        assert pair.json()["data"][0]["generation_info"]["steps"] == DEFAULTS["steps"]  # the row's image_defaults
        again = (await generate(client, seed=7)).json()["data"][0]
        assert again["b64_json"] == pair.json()["data"][0]["b64_json"]  # same seed: the same bytes
        assert np.array_equal(pixels((await generate(client, seed=8)).json()["data"][0]["b64_json"]), second)
        assert not np.array_equal(first, second)
        wide = await generate(client, size="128x64", steps=1, cfg_scale=2.0)
        check_answer(wide.json(), 1, 128, 64)
        info = wide.json()["data"][0]["generation_info"]
        assert info["steps"] == 1 and info["cfg_scale"] == 2.0
        randoms = [(await generate(client, seed=-1)).json()["data"][0]["generation_info"]["seed"] for _ in range(2)]
        assert all(s >= 0 for s in randoms) and randoms[0] != randoms[1]


async def test_generation_errors(host: Host) -> None:
    async with host.client() as client:
        cases: list[tuple[dict[str, Any], int, str]] = [
            ({"response_format": "url"}, 400, "invalid_argument"),
            ({"response_format": "jpeg"}, 400, "invalid_argument"),
            ({"n": 11}, 400, "invalid_argument"),
            ({"n": 0}, 400, "invalid_argument"),
            ({"prompt": None}, 400, "missing_argument"),
            ({"model": None}, 400, "missing_argument"),
            ({"seed": "seven"}, 400, "invalid_argument"),
            ({"model": TINY}, 400, "model_not_applicable"),
            ({"model": UPSCALER}, 400, "model_not_applicable"),
            ({"model": "user.no-such-model"}, 404, "model_not_found"),
            ({"size": "65x64"}, 400, "invalid_argument"),
            ({"size": "64"}, 400, "invalid_argument"),
            ({"size": "99999x64"}, 400, "invalid_argument"),
        ]
        for body, status, code in cases:
            sent = {k: v for k, v in {"model": TINY_SD, "prompt": "x", **body}.items() if v is not None}
            response = await client.post("images/generations", json=sent)
            error = assert_error(response, status, code)
            if body.get("response_format") == "url":
                assert "b64_json" in error["message"]
        assert_error(await client.post("images/generations", content=b"{not json"), 400, "invalid_json")
        health = (await client.get("health")).json()
        assert not {TINY, UPSCALER} & {m["model_name"] for m in health["all_models_loaded"]}  # refused unloaded


async def test_edits_with_and_without_a_mask(host: Host) -> None:
    source = png(96, 64, seed=1)
    async with host.client() as client:
        plain = await client.post(
            "images/edits",
            data={"model": TINY_SD, "prompt": "make it blue", "seed": "3", "n": "2"},
            files={"image": ("in.png", source, "image/png")},
        )
        assert plain.status_code == 200, plain.text
        check_answer(plain.json(), 2, 96, 64)  # the default size is the image's
        assert plain.json()["data"][0]["generation_info"]["masked"] is False
        masked = await client.post(
            "images/edits",
            data={"model": TINY_SD, "prompt": "make it blue", "size": "64x64", "seed": "3"},
            files=[("image[]", ("in.png", png(seed=2), "image/png")), ("mask", ("m.png", half_mask(), "image/png"))],
        )
        assert masked.status_code == 200, masked.text
        (edited,) = check_answer(masked.json(), 1, 64, 64)
        original = np.asarray(Image.open(io.BytesIO(png(seed=2)))).astype(int)
        kept, changed = slice(TINY_SIZE // 2 + 2, None), slice(0, TINY_SIZE // 2 - 2)
        assert np.abs(edited[:, kept] - original[:, kept]).max() <= 2  # black in the mask: kept
        assert np.abs(edited[:, changed] - original[:, changed]).mean() > 10  # white: edited
        jpeg = await client.post(
            "images/edits",
            data={"model": TINY_SD, "prompt": "x"},
            files={"image": ("in.jpg", png(kind="JPEG"), "image/jpeg")},
        )
        check_answer(jpeg.json(), 1, TINY_SIZE, TINY_SIZE)


async def test_edit_and_variation_errors(host: Host) -> None:
    image = ("in.png", png(), "image/png")
    async with host.client() as client:
        for route in ("images/edits", "images/variations"):
            as_json = await client.post(route, json={"model": TINY_SD, "prompt": "x"})
            assert as_json.status_code == 400 and as_json.json()["error"]["code"] == "invalid_content_type"
            fields = {"model": TINY_SD, "prompt": "x"}
            both = await client.post(route, data=fields, files=[("image", image), ("image[]", image)])
            assert_error(both, 400, "invalid_argument")
            assert_error(await client.post(route, data=fields, files={"other": image}), 400, "missing_argument")
            not_png = await client.post(route, data=fields, files={"image": ("a.gif", b"GIF89a....", "image/gif")})
            assert "PNG or JPEG" in assert_error(not_png, 400, "invalid_argument")["message"]
            for bad in ({"n": "11"}, {"n": "0"}, {"n": "two"}, {"response_format": "url"}, {"size": "63x64"}):
                assert_error(
                    await client.post(route, data={**fields, **bad}, files={"image": image}), 400, "invalid_argument"
                )
            assert_error(
                await client.post(route, data={"prompt": "x"}, files={"image": image}), 400, "missing_argument"
            )
            chat = await client.post(route, data={**fields, "model": TINY}, files={"image": image})
            assert_error(chat, 400, "model_not_applicable")
        no_prompt = await client.post("images/edits", data={"model": TINY_SD}, files={"image": image})
        assert_error(no_prompt, 400, "missing_argument")
        for route in ("images/edits", "images/variations"):
            two = await client.post(route, data={"model": TINY_SD, "prompt": "x"}, files=[("image[]", image)] * 2)
            assert "one image" in assert_error(two, 400, "invalid_argument")["message"]
        broken = await client.post(
            "images/edits", data={"model": TINY_SD, "prompt": "x"}, files={"image": ("b.png", b"\x89PNG\r\n\x1a\nxx")}
        )
        assert_error(broken, 400, "invalid_argument")


async def test_variations(host: Host) -> None:
    async with host.client() as client:
        response = await client.post(
            "images/variations",
            data={"model": TINY_SD, "n": "2", "size": "64x128", "seed": "11", "user": "someone"},
            files={"image": ("in.png", png(80, 80), "image/png")},
        )
        assert response.status_code == 200, response.text
        first, second = check_answer(response.json(), 2, 64, 128)
        assert not np.array_equal(first, second)
        assert response.json()["data"][1]["generation_info"]["seed"] == 12


async def test_openai_sdk(host: Host, tmp_path: Path) -> None:
    client = host.openai()
    made = await client.images.generate(model=TINY_SD, prompt="a lighthouse", n=2, size="64x64")  # type: ignore[arg-type]
    assert len(made.data) == 2 and all(pixels(d.b64_json or "").shape == (64, 64, 3) for d in made.data)
    source = tmp_path / "source.png"
    source.write_bytes(png(seed=4))
    with source.open("rb") as image:
        edited = await client.images.edit(model=TINY_SD, image=image, prompt="add a moon", size="64x64")  # type: ignore[arg-type]
    assert pixels(edited.data[0].b64_json or "").shape == (64, 64, 3)
    with source.open("rb") as image:
        varied = await client.images.create_variation(model=TINY_SD, image=image, n=1)
    assert pixels(varied.data[0].b64_json or "").shape == (TINY_SIZE, TINY_SIZE, 3)
    with pytest.raises(openai.BadRequestError):
        await client.images.generate(model=TINY_SD, prompt="x", response_format="url")


async def test_soft_pixel_cap_and_load_options(host: Host) -> None:
    """An edit without ``size`` scales its image under the model's ``soft_pixel_cap`` (an explicit size skips
    it); ``steps`` comes from the row's options, then from a load's; the size default is 512x512 without
    image_defaults."""
    async with host.client() as client:
        edit = await client.post(
            "images/edits",
            data={"model": CAPPED_SD, "prompt": "x"},
            files={"image": ("in.png", png(192, 128), "image/png")},
        )
        assert edit.status_code == 200, edit.text
        check_answer(edit.json(), 1, 48, 32)  # 192x128 scaled under 48*32 pixels, sides multiples of 8
        assert edit.json()["data"][0]["generation_info"]["steps"] == 1  # the row's recipe_options
        explicit = await client.post(
            "images/edits",
            data={"model": CAPPED_SD, "prompt": "x", "size": "128x64"},
            files={"image": ("in.png", png(192, 128), "image/png")},
        )
        check_answer(explicit.json(), 1, 128, 64)
        default = (await client.post("images/generations", json={"model": CAPPED_SD, "prompt": "x", "seed": 1})).json()
        check_answer(default, 1, 512, 512)  # Lemonade's default size: the row has no image_defaults
        loaded = await client.post("load", json={"model_name": CAPPED_SD, "steps": 2, "width": 64, "height": 32})
        assert loaded.status_code == 200, loaded.text
        made = (await client.post("images/generations", json={"model": CAPPED_SD, "prompt": "x"})).json()
        check_answer(made, 1, 64, 32)
        assert made["data"][0]["generation_info"]["steps"] == 2
        await client.post("unload", json={"model_name": CAPPED_SD})
