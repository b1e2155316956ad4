"""The OpenAI Batch API (spec: ``openai-api.md``, Batches): ``POST /v1/batches``, ``GET /v1/batches``,
``GET /v1/batches/{id}``, ``POST /v1/batches/{id}/cancel``; and :class:`BatchRunner`, which runs them.

A batch's requests run through the very code of their routes: each line's body goes to the route's handler class,
joined to :class:`_Captured` (the few Tornado methods a handler calls, keeping what it writes) instead of a
connection, so a line is validated, served and refused exactly as the same request sent over HTTP, answer cache
included. They run as the batch's owner, as *background* requests (:data:`lemonkit.serving.fairness.background`):
within the owner's limits and fair share, behind every interactive request at the model, and as many at once as
the model has slots (plus one waiting, so that no slot idles between two rows).

Durability is :mod:`lemonkit.serving.batch_store`'s journal: a server that starts resumes every unfinished batch
of every user, skipping the requests already journaled.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import secrets
import time
from collections.abc import Generator
from pathlib import Path
from typing import Any

from tornado.ioloop import IOLoop

from lemonkit.errors import InvalidArgument, InvalidRequest, LemonkitError, MissingArgument, NotFound, RetryLater
from lemonkit.formats.headers import CACHE_HEADER
from lemonkit.server import openai
from lemonkit.server.captured import row_handler
from lemonkit.server.files_api import list_page, query_limit
from lemonkit.server.handler import LemonkitHandler
from lemonkit.server.service import Service
from lemonkit.serving import fairness
from lemonkit.serving.batch_store import FINAL, BatchRecord, Journal, new_id
from lemonkit.serving.caller import Caller, current

__all__ = ["ENDPOINTS", "BatchCancelHandler", "BatchHandler", "BatchRunner", "BatchesHandler", "runner", "start"]

log = logging.getLogger("lemonkit.batches")

#: the routes a batch may target, and the handler that serves each
ENDPOINTS: dict[str, type[openai.InferenceHandler]] = {
    "/v1/chat/completions": openai.ChatCompletionsHandler,
    "/v1/completions": openai.CompletionsHandler,
    "/v1/embeddings": openai.EmbeddingsHandler,
    "/v1/responses": openai.ResponsesHandler,
}
#: errors a failed validation lists at most
_MAX_ERRORS = 100
#: seconds between two writes of a running batch's object (its counts); the journal is written per request
_SAVE_EVERY = 0.5
#: lines read from the input file at a time
_READ_LINES = 256


async def run_request(
    service: Service, caller: Caller, endpoint: str, body: dict[str, Any]
) -> tuple[int, Any, dict[str, str]]:
    """Serve one request of a batch through its route's handler: ``(status, JSON answer, headers)``.

    Raises:
        RetryLater: The owner or the model has no room now (their limits, the model's queue): try again later.
    """
    if body.get("stream"):
        err = InvalidArgument("stream: a batch's requests are answered whole; leave stream out or false")
        return err.status, err.to_dict(), {}
    handler = row_handler(ENDPOINTS[endpoint])(service, caller, endpoint, json.dumps(body).encode())
    try:
        await handler.post()
    except RetryLater:
        raise
    except LemonkitError as err:
        return err.status, err.to_dict(), handler.headers
    except Exception:
        log.exception("a request of a batch failed unexpectedly")
        failure = LemonkitError("The request failed unexpectedly; see the server log", code="internal_error")
        return failure.status, failure.to_dict(), handler.headers
    return handler.status, json.loads(handler.body), handler.headers


def _check_input(path: Path, endpoint: str, most: int) -> tuple[int, list[dict[str, Any]], str | None]:
    """Check a batch's input file, line by line, as OpenAI's validation does (blocking).

    Returns:
        ``(requests, errors, model)``: the count of requests, OpenAI's ``errors.data`` items (each naming its
        ``line``, 1-based; empty when the file is good) and the model every line names.
    """
    errors: list[dict[str, Any]] = []
    seen: set[str] = set()
    model: str | None = None
    count = 0

    def fail(code: str, message: str, line: int | None, param: str | None = None) -> None:
        if len(errors) < _MAX_ERRORS:
            errors.append({"code": code, "message": message, "param": param, "line": line})

    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            count += 1
            if count > most:
                fail(
                    "too_many_requests",
                    f"The file holds more than {most} requests (LEMONKIT_BATCH_MAX_REQUESTS)",
                    number,
                )
                break
            try:
                line = json.loads(raw)
            except ValueError:
                fail(
                    "invalid_json_line",
                    "This line is not JSON (the file must be JSONL: one JSON object a line)",
                    number,
                )
                continue
            if not isinstance(line, dict):
                fail("invalid_json_line", "This line is not a JSON object", number)
                continue
            custom_id = line.get("custom_id")
            if not isinstance(custom_id, str) or not custom_id:
                fail("missing_custom_id", "custom_id: required, a non-empty string", number, "custom_id")
            elif custom_id in seen:
                fail("duplicate_custom_id", f"custom_id {custom_id!r} is used by an earlier line", number, "custom_id")
            else:
                seen.add(custom_id)
            if line.get("method", "POST") != "POST":
                fail("invalid_method", "method: must be POST", number, "method")
            if line.get("url") != endpoint:
                fail(
                    "mismatched_endpoint",
                    f"url: {line.get('url')!r} is not the batch's endpoint {endpoint}",
                    number,
                    "url",
                )
            body = line.get("body")
            if not isinstance(body, dict):
                fail("missing_body", "body: required, a JSON object (the request)", number, "body")
                continue
            name = body.get("model")
            if isinstance(name, str):
                if model is None:
                    model = name
                elif name != model:
                    fail(
                        "mismatched_model",
                        f"body.model: {name!r}; every request of a batch names one model ({model!r})",
                        number,
                        "body.model",
                    )
    if count == 0 and not errors:
        fail("empty_file", "The input file holds no requests", None)
    return count, errors, model


def _input_lines(path: Path) -> Generator[list[tuple[int, bytes]], None, None]:
    """The input file's requests as ``(index, line)``, ``_READ_LINES`` at a time (blank lines are not requests)."""
    with open(path, "rb") as f:
        chunk: list[tuple[int, bytes]] = []
        index = 0
        for raw in f:
            if not raw.strip():
                continue
            chunk.append((index, raw))
            index += 1
            if len(chunk) == _READ_LINES:
                yield chunk
                chunk = []
        if chunk:
            yield chunk


def _next(lines: Generator[list[tuple[int, bytes]], None, None]) -> list[tuple[int, bytes]] | None:
    return next(lines, None)


def _usage(answer: Any) -> dict[str, int]:
    """An answer's tokens as the batch's ``usage`` counts them."""
    usage = answer.get("usage") if isinstance(answer, dict) else None
    if not isinstance(usage, dict):
        return {}
    prompt = usage.get("prompt_tokens", usage.get("input_tokens")) or 0
    output = usage.get("completion_tokens", usage.get("output_tokens")) or 0
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
    return {"input": int(prompt), "output": int(output), "cached": int(details.get("cached_tokens") or 0)}


def _engine_seconds(answer: Any) -> float:
    timings = answer.get("timings") if isinstance(answer, dict) else None
    if not isinstance(timings, dict):
        return 0.0
    return float(timings.get("prompt_ms") or 0) / 1000 + float(timings.get("predicted_ms") or 0) / 1000


class _Running:
    """One batch being run: its record, journal, requests in flight, and what asks it to stop."""

    def __init__(self, record: BatchRecord) -> None:
        self.record = record
        self.journal: Journal | None = None
        self.rows: set[asyncio.Task[None]] = set()
        self.stop: str | None = None  # "cancelled" or "expired"
        self.saved_at = 0.0


class BatchRunner:
    """Runs every batch of one server: new ones as they are created, unfinished ones when the server starts.

    Args:
        service: The server's state (its file and batch stores, its model manager).
    """

    def __init__(self, service: Service) -> None:
        self.service = service
        self._running: dict[str, _Running] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False
        #: (model, outcome) -> requests of batches finished since the server started: completed (computed),
        #: cached (answered by the answer cache) or failed (``/metrics``' ``lemonkit_batch_rows``)
        self.rows: collections.Counter[tuple[str, str]] = collections.Counter()

    # -- lifecycle ---------------------------------------------------------------------------------------------

    async def resume(self) -> None:
        """Start every unfinished batch the cache holds (a server restarted, or killed, with batches under way)."""
        for record in await asyncio.to_thread(self.service.batch_store.unfinished):
            log.info("resuming %s (%s) of %s", record.id, record.batch["status"], record.owner.get("name"))
            self.start(record)

    def start(self, record: BatchRecord) -> None:
        if self._closed or record.id in self._running:
            return
        running = self._running[record.id] = _Running(record)
        task = asyncio.get_running_loop().create_task(self._drive(running), name=f"lemonkit-{record.id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        """Stop running batches where they are (their journals keep what finished; the next start resumes them)."""
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    def live(self, batch_id: str) -> BatchRecord | None:
        """The record of a batch this runner runs now (its counts are newer than on disk)."""
        running = self._running.get(batch_id)
        return running.record if running else None

    # -- requests from the API ---------------------------------------------------------------------------------

    async def cancel(self, record: BatchRecord) -> BatchRecord:
        """Cancel a batch: ``cancelling`` at once, ``cancelled`` once its requests in flight stopped (within one
        step); the finished ones are kept in its output."""
        running = self._running.get(record.id)
        if running is not None:
            record = running.record
        if record.batch["status"] in FINAL or record.batch["status"] == "cancelling":
            return record
        record.batch.update(status="cancelling", cancelling_at=int(time.time()))
        await asyncio.to_thread(self.service.batch_store.save, record)
        if running is not None:
            running.stop = "cancelled"
            for row in list(running.rows):
                row.cancel()
        else:
            self.start(record)  # finishes it as cancelled
        return record

    # -- running -----------------------------------------------------------------------------------------------

    async def _drive(self, running: _Running) -> None:
        record = running.record
        owner = record.owner
        current.set(Caller(owner["name"], owner["admin"], frozenset(owner.get("scopes", ())), owner["shared"]))
        lock = await asyncio.to_thread(self.service.batch_store.lock, record)
        if lock is None:  # another server on this cache runs it
            self._running.pop(record.id, None)
            return
        try:
            if record.batch["status"] == "validating":
                await self._validate(record)
            status = record.batch["status"]
            if status == "in_progress":
                await self._run(running)
                status = running.stop or "completed"
            elif status == "cancelling":
                status = "cancelled"
            elif status == "finalizing":
                status = "completed"
            if status in ("completed", "cancelled", "expired"):
                await self._finish(running, status)
        except asyncio.CancelledError:
            raise  # the server is stopping: the batch resumes at its next start
        except Exception as exc:
            log.exception("%s failed", record.id)
            await self._fail(record, [{"code": "server_error", "message": str(exc), "param": None, "line": None}])
        finally:
            if running.journal is not None:
                await asyncio.to_thread(running.journal.close)
            lock.close()
            self._running.pop(record.id, None)

    async def _validate(self, record: BatchRecord) -> None:
        batch, user = record.batch, record.owner["name"]
        path = await asyncio.to_thread(self.service.files.content, user, batch["input_file_id"])
        if path is None:
            message = f"The input file {batch['input_file_id']} was deleted before the batch started"
            await self._fail(
                record, [{"code": "file_not_found", "message": message, "param": "input_file_id", "line": None}]
            )
            return
        most = self.service.settings.batch_max_requests
        count, errors, model = await asyncio.to_thread(_check_input, path, batch["endpoint"], most)
        if batch["status"] != "validating":
            return  # cancelled meanwhile
        if errors:
            batch["request_counts"]["total"] = count
            await self._fail(record, errors)
            return
        batch.update(status="in_progress", in_progress_at=int(time.time()), model=model)
        batch["request_counts"]["total"] = count
        await asyncio.to_thread(self.service.batch_store.save, record)

    async def _fail(self, record: BatchRecord, errors: list[dict[str, Any]]) -> None:
        record.batch.update(status="failed", failed_at=int(time.time()), errors={"object": "list", "data": errors})
        await asyncio.to_thread(self.service.batch_store.save, record)

    def _width(self, model: str | None) -> int:
        """Requests of a batch in flight at once: as many as background turns the model gives (all its slots but
        one, kept for interactive requests) and one more waiting for the next; never all of a per-user
        ``max_active`` (the owner's own chats keep one)."""
        loaded = self.service.manager.loaded(model) if model else None
        slots = loaded.slots if loaded is not None else 1
        width = max(1, slots - 1) + 1
        most = self.service.settings.user_limits.max_active
        return max(1, min(width, most - 1)) if most else width

    async def _run(self, running: _Running) -> None:
        record = running.record
        batch = record.batch
        path = await asyncio.to_thread(self.service.files.content, record.owner["name"], batch["input_file_id"])
        if path is None:
            running.stop = "cancelled"  # the input went away: keep what finished
            return
        journal = running.journal = await asyncio.to_thread(Journal, record.journal_path)
        counts = batch["request_counts"]
        counts["completed"] = sum(journal.done.values())
        counts["failed"] = len(journal.done) - counts["completed"]
        batch.setdefault("usage", _empty_usage())
        extra = batch.setdefault("lemonkit", {"engine_seconds": 0.0, "cache_hits": 0})
        started = time.monotonic()
        lines = await asyncio.to_thread(_input_lines, path)
        try:
            while running.stop is None and (chunk := await asyncio.to_thread(_next, lines)) is not None:
                for index, raw in chunk:
                    if index in journal.done:
                        continue
                    while len(running.rows) >= self._width(batch.get("model")) and running.stop is None:
                        await asyncio.wait(running.rows, return_when=asyncio.FIRST_COMPLETED)
                    if running.stop is None and time.time() >= batch["expires_at"]:
                        running.stop = "expired"
                    if running.stop is not None:
                        break
                    row = asyncio.get_running_loop().create_task(self._row(running, index, raw))
                    running.rows.add(row)
                    row.add_done_callback(running.rows.discard)
            while running.rows:
                await asyncio.wait(running.rows)
        finally:
            for row in list(running.rows):
                row.cancel()
            if running.rows:
                await asyncio.wait(running.rows)
            await asyncio.to_thread(lines.close)
            extra["wall_seconds"] = round(extra.get("wall_seconds", 0.0) + time.monotonic() - started, 3)

    async def _row(self, running: _Running, index: int, raw: bytes) -> None:
        record = running.record
        batch = record.batch
        line = json.loads(raw)
        fairness.background.set(True)
        while True:
            try:
                status, answer, headers = await run_request(
                    self.service, current.get(), batch["endpoint"], line["body"]
                )
                break
            except RetryLater as exc:  # no room for the owner or at the model now: not this request's fault
                await asyncio.sleep(min(max(exc.retry_after, 0.05), 5.0))
        ok = 200 <= status < 300
        out = {
            "id": "batch_req_" + secrets.token_hex(12),
            "custom_id": line["custom_id"],
            "response": {"status_code": status, "request_id": "req_" + secrets.token_hex(12), "body": answer},
            "error": None,
        }
        assert running.journal is not None
        await asyncio.to_thread(running.journal.append, [{"i": index, "ok": ok, "line": out}])
        batch["request_counts"]["completed" if ok else "failed"] += 1
        hit = headers.get(CACHE_HEADER) == "hit"
        self.rows[(str(batch.get("model")), "failed" if not ok else "cached" if hit else "completed")] += 1
        if ok:
            tokens = _usage(answer)
            usage = batch["usage"]
            usage["input_tokens"] += tokens.get("input", 0)
            usage["input_tokens_details"]["cached_tokens"] += tokens.get("cached", 0)
            usage["output_tokens"] += tokens.get("output", 0)
            usage["total_tokens"] = usage["input_tokens"] + usage["output_tokens"]
            if hit:
                batch["lemonkit"]["cache_hits"] += 1  # no engine time: the answer's timings are the first run's
            else:
                seconds = batch["lemonkit"]["engine_seconds"] + _engine_seconds(answer)
                batch["lemonkit"]["engine_seconds"] = round(seconds, 4)
        if time.monotonic() - running.saved_at >= _SAVE_EVERY:
            running.saved_at = time.monotonic()
            await asyncio.to_thread(self.service.batch_store.save, record)

    async def _finish(self, running: _Running, status: str) -> None:
        """Write the output and error files from the journal and end the batch as ``status``."""
        record = running.record
        batch, user = record.batch, record.owner["name"]
        now = int(time.time())
        if status == "completed":
            batch.update(status="finalizing", finalizing_at=now)
            await asyncio.to_thread(self.service.batch_store.save, record)
        if running.journal is not None:
            await asyncio.to_thread(running.journal.close)
            running.journal = None
        journal_path = record.journal_path
        expired = status == "expired"
        path = await asyncio.to_thread(self.service.files.content, user, batch["input_file_id"])
        out_id, err_id, completed, failed = await asyncio.to_thread(
            _write_results, self.service, user, record, journal_path, path if expired else None
        )
        batch["output_file_id"], batch["error_file_id"] = out_id, err_id
        batch["request_counts"]["failed"] = failed
        batch["request_counts"]["completed"] = completed
        batch.update(status=status, **{f"{status}_at": int(time.time())})
        await asyncio.to_thread(self.service.batch_store.save, record)
        log.info("%s %s: %s", record.id, status, batch["request_counts"])


def _write_results(
    service: Service, user: str, record: BatchRecord, journal_path: Path, expired_input: Path | None
) -> tuple[str | None, str | None, int, int]:
    """Write the batch's output and error files (blocking); with ``expired_input``, each request that did not run
    goes to the error file as ``batch_expired``. Returns their ids (``None``: no such line) and the completed and
    failed counts.

    The files' ids derive from the batch's, so a server killed while writing them writes the same files again."""
    hexid = record.id.removeprefix("batch_")
    journal = Journal(journal_path)
    journal.close()
    files = service.files
    outputs = files.create(user, f"{record.id}_output.jsonl", "batch_output", f"file-{hexid}-out")
    errors = files.create(user, f"{record.id}_error.jsonl", "batch_output", f"file-{hexid}-err")
    wrote_out = wrote_err = 0
    with outputs, errors:
        for r in journal.records():
            target = outputs if r["ok"] else errors
            target.write(json.dumps(r["line"]).encode() + b"\n")
            if r["ok"]:
                wrote_out += 1
            else:
                wrote_err += 1
        if expired_input is not None:
            for chunk in _input_lines(expired_input):
                for index, raw in chunk:
                    if index in journal.done:
                        continue
                    line = {
                        "id": "batch_req_" + secrets.token_hex(12),
                        "custom_id": json.loads(raw).get("custom_id"),
                        "response": None,
                        "error": {
                            "code": "batch_expired",
                            "message": "This request was not run before the batch expired",
                        },
                    }
                    errors.write(json.dumps(line).encode() + b"\n")
                    wrote_err += 1
        out_id = outputs.commit()["id"] if wrote_out else None
        err_id = errors.commit()["id"] if wrote_err else None
    return out_id, err_id, wrote_out, wrote_err


def _empty_usage() -> dict[str, Any]:
    return {
        "input_tokens": 0,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": 0,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 0,
    }


def runner(service: Service) -> BatchRunner:
    """The service's batch runner (made on first use)."""
    existing: BatchRunner | None = service.batch_runner
    if existing is None:
        existing = service.batch_runner = BatchRunner(service)
    return existing


def start(service: Service) -> None:
    """Resume the unfinished batches of the cache once the server's loop runs (each host calls this as it starts)."""
    IOLoop.current().add_callback(runner(service).resume)


# -- handlers ------------------------------------------------------------------------------------------------------


def _metadata(value: Any) -> dict[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or len(value) > 16:
        raise InvalidArgument("metadata: an object of at most 16 string keys and values")
    for key, item in value.items():
        if not isinstance(item, str) or len(key) > 64 or len(item) > 512:
            raise InvalidArgument("metadata: keys of at most 64 characters, string values of at most 512")
    return value


def _not_found(batch_id: str) -> NotFound:
    return NotFound(f"No batch with id {batch_id!r}", code="batch_not_found")


class BatchesHandler(LemonkitHandler):
    """``POST /v1/batches`` (create) and ``GET /v1/batches`` (``after``, ``limit``)."""

    async def post(self) -> None:
        body = self.json_body()
        file_id, endpoint = body.get("input_file_id"), body.get("endpoint")
        window = body.get("completion_window", "24h")
        if not isinstance(file_id, str) or not file_id:
            raise MissingArgument("input_file_id: required argument is missing (an uploaded file's id)")
        if endpoint is None:
            raise MissingArgument(f"endpoint: required argument is missing (one of {', '.join(ENDPOINTS)})")
        if endpoint not in ENDPOINTS:
            raise InvalidArgument(f"endpoint: {endpoint!r} is not one of {', '.join(ENDPOINTS)}")
        if window != "24h":
            raise InvalidArgument(f"completion_window: only '24h' is supported, got {window!r}")
        metadata = _metadata(body.get("metadata"))
        caller = self.caller
        obj = await asyncio.to_thread(self.service.files.get, caller.name, file_id)
        if obj is None:
            raise NotFound(f"No file with id {file_id!r}", code="file_not_found")
        if obj.get("purpose") != "batch":
            raise InvalidArgument(
                f"input_file_id: {file_id} was uploaded with purpose {obj.get('purpose')!r}, not 'batch'"
            )
        now = int(time.time())
        batch = {
            "id": new_id(),
            "object": "batch",
            "endpoint": endpoint,
            "model": None,
            "errors": None,
            "input_file_id": file_id,
            "completion_window": window,
            "status": "validating",
            "output_file_id": None,
            "error_file_id": None,
            "created_at": now,
            "in_progress_at": None,
            "expires_at": now + 24 * 3600,
            "finalizing_at": None,
            "completed_at": None,
            "failed_at": None,
            "expired_at": None,
            "cancelling_at": None,
            "cancelled_at": None,
            "request_counts": {"total": 0, "completed": 0, "failed": 0},
            "usage": _empty_usage(),
            "metadata": metadata,
        }
        owner = {"name": caller.name, "admin": caller.admin, "shared": caller.shared, "scopes": sorted(caller.scopes)}
        record = await asyncio.to_thread(self.service.batch_store.create, owner, batch)
        runner(self.service).start(record)
        self.write_json(record.batch)

    async def get(self) -> None:
        limit = query_limit(self, 20, 100)
        records = await asyncio.to_thread(self.service.batch_store.of_user, self.caller.name)
        live = runner(self.service)
        objects = [(live.live(r.id) or r).batch for r in records]
        self.write_json(list_page(objects, after=self.get_query_argument("after", None), limit=limit))


class BatchHandler(LemonkitHandler):
    """``GET /v1/batches/{id}``."""

    async def get(self, batch_id: str) -> None:
        record = runner(self.service).live(batch_id)
        if record is None or record.owner["name"] != self.caller.name:
            record = await asyncio.to_thread(self.service.batch_store.get, self.caller.name, batch_id)
        if record is None:
            raise _not_found(batch_id)
        self.write_json(record.batch)


class BatchCancelHandler(LemonkitHandler):
    """``POST /v1/batches/{id}/cancel``."""

    raw_body = True  # it reads no body (as OpenAI's): whatever is sent is ignored

    async def post(self, batch_id: str) -> None:
        record = await asyncio.to_thread(self.service.batch_store.get, self.caller.name, batch_id)
        if record is None:
            raise _not_found(batch_id)
        if record.batch["status"] in FINAL:
            raise InvalidRequest(
                f"Batch {batch_id} is {record.batch['status']}: only a batch under way can be cancelled",
                code="batch_not_cancellable",
            )
        record = await runner(self.service).cancel(record)
        self.write_json(record.batch)
