"""llama-server's utility routes (``tokenize``, ``detokenize``, ``props``, ``slots``) on both hosts."""

from __future__ import annotations

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
