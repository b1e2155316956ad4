"""lemonkit: local AI models served from inside Jupyter through the Lemonade / OpenAI API."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

__all__ = ["__version__"]


def _jupyter_server_extension_points() -> list[dict[str, Any]]:
    from lemonkit.server.extension import LemonkitExtension

    return [{"module": "lemonkit.server.extension", "app": LemonkitExtension}]
