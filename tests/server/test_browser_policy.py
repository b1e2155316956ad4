"""The standalone host's Host and Origin rules, for binds the e2e tests do not make (beyond loopback)."""

from __future__ import annotations

import socket

import pytest
from tornado.httputil import HTTPHeaders, HTTPServerRequest

from lemonkit.errors import ForbiddenHost, ForbiddenOrigin, InvalidArgument, InvalidJSON
from lemonkit.formats.bodies import MAX_DEPTH, parse_json
from lemonkit.server.security import BrowserPolicy


def _request(host: str | None, origin: str | None = None) -> HTTPServerRequest:
    headers = HTTPHeaders()
    if host is not None:
        headers["Host"] = host
    if origin is not None:
        headers["Origin"] = origin
    return HTTPServerRequest(method="GET", uri="/api/v1/models", headers=headers)


def test_loopback_bind_accepts_local_names_and_ip_literals_only() -> None:
    policy = BrowserPolicy.create(["127.0.0.1", "127.0.0.1"], "", "")
    for host in ("localhost:13305", "a.b.localhost", "127.0.0.1:1", "[::1]:13305", "10.1.2.3", "[fe80::1]"):
        policy.check(_request(host))
    for host in (None, "", ":13305", "evil.example", socket.gethostname(), "localhost.evil.example", "[::1"):
        with pytest.raises(ForbiddenHost):
            policy.check(_request(host))
    assert policy.local_only and policy.warnings(None) == []


def test_a_bind_beyond_loopback_accepts_the_machine_name_and_warns_without_a_key() -> None:
    policy = BrowserPolicy.create(["0.0.0.0", "0.0.0.0"], "", "")
    policy.check(_request(f"{socket.gethostname()}:13305"))
    policy.check(_request("192.168.1.20:13305"))
    with pytest.raises(ForbiddenHost):
        policy.check(_request("evil.example:13305"))
    (warning,) = policy.warnings(None)
    assert "LEMONADE_API_KEY" in warning and "no API key" in warning
    assert policy.warnings("a-key") == []
    named = BrowserPolicy.create(["gpu-box.lan", "192.168.1.20"], "", "")
    named.check(_request("GPU-BOX.LAN:13305"))


def test_allowed_lists() -> None:
    policy = BrowserPolicy.create(["::1"], " Proxy.Example ,*.corp.example", "https://app.example, http://x.test:81")
    for host in ("proxy.example", "corp.example", "a.b.corp.example:8443"):
        policy.check(_request(host))
    with pytest.raises(ForbiddenHost):
        policy.check(_request("xcorp.example"))
    policy.check(_request("localhost", "https://app.example:443"))
    policy.check(_request("localhost", "http://x.test:81"))
    for origin in ("http://app.example", "http://x.test", "null", "https://app.example.evil", "file://"):
        with pytest.raises(ForbiddenOrigin):
            policy.check(_request("localhost", origin))
    with pytest.raises(ValueError, match="allowed origins"):
        BrowserPolicy.create(["127.0.0.1"], "", "app.example")


def test_stars_turn_checks_off_with_warnings() -> None:
    policy = BrowserPolicy.create(["127.0.0.1"], "*", "*")
    policy.check(_request(None, "http://anything.example"))
    assert policy.origin_allowed("http://anything.example") and not policy.origin_allowed("null")
    assert len(policy.warnings("key")) == 2


@pytest.mark.parametrize(
    "raw",
    [
        b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1),
        b"[" * 100_000,
        b'{"a": NaN}',
        b'{"a": -Infinity}',
        b'{"a": "\\udc00"}',
        b'{"\\ud800": 1}',
        b"\xef\xbb\xbf{}",
        '{"a": 1}'.encode("utf-16"),
        b'{"a": "\xff"}',
    ],
)
def test_parse_json_refuses(raw: bytes) -> None:
    with pytest.raises(InvalidJSON):
        parse_json(raw)


def test_parse_json_refuses_a_number_no_field_takes() -> None:
    with pytest.raises(InvalidArgument, match="1e400"):
        parse_json(b'{"a": [1e400]}')


def test_parse_json_accepts_up_to_the_depth_and_surrogate_pairs() -> None:
    deep = b"[" * MAX_DEPTH + b"]" * MAX_DEPTH
    assert parse_json(deep) == parse_json(deep.decode())
    assert parse_json(b'{"a": "\\ud83d\\ude00", "b": 1e300}') == {"a": "\U0001f600", "b": 1e300}
