"""lemonkit: local AI models served from inside Jupyter through the Lemonade / OpenAI API."""

from __future__ import annotations

from typing import Any

from lemonkit.api import default_client, pull
from lemonkit.client import AsyncClient, Client, ServerUnavailable
from lemonkit.errors import (
    DownloadError,
    DownloadStopped,
    InvalidArgument,
    InvalidRequest,
    LemonkitError,
    ModelLoadError,
    ModelNotFound,
    NotFound,
    Unauthorized,
)

__version__ = "0.1.0"

__all__ = [
    "AsyncClient",
    "Client",
    "DownloadError",
    "DownloadStopped",
    "InvalidArgument",
    "InvalidRequest",
    "LemonkitError",
    "ModelLoadError",
    "ModelNotFound",
    "NotFound",
    "ServerUnavailable",
    "Unauthorized",
    "__version__",
    "default_client",
    "pull",
]


# -- widgets: imported on first use (anywidget and ipywidgets cost an import a server or script never needs) ----
_WIDGETS = {"ChatPanel", "DownloadBar", "ModelBrowser"}


def __getattr__(name: str) -> Any:
    if name in _WIDGETS:
        from lemonkit import widgets

        return getattr(widgets, name)
    raise AttributeError(f"module 'lemonkit' has no attribute {name!r}")


def _jupyter_server_extension_points() -> list[dict[str, Any]]:
    from lemonkit.server.extension import LemonkitExtension

    return [{"module": "lemonkit.server.extension", "app": LemonkitExtension}]
