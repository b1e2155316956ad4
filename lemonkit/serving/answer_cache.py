"""The answer cache: deterministic answers kept on disk by what determines them, so a request asked again is answered
at once with the first answer, bit for bit.

The key (:func:`key`) is the sha256 of the canonical JSON of the route, the model's weights (their sha256 and
revision), the recipe options the model runs with, and the request itself with what cannot change an answer left out
(``stream``, ``stream_options``, ``user``, ``cache``). Only a deterministic request is kept: greedy
(``temperature`` 0) or seeded sampling, or a route with no sampling (embeddings, rerank).

A streamed request is kept as its stream: the SSE events of a stream that ended with ``[DONE]`` and no error, pings
left out (:func:`kept_stream`), under a key of its own (with its ``stream_options``), and replayed as those events
(:func:`replayed_stream`). Rebuilding a whole answer from its deltas, or deltas from a whole answer, would give
something other than what the first client got.

Answers live in ``<cache>/answers/<user>/<key[:2]>/<key>.json`` (the user as a hash; a personal server has one),
written atomically. Each user's answers are bounded in bytes (``answer_cache_bytes``); the least recently used go
first. The index of what a user has is read from disk on first use, so a restarted server keeps its cache.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lemonkit.catalog.hf_cache import inside, safe_relpath
from lemonkit.formats import sse
from lemonkit.formats.files import atomic_write_bytes

__all__ = ["AnswerCache", "deterministic", "key"]

#: asks for the cache (``use``) where a client cannot add the ``cache`` field; answers say ``hit`` or ``miss``

#: request fields that do not change the answer
_IGNORED = ("stream", "stream_options", "user", "cache")


def deterministic(body: dict[str, Any], *, samples: bool = True) -> bool:
    """Whether ``body`` always gets the same answer from the same weights and options: greedy or seeded, or a
    route that does not sample (``samples=False``)."""
    if not samples:
        return True
    temperature = body.get("temperature")
    seed = body.get("seed")
    return temperature == 0 or (isinstance(seed, int) and not isinstance(seed, bool))


def key(route: str, model: dict[str, Any], body: dict[str, Any]) -> str:
    """The cache key of ``body`` sent to ``route`` of the model described by ``model`` (its provenance facts:
    ``file_sha256``, ``revision``, ``recipe_options``, ``engine``). A streamed request's key is not its whole
    answer's: the two are kept apart, each as the client got it."""
    request = {k: v for k, v in body.items() if k not in _IGNORED}
    if body.get("stream"):
        request["stream"] = body.get("stream_options") or True  # include_usage changes the events
    facts = {k: model.get(k) for k in ("model", "file_sha256", "revision", "recipe_options", "engine")}
    canonical = json.dumps({"route": route, "model": facts, "request": request}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def kept_stream(raw: bytes) -> bytes | None:
    """What the cache keeps of the SSE bytes a stream sent: its events without pings, when it ended with
    ``[DONE]`` and carried no error event (``None``: a stream cut short or failed is never kept)."""
    if not raw.endswith(sse.DONE):
        return None
    frames = [f for f in raw.split(b"\n\n") if f.strip() and not f.startswith(b":")]
    for f in frames:
        data = sse.frame_data(f)
        if isinstance(data, dict) and "error" in data:
            return None
    return b"".join(f + b"\n\n" for f in frames)


def replayed_stream(kept: bytes) -> bytes:
    """A kept stream as sent again: the same events, the usage it reports marked ``cached_answer``."""
    out = []
    for f in kept.split(b"\n\n"):
        if not f:
            continue
        data = sse.frame_data(f)
        marked = []
        if isinstance(data, dict):
            response = data.get("response")  # the Responses API's events carry the response
            usages = [data.get("usage"), response.get("usage") if isinstance(response, dict) else None]
            marked = [u for u in usages if isinstance(u, dict)]
        if marked:
            for usage in marked:
                usage["cached_answer"] = True
            head = b"".join(line + b"\n" for line in f.split(b"\n") if not line.startswith(b"data:"))
            f = head + b"data: " + json.dumps(data).encode()
        out.append(f + b"\n\n")
    return b"".join(out)


@dataclass
class _UserIndex:
    entries: OrderedDict[str, int] = field(default_factory=OrderedDict)  # key -> bytes, least recent first
    bytes: int = 0
    hits: int = 0
    misses: int = 0


class AnswerCache:
    """Deterministic answers on disk, per user, bounded (blocking methods: call them off the event loop).

    Args:
        cache_dir: The lemonkit cache; answers live in its ``answers/``.
        max_bytes: Bytes each user's answers may take (``0``: the cache is off).
    """

    def __init__(self, cache_dir: Path, max_bytes: int) -> None:
        self.root = cache_dir / "answers"
        self.max_bytes = max_bytes
        self._users: dict[str, _UserIndex] = {}
        self._lock = threading.Lock()
        #: lookups since the server started, all users together (``/metrics``)
        self.lookups: dict[str, int] = {"hit": 0, "miss": 0}

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def _folder(self, user: str) -> Path:
        return self.root / hashlib.sha256(user.encode()).hexdigest()[:32]

    def _path(self, user: str, cache_key: str) -> Path:
        folder = self._folder(user)
        return inside(self.root, safe_relpath(f"{folder.name}/{cache_key[:2]}/{cache_key}.json", what="cache key"))

    def _index(self, user: str) -> _UserIndex:
        index = self._users.get(user)
        if index is None:
            index = self._users[user] = _UserIndex()
            found = []
            for path in self._folder(user).glob("??/*.json"):
                with contextlib.suppress(OSError):
                    st = path.stat()
                    found.append((st.st_mtime_ns, path.stem, st.st_size))
            for _, name, size in sorted(found):
                index.entries[name] = size
                index.bytes += size
        return index

    def get(self, user: str, cache_key: str) -> bytes | None:
        """``user``'s answer kept under ``cache_key`` (the JSON bytes), or ``None``; a hit becomes the most recent."""
        path = self._path(user, cache_key)
        with self._lock:
            index = self._index(user)
            try:
                data = path.read_bytes()
            except FileNotFoundError:
                index.misses += 1
                self.lookups["miss"] += 1
                if cache_key in index.entries:  # removed by another server sharing the cache
                    index.bytes -= index.entries.pop(cache_key)
                return None
            index.hits += 1
            self.lookups["hit"] += 1
            if cache_key in index.entries:
                index.entries.move_to_end(cache_key)
            with contextlib.suppress(OSError):
                os.utime(path)  # the order a restarted server reads back
            return data

    def put(self, user: str, cache_key: str, answer: bytes) -> None:
        """Keep ``answer`` under ``cache_key``, then drop ``user``'s least recently used answers past the bound."""
        if not self.enabled or len(answer) > self.max_bytes:
            return
        path = self._path(user, cache_key)
        with self._lock:
            index = self._index(user)
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(path, answer)
            if cache_key in index.entries:
                index.bytes -= index.entries.pop(cache_key)
            index.entries[cache_key] = len(answer)
            index.bytes += len(answer)
            while index.bytes > self.max_bytes and index.entries:
                old, size = index.entries.popitem(last=False)
                index.bytes -= size
                with contextlib.suppress(FileNotFoundError):
                    self._path(user, old).unlink()

    def info(self, user: str) -> dict[str, Any]:
        """``user``'s cache: entries, bytes, bound, and hits and misses since the server started."""
        with self._lock:
            index = self._index(user)
            return {
                "object": "answer_cache",
                "entries": len(index.entries),
                "bytes": index.bytes,
                "max_bytes": self.max_bytes,
                "hits": index.hits,
                "misses": index.misses,
            }

    def clear(self, user: str) -> int:
        """Remove every answer of ``user``'s; returns how many there were."""
        with self._lock:
            index = self._index(user)
            count = len(index.entries)
            shutil.rmtree(self._folder(user), ignore_errors=True)
            self._users[user] = _UserIndex(hits=index.hits, misses=index.misses)
            return count
