"""Where a result came from, and rerunning it: ``result.provenance`` and :func:`replay`.

A result's provenance joins what the server reports in its ``X-Lemonkit-Provenance`` header (model, checkpoint,
revision, file sha256, recipe options, engine, server version; see :mod:`lemonkit.server.provenance`) with the
request's side: the sampling parameters and the seed (set by the API when the caller named none, so that every
request can be replayed), the lemonkit version of the caller, the server's URL, the start time and the wall time,
and the request itself.
"""

from __future__ import annotations

import difflib
import json
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from lemonkit.formats.headers import PROVENANCE_HEADER

if TYPE_CHECKING:
    from lemonkit.client import Client
    from lemonkit.client.results import ChatResult

__all__ = ["Clock", "ReplayResult", "build", "replay"]

#: request fields that are not sampling parameters
_NOT_SAMPLING = {"model", "messages", "prompt", "input", "query", "documents", "stream", "stream_options", "tools"}
#: the server facts that, when they differ, explain a replay that does not match
_MODEL_FACTS = ("model", "checkpoint", "revision", "file_sha256", "recipe_options", "engine", "server_version")


class Clock:
    """When a request started (UTC, ISO 8601) and how long it has taken."""

    def __init__(self) -> None:
        self.started_at = datetime.now(UTC).isoformat(timespec="milliseconds")
        self._start = time.perf_counter()

    def elapsed(self) -> float:
        return round(time.perf_counter() - self._start, 4)


def build(route: str, body: dict[str, Any], headers: dict[str, str], clock: Clock, server_api: str) -> dict[str, Any]:
    """A result's provenance: the server's facts (from ``headers``) and the request's."""
    from lemonkit._version import __version__

    server = _server_facts(headers)
    return {
        **server,
        "model": server.get("model") or body.get("model"),
        "sampling": {k: v for k, v in body.items() if k not in _NOT_SAMPLING},
        "seed": body.get("seed"),
        "lemonkit_version": __version__,
        "server": server_api,
        "started_at": clock.started_at,
        "wall_time_s": clock.elapsed(),
        "route": route,
        "request": body,
    }


def _server_facts(headers: dict[str, str]) -> dict[str, Any]:
    value = next((v for k, v in headers.items() if k.lower() == PROVENANCE_HEADER.lower()), None)
    try:
        facts = json.loads(value) if value else {}
    except ValueError:
        return {}
    return facts if isinstance(facts, dict) else {}


@dataclass
class ReplayResult:
    """What :func:`replay` found.

    Attributes:
        matched: The new answer's text (and reasoning) equals the original's.
        result: The new answer.
        diff: Empty when matched; else a unified diff of the two texts (original first).
        changed: The model facts that differ between the runs (``{"revision": (old, new)}``): a reason for a
            mismatch.
    """

    matched: bool
    result: ChatResult
    diff: str = ""
    changed: dict[str, tuple[Any, Any]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return self.matched


def replay(result: ChatResult, *, client: Client | None = None) -> ReplayResult:
    """Run ``result``'s request again (same model, messages, sampling and seed) and compare the answers.

    Args:
        result: A result of :func:`lemonkit.chat`, :func:`lemonkit.complete` or :meth:`lemonkit.Chat.send`.
        client: The client to use (default: :func:`lemonkit.default_client`).

    Returns:
        A :class:`ReplayResult`; it is truthy when the answers match.

    Raises:
        ValueError: ``result`` carries no request to replay.
        LemonkitError: The server's error.

    Example:
        >>> r = lemonkit.chat("Name a colour.", max_tokens=8)
        >>> lemonkit.replay(r).matched
        True
    """
    from lemonkit.client import default_client

    request = result.provenance.get("request")
    route = result.provenance.get("route")
    if not isinstance(request, dict) or route not in ("chat/completions", "completions"):
        raise ValueError("Only chat and completion results can be replayed (this one's provenance has no such request)")
    body = {k: v for k, v in request.items() if k != "stream_options"}
    body["stream"] = False
    # the whole prompt evaluated as the first time: without batch-invariant kernels a cached prefix rounds otherwise
    body.setdefault("cache_prompt", False)
    again = (client or default_client()).run(route, body)
    before, after = result.provenance, again.provenance
    changed = {k: (before.get(k), after.get(k)) for k in _MODEL_FACTS if before.get(k) != after.get(k)}
    matched = (again.text, again.reasoning) == (result.text, result.reasoning)
    diff = "" if matched else _diff(result.reasoning + result.text, again.reasoning + again.text)
    return ReplayResult(matched, again, diff, changed)


def _diff(old: str, new: str) -> str:
    lines = difflib.unified_diff(
        old.splitlines(), new.splitlines(), fromfile="original", tofile="replay", lineterm="", n=1
    )
    return "\n".join(lines)
