"""``GET /metrics``: the server's figures in Prometheus' text format, labelled per model.

Requests admitted, batch requests by outcome, answer cache lookups, loads and unloads (evictions by reason), tokens
in and out, time to first token and time per output token (histograms the engines keep,
:mod:`lemonkit.formats.generation_metrics`), queue depth and slots, host memory, and the bytes downloads took off
the network. Authenticated like every route unless the operator opens it
(``LEMONKIT_METRICS_OPEN=1``, standalone and hub: a Prometheus server on the same network reads it without a key).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from lemonkit.catalog.placement import MiB
from lemonkit.server.handler import LemonkitHandler
from lemonkit.server.service import Service

__all__ = ["MetricsHandler", "render"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _Figures:
    """A collector over figures gathered once per scrape."""

    def __init__(self, metrics: list[Metric]) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        yield from self.metrics


def _histogram(name: str, doc: str, per_model: dict[str, dict[str, Any]], key: str) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, doc, labels=["model"])
    for model, totals in sorted(per_model.items()):
        figures = totals.get(key)
        if not figures:
            continue
        running, buckets = 0, []
        for bound, count in zip([*figures["bounds"], float("inf")], figures["counts"], strict=True):
            running += count
            buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), running))
        family.add_metric([model], buckets, figures["sum"])
    return family


async def render(service: Service) -> bytes:
    """The scrape's text."""
    manager = service.manager
    totals = await manager.generation_totals()
    requests = CounterMetricFamily("lemonkit_requests", "Model requests admitted", labels=["model"])
    for model, count in sorted(manager.requests.items()):
        requests.add_metric([model], count)
    loads = CounterMetricFamily("lemonkit_model_loads", "Models loaded into a sidecar", labels=["model"])
    for model, count in sorted(manager.loads.items()):
        loads.add_metric([model], count)
    unloads = CounterMetricFamily(
        "lemonkit_model_unloads",
        "Models unloaded: reason memory, device or count (evicted for another), keep_alive, request, failed",
        labels=["model", "reason"],
    )
    for (model, reason), count in sorted(manager.unloads.items()):
        unloads.add_metric([model, reason], count)
    tokens = {
        kind: CounterMetricFamily(f"lemonkit_{kind}_tokens", doc, labels=["model"])
        for kind, doc in (
            ("prompt", "Prompt tokens of the generations"),
            ("cached", "Prompt tokens reused from a slot's cache rather than evaluated"),
            ("generated", "Tokens generated"),
        )
    }
    generations = CounterMetricFamily("lemonkit_generations", "Generations the engines ran", labels=["model"])
    for model, figures in sorted(totals.items()):
        generations.add_metric([model], figures.get("generations", 0))
        for kind, family in tokens.items():
            family.add_metric([model], figures.get(f"{kind}_tokens", 0))
    queue = GaugeMetricFamily("lemonkit_queue_depth", "Requests waiting for a turn at the model", labels=["model"])
    busy = GaugeMetricFamily("lemonkit_slots_busy", "Slots serving a request", labels=["model"])
    slots = GaugeMetricFamily("lemonkit_slots", "Slots (requests served at once)", labels=["model"])
    held = GaugeMetricFamily(
        "lemonkit_model_memory_bytes", "Host memory a loaded model is counted for", labels=["model"]
    )
    loaded = manager.loaded_models()
    for running in loaded:
        health = manager.fairness.health(running.name)
        queue.add_metric([running.name], health["queue_depth"])
        busy.add_metric([running.name], health["slots"]["busy"])
        slots.add_metric([running.name], health["slots"]["total"])
        held.add_metric([running.name], running.host_bytes)
    memory = manager.health()["memory"]
    host = GaugeMetricFamily("lemonkit_memory_bytes", "Host memory: limit, held by models, available", labels=["kind"])
    for kind in ("limit", "models", "available"):
        host.add_metric([kind], memory[f"{kind}_mb"] * MiB)
    downloaded = CounterMetricFamily(
        "lemonkit_download", "Bytes downloads took off the network", labels=["model"], unit="bytes"
    )
    for model, count in sorted(service.downloads.bytes_received().items()):
        downloaded.add_metric([model], count)
    batch_rows = CounterMetricFamily(
        "lemonkit_batch_rows",
        "Requests of batches finished: completed (computed), cached (the answer cache answered) or failed",
        labels=["model", "outcome"],
    )
    if service.batch_runner is not None:
        for (model, outcome), count in sorted(service.batch_runner.rows.items()):
            batch_rows.add_metric([model, outcome], count)
    cache = CounterMetricFamily(
        "lemonkit_answer_cache_lookups", "Requests that asked the answer cache, by result", labels=["result"]
    )
    for result, count in sorted(service.answers.lookups.items()):
        cache.add_metric([result], count)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(
        _Figures(
            [
                requests,
                generations,
                batch_rows,
                cache,
                *tokens.values(),
                _histogram(
                    "lemonkit_time_to_first_token_seconds",
                    "Seconds from a request to its first token",
                    totals,
                    "time_to_first_token",
                ),
                _histogram(
                    "lemonkit_time_per_output_token_seconds",
                    "Seconds per generated token",
                    totals,
                    "time_per_output_token",
                ),
                _histogram(
                    "lemonkit_prompt_tokens_per_second",
                    "Prompt tokens evaluated per second, per request (its cached prefix left out)",
                    totals,
                    "prompt_tokens_per_second",
                ),
                queue,
                busy,
                slots,
                GaugeMetricFamily("lemonkit_models_loaded", "Models loaded", value=len(loaded)),
                held,
                host,
                loads,
                unloads,
                downloaded,
            ]
        )
    )
    return generate_latest(registry)


class MetricsHandler(LemonkitHandler):
    """``GET /metrics``."""

    @property
    def auth_required(self) -> bool:  # type: ignore[override]
        return not self.service.settings.metrics_open

    async def get(self) -> None:
        text = await render(self.service)
        self.set_header("Content-Type", CONTENT_TYPE)
        self.set_header("Content-Length", str(len(text)))
        self.write(text)
        await self.flush()  # before finish(): Jupyter's would make the Content-Type JSON while headers are unsent
        self.finish()
