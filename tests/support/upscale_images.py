"""Test images for the upscaler (made here, never committed) and how close two images are."""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

__all__ = ["MIN_PSNR", "UPSCALERS", "bicubic", "noise", "picture", "png", "png_b64", "psnr", "rgb"]

#: bundled upscaler -> its scale
UPSCALERS = {
    "realesr-animevideov3-x2": 2,
    "realesr-animevideov3-x3": 3,
    "realesr-animevideov3-x4": 4,
    "RealESRGAN-x4plus-anime": 4,
    "RealESRGAN-x4plus": 4,
}
#: how close (dB, :func:`psnr`) an upscale is to a bicubic one at least: the bundled networks score 20-27 dB on
#: :func:`picture`, while noise and a flat grey score 8-12 dB
MIN_PSNR = 19.0


def picture(width: int, height: int, mode: str = "RGB") -> Image.Image:
    """A smooth colour gradient with a few anti-aliased shapes: edges and flat areas, like a drawing."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack(
        [60 + 150 * x / max(width - 1, 1), 60 + 150 * y / max(height - 1, 1), 180 - 100 * x / max(width - 1, 1)], -1
    )
    image = Image.fromarray(base.astype(np.uint8), "RGB")
    big = image.resize((width * 4, height * 4))  # drawn at 4x, then scaled down: anti-aliased edges
    draw = ImageDraw.Draw(big)
    draw.ellipse((width * 0.6, height * 0.6, width * 2.2, height * 2.4), fill=(250, 240, 40))
    draw.rectangle((width * 2.4, height * 1.2, width * 3.6, height * 3.4), fill=(30, 30, 120))
    draw.line((0, height * 4, width * 4, 0), fill=(255, 255, 255), width=max(width // 8, 2))
    image = big.resize((width, height), Image.Resampling.LANCZOS)
    return image.convert(mode) if mode != "RGB" else image


def noise(width: int, height: int, seed: int = 0) -> Image.Image:
    """Uniform RGB noise: the negative control of a closeness measure."""
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


def bicubic(image: Image.Image, scale: int) -> Image.Image:
    return image.resize((image.width * scale, image.height * scale), Image.Resampling.BICUBIC)


def rgb(image: Image.Image) -> np.ndarray:
    return np.asarray(image.convert("RGB"), dtype=np.float64)


def psnr(a: Image.Image, b: Image.Image) -> float:
    """Peak signal-to-noise ratio of ``a`` against ``b`` (same size), in dB, over RGB."""
    assert a.size == b.size, (a.size, b.size)
    mse = float(np.mean((rgb(a) - rgb(b)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def png(image: Image.Image, **options: Any) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", **options)
    return buffer.getvalue()


def png_b64(image: Image.Image) -> str:
    return base64.b64encode(png(image)).decode()
