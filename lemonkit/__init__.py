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

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

from lemonkit._version import __version__

if TYPE_CHECKING:  # what type checkers and editors see; at run time each name is imported on first use
    from lemonkit.api import (
        align,
        async_openai_client,
        cache_clear,
        cache_info,
        cancel_batch,
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
    from lemonkit.client import AsyncClient, Client
    from lemonkit.client.api_requests import Embeddings
    from lemonkit.client.audio_clips import AudioClip, Speech
    from lemonkit.client.conversation import Chat
    from lemonkit.client.image_results import Images
    from lemonkit.client.map_items import MapError, MapResult
    from lemonkit.client.map_items import map_items as map
    from lemonkit.client.replay import ReplayResult, replay
    from lemonkit.client.results import ChatResult, ModelList, RankedDocument, Ranking
    from lemonkit.client.transcripts import Segment, Transcript, Word
    from lemonkit.client.voice_chat_reply import VoiceChatReply
    from lemonkit.errors import (
        DownloadError,
        DownloadStopped,
        InvalidArgument,
        InvalidRequest,
        LemonkitError,
        ModelLoadError,
        ModelNotFound,
        NotFound,
        ServerUnavailable,
        StructuredOutputError,
        Unauthorized,
    )
    from lemonkit.widgets import (  # noqa: F401 - public, but not in __all__: a star import loads no widgets
        ChatPanel,
        DownloadBar,
        ImagePanel,
        ModelBrowser,
        SpeechPanel,
        TranscriptionPanel,
    )

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
    "cache_clear",
    "cache_info",
    "cancel_batch",
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

#: the modules of the public names that are not ``lemonkit.api``'s, and of the widgets (public, but not in
#: ``__all__``: a star import loads no widgets)
_ELSEWHERE: dict[str, tuple[str, ...]] = {
    "lemonkit.client": ("AsyncClient", "Client"),
    "lemonkit.client.api_requests": ("Embeddings",),
    "lemonkit.client.audio_clips": ("AudioClip", "Speech"),
    "lemonkit.client.conversation": ("Chat",),
    "lemonkit.client.image_results": ("Images",),
    "lemonkit.client.map_items": ("MapError", "MapResult", "map"),
    "lemonkit.client.replay": ("ReplayResult", "replay"),
    "lemonkit.client.results": ("ChatResult", "ModelList", "RankedDocument", "Ranking"),
    "lemonkit.client.transcripts": ("Segment", "Transcript", "Word"),
    "lemonkit.client.voice_chat_reply": ("VoiceChatReply",),
    "lemonkit.errors": (
        "DownloadError",
        "DownloadStopped",
        "InvalidArgument",
        "InvalidRequest",
        "LemonkitError",
        "ModelLoadError",
        "ModelNotFound",
        "NotFound",
        "ServerUnavailable",
        "StructuredOutputError",
        "Unauthorized",
    ),
    "lemonkit.widgets": ("ChatPanel", "DownloadBar", "ImagePanel", "ModelBrowser", "SpeechPanel", "TranscriptionPanel"),
}
#: public name -> (module, attribute), imported on first use: ``import lemonkit`` imports none of them, so a sidecar
#: or a server that imports a core module never loads the notebook client, httpx or numpy (huggingface_hub's lazy
#: root). A name of ``__all__`` not elsewhere is ``lemonkit.api``'s (whose ``__all__`` is read from here);
#: ``lemonkit.map`` is ``map_items`` in its module.
_LAZY: dict[str, tuple[str, str]] = {
    **{name: ("lemonkit.api", name) for name in __all__ if name != "__version__"},
    **{
        name: (module, "map_items" if name == "map" else name) for module, names in _ELSEWHERE.items() for name in names
    },
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module, attribute = _LAZY[name]
        value = getattr(importlib.import_module(module), attribute)
        globals()[name] = value  # the next lookup does not come here
        return value
    # a submodule reached as an attribute (``lemonkit.catalog.config``), as the eager root used to allow
    if not name.startswith("_") and importlib.util.find_spec(f"lemonkit.{name}") is not None:
        return importlib.import_module(f"lemonkit.{name}")
    raise AttributeError(f"module 'lemonkit' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


def _jupyter_server_extension_points() -> list[dict[str, Any]]:
    from lemonkit.server.extension import LemonkitExtension

    return [{"module": "lemonkit.server.extension", "app": LemonkitExtension}]


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext lemonkit``: the ``%%chat`` and ``%lemonkit`` magics (see :mod:`lemonkit.magics`)."""
    from lemonkit.magics import load_ipython_extension as load

    load(ipython)
