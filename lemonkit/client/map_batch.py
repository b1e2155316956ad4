"""A template's ``lemonkit.map`` run on the server: the answer cache asked first, the rest as one durable batch,
followed with a progress bar (see :mod:`lemonkit.client.map_items`)."""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections.abc import Callable
from typing import Any

from lemonkit.client import Client, api_requests
from lemonkit.client import replay as provenance
from lemonkit.client.map_items import MapError, MapResult
from lemonkit.client.results import ChatAccumulator
from lemonkit.errors import LemonkitError, StructuredOutputError, error_from_body

__all__ = ["MapBatch"]

ENDPOINT = "/v1/chat/completions"
#: requests asked of the answer cache in one lookup
_LOOKUP_CHUNK = 2000
#: seconds between two looks at the batch
_POLL = 0.2
#: statuses of a batch that will still produce its output
_UNDER_WAY = ("validating", "in_progress", "finalizing")


class MapBatch:
    """One template's rows: their requests, what the cache and the batch answered, and the bar that shows it."""

    def __init__(
        self,
        client: Client,
        prompts: list[str],
        inputs: list[Any],
        *,
        model: str | None,
        schema: Any,
        system: str | None,
        progress: bool,
    ) -> None:
        self.client, self.prompts, self.inputs = client, prompts, inputs
        self.model, self.schema, self.system, self.progress = model, schema, system, progress
        self.results = MapResult(len(prompts))
        self.bodies: list[dict[str, Any]] = []
        self.clock = provenance.Clock()
        self._usage: dict[int, dict[str, Any]] = {}

    def run(self, seed_of: Callable[[str], int], sampling: dict[str, Any]) -> MapResult:
        from tqdm.auto import tqdm

        model = self.model or api_requests.default_model(self.client.health(), "llm")
        response_format = api_requests.schema_format(self.schema) if self.schema is not None else None
        self.bodies = [
            api_requests.chat_body(
                prompt,
                model,
                stream=False,
                system=self.system,
                tools=None,
                response_format=response_format,
                sampling={**sampling, "seed": seed_of(prompt)},
            )
            for prompt in self.prompts
        ]
        for body in self.bodies:
            body.pop("stream")
        fingerprint = hashlib.sha256(
            b"\n".join(json.dumps(b, sort_keys=True).encode() for b in self.bodies)
        ).hexdigest()[:32]
        started = time.perf_counter()
        batch = self._running_batch(fingerprint)
        hits = self._from_cache()
        stats = self.results.stats
        stats.update(rows=len(self.bodies), batch_id=None)
        missing = [i for i in range(len(self.bodies)) if i not in self.results._finished]
        with tqdm(
            total=len(self.bodies), initial=hits, disable=not self.progress, desc="lemonkit.map", unit="row"
        ) as bar:
            bar.set_postfix(cached=hits, refresh=False)
            if missing and batch is None:
                batch = self._submit(missing, fingerprint)
            if batch is not None:
                self.results.batch_id = stats["batch_id"] = batch["id"]
                try:
                    batch = self._follow(batch, bar, hits)
                except KeyboardInterrupt:
                    self.results.interrupted = True
                    print(
                        f"lemonkit.map: interrupted; the batch {batch['id']} goes on on the server. Run the same "
                        "lemonkit.map again to pick it up (rows it finished come from the answer cache), or stop "
                        f"it: lemonkit.cancel_batch({batch['id']!r})",
                        file=sys.stderr,
                    )
                    return self._finish_stats(started, None)
                self._collect(batch)
        return self._finish_stats(started, batch)

    # -- the answer cache --------------------------------------------------------------------------------------

    def _from_cache(self) -> int:
        hits = 0
        for start in range(0, len(self.bodies), _LOOKUP_CHUNK):
            chunk = self.bodies[start : start + _LOOKUP_CHUNK]
            answer = self.client.request("POST", "cache/lookup", json={"endpoint": ENDPOINT, "requests": chunk})
            for offset, cached in enumerate(answer["data"]):
                if cached is not None:
                    self._finish(start + offset, cached)
                    hits += 1
        return hits

    # -- the batch ---------------------------------------------------------------------------------------------

    def _running_batch(self, fingerprint: str) -> dict[str, Any] | None:
        """A batch of these rows still under way (the cell ran before, and was interrupted or its kernel restarted)."""
        after = None
        for _ in range(10):  # the newest 1,000 batches
            page = self.client.request("GET", "batches", params={"limit": 100, **({"after": after} if after else {})})
            for batch in page["data"]:
                if (batch.get("metadata") or {}).get("lemonkit_map") == fingerprint and batch["status"] in _UNDER_WAY:
                    return dict(batch)
            if not page["has_more"]:
                return None
            after = page["last_id"]
        return None

    def _submit(self, rows: list[int], fingerprint: str) -> dict[str, Any]:
        lines = b"".join(
            json.dumps({"custom_id": str(i), "method": "POST", "url": ENDPOINT, "body": self.bodies[i]}).encode()
            + b"\n"
            for i in rows
        )
        upload = self.client.request(
            "POST",
            "files",
            files={"file": ("lemonkit-map.jsonl", lines, "application/jsonl")},
            data={"purpose": "batch"},
        )
        metadata = {"lemonkit_map": fingerprint, "rows": str(len(rows))}
        body = {"input_file_id": upload["id"], "endpoint": ENDPOINT, "completion_window": "24h", "metadata": metadata}
        batch: dict[str, Any] = self.client.request("POST", "batches", json=body)
        return batch

    def _follow(self, batch: dict[str, Any], bar: Any, hits: int) -> dict[str, Any]:
        shown = hits
        while True:
            counts = batch["request_counts"]
            done = min(len(self.bodies), hits + counts["completed"] + counts["failed"])
            if done > shown:
                bar.update(done - shown)
                shown = done
            extra = batch.get("lemonkit") or {}
            usage = batch.get("usage") or {}
            bar.set_postfix(
                cached=hits + int(extra.get("cache_hits", 0)), tokens=int(usage.get("output_tokens", 0)), refresh=False
            )
            if batch["status"] not in _UNDER_WAY:
                return batch
            time.sleep(_POLL)
            batch = self.client.request("GET", f"batches/{batch['id']}")

    def _collect(self, batch: dict[str, Any]) -> None:
        if batch["status"] == "failed":
            errors = (batch.get("errors") or {}).get("data") or [{}]
            raise LemonkitError(
                f"The batch {batch['id']} failed: {errors[0].get('message')}", code=errors[0].get("code")
            )
        for file_id in (batch.get("output_file_id"), batch.get("error_file_id")):
            if file_id is None:
                continue
            content = self.client.request("GET", f"files/{file_id}/content", raw=True)
            for raw in content.splitlines():
                if not raw.strip():
                    continue
                line = json.loads(raw)
                index = int(line["custom_id"])
                if index in self.results._finished:
                    continue  # the cache answered it before this run followed the batch
                response = line.get("response")
                if response is not None and response["status_code"] == 200:
                    self._finish(index, response["body"])
                else:
                    error = response["body"] if response is not None else {"error": line.get("error")}
                    status = response["status_code"] if response is not None else None
                    self.results.finish(index, MapError(index, self.inputs[index], error_from_body(status, error), 1))
        for index in self.results.pending:  # a batch cancelled elsewhere, or expired
            failure = LemonkitError(f"The batch {batch['id']} ended ({batch['status']}) before this row ran")
            self.results.finish(index, MapError(index, self.inputs[index], failure, 1))

    # -- results -----------------------------------------------------------------------------------------------

    def _finish(self, index: int, answer: dict[str, Any]) -> None:
        self._usage[index] = answer.get("usage") or {}
        result = ChatAccumulator().whole(answer)
        body = {**self.bodies[index], "stream": False}
        result.provenance = provenance.build("chat/completions", body, {}, self.clock, self.client.server.api)
        value: Any = result
        if self.schema is not None:
            try:
                value = api_requests.parse_structured(result, self.schema)
            except StructuredOutputError as exc:
                value = MapError(index, self.inputs[index], exc, 1)
        self.results.finish(index, value)

    def _finish_stats(self, started: float, batch: dict[str, Any] | None) -> MapResult:
        stats = self.results.stats
        wall = time.perf_counter() - started
        usage = list(self._usage.values())
        hits = sum(1 for u in usage if u.get("cached_answer"))
        stats.update(
            cache_hits=hits,
            computed=len(usage) - hits,
            failed=len(self.results.errors),
            prompt_tokens=sum(int(u.get("prompt_tokens", 0)) for u in usage),
            cached_tokens=sum(int((u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)) for u in usage),
            generated_tokens=sum(int(u.get("completion_tokens", 0)) for u in usage),
            wall_seconds=round(wall, 3),
            rows_per_second=round(len(self.results._finished) / wall, 2) if wall > 0 else None,
            engine_seconds=float(((batch or {}).get("lemonkit") or {}).get("engine_seconds", 0.0)),
        )
        return self.results
