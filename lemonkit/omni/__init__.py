"""Omni collections (``recipe: "collection.omni"``): the server-side tool loop's pure parts.

- :mod:`~lemonkit.omni.tools`: which component plays which role, the built-in tools and system prompt;
- :mod:`~lemonkit.omni.media`: media embedded in an assistant's ``content`` (made, found, stripped, chunked).

The loop itself, which talks to the components' sidecars, is :mod:`lemonkit.server.omni`.
"""

from lemonkit.omni.media import (
    MAX_DELTA_CHARS,
    Media,
    audio_tag,
    chunks,
    find_media,
    image_markdown,
    split_media,
    strip_media,
)
from lemonkit.omni.tools import (
    EDIT_IMAGE,
    GENERATE_IMAGE,
    OMNI_TOOLS,
    TEXT_TO_SPEECH,
    Roles,
    system_prompt,
    tool_definitions,
)

__all__ = [
    "EDIT_IMAGE",
    "GENERATE_IMAGE",
    "MAX_DELTA_CHARS",
    "OMNI_TOOLS",
    "TEXT_TO_SPEECH",
    "Media",
    "Roles",
    "audio_tag",
    "chunks",
    "find_media",
    "image_markdown",
    "split_media",
    "strip_media",
    "system_prompt",
    "tool_definitions",
]
