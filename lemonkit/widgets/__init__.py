"""Notebook widgets (anywidget): the model browser, a download bar, a chat panel, the transcription and speech
panels, and the pieces they share (:mod:`~lemonkit.widgets.base`, :mod:`~lemonkit.widgets.progress`,
:mod:`~lemonkit.widgets.picker` and ``static/shared.js``); matplotlib figures in :mod:`~lemonkit.widgets.plots`.

Every server call goes through :class:`lemonkit.Client` in the kernel: the page never holds a token.
"""

from __future__ import annotations

from lemonkit.widgets.audio import SpeechPanel, TranscriptionPanel
from lemonkit.widgets.chat import ChatPanel
from lemonkit.widgets.download import DownloadBar
from lemonkit.widgets.models import ModelBrowser

__all__ = ["ChatPanel", "DownloadBar", "ModelBrowser", "SpeechPanel", "TranscriptionPanel"]
