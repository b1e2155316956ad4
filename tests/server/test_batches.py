"""The OpenAI Files and Batch APIs through real HTTP on both hosts, with the openai SDK's ``files`` and ``batches``
calls and real weights (the generated tiny models): each endpoint, bad lines, a malformed file, cancel, a server
killed mid-batch and restarted, an interactive chat during a batch."""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import pytest

from tests.support.hosts import API_KEY, Host, Standalone
from tests.support.session import CACHE_DIR
from tests.support.tiny_models import EMBED, TINY
from tests.support.waiting import until

GREEDY = {"temperature": 0, "seed": 1}


def _jsonl(lines: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def _chat_lines(n: int, *, max_tokens: int = 6, url: str = "/v1/chat/completions") -> list[dict[str, Any]]:
    return [
        {
            "custom_id": f"row-{i}",
            "method": "POST",
            "url": url,
            "body": {
                "model": TINY,
                "messages": [{"role": "user", "content": f"Label item number {i}."}],
                "max_tokens": max_tokens,
                **GREEDY,
            },
        }
        for i in range(n)
    ]


async def _finished(client: openai.AsyncOpenAI, batch_id: str, timeout: float = 180) -> Any:
    async def final() -> Any:
        batch = await client.batches.retrieve(batch_id)
        return batch if batch.status in ("completed", "failed", "cancelled", "expired") else None

    return await until(final, f"batch {batch_id} to end", timeout)


async def _lines(client: openai.AsyncOpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    content = await client.files.content(file_id)
    return [json.loads(line) for line in content.read().splitlines() if line.strip()]


async def _submit(client: openai.AsyncOpenAI, lines: list[dict[str, Any]], endpoint: str) -> Any:
    upload = await client.files.create(file=("rows.jsonl", io.BytesIO(_jsonl(lines))), purpose="batch")
    return await client.batches.create(input_file_id=upload.id, endpoint=endpoint, completion_window="24h")  # type: ignore[arg-type]


# -- files ---------------------------------------------------------------------------------------------------------


async def test_files_api_round_trip(host: Host) -> None:
    client = host.openai()
    data = b"first line\nsecond line\n" * 1000
    made = await client.files.create(file=("notes.txt", io.BytesIO(data)), purpose="user_data")
    assert made.object == "file" and made.id.startswith("file-")
    assert (made.bytes, made.filename, made.purpose, made.status) == (len(data), "notes.txt", "user_data", "processed")
    other = await client.files.create(file=("rows.jsonl", io.BytesIO(b"{}\n")), purpose="batch")

    assert (await client.files.retrieve(made.id)).model_dump() == made.model_dump()
    assert (await client.files.content(made.id)).read() == data
    ids = [f.id async for f in client.files.list()]
    assert ids.index(other.id) < ids.index(made.id) or other.created_at == made.created_at  # newest first
    only_data = [f.id async for f in client.files.list(purpose="user_data")]
    assert made.id in only_data and other.id not in only_data
    oldest_first = (await client.files.list(order="asc", limit=10_000)).data
    assert [f.id for f in oldest_first] == list(reversed(ids))

    async with host.client() as raw:
        page = (await raw.get("files", params={"limit": 1})).json()
        assert len(page["data"]) == 1 and page["has_more"] is True and page["first_id"] == page["last_id"]
        rest = (await raw.get("files", params={"limit": 10_000, "after": page["last_id"]})).json()
        assert [f["id"] for f in rest["data"]] == ids[1:]
        bad = await raw.get("files", params={"limit": 0})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_argument"
        no_purpose = await raw.post("files", files={"file": ("a.txt", b"x")})
        assert no_purpose.status_code == 400 and no_purpose.json()["error"]["code"] == "missing_argument"
        wrong_purpose = await raw.post("files", files={"file": ("a.txt", b"x")}, data={"purpose": "nope"})
        assert wrong_purpose.status_code == 400 and wrong_purpose.json()["error"]["code"] == "invalid_argument"
        no_file = await raw.post("files", data={"purpose": "batch"})
        assert no_file.status_code == 400, no_file.text
        not_multipart = await raw.post("files", json={"purpose": "batch"})
        assert not_multipart.status_code == 400 and not_multipart.json()["error"]["code"] == "invalid_content_type"

    deleted = await client.files.delete(made.id)
    assert deleted.deleted is True and deleted.id == made.id
    for call in (client.files.retrieve, client.files.content, client.files.delete):
        with pytest.raises(openai.NotFoundError) as caught:
            await call(made.id)
        assert caught.value.status_code == 404
        assert caught.value.body["code"] == "file_not_found"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        await client.files.retrieve("../../etc/passwd")
    await client.files.delete(other.id)


async def test_an_upload_refused_for_its_credentials_is_answered_and_the_connection_kept(host: Host) -> None:
    """A short body is read before the refusal is sent: answered while the client still sent, the close would
    reset the connection and lose the answer. A long one is refused at once, saying the connection closes."""
    async with httpx.AsyncClient(base_url=host.api + "/", timeout=60) as anonymous:
        for _ in range(20):
            refused = await anonymous.post("files", files={"file": ("a.txt", b"x" * 50_000)}, data={"purpose": "batch"})
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
            assert refused.headers.get("Connection") != "close"
    url = httpx.URL(host.api + "/files")
    reader, writer = await asyncio.open_connection(url.host, url.port)
    head = (
        f"POST {url.raw_path.decode()} HTTP/1.1\r\nHost: {url.host}:{url.port}\r\n"
        "Content-Type: multipart/form-data; boundary=b\r\nContent-Length: 100000000\r\n\r\n"
    )
    writer.write(head.encode())  # and none of the body: nothing unread is left to reset the connection
    answer = await asyncio.wait_for(reader.read(), 60)  # to the server's close
    writer.close()
    status, _, rest = answer.partition(b"\r\n")
    assert status.split()[1] == b"401" and b"\r\nConnection: close\r\n" in rest, answer[:400]


@pytest.fixture(scope="module")
def small_files_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Standalone]:
    """A ``lemonkit serve`` whose files may be at most 64 KiB, with a cache of its own."""
    cache = tmp_path_factory.mktemp("small-files-cache")
    server = Standalone(
        {"LEMONADE_API_KEY": API_KEY, "LEMONADE_CACHE_DIR": str(cache), "LEMONKIT_FILES_MAX_BYTES": "64KiB"}
    )
    yield server
    server.stop()


async def test_an_upload_over_the_limit_is_413_and_leaves_nothing(small_files_server: Standalone) -> None:
    host = Host("standalone", small_files_server.root, API_KEY)
    client = host.openai()
    fits = await client.files.create(file=("fits.bin", io.BytesIO(b"a" * 60_000)), purpose="user_data")
    assert fits.bytes == 60_000
    with pytest.raises(openai.APIStatusError) as caught:
        await client.files.create(file=("big.bin", io.BytesIO(b"a" * 200_000)), purpose="user_data")
    assert caught.value.status_code == 413
    assert caught.value.body["code"] == "payload_too_large"  # type: ignore[index]

    async def chunked() -> Any:  # no Content-Length: the limit is found while the body streams
        boundary = b"xyzzy"
        yield b"--" + boundary + b'\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nuser_data\r\n'
        yield b"--" + boundary + b'\r\nContent-Disposition: form-data; name="file"; filename="b.bin"\r\n\r\n'
        for _ in range(10):
            yield b"b" * 10_000
        yield b"\r\n--" + boundary + b"--\r\n"

    async with host.client() as raw:
        response = await raw.post(
            "files", content=chunked(), headers={"Content-Type": "multipart/form-data; boundary=xyzzy"}
        )
    assert response.status_code == 413 and response.json()["error"]["code"] == "payload_too_large"
    assert [f.id for f in (await client.files.list()).data] == [fits.id]
    cache = Path(small_files_server.env["LEMONADE_CACHE_DIR"]) / "files"
    assert sorted(p.name for p in cache.rglob("*") if p.is_file()) == sorted([fits.id, fits.id + ".json"])


async def test_an_upload_streams_to_disk(tmp_path: Path) -> None:
    """A 96 MB upload does not grow the server's memory by anything near its size (it is written as it comes)."""
    server = Standalone({"LEMONADE_API_KEY": API_KEY, "LEMONADE_CACHE_DIR": str(tmp_path)})
    try:
        process = psutil.Process(server.process.pid)
        before = process.memory_info().rss
        peak = before
        size = 96 * 1024 * 1024

        async def body() -> Any:
            nonlocal peak
            yield b'--b0\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nuser_data\r\n'
            yield b'--b0\r\nContent-Disposition: form-data; name="file"; filename="big.bin"\r\n\r\n'
            block = os.urandom(1024 * 1024)
            for _ in range(size // len(block)):
                yield block
                peak = max(peak, process.memory_info().rss)
            yield b"\r\n--b0--\r\n"

        host = Host("standalone", server.root, API_KEY)
        async with host.client() as raw:
            response = await raw.post(
                "files", content=body(), headers={"Content-Type": "multipart/form-data; boundary=b0"}
            )
        assert response.status_code == 200, response.text
        assert response.json()["bytes"] == size
        assert peak - before < size / 3, (before, peak)
    finally:
        server.stop()


# -- batches -------------------------------------------------------------------------------------------------------


async def test_a_chat_batch_answers_every_line_as_the_route_does(host: Host) -> None:
    client = host.openai()
    lines = _chat_lines(6)
    lines.insert(2, {"custom_id": "bad-body", "method": "POST", "url": "/v1/chat/completions", "body": {"model": TINY}})
    lines.insert(4, {**_chat_lines(1)[0], "custom_id": "streamed"})
    lines[4]["body"] = {**lines[4]["body"], "stream": True}
    lines.append({**_chat_lines(1)[0], "custom_id": "bad-temperature"})
    lines[-1]["body"] = {**lines[-1]["body"], "temperature": -3}
    batch = await _submit(client, lines, "/v1/chat/completions")
    assert batch.status == "validating" and batch.endpoint == "/v1/chat/completions"
    assert batch.completion_window == "24h" and batch.expires_at == batch.created_at + 24 * 3600

    done = await _finished(client, batch.id)
    assert done.status == "completed", done
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (9, 6, 3)
    assert done.in_progress_at and done.finalizing_at and done.completed_at
    assert done.created_at <= done.in_progress_at <= done.finalizing_at <= done.completed_at

    outputs = await _lines(client, done.output_file_id)
    assert sorted(o["custom_id"] for o in outputs) == sorted(f"row-{i}" for i in range(6))
    direct = {}
    for line in lines:
        if line["custom_id"].startswith("row-"):
            answer = await client.chat.completions.create(**line["body"])
            direct[line["custom_id"]] = answer
    for out in outputs:
        assert out["id"].startswith("batch_req_") and out["error"] is None
        assert out["response"]["status_code"] == 200
        body = out["response"]["body"]
        assert body["object"] == "chat.completion"
        expected = direct[out["custom_id"]]
        assert body["choices"][0]["message"]["content"] == expected.choices[0].message.content
        assert body["usage"]["completion_tokens"] == expected.usage.completion_tokens  # type: ignore[union-attr]
    assert done.usage.output_tokens == sum(o["response"]["body"]["usage"]["completion_tokens"] for o in outputs)  # type: ignore[union-attr]
    assert done.usage.input_tokens == sum(o["response"]["body"]["usage"]["prompt_tokens"] for o in outputs)  # type: ignore[union-attr]

    errors = {e["custom_id"]: e for e in await _lines(client, done.error_file_id)}
    assert set(errors) == {"bad-body", "streamed", "bad-temperature"}
    for custom_id, code in (
        ("bad-body", "missing_argument"),
        ("streamed", "invalid_argument"),
        ("bad-temperature", "invalid_argument"),
    ):
        response = errors[custom_id]["response"]
        assert response["status_code"] == 400 and response["body"]["error"]["code"] == code, response

    assert done.id in [b.id async for b in client.batches.list()]
    output_file = await client.files.retrieve(done.output_file_id)  # type: ignore[arg-type]
    assert output_file.purpose == "batch_output"


@pytest.mark.parametrize(
    ("endpoint", "body", "check"),
    [
        ("/v1/completions", {"model": TINY, "prompt": "Once upon", "max_tokens": 5, **GREEDY}, "text_completion"),
        ("/v1/embeddings", {"model": EMBED, "input": "a small test"}, "list"),
        ("/v1/responses", {"model": TINY, "input": "Say hi.", "max_output_tokens": 5, **GREEDY}, "response"),
    ],
)
async def test_a_batch_of_each_endpoint(host: Host, endpoint: str, body: dict[str, Any], check: str) -> None:
    client = host.openai()
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": endpoint, "body": body} for i in range(3)]
    done = await _finished(client, (await _submit(client, lines, endpoint)).id)
    assert done.status == "completed" and done.request_counts.completed == 3, done
    outputs = await _lines(client, done.output_file_id)
    assert sorted(o["custom_id"] for o in outputs) == ["r0", "r1", "r2"]
    for out in outputs:
        assert out["response"]["status_code"] == 200
        assert out["response"]["body"]["object"] == check
    if endpoint == "/v1/embeddings":
        vectors = [o["response"]["body"]["data"][0]["embedding"] for o in outputs]
        assert len(vectors[0]) > 8 and vectors[0] == vectors[1] == vectors[2]
    else:
        bodies = [o["response"]["body"] for o in outputs]
        if endpoint == "/v1/responses":
            texts = [b["output"][0]["content"][0]["text"] for b in bodies]
        else:
            texts = [b["choices"][0]["text"] for b in bodies]
        assert texts[0] and len(set(texts)) == 1  # greedy and seeded: the same answer each time


@pytest.mark.parametrize(
    ("lines", "code", "line"),
    [
        (
            b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "m"}}\nnot json\n',
            "invalid_json_line",
            2,
        ),
        (_jsonl([*_chat_lines(1), {**_chat_lines(1)[0]}]), "duplicate_custom_id", 2),
        (_jsonl(_chat_lines(2, url="/v1/completions")), "mismatched_endpoint", 1),
        (
            _jsonl([{"custom_id": "x", "method": "GET", "url": "/v1/chat/completions", "body": {"model": TINY}}]),
            "invalid_method",
            1,
        ),
        (_jsonl([{"custom_id": "x", "url": "/v1/chat/completions"}]), "missing_body", 1),
        (_jsonl([{"url": "/v1/chat/completions", "body": {"model": TINY}}]), "missing_custom_id", 1),
        (b"\n\n", "empty_file", None),
    ],
)
async def test_a_malformed_file_fails_in_validating(host: Host, lines: bytes, code: str, line: int | None) -> None:
    client = host.openai()
    upload = await client.files.create(file=("rows.jsonl", io.BytesIO(lines)), purpose="batch")
    batch = await client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    done = await _finished(client, batch.id)
    assert done.status == "failed" and done.failed_at and done.output_file_id is None
    assert done.errors is not None and done.errors.data, done
    assert (done.errors.data[0].code, done.errors.data[0].line) == (code, line)


async def test_batch_create_checks_its_arguments(host: Host) -> None:
    client = host.openai()
    notes = await client.files.create(file=("n.txt", io.BytesIO(b"x")), purpose="user_data")
    async with host.client() as raw:
        for body, status, code in (
            ({"endpoint": "/v1/chat/completions"}, 400, "missing_argument"),
            ({"input_file_id": notes.id}, 400, "missing_argument"),
            ({"input_file_id": notes.id, "endpoint": "/v1/images/generations"}, 400, "invalid_argument"),
            (
                {"input_file_id": notes.id, "endpoint": "/v1/chat/completions", "completion_window": "1h"},
                400,
                "invalid_argument",
            ),
            ({"input_file_id": notes.id, "endpoint": "/v1/chat/completions"}, 400, "invalid_argument"),
            ({"input_file_id": "file-doesnotexist00", "endpoint": "/v1/chat/completions"}, 404, "file_not_found"),
            (
                {"input_file_id": notes.id, "endpoint": "/v1/chat/completions", "metadata": {"k": 3}},
                400,
                "invalid_argument",
            ),
        ):
            response = await raw.post("batches", json=body)
            assert response.status_code == status, (body, response.text)
            assert response.json()["error"]["code"] == code, (body, response.text)
        for method, path in (
            ("GET", "batches/batch_000000000000"),
            ("POST", "batches/batch_000000000000/cancel"),
            ("GET", "batches/x/../y"),
        ):
            response = await raw.request(method, path)
            assert response.status_code == 404, response.text


async def test_cancel_keeps_the_finished_requests(host: Host) -> None:
    client = host.openai()
    lines = _chat_lines(40, max_tokens=24)
    batch = await _submit(client, lines, "/v1/chat/completions")

    async def some_done() -> bool:
        return (await client.batches.retrieve(batch.id)).request_counts.completed >= 2  # type: ignore[union-attr]

    await until(some_done, "two requests to finish", 120)
    cancelling = await client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    done = await _finished(client, batch.id)
    assert done.status == "cancelled" and done.cancelled_at and done.cancelling_at
    completed = done.request_counts.completed  # type: ignore[union-attr]
    assert 2 <= completed < 40
    outputs = await _lines(client, done.output_file_id)
    assert len(outputs) == completed == len({o["custom_id"] for o in outputs})
    assert all(o["response"]["status_code"] == 200 for o in outputs)
    with pytest.raises(openai.BadRequestError):
        await client.batches.cancel(batch.id)  # over already
    at_once = await _submit(client, lines, "/v1/chat/completions")
    await client.batches.cancel(at_once.id)  # while it validates, or just after
    ended = await _finished(client, at_once.id)
    assert ended.status == "cancelled" and ended.request_counts.completed < 40  # type: ignore[union-attr]


async def test_a_chat_during_a_batch_goes_ahead_of_its_queued_rows(host: Host) -> None:
    """The batch's rows are background turns: a chat sent while many wait is served before them."""
    client = host.openai()
    lines = _chat_lines(30, max_tokens=16)
    batch = await _submit(client, lines, "/v1/chat/completions")

    async def running() -> int:
        return (await client.batches.retrieve(batch.id)).request_counts.completed  # type: ignore[union-attr,return-value]

    await until(running, "the batch to start", 120)
    async with host.client() as raw:
        slots = (await raw.get("health")).json()["all_models_loaded"][0]["slots"]["total"]
    before = await running()
    chat = await client.chat.completions.create(
        model=TINY, messages=[{"role": "user", "content": "Hello"}], max_tokens=4, **GREEDY
    )
    after = await running()
    assert chat.choices[0].message.content is not None
    # it waited at most for the rows holding the slots (and the one next in line), not for the batch's queue
    assert after - before <= slots + 1, (before, after, slots)
    assert after < 30
    await client.batches.cancel(batch.id)
    await _finished(client, batch.id)


async def _generations(client: httpx.AsyncClient) -> int:
    text = (await client.get(client.base_url.join("/metrics"))).text
    for line in text.splitlines():
        if line.startswith("lemonkit_generations_total{") and f'model="{TINY}"' in line:
            return int(float(line.rsplit(" ", 1)[1]))
    return 0


async def test_a_killed_server_resumes_its_batch_without_computing_a_row_twice(tmp_path: Path) -> None:
    env = {"LEMONADE_API_KEY": API_KEY, "LEMONADE_CACHE_DIR": str(tmp_path)}
    # the models' registrations live in the session's cache: this server's own cache needs them too
    (tmp_path / "user_models.json").write_bytes((CACHE_DIR / "user_models.json").read_bytes())
    total = 24
    first = Standalone(env)
    try:
        host = Host("standalone", first.root, API_KEY)
        client = host.openai()
        batch = await _submit(client, _chat_lines(total, max_tokens=12), "/v1/chat/completions")

        async def a_third() -> bool:
            return (await client.batches.retrieve(batch.id)).request_counts.completed >= total // 3  # type: ignore[union-attr,operator]

        await until(a_third, "a third of the batch", 120)
        os.kill(first.process.pid, signal.SIGKILL)
        first.process.wait(30)
    finally:
        first.stop()
    journal = next(tmp_path.glob(f"batches/*/{batch.id}/journal.jsonl"))
    journaled = len([line for line in journal.read_bytes().split(b"\n") if line.strip()])
    assert total // 3 <= journaled < total

    second = Standalone(env)
    try:
        host = Host("standalone", second.root, API_KEY)
        client = host.openai()
        done = await _finished(client, batch.id)
        assert done.status == "completed" and done.request_counts.completed == total, done
        outputs = await _lines(client, done.output_file_id)
        assert sorted(o["custom_id"] for o in outputs) == sorted(f"row-{i}" for i in range(total))
        async with host.client() as raw:
            ran = await _generations(raw)
        # a request computed but not journaled before the kill ran again, or was answered by the answer cache
        hits = done.lemonkit["cache_hits"]  # type: ignore[attr-defined]
        assert ran + hits == total - journaled, (ran, hits, total, journaled)
        assert done.lemonkit["engine_seconds"] > 0 and done.lemonkit["wall_seconds"] > 0  # type: ignore[attr-defined]
    finally:
        second.stop()


async def test_a_batch_run_again_is_answered_by_the_cache(host: Host) -> None:
    async with host.client() as raw:
        assert (await raw.delete("cache")).status_code == 200  # both hosts share the session's cache
    client = host.openai()
    lines = _chat_lines(5)
    first = await _finished(client, (await _submit(client, lines, "/v1/chat/completions")).id)
    again = await _finished(client, (await _submit(client, lines, "/v1/chat/completions")).id)
    assert first.status == again.status == "completed"
    assert again.lemonkit["cache_hits"] == 5 and again.lemonkit["engine_seconds"] == 0  # type: ignore[attr-defined]
    one = {o["custom_id"]: o["response"]["body"] for o in await _lines(client, first.output_file_id)}
    two = {o["custom_id"]: o["response"]["body"] for o in await _lines(client, again.output_file_id)}
    for custom_id, body in two.items():
        assert body["usage"].pop("cached_answer") is True
        assert body == one[custom_id]  # the first answer, bit for bit
    async with host.client() as raw:
        metrics = (await raw.get(host.root + "metrics")).text
    cached = [line for line in metrics.splitlines() if line.startswith("lemonkit_batch_rows_total{")]
    assert any(
        f'model="{TINY}"' in line and 'outcome="cached"' in line and float(line.split()[-1]) >= 5 for line in cached
    ), cached
    hits = [
        line for line in metrics.splitlines() if line.startswith('lemonkit_answer_cache_lookups_total{result="hit"}')
    ]
    assert hits and float(hits[0].split()[-1]) >= 5


async def test_a_batch_past_its_window_expires_with_its_finished_requests(tmp_path: Path) -> None:
    """A server stopped mid-batch; the batch's window ends meanwhile (its 24 h, moved into the past on disk); the
    next start ends it expired: the finished requests in the output, the rest as batch_expired errors."""
    env = {"LEMONADE_API_KEY": API_KEY, "LEMONADE_CACHE_DIR": str(tmp_path)}
    (tmp_path / "user_models.json").write_bytes((CACHE_DIR / "user_models.json").read_bytes())
    total = 20
    first = Standalone(env)
    try:
        client = Host("standalone", first.root, API_KEY).openai()
        batch = await _submit(client, _chat_lines(total, max_tokens=12), "/v1/chat/completions")

        async def some() -> bool:
            return (await client.batches.retrieve(batch.id)).request_counts.completed >= 3  # type: ignore[union-attr,operator]

        await until(some, "a few requests to finish", 120)
    finally:
        first.stop()  # a clean stop: the batch resumes at the next start
    record = next(tmp_path.glob(f"batches/*/{batch.id}/batch.json"))
    data = json.loads(record.read_text())
    assert data["batch"]["status"] == "in_progress"
    journaled = len([line for line in next(record.parent.glob("journal.jsonl")).read_bytes().splitlines() if line])
    assert 3 <= journaled < total
    data["batch"]["expires_at"] = data["batch"]["created_at"] - 1
    record.write_text(json.dumps(data))

    second = Standalone(env)
    try:
        client = Host("standalone", second.root, API_KEY).openai()
        done = await _finished(client, batch.id)
        assert done.status == "expired" and done.expired_at, done
        assert (done.request_counts.completed, done.request_counts.failed) == (journaled, total - journaled)  # type: ignore[union-attr]
        outputs = await _lines(client, done.output_file_id)
        errors = await _lines(client, done.error_file_id)
        assert len(outputs) == journaled and len(errors) == total - journaled
        assert {e["error"]["code"] for e in errors} == {"batch_expired"}
        assert sorted(o["custom_id"] for o in outputs + errors) == sorted(f"row-{i}" for i in range(total))
    finally:
        second.stop()
