"""Media in an omni answer's ``content`` (spec: openai-api.md, "Server-Side Tools"): an image is the markdown
``![generated image](data:image/png;base64,…)``, speech is ``<audio>data:audio/mpeg;base64,…</audio>``.

The same text is what a client gets, what a notebook result displays, and what comes back in the assistant turns of
a resumed conversation, where the media is replaced by a short placeholder before the chat model sees it (a picture
is hundreds of thousands of characters: it would fill the model's context and mean nothing to it).
"""

from __future__ import annotations

import base64
import re
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = [
    "MAX_DELTA_CHARS",
    "Media",
    "audio_tag",
    "chunks",
    "find_media",
    "image_markdown",
    "split_media",
    "strip_media",
]

#: the longest ``content`` delta a stream carries media in
MAX_DELTA_CHARS = 16_000

_B64 = r"[A-Za-z0-9+/=\s]+"
#: an image's markdown, or an ``<audio>`` element, each with a base64 data URL
_MEDIA = re.compile(
    rf"!\[[^\]\n]*\]\(data:(?P<image>image/[\w.+-]+);base64,(?P<image_data>{_B64})\)"
    rf"|<audio>data:(?P<audio>audio/[\w.+-]+);base64,(?P<audio_data>{_B64})</audio>"
)


@dataclass(frozen=True)
class Media:
    """One image or sound found in a text."""

    kind: str  #: ``image`` or ``audio``
    mime: str  #: e.g. ``image/png``, ``audio/mpeg``
    b64: str  #: the base64 data, as the text holds it

    @property
    def data(self) -> bytes:
        return base64.b64decode(self.b64)


def image_markdown(b64_png: str) -> str:
    """The spec's markdown for a generated PNG (``b64_png``: its base64)."""
    return f"![generated image](data:image/png;base64,{b64_png})"


def audio_tag(b64_mp3: str) -> str:
    """The spec's element for generated speech (``b64_mp3``: its base64)."""
    return f"<audio>data:audio/mpeg;base64,{b64_mp3}</audio>"


def find_media(text: str) -> list[Media]:
    """The images and sounds embedded in ``text``, in order."""
    found = []
    for m in _MEDIA.finditer(text):
        if m.group("image"):
            found.append(Media("image", m.group("image"), re.sub(r"\s", "", m.group("image_data"))))
        else:
            found.append(Media("audio", m.group("audio"), re.sub(r"\s", "", m.group("audio_data"))))
    return found


def split_media(text: str) -> list[str | Media]:
    """``text`` as its plain pieces and its media, in order (empty pieces left out)."""
    out: list[str | Media] = []
    at = 0
    for m, media in zip(_MEDIA.finditer(text), find_media(text), strict=True):
        if m.start() > at:
            out.append(text[at : m.start()])
        out.append(media)
        at = m.end()
    if at < len(text):
        out.append(text[at:])
    return out


def strip_media(text: str) -> str:
    """``text`` with each embedded image or sound replaced by ``[image]`` or ``[audio]``."""
    return _MEDIA.sub(lambda m: "[image]" if m.group("image") else "[audio]", text)


def chunks(text: str, size: int = MAX_DELTA_CHARS) -> Iterator[str]:
    """``text`` in pieces of at most ``size`` characters."""
    for start in range(0, len(text), size):
        yield text[start : start + size]
