"""Notebook widgets (anywidget): the model browser, a download bar, a chat panel, the transcription and speech
panels, the image panel, and the pieces they share (:mod:`~lemonkit.widgets.panel`, :mod:`~lemonkit.widgets.progress`,
:mod:`~lemonkit.widgets.picker` and ``static/shared.js``); matplotlib figures in :mod:`~lemonkit.client.plots`.

Every server call goes through :class:`lemonkit.Client` in the kernel: the page never holds a token. The panels are
imported on first use, so that ``Transcript.plot()`` in plain ``python`` imports neither anywidget nor IPython.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lemonkit.widgets.audio_panels import SpeechPanel, TranscriptionPanel
    from lemonkit.widgets.chat_panel import ChatPanel
    from lemonkit.widgets.download_bar import DownloadBar
    from lemonkit.widgets.image_panel import ImagePanel
    from lemonkit.widgets.model_browser import ModelBrowser

__all__ = ["ChatPanel", "DownloadBar", "ImagePanel", "ModelBrowser", "SpeechPanel", "TranscriptionPanel"]

#: each panel's module (as imported above for type checkers)
_MODULES = {
    "ChatPanel": "chat_panel",
    "DownloadBar": "download_bar",
    "ImagePanel": "image_panel",
    "ModelBrowser": "model_browser",
    "SpeechPanel": "audio_panels",
    "TranscriptionPanel": "audio_panels",
}


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        return getattr(importlib.import_module(f"lemonkit.widgets.{_MODULES[name]}"), name)
    raise AttributeError(f"module 'lemonkit.widgets' has no attribute {name!r}")
