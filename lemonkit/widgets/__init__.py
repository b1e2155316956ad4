"""Notebook widgets (anywidget): the model browser, a download bar, a chat panel, the transcription and speech
panels, the image panel, and the pieces they share (:mod:`~lemonkit.widgets.base`, :mod:`~lemonkit.widgets.progress`,
:mod:`~lemonkit.widgets.picker` and ``static/shared.js``); matplotlib figures in :mod:`~lemonkit.plots`.

Every server call goes through :class:`lemonkit.Client` in the kernel: the page never holds a token. The panels are
imported on first use, so that ``Transcript.plot()`` in plain ``python`` imports neither anywidget nor IPython.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lemonkit.widgets.audio import SpeechPanel, TranscriptionPanel
    from lemonkit.widgets.chat import ChatPanel
    from lemonkit.widgets.download import DownloadBar
    from lemonkit.widgets.images import ImagePanel
    from lemonkit.widgets.models import ModelBrowser

__all__ = ["ChatPanel", "DownloadBar", "ImagePanel", "ModelBrowser", "SpeechPanel", "TranscriptionPanel"]

_MODULES = {
    "ChatPanel": "chat",
    "DownloadBar": "download",
    "ImagePanel": "images",
    "ModelBrowser": "models",
    "SpeechPanel": "audio",
    "TranscriptionPanel": "audio",
}


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        return getattr(importlib.import_module(f"lemonkit.widgets.{_MODULES[name]}"), name)
    raise AttributeError(f"module 'lemonkit.widgets' has no attribute {name!r}")
