"""The image results of the Python API without a server: :class:`Images` read from an ``/v1/images/*`` answer, its
grid, its PNG files (settings in a text chunk) and repr; the requests the image methods build from PIL images,
paths and bytes (JSON for generations and upscales, multipart with ``image``/``image[]`` and ``mask`` for edits and
variations)."""

from __future__ import annotations

import base64
import inspect
import io
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

import lemonkit
from lemonkit.client.calls import SERVER, Request, Steps
from lemonkit.client.discovery import Server
from lemonkit.client.image_calls import ImageRequest, size_of
from lemonkit.client.image_results import Images, image_bytes, open_image, png_bytes
from lemonkit.errors import InvalidArgument
from lemonkit.formats.headers import PROVENANCE_HEADER


def picture(width: int = 24, height: int = 16, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


def encoded(image: Image.Image, format: str = "PNG") -> str:
    out = io.BytesIO()
    image.save(out, format=format)
    return base64.b64encode(out.getvalue()).decode("ascii")


def answer(*images: Image.Image, infos: list[dict[str, object]] | None = None) -> dict[str, object]:
    data = [{"b64_json": encoded(image)} for image in images]
    for entry, info in zip(data, infos or [], strict=False):
        entry["generation_info"] = info
    return {"created": 1791943145, "data": data, "output_format": "png"}


def test_images_from_an_answer_keep_each_ones_settings() -> None:
    first, second = picture(seed=1), picture(seed=2)
    infos = [
        {"seed": 7, "steps": 2, "cfg_scale": 1.0, "width": 24, "height": 16, "scheduler": None},
        {"seed": 8, "steps": 2, "cfg_scale": 1.0, "width": 24, "height": 16},
    ]
    images = Images.from_answer(
        answer(first, second, infos=infos), model="SD-Turbo", prompt="a lighthouse", defaults={"seed": 7, "steps": 2}
    )
    assert isinstance(images, list) and len(images) == 2 and all(isinstance(i, Image.Image) for i in images)
    assert np.array_equal(np.asarray(images[0]), np.asarray(first))
    assert np.array_equal(np.asarray(images[1]), np.asarray(second))
    assert images.seeds == [7, 8] and images.settings[1]["steps"] == 2 and "scheduler" not in images.settings[0]
    assert images.model == "SD-Turbo" and images.prompt == "a lighthouse"
    assert images.caption(1) == "seed 8 · 2 steps · cfg 1.0 · 24x16"
    assert repr(images) == "Images(2: 24x16, 24x16; model='SD-Turbo', seeds=[7, 8])"


def test_settings_the_engine_did_not_report_come_from_the_request() -> None:
    images = Images.from_answer(answer(picture(8, 8)), model="RealESRGAN-x4plus", defaults={"upscale_factor": 4})
    assert images.settings == [{"upscale_factor": 4, "width": 8, "height": 8}] and images.seeds == [None]
    assert images.caption(0) == "4x · 8x8" and images.prompt is None


def test_an_answer_without_images_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="b64_json"):
        Images.from_answer({"data": [{"url": "https://example.invalid/a.png"}]})
    with pytest.raises(InvalidArgument, match="Pillow"):
        Images.from_answer({"data": [{"b64_json": base64.b64encode(b"not a png").decode()}]})
    with pytest.raises(ValueError, match="2 images but 1 settings"):
        Images([picture(), picture()], [{}])


def test_the_grid_shows_every_image_with_its_caption() -> None:
    infos = [{"seed": s, "steps": 4} for s in (3, 4, 5)]
    images = Images.from_answer(
        answer(*(picture(seed=s) for s in range(3)), infos=infos), model="m", prompt="<b>cats</b>"
    )
    grid = images._repr_html_()
    assert grid.count('<figure class="lk-image"') == 3 and "<b>cats</b>" not in grid and "&lt;b&gt;cats" in grid
    shown = re.findall(r'src="data:image/png;base64,([^"]+)"', grid)
    assert [np.asarray(open_image(base64.b64decode(s))).tolist() for s in shown] == [
        np.asarray(i).tolist() for i in images
    ]
    assert [c for c in re.findall(r"<figcaption[^>]*>([^<]+)</figcaption>", grid)] == [
        "seed 3 · 4 steps · 24x16",
        "seed 4 · 4 steps · 24x16",
        "seed 5 · 4 steps · 24x16",
    ]


def test_save_writes_pngs_that_carry_their_settings(tmp_path: Path) -> None:
    images = Images.from_answer(
        answer(picture(seed=1), picture(seed=2), infos=[{"seed": 11}, {"seed": 12}]), model="m", prompt="a fox"
    )
    paths = images.save(tmp_path / "out")
    assert paths == [tmp_path / "out" / "image-0-seed11.png", tmp_path / "out" / "image-1-seed12.png"]
    for path, image, seed in zip(paths, images, (11, 12), strict=True):
        read = Image.open(path)
        assert read.format == "PNG" and np.array_equal(np.asarray(read), np.asarray(image))
        facts = json.loads(read.text["lemonkit"])
        assert facts["seed"] == seed and facts["model"] == "m" and facts["prompt"] == "a fox"
        assert read.text["prompt"] == "a fox"
    unseeded = Images([picture()], model="up")
    assert unseeded.save(tmp_path, prefix="big") == [tmp_path / "big-0.png"]


def test_image_inputs_become_uploads(tmp_path: Path) -> None:
    image = picture()
    png = base64.b64decode(encoded(image))
    jpeg = base64.b64decode(encoded(image, "JPEG"))
    path = tmp_path / "in.png"
    path.write_bytes(png)
    assert image_bytes(png) == (png, "image/png") and image_bytes(jpeg) == (jpeg, "image/jpeg")
    assert image_bytes(path) == (png, "image/png") and image_bytes(str(path)) == (png, "image/png")
    data, kind = image_bytes(image)
    assert kind == "image/png" and np.array_equal(np.asarray(open_image(data)), np.asarray(image))
    assert png_bytes(jpeg).startswith(b"\x89PNG")  # upscaling takes PNG only: a JPEG is converted
    gif = io.BytesIO()
    image.save(gif, format="GIF")
    assert image_bytes(gif.getvalue())[1] == "image/png"
    cmyk = image.convert("CMYK")
    assert open_image(png_bytes(cmyk)).mode == "RGB"
    with pytest.raises(InvalidArgument, match=r"not an image|Pillow"):
        image_bytes(b"hello")
    with pytest.raises(InvalidArgument, match="not list"):
        image_bytes([1, 2])
    with pytest.raises(FileNotFoundError):
        image_bytes(tmp_path / "missing.png")


def test_sizes() -> None:
    assert size_of(None) is None and size_of("512x256") == "512x256" and size_of((64, 32)) == "64x32"
    assert size_of(" 64 X 64") == "64x64"
    for bad in ("big", "64x", (64,), (0, 64), "64x64x3"):
        with pytest.raises(InvalidArgument, match="size"):
            size_of(bad)  # type: ignore[arg-type]


def test_a_generation_request_is_seeded_json() -> None:
    request = ImageRequest.generation("a cat", "SD-Turbo", n=2, size=(64, 64), steps=2, cfg_scale=None, seed=None)
    body = request.kwargs["json"]
    assert request.route == "images/generations" and set(request.kwargs) == {"json"}
    assert body == {
        "model": "SD-Turbo",
        "prompt": "a cat",
        "n": 2,
        "response_format": "b64_json",
        "seed": body["seed"],
        "size": "64x64",
        "steps": 2,
    }
    assert isinstance(body["seed"], int) and 0 <= body["seed"] < 2**31  # random, but sent: the result records it
    assert ImageRequest.generation("a cat", "m", n=1, size=None, seed=5).fields["seed"] == 5
    assert ImageRequest.generation("a cat", "m", n=1, size=None, seed=-1).fields["seed"] >= 0


def test_an_edit_is_multipart_with_its_images_in_order_and_a_mask() -> None:
    first, second, mask = picture(seed=1), picture(seed=2), Image.new("L", (24, 16), 255)
    request = ImageRequest.edit(
        [first, second], "add a hat", "m", mask=mask, n=1, size=None, steps=3, cfg_scale=None, seed=9
    )
    kwargs = request.kwargs
    assert kwargs["data"] == {
        "model": "m",
        "prompt": "add a hat",
        "n": "1",
        "response_format": "b64_json",
        "seed": "9",
        "steps": "3",
    }
    assert [name for name, _ in kwargs["files"]] == ["image[]", "image[]", "mask"]
    sent = [open_image(file[1]) for _, file in kwargs["files"]]
    assert np.array_equal(np.asarray(sent[0]), np.asarray(first))
    assert np.array_equal(np.asarray(sent[1]), np.asarray(second))
    assert sent[2].mode == "L" and kwargs["files"][2][1][0] == "mask.png"
    one = ImageRequest.edit(first, "x", "m", mask=None, n=2, size="32x32", seed=1)
    assert [name for name, _ in one.kwargs["files"]] == ["image"] and one.kwargs["data"]["size"] == "32x32"
    with pytest.raises(InvalidArgument, match="at least one"):
        ImageRequest.edit([], "x", "m", mask=None, n=1, size=None, seed=1)


def test_variation_and_upscale_requests() -> None:
    image = picture()
    variation = ImageRequest.variation(image, "m", n=3, size=None, seed=4)
    assert variation.route == "images/variations" and variation.kwargs["data"]["n"] == "3"
    assert [name for name, _ in variation.kwargs["files"]] == ["image"] and "prompt" not in variation.fields

    upscale = ImageRequest.upscale(image, "RealESRGAN-x4plus", factor=None)
    body = upscale.kwargs["json"]
    assert set(body) == {"model", "image"} and upscale.route == "images/upscale"
    assert np.array_equal(np.asarray(open_image(base64.b64decode(body["image"]))), np.asarray(image))
    assert ImageRequest.upscale(image, "m", factor=2).fields["upscale_factor"] == 2


def answered(steps: Steps[Images], answer: dict[str, Any], headers: dict[str, str], api: str) -> Images:
    """Drive a call's steps as a client does, answering its one request with ``answer`` and ``headers``."""
    request = next(steps)
    assert isinstance(request, Request) and request.method == "POST" and request.headers_out is not None
    request.headers_out.update(headers)
    assert steps.send(answer) is SERVER
    with pytest.raises(StopIteration) as done:
        steps.send(Server(api, None, "url"))
    result: Images = done.value.value
    return result


def test_the_result_carries_provenance_without_the_image_data() -> None:
    request = ImageRequest.upscale(picture(), "RealESRGAN-x4plus", factor=None)
    headers = {PROVENANCE_HEADER: json.dumps({"model": "RealESRGAN-x4plus", "engine": "ncnn"})}
    result = answered(request.sent(), answer(picture(96, 64)), headers, "http://127.0.0.1:1/api/v1")
    facts = result.provenance
    assert facts["route"] == "images/upscale" and facts["engine"] == "ncnn" and facts["model"] == "RealESRGAN-x4plus"
    assert "image" not in facts["request"] and facts["server"] == "http://127.0.0.1:1/api/v1"
    edit = ImageRequest.edit(picture(), "x", "m", mask=picture(), n=1, size=None, seed=3)
    edited = answered(edit.sent(), answer(picture(), infos=[{"seed": 3}]), {}, "api")
    assert edited.provenance["request"]["files"] == ["image=image-0.png", "mask=mask.png"]
    assert edited.provenance["seed"] == 3 and edited.prompt == "x"


def test_the_public_names() -> None:
    assert lemonkit.Images is Images
    for name in ("generate_image", "edit_image", "vary_image", "upscale"):
        assert callable(getattr(lemonkit, name)) and name in lemonkit.__all__
        assert getattr(lemonkit, name).__doc__ == getattr(lemonkit.Client, name).__doc__.replace(
            "lemonkit.Client().", "lemonkit."
        )
        # one call: the async client's method, the sync one's and the module function take the same arguments
        signature = inspect.signature(getattr(lemonkit.Client(start=False), name))
        assert inspect.signature(getattr(lemonkit, name)) == signature
        assert inspect.signature(getattr(lemonkit.AsyncClient(start=False), name)) == signature
