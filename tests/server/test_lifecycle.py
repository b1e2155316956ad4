"""Loading, eviction, concurrency, disconnects and sidecar crashes, on both hosts."""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import re
import signal

import httpx
import pytest

from tests.support.hosts import API_KEY, Host, Standalone
from tests.support.session import CACHE_DIR
from tests.support.tiny_models import EMBED, TINY, TINY_B
from tests.support.waiting import until

CHAT = {"messages": [{"role": "user", "content": "go"}], "temperature": 0}


async def _health(client: httpx.AsyncClient) -> dict:
    return (await client.get("health")).json()


async def _stream_lines(response: httpx.Response) -> list[str]:
    return [line async for line in response.aiter_lines() if line]


async def test_lru_eviction_with_max_one(counted_host: Host) -> None:
    async with counted_host.client() as client:
        assert (await _health(client))["max_models"]["llm"] == 1
        assert (await client.post("load", json={"model_name": TINY})).status_code == 200
        assert (await client.post("load", json={"model_name": TINY_B})).status_code == 200
        assert [m["model_name"] for m in (await _health(client))["all_models_loaded"]] == [TINY_B]
        # a request naming the evicted model loads it again, evicting the other
        response = await client.post("chat/completions", json={"model": TINY, "max_tokens": 2, **CHAT})
        assert response.status_code == 200
        assert [m["model_name"] for m in (await _health(client))["all_models_loaded"]] == [TINY]


async def _loaded(client: httpx.AsyncClient) -> dict[str, dict]:
    return {m["model_name"]: m for m in (await _health(client))["all_models_loaded"]}


async def test_models_that_fit_in_memory_stay_loaded_together(host: Host) -> None:
    async with host.client() as client:
        for name in (TINY, TINY_B, EMBED):
            assert (await client.post("load", json={"model_name": name})).status_code == 200
        health = await _health(client)
        loaded = await _loaded(client)
    assert sorted(loaded) == sorted([TINY, TINY_B, EMBED]) and health["max_models"]["llm"] == -1
    assert all(m["memory_mb"] >= 256 for m in loaded.values())  # a sidecar's interpreter and engine, at least
    memory = health["memory"]
    assert abs(memory["models_mb"] - sum(m["memory_mb"] for m in loaded.values())) <= len(loaded)
    assert 0 < memory["available_mb"] < memory["limit_mb"]


async def test_a_memory_cap_evicts_the_least_recently_used_and_refuses_what_cannot_fit(
    standalone: Standalone,
) -> None:
    async with Host("standalone", standalone.root, API_KEY).client() as client:
        for name in (TINY, TINY_B):
            assert (await client.post("load", json={"model_name": name})).status_code == 200
        sizes = {name: m["memory_mb"] for name, m in (await _loaded(client)).items()}
        await client.post("unload", json={})
    cap = max(sizes.values()) + min(sizes.values()) // 2  # room for one of them, not for both
    capped = Standalone({"LEMONADE_API_KEY": API_KEY, "LEMONKIT_MEMORY": f"{cap}MiB"})
    try:
        async with Host("standalone", capped.root, API_KEY).client() as client:
            assert (await _health(client))["memory"]["limit_mb"] == cap
            assert (await client.post("load", json={"model_name": TINY})).status_code == 200
            assert (await client.post("load", json={"model_name": TINY_B})).status_code == 200
            assert list(await _loaded(client)) == [TINY_B]
            evicted = (await client.get(capped.root + "metrics")).text
            assert f'lemonkit_model_unloads_total{{model="{TINY}",reason="memory"}} 1.0' in evicted
            # a request naming the evicted model loads it again, evicting the other
            response = await client.post("chat/completions", json={"model": TINY, "max_tokens": 2, **CHAT})
            assert response.status_code == 200 and list(await _loaded(client)) == [TINY]
            try:
                # beside a pinned model the other does not fit: a 400 with the figures, and nothing unloaded
                assert (await client.post("load", json={"model_name": TINY, "pinned": True})).status_code == 200
                response = await client.post("load", json={"model_name": TINY_B})
                error = response.json()["error"]
                assert response.status_code == 400 and error["code"] == "model_load_error"
                assert f"of the {cap} MiB lemonkit may use (LEMONKIT_MEMORY)" in error["message"]
                assert f"beside {TINY} (" in error["message"] and "MiB, pinned)" in error["message"]
                needs = int(re.search(r"needs about (\d+) MiB", error["message"])[1])  # type: ignore[index]
                assert abs(needs - sizes[TINY_B]) <= 1
                assert list(await _loaded(client)) == [TINY]
            finally:
                await client.delete(f"models/{TINY}/options")  # the pin is saved: other tests expect TINY unpinned
    finally:
        capped.stop()
    small = Standalone({"LEMONADE_API_KEY": API_KEY, "LEMONKIT_MEMORY": f"{min(sizes.values()) // 2}MiB"})
    try:
        async with Host("standalone", small.root, API_KEY).client() as client:
            response = await client.post("load", json={"model_name": TINY})
            error = response.json()["error"]
            assert response.status_code == 400 and error["code"] == "model_load_error"
            assert f"{min(sizes.values()) // 2} MiB are free" in error["message"]
            assert await _loaded(client) == {}
    finally:
        small.stop()


async def test_an_automatic_context_is_the_trained_one_as_memory_allows(standalone: Standalone) -> None:
    """SmolLM2 was trained for 8192 tokens, whose KV cache (23,040 bytes a token) a quarter of this machine's
    memory holds many times over; on a server whose operator allowed 700 MiB, a quarter holds 7,965 tokens."""
    model = "SmolLM2-135M-Instruct-Bundled"
    async with Host("standalone", standalone.root, API_KEY).client() as client:
        assert (await client.post("load", json={"model_name": model})).status_code == 200
        assert (await client.get(f"models/{model}")).json()["context_length"] == 8192
        assert (await client.get(f"models/{model}/options")).json()["resolved_ctx_size"] == 8192
        await client.post("unload", json={"model_name": model})
    small = Standalone({"LEMONADE_API_KEY": API_KEY, "LEMONKIT_MEMORY": "700MiB"})
    try:
        async with Host("standalone", small.root, API_KEY).client() as client:
            assert (await client.post("load", json={"model_name": model})).status_code == 200
            assert (await client.get(f"models/{model}")).json()["context_length"] == 7936  # in steps of 256
            assert (await client.get(f"models/{model}/options")).json()["resolved_ctx_size"] == 7936
    finally:
        small.stop()


async def test_pinned_model_is_never_evicted(counted_host: Host) -> None:
    async with counted_host.client() as client:
        try:
            assert (await client.post("load", json={"model_name": TINY, "pinned": True})).status_code == 200
            response = await client.post("load", json={"model_name": TINY_B})
            assert response.status_code == 409 and response.json()["error"]["code"] == "slots_pinned_error"
            assert [m["model_name"] for m in (await _health(client))["all_models_loaded"]] == [TINY]
        finally:
            await client.delete(f"models/{TINY}/options")  # the pin is saved: other tests expect TINY unpinned


async def test_concurrent_requests_all_complete(host: Host) -> None:
    async def one(client: httpx.AsyncClient, i: int) -> str:
        body = {
            "model": TINY,
            "max_tokens": 40,
            "stream": True,
            **CHAT,
            "messages": [{"role": "user", "content": f"request {i}"}],
        }
        async with client.stream("POST", "chat/completions", json=body) as response:
            assert response.status_code == 200
            lines = await _stream_lines(response)
        assert lines[-1] == "data: [DONE]"
        finals = [json.loads(line[6:]) for line in lines[:-1] if line.startswith("data: ")]  # skip ": ping"
        assert finals[-1]["choices"][0]["finish_reason"] in ("stop", "length")
        return "".join(c["choices"][0]["delta"].get("content") or "" for c in finals if c["choices"])

    async with host.client() as client:
        texts = await asyncio.gather(*(one(client, i) for i in range(4)))
        health = await _health(client)
    assert all(texts)
    assert len(health["all_models_loaded"]) == 1  # the four requests shared one load


async def test_sidecar_killed_mid_stream_then_recovers(host: Host) -> None:
    async with host.client() as client:
        await client.post("load", json={"model_name": TINY, "ctx_size": 4096})
        pid = (await _health(client))["all_models_loaded"][0]["pid"]
        body = {"model": TINY, "max_tokens": 4000, "stream": True, **CHAT}
        async with client.stream("POST", "chat/completions", json=body) as response:
            lines = response.aiter_lines()
            first = await anext(lines)
            assert first.startswith("data: {")
            os.kill(pid, signal.SIGKILL)
            rest = [line async for line in lines if line]
        assert "data: [DONE]" not in rest
        error = json.loads(rest[-1][6:])["error"]
        assert error["status_code"] == 502 and error["message"]
        # the server is still up and the next request reloads the model in a new sidecar
        response = await client.post("chat/completions", json={"model": TINY, "max_tokens": 2, **CHAT})
        assert response.status_code == 200
        assert (await _health(client))["all_models_loaded"][0]["pid"] != pid


async def test_client_disconnect_stops_generation(host: Host) -> None:
    async with host.client() as client:
        await client.post("load", json={"model_name": TINY, "ctx_size": 4096})
        body = {"model": TINY, "max_tokens": 4000, "stream": True, **CHAT}
        async with client.stream("POST", "chat/completions", json=body) as response:
            lines = response.aiter_lines()
            for _ in range(3):
                await anext(lines)
        # the engine serves one request at a time: this one starts only once the abandoned one has stopped
        follow = {"model": TINY, "max_tokens": 3000, "stream": True, **CHAT}
        async with client.stream("POST", "chat/completions", json=follow) as response:
            await anext(response.aiter_lines())
            stats = (await client.get("stats")).json()
    assert 0 < stats["output_tokens"] < 1000  # the abandoned request stopped long before its 4000 tokens


async def test_sidecar_is_private_and_unload_ends_it(host: Host) -> None:
    async with host.client() as client:
        await client.post("load", json={"model_name": TINY})
        (loaded,) = (await _health(client))["all_models_loaded"]
        socket_path = loaded["backend_url"].removeprefix("unix:")
        assert os.stat(socket_path).st_mode & 0o777 == 0o600
        assert os.stat(os.path.dirname(socket_path)).st_mode & 0o777 == 0o700
        assert os.path.exists(f"/proc/{loaded['pid']}")
        await client.post("unload", json={"model_name": TINY})
    assert not os.path.exists(f"/proc/{loaded['pid']}")  # the process is gone, its memory with it
    assert not os.path.exists(socket_path)


async def test_request_ctx_size_and_save_options_priority(host: Host) -> None:
    async with host.client() as client:
        # ctx_size on the request that loads the model
        body = {"model": TINY_B, "max_tokens": 2, "ctx_size": 320, **CHAT}
        assert (await client.post("chat/completions", json=body)).status_code == 200
        (loaded,) = (await _health(client))["all_models_loaded"]
        assert loaded["recipe_options"]["ctx_size"] == 320
        # saved options apply to later loads that do not name them ...
        response = await client.post("load", json={"model_name": TINY_B, "ctx_size": 384, "save_options": True})
        assert response.status_code == 200
        await client.post("unload", json={})
        assert (await client.post("chat/completions", json={**body, "ctx_size": None})).status_code == 200
        (loaded,) = (await _health(client))["all_models_loaded"]
        assert loaded["recipe_options"]["ctx_size"] == 384
        assert (await client.get(f"models/{TINY_B}")).json()["recipe_options"]["ctx_size"] == 384
        # ... and a load request's own value wins over them; -1 asks the engine to size the context
        await client.post("load", json={"model_name": TINY_B, "ctx_size": 256})
        assert (await _health(client))["all_models_loaded"][0]["recipe_options"]["ctx_size"] == 256
        await client.post("load", json={"model_name": TINY_B, "ctx_size": -1})
        auto = (await client.get(f"models/{TINY_B}")).json()["context_length"]
        assert auto > 0
        # forget the saved options so other tests see defaults
        await client.post("load", json={"model_name": TINY_B, "save_options": True})
    assert TINY_B not in json.loads((CACHE_DIR / "recipe_options.json").read_text())


async def test_models_share_the_memory_and_concurrent_loads(jupyter_host: Host, jp_serverapp: object) -> None:
    service = jp_serverapp.web_app.settings["lemonkit"]  # type: ignore[attr-defined]
    async with jupyter_host.client() as client:
        before = service.manager.loads_started
        bodies = [{"model": m, "max_tokens": 3, **CHAT} for m in (TINY, TINY, TINY, TINY_B, TINY_B)]
        responses = await asyncio.gather(*(client.post("chat/completions", json=b) for b in bodies))
        assert [r.status_code for r in responses] == [200] * 5
        assert service.manager.loads_started - before == 2  # one load per model, shared by its requests
        health = await _health(client)
    assert sorted(m["model_name"] for m in health["all_models_loaded"]) == [TINY, TINY_B]
    assert health["max_models"]["llm"] == -1


async def test_a_decode_waits_for_its_cpu_turn(host: Host) -> None:
    """A sidecar's decode takes a CPU turn shared by this user's sidecars (lemonkit/backends/llamacpp/cpu_turns.py):
    while something else holds every turn, the request waits in ``flock`` (visible in /proc/locks), and it answers
    once the turns are free."""
    from lemonkit.backends.llamacpp import cpu_turns

    async with host.client() as client:
        assert (await client.post("load", json={"model_name": TINY})).status_code == 200
        pid = (await _health(client))["all_models_loaded"][0]["pid"]
        directory = cpu_turns._private_dir()
        paths = [directory / f"core-{i}.lock" for i in range(os.cpu_count() or 1)]  # every core
        held = [os.open(path, os.O_RDWR | os.O_CREAT, 0o600) for path in paths]
        try:
            for fd in held:  # blocking: the new sidecar's load-time probe may still hold one
                await asyncio.to_thread(fcntl.flock, fd, fcntl.LOCK_EX)
            body = {"model": TINY, "max_tokens": 4, **CHAT}
            request = asyncio.ensure_future(client.post("chat/completions", json=body))

            async def waiting() -> bool:
                with open("/proc/locks") as locks:
                    return any("->" in line and line.split()[5] == str(pid) for line in locks)

            await until(waiting, "the sidecar to wait for a CPU turn")
            assert not request.done()
        finally:
            for fd in held:
                os.close(fd)  # gives the turns back
        response = await request
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4


async def test_a_decode_runs_on_the_cores_left_free(host: Host) -> None:
    """Other sidecars hold every core but one: the decode takes the free core and runs on one thread
    (``/v1/stats``' ``decode_threads``), and its greedy answer is the one it gives on two."""
    from lemonkit.backends.llamacpp import cpu_turns

    cores = len(os.sched_getaffinity(0))
    if cores < 2:
        pytest.skip("one core: nothing to leave free")
    async with host.client() as client:
        await client.post("unload", json={"model_name": TINY})  # a new sidecar: its planner has timed nothing
        load = {"model_name": TINY, "llamacpp_args": "-t 2"}
        assert (await client.post("load", json=load)).status_code == 200
        body = {"model": TINY, "max_tokens": 3, **CHAT}
        directory = cpu_turns._private_dir()
        held = [os.open(directory / f"core-{i}.lock", os.O_RDWR | os.O_CREAT, 0o600) for i in range(1, cores)]
        try:
            for fd in held:
                await asyncio.to_thread(fcntl.flock, fd, fcntl.LOCK_EX)
            narrow = await client.post("chat/completions", json=body)
            assert narrow.status_code == 200
            assert (await client.get("stats")).json()["decode_threads"] == 1
        finally:
            for fd in held:
                os.close(fd)
        # the steps on one core were not timed: the planner measures its two threads first (three steps of them)
        wide = await client.post("chat/completions", json=body)
        assert (await client.get("stats")).json()["decode_threads"] == 2
    assert wide.json()["choices"][0]["message"] == narrow.json()["choices"][0]["message"]
    assert narrow.json()["usage"]["completion_tokens"] == 3
