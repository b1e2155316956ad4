"""Speculative decoding with n-gram drafts (``--spec-type ngram-simple``, ``ngram-mod``), draft models (``-md``,
a "draft" checkpoint, a companion GGUF) and a model's own MTP layers (``draft-mtp``, the ``mtp`` label): the tokens
are those decoding one at a time gives (greedy and seeded sampling, alone and beside other streams in one batch,
under a grammar), a sequence that repeats itself accepts drafts, which ``timings`` reports, and a draft model of
another vocabulary is refused at load."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx

from lemonkit.catalog.placement import PROCESS_BYTES, MiB, host_estimate
from lemonkit.formats.gguf_header import read_gguf_layout
from tests.support.hosts import API_KEY, Host, Standalone
from tests.support.session import HF_CACHE
from tests.support.tiny_models import (
    DRAFTED,
    GEMMA4_ASSISTANT,
    GEMMA4_MTP,
    GEMMA4_RANDOM_MTP,
    HYBRID,
    HYBRID_MTP,
    HYBRID_MTP_RANDOM,
    MAMBA,
    MTP,
    MTP_LABEL_ONLY,
    OTHER_VOCAB,
    TEST_REPO,
    TINY,
    WITH_COMPANION,
)

SPEC = "--spec-type ngram-simple --draft-max 8"
#: drafts of a fixed length (--spec-draft-n-min at --spec-draft-n-max, never stopped by the draft model's doubt), so
#: that two loads draft the same tokens whatever their steps measured
PINNED = "--spec-draft-p-min 0 --spec-draft-n-max 4 --spec-draft-n-min 4"
#: a prompt whose continuation copies it: a draft-friendly workload
COPY = "red green blue red green blue red green blue red green blue red green blue red green blue"
PROMPTS = (COPY, "one two three four five six seven", "the quick brown fox jumps over the lazy dog and the")
SCHEMA = {
    "type": "json_schema",
    "json_schema": {
        "name": "item",
        "schema": {
            "type": "object",
            "properties": {"colour": {"type": "string", "enum": ["red", "green", "blue"]}, "n": {"type": "integer"}},
            "required": ["colour", "n"],
        },
    },
}


async def _load(client: httpx.AsyncClient, args: str, model: str = TINY) -> None:
    await client.post("unload", json={"model_name": model})
    response = await client.post("load", json={"model_name": model, "llamacpp_args": f"--parallel 4 {args}"})
    assert response.status_code == 200, response.text


async def _complete(client: httpx.AsyncClient, prompt: str, model: str = TINY, **fields: Any) -> dict[str, Any]:
    body = {"model": model, "prompt": prompt, "max_tokens": 48, "temperature": 0, **fields}
    response = await client.post("completions", json=body)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


async def _chat(client: httpx.AsyncClient, text: str, model: str = TINY) -> dict[str, Any]:
    messages = [{"role": "user", "content": text}]
    body = {"model": model, "messages": messages, "max_tokens": 48, "temperature": 0, "response_format": SCHEMA}
    response = await client.post("chat/completions", json=body)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


async def _workload(client: httpx.AsyncClient, model: str = TINY) -> dict[str, Any]:
    """Each prompt alone, then all of them at once with a seeded sampled one and a grammar one beside."""
    alone = [await _complete(client, p, model) for p in PROMPTS]
    together = await asyncio.gather(
        *(_complete(client, p, model) for p in PROMPTS),
        _complete(client, COPY, model, temperature=0.9, seed=11),
        _chat(client, "Pick a colour and a number.", model),
    )
    return {"alone": alone, "together": list(together)}


def _texts(answers: list[dict[str, Any]]) -> list[str]:
    return [a["choices"][0].get("text", a["choices"][0].get("message", {}).get("content")) for a in answers]


async def test_drafts_change_no_token_and_are_accepted_on_a_copying_prompt() -> None:
    server = Standalone({"LEMONADE_API_KEY": API_KEY})
    try:
        host = Host("standalone", server.root, API_KEY)
        async with host.client() as client:
            await _load(client, "")
            plain = await _workload(client)
            await _load(client, SPEC)
            drafted = await _workload(client)
            again = await _complete(client, COPY, TINY, temperature=0.9, seed=11)  # the seeded stream, alone this time
    finally:
        server.stop()
    _same_tokens(drafted, plain)  # the grammar's answer is still its JSON, too
    assert _texts([again]) == _texts([drafted["together"][3]])  # reproducible by its seed, drafts or not
    assert not any("draft_n" in base["timings"] for base in plain["alone"] + plain["together"])
    copying = drafted["alone"][0]["timings"]
    assert copying["draft_n"] > 0 and 0 < copying["draft_n_accepted"] <= copying["draft_n"], copying


def _same_tokens(drafted: dict[str, Any], plain: dict[str, Any], sampled: bool = True) -> None:
    """The same answers (``sampled=False``: but the seeded sampled one, which may differ in float rounding)."""
    keep = [i for i in range(len(drafted["together"])) if sampled or i != 3]  # 3: the seeded sampled stream
    ours = drafted["alone"] + [drafted["together"][i] for i in keep]
    theirs = plain["alone"] + [plain["together"][i] for i in keep]
    assert _texts(ours) == _texts(theirs)
    for spec, base in zip(ours, theirs, strict=True):
        assert spec["usage"]["completion_tokens"] == base["usage"]["completion_tokens"]
    json.loads(_texts(drafted["together"])[-1])


def _drafted(workload: dict[str, Any]) -> tuple[int, int]:
    answers = workload["alone"] + workload["together"]
    return sum(a["timings"].get("draft_n", 0) for a in answers), sum(
        a["timings"].get("draft_n_accepted", 0) for a in answers
    )


async def test_draft_models_and_the_shared_pool_change_no_token() -> None:
    server = Standalone({"LEMONADE_API_KEY": API_KEY})
    try:
        host = Host("standalone", server.root, API_KEY)
        async with host.client() as client:
            await _load(client, "")
            plain = await _workload(client)
            await _load(
                client, f"-md {TINY} --draft-p-min 0 --spec-draft-n-min 1"
            )  # the model drafts for itself: its drafts are right
            itself = await _workload(client)
            await _load(
                client, f"--spec-type ngram-mod,draft-simple --spec-draft-n-max 6 --spec-draft-n-min 1 -md {DRAFTED}"
            )
            mixed = await _workload(client)
            await _load(client, f"{PINNED}", DRAFTED)  # the row's draft checkpoint: tiny-llama-b
            checkpoint = await _workload(client, DRAFTED)
            await _load(client, f"--spec-type draft-simple {PINNED}", WITH_COMPANION)
            companion = await _workload(client, WITH_COMPANION)
            last = await _complete(client, COPY, WITH_COMPANION)  # /v1/stats reports the last request alone
            stats = (await client.get("stats")).json()
            await client.post("unload", json={"model_name": WITH_COMPANION})
            await _load(client, "--spec-type ngram-mod --spec-ngram-mod-n-match 3 --spec-draft-n-min 1")
            pooled = await _workload(client)
    finally:
        server.stop()
    for workload in (itself, mixed, checkpoint, companion, pooled):
        _same_tokens(workload, plain)
    drafted, accepted = _drafted(itself)
    assert drafted > 0 and accepted >= 0.9 * drafted, (drafted, accepted)
    for workload in (mixed, checkpoint, companion, pooled):
        drafted, accepted = _drafted(workload)
        assert drafted > 0 and 0 <= accepted <= drafted, (drafted, accepted)
    # another model's weights draft worse than the target's own
    assert _drafted(checkpoint)[1] / _drafted(checkpoint)[0] < _drafted(itself)[1] / _drafted(itself)[0]
    assert _drafted(companion) == _drafted(checkpoint)  # the same two files, found beside the model instead
    assert last["timings"]["draft_n"] > 0, last["timings"]
    assert (stats["draft_n"], stats["draft_n_accepted"]) == (
        last["timings"]["draft_n"],
        last["timings"]["draft_n_accepted"],
    )


async def test_the_flags_are_checked(host: Host) -> None:
    async with host.client() as client:
        for args, word in (
            ("--spec-type eagle", "ngram-simple"),
            ("--spec-type draft-mtp", "MTP"),  # tiny-llama has no MTP layers
            ("--spec-type draft-simple,draft-mtp", "not both"),
            ("--spec-type ngram-simple --draft-max 0", "1"),
            ("--spec-draft-p-min 1.5", "probability"),
            ("-md /etc/passwd", "registered model"),
            ("-md user.no-such-model", "no such model"),
            ("--spec-type draft-simple", "-md"),  # no draft model: none registered and no companion beside it
        ):
            refused = await client.post("load", json={"model_name": TINY, "llamacpp_args": args})
            assert refused.status_code == 400, refused.text
            assert word in refused.json()["error"]["message"], (args, refused.text)


def _all_but_sampled_accepted(workload: dict[str, Any]) -> None:
    """A head that says what the trunk will: drafts of the greedy streams accepted (the sampled one may differ)."""
    greedy = {"alone": workload["alone"], "together": workload["together"][:3]}
    n, accepted = _drafted(greedy)
    assert n > 0 and accepted >= 0.9 * n, (n, accepted)


async def _speculative_slots(client: httpx.AsyncClient, model: str) -> list[bool]:
    slots = (await client.get("slots", params={"model": model})).json()
    return [slot["speculative"] for slot in slots]


async def test_mtp_drafts_change_no_token_and_the_mtp_label_switches_them_on() -> None:
    """The mtp label's defaults (draft-mtp, 3 tokens, p-min 0.75) on a model with an MTP layer: the same tokens as
    without, alone and beside other streams, and the head's drafts, which say what the trunk will, accepted. The
    label on a model whose file has no MTP layers loads it without speculation."""
    server = Standalone({"LEMONADE_API_KEY": API_KEY})
    try:
        host = Host("standalone", server.root, API_KEY)
        async with host.client() as client:
            await _load(client, "--spec-type none", MTP)
            assert await _speculative_slots(client, MTP) == [False] * 4
            plain = await _workload(client, MTP)
            # the label's draft-mtp, pinned to drafting on every step whatever a step of this tiny model costs
            await _load(client, "--spec-draft-n-min 1", MTP)
            assert await _speculative_slots(client, MTP) == [True] * 4
            drafted = await _workload(client, MTP)
            again = await _complete(client, COPY, MTP, temperature=0.9, seed=11)
            await client.post("unload", json={"model_name": MTP})
            await _load(client, "", MTP_LABEL_ONLY)
            assert await _speculative_slots(client, MTP_LABEL_ONLY) == [False] * 4
            no_head = await _complete(client, COPY, MTP_LABEL_ONLY)
    finally:
        server.stop()
    _same_tokens(drafted, plain)
    assert _texts([again]) == _texts([drafted["together"][3]])  # reproducible by its seed, drafts or not
    _all_but_sampled_accepted(drafted)
    assert "draft_n" not in no_head["timings"] and no_head["usage"]["completion_tokens"] == 48


async def _head_runs(good: str, random: str, random_args: str) -> tuple[dict[str, Any], ...]:
    """The workload of a model whose MTP head says what the target will (``good``), without drafts and with the
    mtp label's (drafting every step), then of one whose head is random, without and with ``random_args``."""
    server = Standalone({"LEMONADE_API_KEY": API_KEY})
    try:
        host = Host("standalone", server.root, API_KEY)
        async with host.client() as client:
            await _load(client, "--spec-type none", good)
            assert await _speculative_slots(client, good) == [False] * 4
            plain = await _workload(client, good)
            await _load(client, "--spec-draft-n-min 1", good)
            assert await _speculative_slots(client, good) == [True] * 4
            drafted = await _workload(client, good)
            await client.post("unload", json={"model_name": good})
            await _load(client, "--spec-type none", random)
            random_plain = await _workload(client, random)
            await _load(client, random_args, random)
            rejected = await _workload(client, random)
    finally:
        server.stop()
    return plain, drafted, random_plain, rejected


async def test_a_gemma4_assistant_drafts_over_the_targets_cache_and_changes_no_token() -> None:
    """Lemonade's Gemma 4 MTP rows: the mtp label with a "draft" checkpoint that is Gemma 4's assistant, a head in a
    file of its own reading the target's KV cache. An assistant that says what the target will has its drafts
    accepted; a random one (named with ``-md`` and ``--spec-type draft-mtp``, pinned to 4 tokens a step) has most
    rejected; neither changes a token, alone or beside other streams."""
    plain, drafted, random_plain, rejected = await _head_runs(
        GEMMA4_MTP, GEMMA4_RANDOM_MTP, f"-md {GEMMA4_ASSISTANT} --spec-type draft-mtp {PINNED}"
    )
    _same_tokens(drafted, plain)
    _all_but_sampled_accepted(drafted)
    _same_tokens(rejected, random_plain)
    n, accepted = _drafted(rejected)
    assert n - accepted >= 40, (n, accepted)


async def test_an_mtp_head_file_of_another_model_is_refused_at_load(host: Host) -> None:
    """``-md`` with ``--spec-type draft-mtp`` names an MTP head file: a draft model (no head) and a head whose
    target is another model are refused with a 400 that says why, and the server is none the worse."""
    async with host.client() as client:
        for model, args, why in (
            (GEMMA4_RANDOM_MTP, f"-md {TINY} --spec-type draft-mtp", "not an MTP head"),
            (TINY, f"-md {GEMMA4_ASSISTANT} --spec-type draft-mtp", "another model"),
        ):
            refused = await client.post("load", json={"model_name": model, "llamacpp_args": args})
            assert refused.status_code == 400, (args, refused.text)
            error = refused.json()["error"]
            assert error["code"] == "model_load_refused" and why in error["message"], (args, error)
        works = await client.post("load", json={"model_name": TINY})
        assert works.status_code == 200, works.text


async def test_a_hybrid_model_rolls_its_recurrent_state_back_past_rejected_drafts() -> None:
    """LFM2's convolution layers keep a state per sequence, which llama.cpp rolls back into the state it kept for
    the last accepted token: drafts of a draft model (of another model's weights, so mostly rejected) and n-gram
    drafts change no token, alone and beside other streams. The mtp label on its file, which has no MTP layers,
    switches nothing on."""
    server = Standalone({"LEMONADE_API_KEY": API_KEY})
    try:
        host = Host("standalone", server.root, API_KEY)
        async with host.client() as client:
            await _load(client, "", HYBRID)
            assert await _speculative_slots(client, HYBRID) == [False] * 4
            plain = await _workload(client, HYBRID)
            await _load(client, f"-md {TINY} {PINNED}", HYBRID)
            modelled = await _workload(client, HYBRID)
            await _load(client, "--spec-type ngram-simple,ngram-mod --spec-draft-n-max 4", HYBRID)
            ngrams = await _workload(client, HYBRID)
    finally:
        server.stop()
    _same_tokens(modelled, plain)
    _same_tokens(ngrams, plain)
    drafted, accepted = _drafted(modelled)
    # every step drafted 4 tokens and most were rejected: each rejection rolled the state back
    assert drafted >= 4 * 48 and drafted - accepted >= 48, (drafted, accepted)


async def test_mtp_beside_recurrent_layers_changes_no_token() -> None:
    """Qwen3.5's layout (a delta-net layer, an attention layer, an MTP block): the mtp label's draft-mtp on a head
    that says what the trunk will is accepted and changes no token; a head of random weights, pinned to draft 4
    tokens a step, is mostly rejected, each rejection rolling the delta-net state back, and changes no greedy
    token either."""
    plain, drafted, random_plain, rejected = await _head_runs(
        HYBRID_MTP, HYBRID_MTP_RANDOM, f"--spec-type draft-mtp {PINNED}"
    )
    _same_tokens(drafted, plain)
    _all_but_sampled_accepted(drafted)
    # verifying a draft runs the delta-net over its tokens in chunks, which rounds otherwise than one token at a
    # time: a seeded sampled stream may take another token where two were all but tied, greedy ones do not
    _same_tokens(rejected, random_plain, sampled=False)
    n, accepted = _drafted(rejected)
    assert n - accepted >= 40, (n, accepted)  # ten steps or more rolled back (failing drafts back off)


async def test_speculation_a_model_cannot_do_is_refused_at_load(host: Host) -> None:
    """``draft-mtp`` on a model without MTP layers, any draft on a recurrent model llama.cpp cannot roll back
    (Mamba), and a draft model with recurrent layers are refused with a 400 that says why; the mtp label on the
    recurrent model loads it without speculation, and it answers."""
    async with host.client() as client:
        for model, args, why in (
            (TINY, "--spec-type draft-mtp", "no MTP"),
            (MAMBA, "--spec-type ngram-simple", "recurrent"),
            (MAMBA, "--spec-type ngram-mod,draft-mtp", "recurrent"),
            (TINY, f"-md {HYBRID}", "recurrent"),  # a draft model's drafted cells are dropped after each draft
        ):
            refused = await client.post("load", json={"model_name": model, "llamacpp_args": args})
            assert refused.status_code == 400, (args, refused.text)
            error = refused.json()["error"]
            assert error["code"] == "model_load_refused" and why in error["message"], (args, error)
        health = (await client.get("health")).json()
        assert MAMBA not in [m["model_name"] for m in health.get("all_models_loaded", [])]
        try:
            await _load(client, "", MAMBA)
            assert await _speculative_slots(client, MAMBA) == [False] * 4
            answers = await asyncio.gather(*(_complete(client, p, MAMBA) for p in PROMPTS))
        finally:
            await client.post("unload", json={"model_name": MAMBA})
    for answer in answers:
        assert answer["usage"]["completion_tokens"] == 48 and "draft_n" not in answer["timings"], answer


async def test_a_draft_model_of_another_vocabulary_is_refused_at_load(host: Host) -> None:
    async with host.client() as client:
        refused = await client.post("load", json={"model_name": TINY, "llamacpp_args": f"-md {OTHER_VOCAB}"})
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["code"] == "model_load_refused" and "tokenizer" in error["message"], error
        health = (await client.get("health")).json()
        assert TINY not in [m["model_name"] for m in health.get("all_models_loaded", [])]
        works = await client.post("load", json={"model_name": TINY})  # the server is none the worse
        assert works.status_code == 200, works.text


async def test_speculation_is_switched_on_per_model_by_its_saved_options(host: Host) -> None:
    async with host.client() as client:
        try:
            body = {"model_name": WITH_COMPANION, "llamacpp_args": "--spec-type ngram-simple", "save_options": True}
            saved = await client.post("load", json=body)
            assert saved.status_code == 200, saved.text
            await client.post("unload", json={"model_name": WITH_COMPANION})
            again = await client.post("load", json={"model_name": WITH_COMPANION})  # no flags: the saved ones
            assert again.status_code == 200, again.text
            answer = await _complete(client, COPY, WITH_COMPANION)
            assert answer["timings"]["draft_n"] > 0, answer["timings"]
        finally:
            await client.post("load", json={"model_name": WITH_COMPANION, "save_options": True})  # back to none
            await client.post("unload", json={"model_name": WITH_COMPANION})
        plain = await client.post("load", json={"model_name": WITH_COMPANION})
        assert plain.status_code == 200
        answer = await _complete(client, COPY, WITH_COMPANION)
        assert "draft_n" not in answer["timings"], answer["timings"]
        await client.post("unload", json={"model_name": WITH_COMPANION})


async def test_a_draft_model_counts_in_the_memory_plan(host: Host) -> None:
    """A draft model adds its file and its context: the target's, with room for each of the 4 slots' drafts (16
    tokens and one more). One named beside n-gram speculation alone is not loaded and adds nothing."""
    memory = {}
    async with host.client() as client:
        for args in ("", f"-md {TINY}", f"-md {TINY} --spec-type ngram-mod"):
            await client.post("unload", json={"model_name": TINY})
            body = {"model_name": TINY, "ctx_size": 4096, "llamacpp_args": f"--parallel 4 {args}"}
            response = await client.post("load", json=body)
            assert response.status_code == 200, response.text
            health = (await client.get("health")).json()
            memory[args] = next(m["memory_mb"] for m in health["all_models_loaded"] if m["model_name"] == TINY)
        await client.post("unload", json={"model_name": TINY})
    (path,) = (HF_CACHE / f"models--{TEST_REPO.replace('/', '--')}" / "snapshots").glob("*/tiny-llama.gguf")
    layout = read_gguf_layout(path)
    assert layout is not None
    draft = path.stat().st_size + host_estimate(0, layout, n_ctx=4096 + 4 * 17) - PROCESS_BYTES
    assert draft > 2 * path.stat().st_size  # the context is most of it
    assert abs(memory[f"-md {TINY}"] - memory[""] - draft / MiB) <= 1, (memory, draft / MiB)
    assert memory[f"-md {TINY} --spec-type ngram-mod"] == memory[""], memory
