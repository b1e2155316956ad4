"""llama-server's utility routes (``tokenize``, ``detokenize``, ``props``, ``slots``) on both hosts."""

from __future__ import annotations

from typing import Any

import httpx

from tests.support.hosts import Host
from tests.support.tiny_models import TINY


async def test_tokenize_and_detokenize_round_trip(host: Host) -> None:
    text = "Hello world, hello tokens"
    async with host.client() as client:
        plain = (await client.post("tokenize", json={"model": TINY, "content": text})).json()["tokens"]
        assert plain and all(isinstance(t, int) for t in plain)
        special = (await client.post("tokenize", json={"model": TINY, "content": text, "add_special": True})).json()
        assert special["tokens"][1:] == plain or special["tokens"] == plain  # the BOS, where the model adds one
        pieces = (await client.post("tokenize", json={"model": TINY, "content": text, "with_pieces": True})).json()
        assert [p["id"] for p in pieces["tokens"]] == plain
        assert "".join(p["piece"] for p in pieces["tokens"]).strip() == text
        back = (await client.post("detokenize", json={"model": TINY, "tokens": plain})).json()
        assert back["content"].strip() == text
        # without a model: the loaded chat model
        assert (await client.post("tokenize", json={"content": text})).json()["tokens"] == plain
        bad = await client.post("detokenize", json={"model": TINY, "tokens": [10**9]})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_argument"
        missing = await client.post("tokenize", json={"model": TINY})
        assert missing.status_code == 400 and "content" in missing.json()["error"]["message"]


async def test_props_and_slots(host: Host) -> None:
    async with host.client() as client:
        await client.post("unload", json={})
        none = await client.get("props")
        assert none.status_code == 400 and none.json()["error"]["code"] == "missing_argument"
        assert (await client.get("slots")).json() == []  # nothing loaded: no slots
        props = (await client.get("props", params={"model": TINY})).json()  # loads it
        health = (await client.get("health")).json()
        (loaded,) = health["all_models_loaded"]
        assert props["total_slots"] == loaded["slots"]["total"] >= 1
        assert props["n_ctx"] == (await client.get(f"models/{TINY}")).json()["context_length"]
        assert props["chat_template"] and props["modalities"] == {"vision": False, "audio": False}
        assert props["default_generation_settings"]["params"]["temperature"] > 0
        idle = (await client.get("slots", params={"model": TINY})).json()
        assert len(idle) == props["total_slots"] and not any(s["is_processing"] for s in idle)
        assert {s["model"] for s in idle} == {TINY}
        body = {"model": TINY, "messages": [{"role": "user", "content": "go"}], "max_tokens": 200, "stream": True}
        async with client.stream("POST", "chat/completions", json=body) as stream:
            lines = stream.aiter_lines()
            async for line in lines:
                if '"content": "' in line:  # a token came: the request holds a slot
                    break
            busy = (await client.get("slots")).json()
            async for _ in lines:
                pass
        assert sum(s["is_processing"] for s in busy) == 1
        (working,) = [s for s in busy if s["is_processing"]]
        assert working["next_token"]["n_decoded"] >= 1 and working["n_past"] > 0


async def test_under_every_prefix(host: Host) -> None:
    async with httpx.AsyncClient(base_url=host.root, headers=host.headers, timeout=60) as client:
        for prefix in ("api/v1/", "v1/", "api/v0/", "v0/"):
            response = await client.post(prefix + "tokenize", json={"model": TINY, "content": "hi"})
            assert response.status_code == 200 and response.json()["tokens"], prefix


async def _complete(client: httpx.AsyncClient, prompt: str, max_tokens: int = 4) -> dict[str, Any]:
    body = {"model": TINY, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "seed": 3}
    response = await client.post("completions", json=body)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


async def test_a_slot_saved_to_disk_restores_into_its_slot(host: Host) -> None:
    """``POST /slots/0?action=save`` writes the slot's prompt under the cache; after another prompt took the slot,
    ``action=restore`` brings it back and the first prompt's continuation reuses all of it."""
    a = "one two three four five six seven eight nine ten " * 4
    async with host.client() as client:
        await client.post("unload", json={"model_name": TINY})
        assert (
            await client.post("load", json={"model_name": TINY, "llamacpp_args": "--parallel 1"})
        ).status_code == 200
        first = await _complete(client, a)
        (slot,) = (await client.get("slots", params={"model": TINY})).json()
        saved = await client.post("slots/0", params={"action": "save", "model": TINY}, json={"filename": "a.bin"})
        assert saved.status_code == 200, saved.text
        answer = saved.json()
        assert answer["id_slot"] == 0 and answer["filename"] == "a.bin"
        assert answer["n_saved"] == slot["cache_tokens"] >= first["usage"]["prompt_tokens"] and answer["n_written"] > 0
        await _complete(client, "zulu yankee xray whiskey " * 4)  # the slot now holds another prompt
        restored = await client.post("slots/0", params={"action": "restore", "model": TINY}, json={"filename": "a.bin"})
        assert restored.status_code == 200, restored.text
        assert restored.json()["n_restored"] == answer["n_saved"]
        assert (await client.get("slots", params={"model": TINY})).json()[0]["cache_tokens"] == answer["n_saved"]
        again = await _complete(client, a, max_tokens=6)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == again["usage"]["prompt_tokens"] - 1
        assert again["choices"][0]["text"].startswith(first["choices"][0]["text"])

        erased = await client.post("slots/0", params={"action": "erase", "model": TINY})
        assert erased.status_code == 200 and erased.json()["n_erased"] > 0
        assert (await client.get("slots", params={"model": TINY})).json()[0]["cache_tokens"] == 0
        for params, body, code in (
            ({"action": "save"}, {"filename": "../escape.bin"}, "invalid_argument"),
            ({"action": "save"}, {"filename": "sub/dir.bin"}, "invalid_argument"),
            ({"action": "save"}, {}, "missing_argument"),
            ({"action": "restore"}, {"filename": "never-saved.bin"}, "invalid_argument"),
            ({"action": "copy"}, {"filename": "a.bin"}, "invalid_argument"),
        ):
            refused = await client.post("slots/0", params={**params, "model": TINY}, json=body)
            assert refused.status_code == 400 and refused.json()["error"]["code"] == code, (params, body)
        beyond = await client.post("slots/7", params={"action": "erase", "model": TINY})
        assert beyond.status_code == 400 and beyond.json()["error"]["code"] == "invalid_argument"
        await client.post("unload", json={"model_name": TINY})
