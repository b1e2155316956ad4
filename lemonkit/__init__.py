"""lemonkit: local AI models served from inside Jupyter through the Lemonade / OpenAI API.

In a notebook or a script::

    import lemonkit
    lemonkit.chat("Explain entropy in two sentences")   # streams, returns a ChatResult
    lemonkit.models()                                    # a model browser in a notebook
    lemonkit.transcribe("talk.wav").plot()               # every word timed, over the waveform
    lemonkit.speak("Hello there.")                       # plays inline
    lemonkit.voice_chat("question.wav")                  # heard, answered, and the answer spoken (plays inline)
    lemonkit.upscale(picture)                            # a PIL image, 4x, as a grid with its settings

Every function uses one shared :class:`Client` (:func:`default_client`), which finds its server (the Jupyter
server of this kernel, ``LEMONKIT_URL``, a running ``lemonkit serve``) or starts an embedded one.
"""

from __future__ import annotations

from typing import Any

from lemonkit.api import (
    align,
    async_openai_client,
    chat,
    complete,
    default_client,
    edit_image,
    embed,
    generate_image,
    health,
    load,
    models,
    openai_client,
    openai_url,
    pull,
    rerank,
    speak,
    stats,
    structured,
    transcribe,
    unload,
    upscale,
    vary_image,
    voice_chat,
    voices,
)
from lemonkit.client import AsyncClient, Client, ServerUnavailable
from lemonkit.conversation import Chat
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
from lemonkit.images import Images
from lemonkit.inference import Embeddings, StructuredOutputError
from lemonkit.mapping import MapError, MapResult
from lemonkit.mapping import map_items as map
from lemonkit.provenance import ReplayResult, replay
from lemonkit.results import ChatResult, ModelList, RankedDocument, Ranking
from lemonkit.speech import AudioClip, Speech
from lemonkit.transcripts import Segment, Transcript, Word
from lemonkit.voice_chat_reply import VoiceChatReply

__version__ = "0.1.0"

__all__ = [
    "AsyncClient",
    "AudioClip",
    "Chat",
    "ChatResult",
    "Client",
    "DownloadError",
    "DownloadStopped",
    "Embeddings",
    "Images",
    "InvalidArgument",
    "InvalidRequest",
    "LemonkitError",
    "MapError",
    "MapResult",
    "ModelList",
    "ModelLoadError",
    "ModelNotFound",
    "NotFound",
    "RankedDocument",
    "Ranking",
    "ReplayResult",
    "Segment",
    "ServerUnavailable",
    "Speech",
    "StructuredOutputError",
    "Transcript",
    "Unauthorized",
    "VoiceChatReply",
    "Word",
    "__version__",
    "align",
    "async_openai_client",
    "chat",
    "complete",
    "default_client",
    "edit_image",
    "embed",
    "generate_image",
    "health",
    "load",
    "map",
    "models",
    "openai_client",
    "openai_url",
    "pull",
    "replay",
    "rerank",
    "speak",
    "stats",
    "structured",
    "transcribe",
    "unload",
    "upscale",
    "vary_image",
    "voice_chat",
    "voices",
]


# -- widgets: imported on first use (anywidget and ipywidgets cost an import a server or script never needs) ----
_WIDGETS = {"ChatPanel", "DownloadBar", "ImagePanel", "ModelBrowser", "SpeechPanel", "TranscriptionPanel"}


def __getattr__(name: str) -> Any:
    if name in _WIDGETS:
        from lemonkit import widgets

        return getattr(widgets, name)
    raise AttributeError(f"module 'lemonkit' has no attribute {name!r}")


def _jupyter_server_extension_points() -> list[dict[str, Any]]:
    from lemonkit.server.extension import LemonkitExtension

    return [{"module": "lemonkit.server.extension", "app": LemonkitExtension}]


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext lemonkit``: the ``%%chat`` and ``%lemonkit`` magics (see :mod:`lemonkit.magics`)."""
    from lemonkit.magics import load_ipython_extension as load

    load(ipython)
