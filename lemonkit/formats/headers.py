"""lemonkit's own HTTP headers, named once for the server, the sidecars and the Python client (HTTP header names
are case-insensitive: compare them with ``.lower()``)."""

from __future__ import annotations

__all__ = ["CACHE_HEADER", "HANDOFF_HEADER", "PROVENANCE_HEADER"]

#: what the server knows about the model behind an inference answer (``lemonkit.server.provenance``), which
#: ``lemonkit.replay()`` reads back
PROVENANCE_HEADER = "X-Lemonkit-Provenance"
#: the answer cache: a request's ``use``, an answer's ``hit`` or ``miss`` (``lemonkit.serving.answer_cache``)
CACHE_HEADER = "X-Lemonkit-Cache"
#: a sidecar's stream handed to the server's socket (``lemonkit.backends.handoff``)
HANDOFF_HEADER = "X-Lemonkit-Handoff"
