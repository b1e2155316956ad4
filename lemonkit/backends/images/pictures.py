"""Pictures in and out of an image engine, with Pillow: uploads decoded (PNG or JPEG only), answers encoded as PNG.

This runs in the model's sidecar: the server never decodes an image.
"""

from __future__ import annotations

import base64
import io
from typing import TYPE_CHECKING

from lemonkit.backends.protocol import Upload
from lemonkit.errors import InvalidArgument

if TYPE_CHECKING:
    from PIL import Image

__all__ = ["IMAGE_FORMATS", "decode_image", "encode_png", "image_kind"]

#: the upload formats the image routes take (the spec's "PNG or JPEG")
IMAGE_FORMATS = ("PNG", "JPEG")
#: the largest decoded image accepted, in pixels (a 64 MP upload is a mistake, or a decompression bomb)
MAX_PIXELS = 8192 * 8192


def image_kind(data: bytes) -> str | None:
    """``"PNG"`` or ``"JPEG"`` from a file's first bytes (its signature), else ``None``: cheap enough for the
    server to refuse another format before a model loads."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if data.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    return None


def decode_image(upload: Upload, *, field: str, mode: str | None = "RGB", max_pixels: int = MAX_PIXELS) -> Image.Image:
    """One uploaded PNG or JPEG as a Pillow image in ``mode``.

    Args:
        upload: The file.
        field: The request field it came in, for messages.
        mode: ``RGB`` for pictures, ``L`` for a mask (its brightness: white is edited, black kept); ``None`` keeps
            the file's own (an upscaler keeps alpha and grey).
        max_pixels: The largest image taken, checked before its pixels are decoded.

    Raises:
        InvalidArgument: It is not a PNG or JPEG Pillow can decode, or it is too large.
    """
    from PIL import Image, UnidentifiedImageError

    if image_kind(upload.content) is None:
        raise InvalidArgument(f"{field}: {upload.filename!r} is not a PNG or JPEG image")
    try:
        with Image.open(io.BytesIO(upload.content), formats=IMAGE_FORMATS) as picture:
            if picture.width * picture.height > max_pixels:
                raise InvalidArgument(f"{field}: {picture.width}x{picture.height} is larger than {max_pixels} pixels")
            picture.load()
            return picture.convert(mode) if mode else picture.copy()
    except InvalidArgument:  # a ValueError too: not to be reported as an unreadable file
        raise
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise InvalidArgument(f"{field}: {upload.filename!r} is not a readable PNG or JPEG image ({exc})") from None


def encode_png(picture: Image.Image, parameters: str = "") -> str:
    """``picture`` as a base64 PNG, with ``parameters`` (the prompt and settings) in a ``tEXt`` chunk when given."""
    from PIL.PngImagePlugin import PngInfo

    info = PngInfo()
    if parameters:
        info.add_text("parameters", parameters)
    out = io.BytesIO()
    picture.save(out, format="PNG", pnginfo=info)
    return base64.b64encode(out.getvalue()).decode("ascii")
