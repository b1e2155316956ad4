"""The diffusers engine called directly on the tiny random pipeline (cancellation, which HTTP cannot reach without
timing), and the request pieces it is built from: sizes, defaults, seeds, uploads."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from PIL import Image

from lemonkit.backends.images.params import MAX_SIDE, Settings, capped_size, parse_size
from lemonkit.backends.images.pictures import decode_image, image_kind
from lemonkit.backends.protocol import Upload
from lemonkit.catalog.hf_cache import HubCache
from lemonkit.errors import InvalidArgument, ModelLoadError


def test_sizes() -> None:
    assert parse_size("512x768", multiple=8) == (512, 768)
    assert parse_size(" 64 X 64 ", multiple=8) == (64, 64)
    for bad in ("512", "512x", "ax512", "513x512", "0x512", f"{MAX_SIDE + 8}x512", 512, None):
        with pytest.raises(InvalidArgument):
            parse_size(bad, multiple=8)
    assert capped_size(4000, 3000, cap=2048 * 2048, multiple=8) == (2048, 1536)  # MAX_SIDE bounds it too
    assert capped_size(100, 60, cap=2048 * 2048, multiple=8) == (96, 56)  # small: rounded down only
    assert capped_size(10, 10, cap=16, multiple=8) == (8, 8)  # never below one multiple


def test_settings_defaults_and_seeds() -> None:
    options = {"steps": 4, "cfg_scale": 1.0, "width": 256, "height": 128}
    settings = Settings.parse({"n": 3, "seed": 2**32 - 1}, options, multiple=8)
    assert (settings.width, settings.height, settings.steps, settings.cfg_scale) == (256, 128, 4, 1.0)
    assert settings.seeds() == [2**32 - 1, 0, 1]
    bare = Settings.parse({}, {}, multiple=8)
    assert (bare.width, bare.height, bare.steps, bare.cfg_scale, bare.n) == (512, 512, 20, 7.0, 1)
    assert Settings.parse({"cfg_scale": 0}, options, multiple=8).cfg_scale == 0.0
    assert Settings.parse({"size": "64x64"}, options, multiple=8, size=(8, 8)).width == 64
    for bad in ({"n": 11}, {"n": 0}, {"steps": 0}, {"cfg_scale": -1}, {"seed": 1.5}, {"n": True}):
        with pytest.raises(InvalidArgument):
            Settings.parse(bad, options, multiple=8)


def test_uploads() -> None:
    out = io.BytesIO()
    Image.new("RGBA", (4, 2), (255, 0, 0, 128)).save(out, format="PNG")
    png = out.getvalue()
    assert image_kind(png) == "PNG" and image_kind(b"\xff\xd8\xff\xe0") == "JPEG" and image_kind(b"GIF89a") is None
    picture = decode_image(Upload("a.png", png), field="image")
    assert picture.mode == "RGB" and picture.size == (4, 2)
    assert decode_image(Upload("m.png", png), field="mask", mode="L").mode == "L"
    for bad in (b"GIF89a....", b"\x89PNG\r\n\x1a\ntruncated"):
        with pytest.raises(InvalidArgument, match="image"):
            decode_image(Upload("bad", bad), field="image")


def test_a_diffusers_snapshot_is_present_with_its_index(tmp_path: Path) -> None:
    snapshot = tmp_path / "models--org--sd" / "snapshots" / ("c" * 40)
    (snapshot / "unet").mkdir(parents=True)
    (snapshot / "unet" / "config.json").write_text("{}")
    cache = HubCache(tmp_path)
    assert cache.locate("diffusers", "org/sd") is None  # a component without the pipeline's index
    assert cache.locate("faster-whisper", "org/sd") == snapshot  # other whole-repo recipes: any file
    (snapshot / "model_index.json").write_text("{}")
    assert cache.locate("diffusers", "org/sd") == snapshot


@pytest.mark.slow
def test_cancelled_mid_image_stops_the_request(tmp_path: Path) -> None:
    from lemonkit.backends.images.diffusers_engine import DiffusersEngine
    from lemonkit.testing.tiny_diffusers import write_tiny_pipeline

    with pytest.raises(ModelLoadError):
        DiffusersEngine({"model_path": str(tmp_path), "type": "image"})  # no model_index.json
    root = write_tiny_pipeline(tmp_path / "sd")
    with pytest.raises(ModelLoadError):
        DiffusersEngine({"model_path": str(root), "type": "llm"})
    engine = DiffusersEngine({"model_path": str(root), "type": "image", "options": {"width": 64, "height": 64}})
    asked: list[int] = []

    def cancelled() -> bool:
        asked.append(1)
        return len(asked) > 1  # the client leaves after the first question (before image 1, its first step)

    answer = engine.generate({"prompt": "x", "n": 3, "steps": 10, "seed": 1}, cancelled=cancelled)
    assert len(answer["data"]) == 1  # the interrupted image is returned; the other two are never started
    assert len(asked) == 3  # before image 1, after its first step (interrupt: no more steps), before image 2
    assert engine.stats()["images"] == 1
    whole = engine.generate({"prompt": "x", "n": 2, "steps": 2, "seed": 1}, cancelled=lambda: False)
    assert len(whole["data"]) == 2
