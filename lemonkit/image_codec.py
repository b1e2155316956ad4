"""Images in and out of the image engines: uploaded bytes -> a Pillow image, a Pillow image -> base64 PNG.

Runs in the sidecars only (the server never decodes an image on its event loop). Pillow opens only
:data:`FORMATS`: formats it reads itself, never through an external program (its EPS plugin runs Ghostscript).
"""

from __future__ import annotations

import base64
import io
import warnings
from typing import TYPE_CHECKING

from lemonkit.errors import InvalidArgument

if TYPE_CHECKING:
    from PIL import Image

__all__ = ["FORMATS", "UndecodableImage", "open_image", "png_base64"]

#: the formats an uploaded image may be in
FORMATS = ("PNG", "JPEG", "WEBP", "BMP", "GIF", "TIFF")


class UndecodableImage(InvalidArgument):
    """The bytes are not an image in one of :data:`FORMATS`, or a damaged one (400 ``invalid_image``)."""

    code = "invalid_image"


def open_image(data: bytes, *, what: str = "image", max_pixels: int | None = None) -> Image.Image:
    """Decode ``data`` into a loaded Pillow image (its first frame).

    Args:
        data: The file's bytes.
        what: The request field it came from, for messages.
        max_pixels: Refuse a larger image before decoding its pixels (its header tells the size).

    Returns:
        The image, pixels loaded.

    Raises:
        UndecodableImage: Not an image Pillow reads in :data:`FORMATS`, or truncated.
        InvalidArgument: More than ``max_pixels`` pixels.
    """
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)  # a bomb is refused, not decoded
            image = Image.open(io.BytesIO(data), formats=FORMATS)
    except (UnidentifiedImageError, Image.DecompressionBombError, Image.DecompressionBombWarning, OSError) as exc:
        raise UndecodableImage(f"{what} is not a {'/'.join(FORMATS)} image Pillow can read ({exc})") from None
    width, height = image.size
    if max_pixels is not None and width * height > max_pixels:
        raise InvalidArgument(f"{what}: {width}x{height} is too large ({width * height} pixels; at most {max_pixels})")
    try:
        image.load()
    except (OSError, SyntaxError, ValueError) as exc:  # Pillow's errors for a damaged or truncated file
        raise UndecodableImage(f"{what} is a damaged image: {exc}") from None
    return image


def png_base64(image: Image.Image, *, compress_level: int = 6) -> str:
    """``image`` as a base64 PNG (``b64_json``)."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", compress_level=compress_level)
    return base64.b64encode(buffer.getvalue()).decode("ascii")
