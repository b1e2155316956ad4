"""The Python API's requests, shared by :class:`~lemonkit.client.Client` and :class:`~lemonkit.client.AsyncClient`.

Building a request and reading its answer are plain functions here; the two clients only send (one synchronously,
one awaiting), so the sync and async methods stay a few lines each.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence
from typing import Any

import numpy as np

from lemonkit.catalog import config
from lemonkit.client.results import ChatResult, RankedDocument, Ranking
from lemonkit.errors import StructuredOutputError
from lemonkit.formats.health import loaded_model

__all__ = [
    "Embeddings",
    "StructuredOutputError",
    "chat_body",
    "completion_body",
    "embeddings",
    "parse_structured",
    "ranking",
    "schema_format",
]

Messages = str | Sequence[dict[str, Any]]


class Embeddings(np.ndarray):
    """An ``n x dim`` float32 array of vectors that also carries ``provenance`` (a dict, see ``ChatResult``)."""

    provenance: dict[str, Any]

    def __array_finalize__(self, obj: Any) -> None:
        self.provenance = getattr(obj, "provenance", {})


def default_model(health: dict[str, Any], kind: str) -> str:
    """``model=None``: the loaded model of ``kind``, else the embedded default (``default_chat_model()`` /
    ``default_embedding_model()``)."""
    return loaded_model(health, kind) or (
        config.default_embedding_model() if kind == "embedding" else config.default_chat_model()
    )


def _seeded(body: dict[str, Any]) -> dict[str, Any]:
    """A seed when the caller named none, so that the request is reproducible (recorded in the provenance)."""
    if body.get("seed") is None:
        body["seed"] = secrets.randbelow(2**31)
    if body["stream"]:
        body["stream_options"] = {"include_usage": True}
    return body


def chat_body(
    prompt_or_messages: Messages,
    model: str,
    *,
    stream: bool,
    system: str | None,
    tools: list[dict[str, Any]] | None,
    response_format: dict[str, Any] | None,
    sampling: dict[str, Any],
) -> dict[str, Any]:
    """The ``chat/completions`` body of :meth:`Client.chat`."""
    if isinstance(prompt_or_messages, str):
        messages = [{"role": "user", "content": prompt_or_messages}]
    else:
        messages = [dict(m) for m in prompt_or_messages]
    if system is not None:
        messages = [{"role": "system", "content": system}, *(m for m in messages if m.get("role") != "system")]
    body: dict[str, Any] = {"model": model, "messages": messages, "stream": stream, **sampling}
    if tools:
        body["tools"] = tools
    if response_format is not None:
        body["response_format"] = response_format
    return _seeded(body)


def completion_body(prompt: str, model: str, *, stream: bool, sampling: dict[str, Any]) -> dict[str, Any]:
    """The ``completions`` body of :meth:`Client.complete`."""
    return _seeded({"model": model, "prompt": prompt, "stream": stream, **sampling})


def embeddings(body: dict[str, Any], provenance: dict[str, Any]) -> Embeddings:
    """The vectors of an ``embeddings`` answer, in input order."""
    rows = sorted(body["data"], key=lambda d: d["index"])
    array = np.asarray([row["embedding"] for row in rows], dtype=np.float32).view(Embeddings)
    array.provenance = provenance
    return array


def ranking(body: dict[str, Any], documents: Sequence[str], model: str) -> Ranking:
    """A ``rerank`` answer as a :class:`Ranking`."""
    items = [RankedDocument(r["index"], float(r["relevance_score"]), documents[r["index"]]) for r in body["results"]]
    return Ranking(items, model=model, method="rerank")


def cosine_ranking(vectors: Embeddings, documents: Sequence[str], model: str) -> Ranking:
    """Rank ``documents`` by the cosine of their vectors (rows 1..n) with the query's (row 0)."""
    norms = np.linalg.norm(vectors, axis=1)
    norms[norms == 0] = 1.0
    unit = vectors / norms[:, None]
    scores = unit[1:] @ unit[0]
    items = [RankedDocument(i, float(s), documents[i]) for i, s in enumerate(scores)]
    return Ranking(items, model=model, method="embedding-cosine")


def reranking_model(models: list[dict[str, Any]], health: dict[str, Any]) -> str | None:
    """The reranking model ``rerank(model=None)`` uses: the loaded one, else a downloaded one."""
    loaded = loaded_model(health, "reranking")
    if loaded:
        return loaded
    return next((m["id"] for m in models if "reranking" in (m.get("labels") or []) and m.get("downloaded")), None)


def schema_format(schema: Any) -> dict[str, Any]:
    """``response_format`` for a JSON schema dict or a pydantic model class."""
    if isinstance(schema, dict):
        json_schema, name = schema, str(schema.get("title") or "answer")
    elif hasattr(schema, "model_json_schema"):
        json_schema, name = schema.model_json_schema(), schema.__name__
    else:
        raise TypeError(f"structured() needs a JSON schema dict or a pydantic model class, not {schema!r}")
    return {"type": "json_schema", "json_schema": {"name": name, "schema": json_schema, "strict": True}}


def parse_structured(result: ChatResult, schema: Any) -> Any:
    """The answer parsed: a dict for a schema dict, an instance for a pydantic model class.

    Raises:
        StructuredOutputError: The answer was cut off or does not validate.
    """
    if result.finish_reason == "length":
        raise StructuredOutputError("The answer was cut off by max_tokens before the JSON was complete", result)
    try:
        if isinstance(schema, dict):
            return json.loads(result.text)
        return schema.model_validate_json(result.text)
    except ValueError as exc:  # json's and pydantic's errors are both ValueErrors
        raise StructuredOutputError(f"The answer does not match the schema: {exc}", result) from exc
