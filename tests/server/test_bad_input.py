"""Bad input never costs a 5xx or a hang: a corpus of malformed bodies against every POST route of the route table,
in both hosts. None of them is a valid request, so none loads, pulls or installs anything."""

from __future__ import annotations

import json

import httpx
import pytest

from lemonkit.formats.bodies import MAX_DEPTH
from tests.support.hosts import Host
from tests.support.routes_table import ollama_routes, post_routes
from tests.support.tiny_models import TINY

JSON = "application/json"
#: fields most routes read, each with a type no route accepts
WRONG_TYPES = {
    "model": 5,
    "model_name": ["x"],
    "messages": "hi",
    "input": {"a": 1},
    "prompt": 3,
    "query": [],
    "documents": "d",
    "checkpoint": 7,
    "recipe": 1.5,
    "backend": {},
    "action": [],
    "stream": "yes",
    "max_tokens": "many",
    "temperature": "hot",
    "ctx_size": "big",
}
HUGE = 10**200
NESTED_100 = json.loads("[" * 100 + "]" * 100)

CORPUS: list[tuple[str, bytes, str]] = [
    ("empty-json", b"", JSON),
    ("whitespace", b"  \n\t ", JSON),
    ("not-json", b"{not json", JSON),
    ("truncated", b'{"model": "x", "messages": [', JSON),
    ("trailing-garbage", b'{"model": 5} extra', JSON),
    ("single-quotes", b"{'model': 'x'}", JSON),
    ("array", b'[{"model": "x"}]', JSON),
    ("string", b'"model"', JSON),
    ("number", b"42", JSON),
    ("null", b"null", JSON),
    ("true", b"true", JSON),
    ("nan", b'{"model": 5, "temperature": NaN}', JSON),
    ("infinity", b'{"model": 5, "max_tokens": Infinity}', JSON),
    ("float-overflow", b'{"model": 5, "temperature": 1e999}', JSON),
    ("int-too-long", b'{"model": 5, "max_tokens": ' + b"9" * 5000 + b"}", JSON),
    ("huge-numbers", json.dumps({k: HUGE for k in WRONG_TYPES}).encode(), JSON),
    ("wrong-types", json.dumps(WRONG_TYPES).encode(), JSON),
    ("nulls-and-bools", json.dumps(dict.fromkeys(WRONG_TYPES, True)).encode(), JSON),
    ("deep-arrays", b"[" * 5000 + b"]" * 5000, JSON),
    ("deep-objects", b'{"a":' * 3000 + b"1" + b"}" * 3000, JSON),
    ("deep-in-a-field", b'{"model": 5, "messages": ' + b"[" * 4000 + b"]" * 4000 + b"}", JSON),
    ("just-too-deep", b'{"model": 5, "x": ' + b"[" * MAX_DEPTH + b"]" * MAX_DEPTH + b"}", JSON),
    ("nested-not-too-deep", json.dumps(dict.fromkeys(WRONG_TYPES, NESTED_100)).encode(), JSON),
    ("unclosed-deep", b"[" * 100_000, JSON),
    ("raw-nul", b'{"model": "a\x00b", "model_name": "a\x00b"}', JSON),
    ("escaped-nul", json.dumps({**WRONG_TYPES, "model": "a\u0000b"}).encode(), JSON),
    ("invalid-utf8", b'{"model": "\xff\xfe\xfd"}', JSON),
    ("lone-surrogate", b'{"model": "\\ud800", "model_name": "\\ud800"}', JSON),
    ("utf16-bom", '{"model_name": "x"}'.encode("utf-16"), JSON),
    ("oversized-string", json.dumps({**WRONG_TYPES, "model": "x" * 2_000_000}).encode(), JSON),
    ("many-keys", json.dumps({f"k{i}": i for i in range(50_000)} | WRONG_TYPES).encode(), JSON),
    ("form-urlencoded", b"model=x&messages=hi", "application/x-www-form-urlencoded"),
    (
        "multipart",
        b'--b\r\nContent-Disposition: form-data; name="model"\r\n\r\nx\r\n--b--\r\n',
        "multipart/form-data; boundary=b",
    ),
    ("text-plain", b"model: x", "text/plain"),
    ("xml", b"<model>x</model>", "application/xml"),
    ("binary", bytes(range(256)) * 64, "application/octet-stream"),
]

#: the routes where an empty body (or ``{}``) is a valid request
EMPTY_IS_VALID = {"UnloadHandler", "UnloadAllModelsHandler"}
EMPTY = {"empty-json", "whitespace"}


def _cases() -> list[tuple[str, str, bytes, str]]:
    return [
        (route.path, name, body, content_type)
        for route in post_routes()
        for name, body, content_type in CORPUS
        if not (name in EMPTY and route.handler.__name__ in EMPTY_IS_VALID)
    ]


def test_the_corpus_covers_every_post_route() -> None:
    covered = {path for path, *_ in _cases()}
    assert len(covered) == len(post_routes()) >= 13
    assert {"api/v1/install", "api/v1/pull", "api/v1/chat/completions"} <= covered


async def test_malformed_bodies_are_client_errors(host: Host) -> None:
    failures = []
    # a hang fails the request (the client's timeout), not a timed assertion
    async with httpx.AsyncClient(base_url=host.root, headers=host.headers, timeout=30) as client:
        for path, name, body, content_type in _cases():
            response = await client.post(path, content=body, headers={"Content-Type": content_type})
            problem = _problem(response)
            if problem:
                failures.append(f"{path} {name}: {problem}")
    assert not failures, "\n".join(failures)


def _problem(response: httpx.Response) -> str | None:
    if not 400 <= response.status_code < 500:
        return f"{response.status_code} {response.text[:200]}"
    if not response.headers.get("content-type", "").startswith("application/json"):
        return f"{response.status_code} not JSON: {response.text[:200]}"
    body = response.json()
    error = body.get("error")
    if body.get("type") == "error" and "/messages" in response.request.url.path:  # Anthropic's shape
        return None if isinstance(error, dict) and error.get("message") and error.get("type") else "bad shape"
    if not (isinstance(error, dict) and error.get("message") and error.get("type") and "code" in error):
        return f"{response.status_code} not the OpenAI error shape: {response.text[:200]}"
    return None


async def test_malformed_bodies_on_ollamas_routes_are_client_errors(host: Host) -> None:
    failures = []
    async with httpx.AsyncClient(base_url=host.root, headers=host.headers, timeout=30) as client:
        for route in ollama_routes():
            method = "DELETE" if hasattr(route.handler, "delete") and not hasattr(route.handler, "post") else "POST"
            if not hasattr(route.handler, method.lower()):
                continue
            for name, body, content_type in CORPUS:
                response = await client.request(
                    method, route.path, content=body, headers={"Content-Type": content_type}
                )
                if name in EMPTY and route.path in ("api/version", "api/tags", "api/ps"):
                    continue
                expected = 501 if route.handler.__name__ in UNSUPPORTED else None
                bad = not (400 <= response.status_code < 500 or response.status_code == expected)
                shape = response.headers.get("content-type", "").startswith("application/json") and isinstance(
                    response.json().get("error"), str
                )
                if bad or not shape:
                    failures.append(f"{method} {route.path} {name}: {response.status_code} {response.text[:200]}")
    assert not failures, "\n".join(failures)


#: Ollama routes lemonkit has no equivalent of: any body gets their 501
UNSUPPORTED = {"CreateHandler", "CopyHandler", "PushHandler", "BlobsHandler"}


@pytest.mark.parametrize("body", [b"[" * 5000 + b"]" * 5000, b'{"a":' * 3000 + b"1" + b"}" * 3000])
async def test_deep_nesting_is_invalid_json(host: Host, body: bytes) -> None:
    async with host.client() as client:
        for route in post_routes():
            if getattr(route.handler, "raw_body", False):
                continue  # its body is audio, not JSON: the malformed-body corpus above covers it
            response = await client.post(host.root + route.path, content=body, headers={"Content-Type": JSON})
            assert response.status_code == 400, (route.path, response.text)
            # a multipart-only route (images/edits) refuses any JSON body, parsable or not
            expected = "invalid_content_type" if getattr(route.handler, "multipart_only", False) else "invalid_json"
            if response.json().get("type") == "error":  # Anthropic's shape has no code
                assert response.json()["error"]["type"] == "invalid_request_error", response.text
                continue
            assert response.json()["error"]["code"] == expected


async def test_huge_max_tokens_is_clamped_to_the_context(host: Host) -> None:
    async with host.client() as client:
        loaded = await client.post("load", json={"model_name": TINY, "ctx_size": 256})
        assert loaded.status_code == 200, loaded.text
        context = (await client.get(f"models/{TINY}")).json()["context_length"]
        body = {"model": TINY, "prompt": "hi", "max_tokens": 10**12, "temperature": 0}
        response = await client.post("completions", json=body)
    assert response.status_code == 200, response.text
    result = response.json()
    assert result["choices"][0]["finish_reason"] == "length"
    assert 0 < result["usage"]["completion_tokens"] and result["usage"]["total_tokens"] <= context == 256
