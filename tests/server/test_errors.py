"""Every error-table row we implement answers the spec's status and code, in both hosts."""

from __future__ import annotations

import pytest

from tests.support.hosts import Host
from tests.support.tiny_models import EMBED, RERANK, TINY

MSG = [{"role": "user", "content": "hi"}]

CASES = [
    # (route, body, status, code)
    ("chat/completions", b"{not json", 400, "invalid_json"),
    ("chat/completions", b"[1, 2]", 400, "invalid_json"),
    ("chat/completions", {"model": TINY}, 400, "missing_argument"),
    ("chat/completions", {"messages": MSG}, 400, "missing_argument"),
    ("chat/completions", {"model": TINY, "messages": "hi"}, 400, "invalid_argument"),
    (
        "chat/completions",
        {"model": TINY, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": 5}}]}]},
        400,
        "invalid_argument",
    ),
    ("chat/completions", {"model": TINY, "messages": MSG, "temperature": "hot"}, 400, "invalid_argument"),
    ("chat/completions", {"model": TINY, "messages": MSG, "stop": [1]}, 400, "invalid_argument"),
    ("chat/completions", {"model": TINY, "messages": MSG, "tool_choice": "sometimes"}, 400, "invalid_argument"),
    ("chat/completions", {"model": "no-such-model", "messages": MSG}, 404, "model_not_found"),
    ("chat/completions", {"model": EMBED, "messages": MSG}, 400, "model_not_applicable"),
    ("completions", {"model": TINY}, 400, "missing_argument"),
    ("completions", {"model": TINY, "prompt": 3}, 400, "invalid_argument"),
    ("responses", {"model": TINY}, 400, "missing_argument"),
    ("responses", {"model": EMBED, "input": "hi"}, 400, "model_not_applicable"),
    ("embeddings", {"model": EMBED, "input": "x", "encoding_format": "int8"}, 400, "invalid_argument"),
    ("embeddings", {"model": TINY, "input": "x"}, 501, None),
    ("rerank", {"model": RERANK, "query": "q"}, 400, "missing_argument"),
    ("rerank", {"model": TINY, "query": "q", "documents": ["a"]}, 400, "model_not_applicable"),
    ("load", {}, 400, "missing_argument"),
    ("load", {"model_name": "no-such-model"}, 404, "model_not_found"),
    ("load", {"model_name": TINY, "llamacpp_args": "-m other.gguf"}, 400, "invalid_argument"),
    ("load", {"model_name": TINY, "llamacpp_args": "--ctx-size=99"}, 400, "invalid_argument"),
    ("load", {"model_name": TINY, "llamacpp_backend": "rocm"}, 400, "invalid_argument"),
    ("load", {"model_name": TINY, "ctx_size": "big"}, 400, "invalid_argument"),
    ("load", {"model_name": "user.not-gguf"}, 400, "model_load_refused"),
    ("load", {"model_name": "user.broken-gguf"}, 500, "model_load_error"),
    ("unload", {"model_name": 3}, 400, "invalid_argument"),
    # a request may not point the server at its own files
    ("pull", {"model_name": "user.sneaky", "checkpoint": "/etc/passwd", "recipe": "llamacpp"}, 400, "invalid_argument"),
    (
        "pull",
        {
            "model_name": "user.sneaky",
            "checkpoint": "org/repo:q4.gguf",
            "mmproj": "~/.ssh/id_rsa",
            "recipe": "llamacpp",
            "vision": True,
        },
        400,
        "invalid_argument",
    ),
]


@pytest.mark.parametrize(
    ("route", "body", "status", "code"), CASES, ids=[f"{c[0]}-{c[3]}-{i}" for i, c in enumerate(CASES)]
)
async def test_error_rows(host: Host, route: str, body: object, status: int, code: str | None) -> None:
    async with host.client() as client:
        if isinstance(body, bytes):
            response = await client.post(route, content=body, headers={"Content-Type": "application/json"})
        else:
            response = await client.post(route, json=body)
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert error["message"] and "type" in error and "code" in error
    if code is not None:
        assert error["code"] == code
