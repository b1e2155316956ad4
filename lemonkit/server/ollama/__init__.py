"""Ollama's REST API (``/api/chat``, ``/api/generate``, ``/api/tags``, ...), for the clients that speak it: the
``ollama`` Python library, Open WebUI's Ollama connection, editor plug-ins and agent frameworks.

Each route translates to what the OpenAI and Lemonade routes already run: the same model manager and sidecars
(a chat is an OpenAI chat request to the model's sidecar, its SSE events turned into Ollama's NDJSON lines), the
same download jobs and the same authentication. Errors are Ollama's ``{"error": "..."}`` with the status of
lemonkit's error; one that comes after a stream started is its last line.

- :mod:`.translate`: requests and streams, Ollama <-> OpenAI;
- :mod:`.describe`: what the listing routes say of a model;
- :mod:`.handlers`: the routes that run a model; :mod:`.models`: the routes about models.
"""

from lemonkit.server.handler import LemonkitHandler
from lemonkit.server.ollama.handlers import ChatHandler, EmbeddingsHandler, EmbedHandler, GenerateHandler
from lemonkit.server.ollama.model_routes import (
    BlobsHandler,
    CopyHandler,
    CreateHandler,
    DeleteHandler,
    PsHandler,
    PullHandler,
    PushHandler,
    ShowHandler,
    TagsHandler,
    VersionHandler,
)
from lemonkit.server.ollama.translate import OLLAMA_API_VERSION, chat_request, generate_request, parse_keep_alive

#: the routes, under the host's root next to ``api/v1/`` (``{base_url}lemonkit/api/...`` in Jupyter)
OLLAMA_ROUTES: list[tuple[str, type[LemonkitHandler]]] = [
    ("version", VersionHandler),
    ("tags", TagsHandler),
    ("show", ShowHandler),
    ("ps", PsHandler),
    ("chat", ChatHandler),
    ("generate", GenerateHandler),
    ("embed", EmbedHandler),
    ("embeddings", EmbeddingsHandler),
    ("pull", PullHandler),
    ("delete", DeleteHandler),
    ("create", CreateHandler),
    ("copy", CopyHandler),
    ("push", PushHandler),
    ("blobs/(?P<digest>[^/]+)", BlobsHandler),
]


__all__ = ["OLLAMA_API_VERSION", "OLLAMA_ROUTES", "chat_request", "generate_request", "parse_keep_alive"]
