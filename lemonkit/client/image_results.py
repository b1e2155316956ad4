"""Images as the Python API hands them out: :class:`Images`, what :func:`lemonkit.generate_image`,
:func:`lemonkit.edit_image`, :func:`lemonkit.vary_image` and :func:`lemonkit.upscale` return, and reading what they
take (:func:`image_bytes`, :func:`png_bytes`).

Pillow does the decoding and encoding, in the caller's process (the engines decode uploads in their sidecars with
``lemonkit.backends.images.pictures``, which takes PNG and JPEG only; here a user's GIF or WebP is read too, and
sent as PNG). Nothing here needs IPython: the grid a notebook shows is plain HTML.
"""

from __future__ import annotations

import base64
import html
import io
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

from lemonkit.errors import InvalidArgument

if TYPE_CHECKING:
    from PIL import Image as PILImage

__all__ = ["ImageInput", "Images", "image_bytes", "open_image", "png_bytes"]

#: what the image methods take: a PIL image, an image file's path, or its bytes (Pillow is imported on first use)
ImageInput: TypeAlias = "PILImage.Image | str | os.PathLike[str] | bytes | bytearray"

_PNG = b"\x89PNG\r\n\x1a\n"
_JPEG = b"\xff\xd8\xff"
#: the settings a caption names, in this order, and how
_CAPTION = (("seed", "seed {}"), ("steps", "{} steps"), ("cfg_scale", "cfg {}"), ("upscale_factor", "{}x"))


def open_image(data: bytes) -> PILImage.Image:
    """Decode an image file's bytes, pixels loaded (the image does not keep ``data``).

    Raises:
        InvalidArgument: Pillow cannot read them.
    """
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:  # closed after: the pixels are loaded, the bytes let go
            image.load()
            return image
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise InvalidArgument(f"Not an image Pillow can read: {exc}") from None


def image_bytes(source: ImageInput) -> tuple[bytes, str]:
    """An image file's bytes and media type for an upload: PNG and JPEG files as they are, anything else as PNG.

    Args:
        source: A PIL image, an image file's path, or its bytes.

    Raises:
        InvalidArgument: ``source`` is none of those, or not an image.
        FileNotFoundError: A path that does not exist.
    """
    if isinstance(source, str | os.PathLike):
        source = Path(source).read_bytes()
    if isinstance(source, bytes | bytearray):
        data = bytes(source)
        if data.startswith(_PNG):
            return data, "image/png"
        if data.startswith(_JPEG):
            return data, "image/jpeg"
        source = open_image(data)
    from PIL import Image

    if not isinstance(source, Image.Image):
        raise InvalidArgument(f"An image must be a PIL image, a path or bytes, not {type(source).__name__}")
    return _encode_png(source), "image/png"


def png_bytes(source: ImageInput) -> bytes:
    """``source`` (as :func:`image_bytes` takes it) as a PNG file's bytes.

    Raises:
        InvalidArgument: As :func:`image_bytes`.
    """
    data, media_type = image_bytes(source)
    return data if media_type == "image/png" else _encode_png(open_image(data))


def _encode_png(image: PILImage.Image, text: dict[str, str] | None = None) -> bytes:
    from PIL import PngImagePlugin

    if image.mode not in ("1", "L", "LA", "I", "P", "RGB", "RGBA"):
        image = image.convert("RGBA" if "A" in image.getbands() else "RGB")
    info = PngImagePlugin.PngInfo()
    for key, value in (text or {}).items():
        info.add_text(key, value)
    out = io.BytesIO()
    image.save(out, format="PNG", pnginfo=info)
    return out.getvalue()


class Images(list["PILImage.Image"]):
    """PIL images with each one's settings; in a notebook they display as a grid, each captioned with its seed and
    settings.

    Args:
        images: The images.
        settings: Each image's settings (``seed``, ``steps``, ``cfg_scale``, ``width``, ``height``, ...: what the
            engine reported), in the same order.
        model: The model that made them.
        prompt: The prompt they were made from (``None`` for variations and upscales).
        provenance: Model, checkpoint, versions, wall time and the request (see :class:`~lemonkit.ChatResult`).

    Attributes:
        settings: As above.
        model: As above.
        prompt: As above.
        provenance: As above.
    """

    def __init__(
        self,
        images: list[PILImage.Image],
        settings: list[dict[str, Any]] | None = None,
        *,
        model: str | None = None,
        prompt: str | None = None,
        provenance: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(images)
        self.settings = [dict(s) for s in settings] if settings is not None else [{} for _ in images]
        if len(self.settings) != len(images):
            raise ValueError(f"{len(images)} images but {len(self.settings)} settings")
        self.model = model
        self.prompt = prompt
        self.provenance = provenance or {}

    @classmethod
    def from_answer(
        cls,
        answer: dict[str, Any],
        *,
        model: str | None = None,
        prompt: str | None = None,
        provenance: dict[str, Any] | None = None,
        defaults: dict[str, Any] | None = None,
    ) -> Images:
        """Read an ``/v1/images/*`` answer: ``{"data": [{"b64_json", "generation_info"?}], ...}``.

        Args:
            answer: The server's answer.
            model: As :class:`Images`'.
            prompt: As :class:`Images`'.
            provenance: As :class:`Images`'.
            defaults: Settings every image has unless its ``generation_info`` says otherwise (what was asked for).

        Raises:
            InvalidArgument: An entry holds no image, or one Pillow cannot read.
        """
        images, settings = [], []
        for entry in answer.get("data") or ():
            encoded = entry.get("b64_json")
            if not isinstance(encoded, str) or not encoded:
                raise InvalidArgument("The server's answer holds an entry without b64_json (was response_format url?)")
            image = open_image(base64.b64decode(encoded))
            reported = {k: v for k, v in (entry.get("generation_info") or {}).items() if v is not None}
            settings.append({**(defaults or {}), "width": image.width, "height": image.height, **reported})
            images.append(image)
        return cls(images, settings, model=model, prompt=prompt, provenance=provenance)

    @property
    def seeds(self) -> list[int | None]:
        """Each image's seed (``None`` where the engine reported none, as for upscales)."""
        return [s.get("seed") for s in self.settings]

    def png(self, index: int) -> bytes:
        """Image ``index`` as a PNG file's bytes, its settings (and prompt) in the file's text chunks."""
        text = {"lemonkit": json.dumps(self._facts(index), default=str)}
        if self.prompt:
            text["prompt"] = self.prompt
        return _encode_png(self[index], text)

    def save(self, directory: str | os.PathLike[str], prefix: str = "image") -> list[Path]:
        """Write every image to ``directory`` (created if needed) as ``<prefix>-<i>.png``, or
        ``<prefix>-<i>-seed<seed>.png`` when it has a seed; each file holds its settings in a ``lemonkit`` text chunk.

        Args:
            directory: Where to write them.
            prefix: The files' names' start.

        Returns:
            The paths written, in order.

        Example:
            >>> lemonkit.generate_image("a lighthouse at dawn", n=2, seed=7).save("out")
            [PosixPath('out/image-0-seed7.png'), PosixPath('out/image-1-seed8.png')]
        """
        target = Path(directory)
        target.mkdir(parents=True, exist_ok=True)
        paths = []
        for index, settings in enumerate(self.settings):
            seed = settings.get("seed")
            path = target / (f"{prefix}-{index}-seed{seed}.png" if seed is not None else f"{prefix}-{index}.png")
            path.write_bytes(self.png(index))
            paths.append(path)
        return paths

    def caption(self, index: int) -> str:
        """What the grid says under image ``index``: its seed and settings, and its size."""
        settings = self.settings[index]
        parts = [fmt.format(settings[key]) for key, fmt in _CAPTION if settings.get(key) is not None]
        image = self[index]
        return " · ".join([*parts, f"{image.width}x{image.height}"])

    def _facts(self, index: int) -> dict[str, Any]:
        return {"model": self.model, "prompt": self.prompt, **self.settings[index]}

    def _repr_html_(self) -> str:
        figures = []
        for index in range(len(self)):
            data = base64.b64encode(self.png(index)).decode("ascii")
            tip = html.escape(json.dumps(self._facts(index), default=str))
            figures.append(
                f'<figure class="lk-image" data-index="{index}" style="margin: 0">'
                f'<img src="data:image/png;base64,{data}" title="{tip}" alt="image {index}" '
                f'style="max-width: 100%; height: auto; image-rendering: auto">'
                f'<figcaption style="font-size: 0.85em">{html.escape(self.caption(index))}</figcaption></figure>'
            )
        header = " · ".join(html.escape(str(f)) for f in (self.model, self.prompt) if f)
        return (
            f'<div class="lk-images"><div style="font-size: 0.85em; opacity: 0.7">{header}</div>'
            '<div style="display: grid; grid-template-columns: repeat(auto-fill, minmax(160px, max-content)); '
            f'gap: 8px; align-items: start">{"".join(figures)}</div></div>'
        )

    def __repr__(self) -> str:
        sizes = ", ".join(f"{i.width}x{i.height}" for i in self)
        return f"Images({len(self)}: {sizes}; model={self.model!r}, seeds={self.seeds!r})"
