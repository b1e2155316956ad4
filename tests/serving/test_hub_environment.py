"""What a process under JupyterHub reads from its environment to look for the hub's lemonkit service, and where it
then tries the service (the service itself is tested against a real hub in tests/server/test_hub_discovery.py)."""

from __future__ import annotations

from lemonkit.serving.hub_discovery import HubEnvironment, _roots

HUB = {"JUPYTERHUB_API_URL": "http://127.0.0.1:8081/hub/api/", "JUPYTERHUB_API_TOKEN": "t0k"}


def test_outside_a_hub_there_is_nothing_to_ask() -> None:
    assert HubEnvironment.from_env({}) is None
    assert HubEnvironment.from_env({"JUPYTERHUB_API_URL": HUB["JUPYTERHUB_API_URL"]}) is None  # no token


def test_the_default_service_is_looked_for_but_not_required() -> None:
    hub = HubEnvironment.from_env(HUB)
    assert hub == HubEnvironment("http://127.0.0.1:8081/hub/api", "t0k", "lemonkit", required=False)
    assert hub.headers == {"Authorization": "token t0k"}


def test_naming_a_service_or_forwarding_requires_it() -> None:
    named = HubEnvironment.from_env({**HUB, "LEMONKIT_HUB_SERVICE": "llm"})
    assert named is not None and (named.service, named.required) == ("llm", True)
    for value, required in (("1", True), ("true", True), ("0", False), ("", False)):
        forwarding = HubEnvironment.from_env({**HUB, "LEMONKIT_FORWARD_TO_HUB": value})
        assert forwarding is not None and forwarding.required is required
    assert HubEnvironment.from_env(HUB, required=True).required  # type: ignore[union-attr]


def test_the_service_is_tried_where_it_listens_then_through_the_public_proxy() -> None:
    hub = HubEnvironment("http://hub:8081/hub/api", "t", public_hub_url="https://hub.example.org/jh/hub/")
    model = {"url": "http://10.0.0.5:10101", "prefix": "/jh/services/lemonkit/"}
    assert _roots(hub, model) == [
        "http://10.0.0.5:10101/jh/services/lemonkit",
        "https://hub.example.org/jh/services/lemonkit",
    ]
    # a service the hub does not run (no url): only the public proxy; no public URL either: nowhere
    assert _roots(hub, {"url": "", "prefix": "/jh/services/lemonkit/"}) == [
        "https://hub.example.org/jh/services/lemonkit"
    ]
    assert _roots(HubEnvironment("http://hub:8081/hub/api", "t"), {"url": "", "prefix": "/services/x/"}) == []
