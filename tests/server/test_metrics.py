"""``GET /metrics`` in Prometheus' text format, read with prometheus_client's own parser, on both hosts."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.hosts import API_KEY, Host, Standalone
from tests.support.tiny_models import EMBED, TINY

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}


async def _scrape(client: httpx.AsyncClient, root: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    response = await client.get(root + "metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def _of(figures: dict, name: str, **labels: str) -> float:
    return figures.get((name, tuple(sorted(labels.items()))), 0.0)


async def test_requests_tokens_latency_and_slots(host: Host) -> None:
    async with host.client() as client:
        await client.post("unload", json={})  # so that this test's requests load the models
        before = await _scrape(client, host.root)
        answers = [(await client.post("chat/completions", json={"model": TINY, **CHAT})).json() for _ in range(2)]
        async with client.stream("POST", "chat/completions", json={"model": TINY, **CHAT, "stream": True}) as stream:
            assert [line async for line in stream.aiter_lines() if line.startswith("data: [DONE]")]
        embedded = await client.post("embeddings", json={"model": EMBED, "input": ["a", "b"]})
        assert embedded.status_code == 200
        during = await _scrape(client, host.root)
        assert (await client.post("unload", json={"model_name": TINY})).status_code == 200
        after = await _scrape(client, host.root)
    generated = sum(a["usage"]["completion_tokens"] for a in answers)
    prompt = sum(a["usage"]["prompt_tokens"] for a in answers)

    def grew(name: str, figures: dict = during, **labels: str) -> float:
        return _of(figures, name, **labels) - _of(before, name, **labels)

    assert grew("lemonkit_requests_total", model=TINY) == 3 and grew("lemonkit_requests_total", model=EMBED) == 1
    assert grew("lemonkit_generations_total", model=TINY) == 3
    assert grew("lemonkit_generated_tokens_total", model=TINY) >= generated + 1  # the stream's too
    assert grew("lemonkit_prompt_tokens_total", model=TINY) == prompt * 3 / 2  # three times the same prompt
    assert grew("lemonkit_time_to_first_token_seconds_count", model=TINY) == 3
    assert grew("lemonkit_time_per_output_token_seconds_count", model=TINY) == grew(
        "lemonkit_generated_tokens_total", model=TINY
    )
    assert grew("lemonkit_time_to_first_token_seconds_sum", model=TINY) > 0
    # a prompt rate per request that evaluated prompt tokens (a repeated prompt may come whole from the slot's cache)
    rates = grew("lemonkit_prompt_tokens_per_second_count", model=TINY)
    assert 1 <= rates <= 3 and grew("lemonkit_prompt_tokens_per_second_bucket", model=TINY, le="+Inf") == rates
    assert grew("lemonkit_prompt_tokens_per_second_sum", model=TINY) / rates > 1  # tokens a second, not seconds
    assert _of(during, "lemonkit_queue_depth", model=TINY) == 0 and _of(during, "lemonkit_slots", model=TINY) >= 1
    assert _of(during, "lemonkit_slots_busy", model=TINY) == 0 and _of(during, "lemonkit_models_loaded") >= 2
    assert _of(during, "lemonkit_model_memory_bytes", model=TINY) > 0
    assert (
        _of(during, "lemonkit_memory_bytes", kind="limit") > _of(during, "lemonkit_memory_bytes", kind="available") > 0
    )
    assert grew("lemonkit_model_loads_total", model=TINY) >= 1
    # an unloaded model's figures stay: its sidecar's totals were taken before it went
    for name in ("lemonkit_generated_tokens_total", "lemonkit_time_to_first_token_seconds_count"):
        assert _of(after, name, model=TINY) == _of(during, name, model=TINY)
    assert grew("lemonkit_model_unloads_total", after, model=TINY, reason="request") == 1
    assert ("lemonkit_queue_depth", (("model", TINY),)) not in after


@pytest.fixture(scope="module")
def open_metrics() -> Iterator[Standalone]:
    server = Standalone({"LEMONADE_API_KEY": API_KEY, "LEMONKIT_METRICS_OPEN": "1"})
    yield server
    server.stop()


async def test_metrics_need_credentials_unless_the_operator_opens_them(host: Host, open_metrics: Standalone) -> None:
    async with httpx.AsyncClient(timeout=60) as anonymous:
        assert (await anonymous.get(host.root + "metrics")).status_code == 401
        opened = await anonymous.get(open_metrics.root + "metrics")
        assert opened.status_code == 200 and "lemonkit_models_loaded" in opened.text
        assert (await anonymous.get(open_metrics.root + "api/v1/models")).status_code == 401  # only /metrics
