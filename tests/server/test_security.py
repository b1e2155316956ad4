"""No web page can drive a local server: credentials on every route of the table (both hosts), the standalone
host's Host allow-list (DNS rebinding) and Origin policy (cross-site requests, CORS), Jupyter's own checks, and
no key in any log line."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest
from tornado.httpclient import HTTPClientError, HTTPRequest
from tornado.websocket import websocket_connect

from tests.support.hosts import API_KEY, Host, Standalone
from tests.support.routes_table import METHODS, UNKNOWN, api_routes, ollama_routes, root_routes, ws_routes

ALLOWED_ORIGIN = "http://app.example:8080"
EVIL_ORIGIN = "http://evil.example"
UPGRADE = {
    "Connection": "Upgrade",
    "Upgrade": "websocket",
    "Sec-WebSocket-Version": "13",
    "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==",
}


def _assert_error(response: httpx.Response, status: int, code: str) -> None:
    assert response.status_code == status, (response.request.method, response.request.url, response.text)
    assert response.headers["content-type"].startswith("application/json")
    if response.request.method != "HEAD":
        body = response.json()
        error = body["error"]
        if body.get("type") == "error":  # Anthropic's shape, on /v1/messages
            assert error["type"] == _ANTHROPIC_TYPES[status] and error["message"], body
            assert "/messages" in response.request.url.path, body
            return
        assert error["code"] == code and error["message"] and error["type"], error


_ANTHROPIC_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error"}


# -- credentials on every route of the table ---------------------------------------------------------------------


@pytest.mark.parametrize("credentials", [{}, {"Authorization": "Bearer wrong"}], ids=["missing", "wrong"])
async def test_every_route_of_the_table_needs_credentials(host: Host, credentials: dict[str, str]) -> None:
    routes = [route.path for route in api_routes() + root_routes()] + list(UNKNOWN)
    assert len(routes) > 80
    async with httpx.AsyncClient(base_url=host.root, headers=credentials, timeout=30) as client:
        for path in routes:
            for method in METHODS:
                body = b"{}" if method in ("POST", "PUT", "PATCH") else None
                _assert_error(await client.request(method, path, content=body), 401, "invalid_api_key")
        for path in ws_routes():
            _assert_error(await client.get(path, headers=UPGRADE), 401, "invalid_api_key")
        # only /live is open
        assert (await client.get("live")).json() == {"status": "ok"}


@pytest.mark.parametrize("credentials", [{}, {"Authorization": "Bearer wrong"}], ids=["missing", "wrong"])
async def test_every_ollama_route_needs_credentials(host: Host, credentials: dict[str, str]) -> None:
    routes = ollama_routes()
    assert len(routes) >= 14
    async with httpx.AsyncClient(base_url=host.root, headers=credentials, timeout=30) as client:
        for route in routes:
            for method in METHODS:
                body = b"{}" if method in ("POST", "PUT", "PATCH") else None
                response = await client.request(method, route.path, content=body)
                assert response.status_code == 401, (method, route.path, response.text)
                if method != "HEAD":  # Ollama's shape
                    assert isinstance(response.json()["error"], str), (method, route.path, response.text)


async def test_the_key_in_the_query_opens_only_websockets(standalone: Standalone) -> None:
    async with httpx.AsyncClient(base_url=standalone.root) as client:
        _assert_error(await client.get("api/v1/models", params={"api_key": API_KEY}), 401, "invalid_api_key")


# -- the standalone host: Host and Origin ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def keyless() -> Iterator[Standalone]:
    """A standalone server with no key (the exposed configuration), allowed names and origins from the
    environment and the command line."""
    server = Standalone(
        {"LEMONKIT_ALLOWED_HOSTS": "proxy.example, .corp.example"}, args=("--allowed-origins", ALLOWED_ORIGIN)
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def any_host() -> Iterator[Standalone]:
    server = Standalone(args=("--allowed-hosts", "*"))
    yield server
    server.stop()


def _host(server: Standalone, name: str) -> dict[str, str]:
    return {"Host": f"{name}:{server.port}"}


@pytest.mark.parametrize(
    "headers",
    [
        {"Host": "evil.example"},
        {"Host": "evil.example:{port}"},
        {"Host": "localhost.evil.example:{port}"},
        {"Host": ":{port}"},  # an empty name: the bypass of Ollama's fix
        {"Host": ""},
        {"Host": "[not-an-ip]:{port}"},
    ],
    ids=["foreign", "foreign-port", "localhost-prefix", "empty-name", "empty", "bad-brackets"],
)
async def test_foreign_host_is_refused(keyless: Standalone, headers: dict[str, str]) -> None:
    headers = {k: v.format(port=keyless.port) for k, v in headers.items()}
    async with httpx.AsyncClient(base_url=keyless.root, headers=headers) as client:
        for method, path in [("GET", "api/v1/models"), ("GET", "live"), ("POST", "api/v1/unload")]:
            _assert_error(await client.request(method, path), 403, "forbidden_host")
        _assert_error(await client.get("logs/stream", headers=UPGRADE), 403, "forbidden_host")


def _raw_request(port: int, request: bytes) -> tuple[int, dict[str, object]]:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


async def test_a_request_without_host_is_refused(keyless: Standalone) -> None:
    assert keyless.port is not None
    for request in (b"GET /api/v1/models HTTP/1.0\r\n\r\n", b"GET /live HTTP/1.0\r\nConnection: close\r\n\r\n"):
        status, body = await asyncio.to_thread(_raw_request, keyless.port, request)
        assert status == 403 and body["error"]["code"] == "forbidden_host", body  # type: ignore[index]
    # a target in absolute form names no route: still the JSON answers, the Host check first
    absolute = b"GET http://evil.example/api/v1/models HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n"
    for host, expected in ((b"evil.example", (403, "forbidden_host")), (b"127.0.0.1", (404, "not_found"))):
        status, body = await asyncio.to_thread(_raw_request, keyless.port, absolute % host)
        assert (status, body["error"]["code"]) == expected, body  # type: ignore[index]


@pytest.mark.parametrize(
    "name",
    [
        "localhost",
        "LOCALHOST",
        "app.localhost",
        "localhost.",
        "127.0.0.1",
        "[::1]",
        "proxy.example",
        "corp.example",
        "a.corp.example",
    ],
)
async def test_own_and_allowed_names_are_served(keyless: Standalone, name: str) -> None:
    async with httpx.AsyncClient(base_url=keyless.root, headers=_host(keyless, name)) as client:
        response = await client.get("api/v1/health")
        assert response.status_code == 200 and response.json()["status"] == "ok"
        assert (await client.get("live")).status_code == 200


async def test_star_turns_the_host_check_off_with_a_warning(any_host: Standalone) -> None:
    async with httpx.AsyncClient(base_url=any_host.root, headers=_host(any_host, "evil.example")) as client:
        assert (await client.get("api/v1/health")).status_code == 200
    assert any("WARNING" in line and "allowed hosts include '*'" in line for line in any_host.log), any_host.log


@pytest.mark.parametrize(
    ("route", "body", "processed"),
    [
        # each body would be answered otherwise if it were processed: the 403 comes before any action
        (
            "pull",
            {"model_name": "user.cross-site", "checkpoint": "nobody/none-GGUF:x.gguf", "recipe": "llamacpp"},
            None,
        ),
        ("delete", {"model_name": "user.no-such-model"}, 404),
        ("uninstall", {"recipe": "llamacpp", "backend": "no-such-backend"}, 400),
        ("unload", {}, 200),
    ],
)
async def test_cross_site_text_plain_post_is_refused_before_any_action(
    keyless: Standalone, route: str, body: dict[str, str], processed: int | None
) -> None:
    content = json.dumps(body)
    async with httpx.AsyncClient(base_url=keyless.root + "api/v1/", timeout=60) as client:
        for origin in (EVIL_ORIGIN, "null", f"http://localhost:{keyless.port + 1}"):
            headers = {"Origin": origin, "Content-Type": "text/plain;charset=UTF-8"}
            response = await client.post(route, content=content, headers=headers)
            _assert_error(response, 403, "forbidden_origin")
            assert "access-control-allow-origin" not in response.headers
        models = (await client.get("models", params={"show_all": "true"})).json()["data"]
        assert "user.cross-site" not in {m["id"] for m in models}
        if processed is not None:  # the same request from a non-browser client is processed: the body is apt
            assert (await client.post(route, content=content)).status_code == processed


async def test_same_origin_pages_are_served(keyless: Standalone) -> None:
    root = urlsplit(keyless.root)
    async with httpx.AsyncClient(base_url=keyless.root) as client:
        for name in ("127.0.0.1", "localhost"):
            headers = {**_host(keyless, name), "Origin": f"{root.scheme}://{name}:{keyless.port}"}
            response = await client.post("api/v1/unload", headers=headers)
            assert response.status_code == 200, response.text
        # a page on another port of the same machine is another origin
        other = {**_host(keyless, "localhost"), "Origin": f"http://localhost:{keyless.port + 1}"}
        _assert_error(await client.get("api/v1/models", headers=other), 403, "forbidden_origin")


async def test_allowed_origin_gets_cors_answers(keyless: Standalone) -> None:
    async with httpx.AsyncClient(base_url=keyless.root + "api/v1/") as client:
        preflight = await client.options(
            "chat/completions",
            headers={
                "Origin": ALLOWED_ORIGIN,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization, content-type",
            },
        )
        assert preflight.status_code == 204, preflight.text
        assert preflight.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
        assert "POST" in preflight.headers["access-control-allow-methods"]
        allowed = {h.strip().lower() for h in preflight.headers["access-control-allow-headers"].split(",")}
        assert {"authorization", "content-type"} <= allowed
        assert "Origin" in preflight.headers["vary"]
        for response in (
            await client.get("models", headers={"Origin": ALLOWED_ORIGIN}),
            await client.get("models/no-such-model", headers={"Origin": ALLOWED_ORIGIN}),  # errors too
            await client.get(keyless.root + "live", headers={"Origin": ALLOWED_ORIGIN}),
        ):
            assert response.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
            assert "Origin" in response.headers["vary"]
            assert response.headers.get("access-control-allow-credentials") is None
        # a preflight from a foreign page is refused, and says nothing a browser would honour
        refused = await client.options(
            "chat/completions", headers={"Origin": EVIL_ORIGIN, "Access-Control-Request-Method": "POST"}
        )
        _assert_error(refused, 403, "forbidden_origin")
        assert "access-control-allow-origin" not in refused.headers
        live = await client.get(keyless.root + "live", headers={"Origin": EVIL_ORIGIN})
        _assert_error(live, 403, "forbidden_origin")
        assert "access-control-allow-origin" not in live.headers


async def test_clients_without_origin_get_no_cors_headers(keyless: Standalone) -> None:
    async with httpx.AsyncClient(base_url=keyless.root + "api/v1/") as client:
        response = await client.get("models")
    assert response.status_code == 200
    assert not any(name.startswith("access-control-") for name in response.headers)


async def test_cross_origin_websocket_is_refused(keyless: Standalone) -> None:
    url = keyless.root.replace("http://", "ws://", 1) + "logs/stream"
    for origin in (EVIL_ORIGIN, "null"):
        with pytest.raises(HTTPClientError) as refused:
            await websocket_connect(HTTPRequest(url, headers={"Origin": origin}))
        assert refused.value.code == 403 and refused.value.response is not None
        assert json.loads(refused.value.response.body)["error"]["code"] == "forbidden_origin"
    with pytest.raises(HTTPClientError) as rebinding:
        await websocket_connect(HTTPRequest(url, headers=_host(keyless, "evil.example")))
    assert rebinding.value.code == 403
    (await websocket_connect(HTTPRequest(url, headers={"Origin": ALLOWED_ORIGIN}))).close()


# -- Jupyter keeps its own checks ----------------------------------------------------------------------------------


async def test_jupyter_refuses_a_foreign_host(jupyter_host: Host) -> None:
    async with httpx.AsyncClient(headers={**jupyter_host.headers, "Host": "evil.example"}) as client:
        response = await client.get(jupyter_host.api + "/models")
    assert response.status_code == 403, response.text
    assert response.json()["error"]["code"] == "forbidden"


async def test_jupyter_refuses_a_cookie_post_without_xsrf(jupyter_host: Host) -> None:
    async with httpx.AsyncClient(base_url=jupyter_host.api + "/") as client:
        login = await client.get("health", params={"token": jupyter_host.token})
        assert login.status_code == 200 and client.cookies, "the token in the URL logs the browser in"
        assert (await client.get("health")).status_code == 200  # the cookie alone is a login
        for route in ("unload", "delete", "pull"):
            response = await client.post(route, content=b"{}", headers={"Content-Type": "text/plain"})
            assert response.status_code == 403, response.text
            assert response.json()["error"]["code"] == "forbidden"


# -- no key in any log line ----------------------------------------------------------------------------------------


@pytest.fixture
def logged() -> Iterator[Standalone]:
    """A keyed server that logs each request (access lines are at info, below the default level)."""
    server = Standalone({"LEMONADE_API_KEY": API_KEY}, args=("--log-level", "info"))
    yield server
    server.stop()


async def test_api_key_in_the_query_is_never_logged(logged: Standalone) -> None:
    standalone = logged
    wrong = "wrong-secret-7f3a9c"
    ws = standalone.root.replace("http://", "ws://", 1) + "logs/stream"
    stream = await websocket_connect(f"{ws}?api_key={API_KEY}")
    with pytest.raises(HTTPClientError):
        await websocket_connect(f"{ws}?x=1&api_key={wrong}")
    marker = f"marker-{id(stream)}"
    async with httpx.AsyncClient(base_url=standalone.root) as client:
        await client.get("api/v1/models", params={"api_key": wrong})
        await client.get("no/such/path", params={"api_key": API_KEY, "token": wrong})
        await client.get("live", params={"m": marker})
    while not any(marker in line for line in standalone.log):  # the server logs each request as it answers it
        assert standalone.process.poll() is None
        await asyncio.sleep(0.05)
    try:
        await stream.write_message(json.dumps({"type": "logs.subscribe"}))
        snapshot = json.loads(await asyncio.wait_for(stream.read_message(), 20))  # type: ignore[arg-type]
    finally:
        stream.close()
    lines = [entry["line"] for entry in snapshot["entries"]] + standalone.log
    assert any("api_key=[redacted]" in line for line in standalone.log), "the requests were logged"
    assert not [line for line in lines if API_KEY in line or wrong in line]
