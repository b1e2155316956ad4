"""Continuous batching in the llama.cpp engine, through both personal hosts over real HTTP.

A model loaded with ``--parallel N`` reports N slots in ``/v1/health``, generates N requests together, gives each
request exactly the output it gets alone (per-sequence sampling state: seeds, penalties, grammars, stop strings,
logprobs; batch-invariant kernels, so the same logits to the last bit), lets a client that leaves free its slot,
and keeps one prompt cache per slot.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from lemonkit.backends.llamacpp.prompt_cache import common_prefix
from tests.support.hosts import API_KEY, Host, Standalone
from tests.support.tiny_models import TINY
from tests.support.waiting import until

pytestmark = pytest.mark.slow

TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look a word up",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
    },
}
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


def _chat(content: str, **extra: Any) -> dict[str, Any]:
    return {"model": TINY, "messages": [{"role": "user", "content": content}], "max_tokens": 40, **extra}


#: Seven requests with their own sampling settings; each must answer in a batch exactly as alone.
FINISHING = {
    "greedy": _chat("one", temperature=0, logprobs=True, top_logprobs=2),
    "seeded": _chat("two", temperature=0.9, seed=11, top_k=20),
    "nucleus": _chat("three", temperature=0.7, seed=12, top_p=0.8, min_p=0.1),
    # long enough to be evaluated in chunks beside the others (ggml has other kernels for 64 rows and more)
    "penalties": _chat("four " * 150, temperature=1.0, seed=13, repeat_penalty=1.3, presence_penalty=0.5),
    "json": _chat(
        "five",
        temperature=0,
        max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
    ),
    "tool": _chat(
        "six",
        temperature=0,
        max_tokens=60,
        tools=[TOOL],
        tool_choice={"type": "function", "function": {"name": "lookup"}},
    ),
    "logprobs_stop": _chat("seven", temperature=0, logprobs=True, top_logprobs=2, stop=["loo"]),
}


async def _load(client: httpx.AsyncClient, llamacpp_args: str) -> None:
    await client.post("unload", json={"model_name": TINY})  # 404 when not loaded: fine
    body = {"model_name": TINY, "ctx_size": 4096, "llamacpp_args": llamacpp_args}
    response = await client.post("load", json=body)
    assert response.status_code == 200, response.text


async def _entry(client: httpx.AsyncClient) -> dict[str, Any]:
    health = (await client.get("health")).json()
    (entry,) = [m for m in health["all_models_loaded"] if m["model_name"] == TINY]
    return entry


async def _idle(client: httpx.AsyncClient) -> None:
    async def idle() -> bool:
        entry = await _entry(client)
        return entry["slots"]["busy"] == 0 and entry["queue_depth"] == 0

    await until(idle, "the model to be idle")


class Answer:
    """What a stream delivered: its text, tool-call arguments, logprob tokens, finish reason and usage."""

    def __init__(self) -> None:
        self.text = ""
        self.arguments = ""
        self.logprobs: list[tuple[str, float, list[tuple[str, float]]]] = []
        self.finish: str | None = None
        self.usage: dict[str, Any] | None = None
        self.events = 0

    def add(self, chunk: dict[str, Any]) -> None:
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        if not chunk["choices"]:
            return
        choice = chunk["choices"][0]
        delta = choice["delta"]
        self.text += delta.get("content") or ""
        for call in delta.get("tool_calls") or []:
            self.arguments += call["function"].get("arguments") or ""
        for entry in (choice.get("logprobs") or {}).get("content") or []:
            tops = [(top["token"], top["logprob"]) for top in entry.get("top_logprobs") or []]
            self.logprobs.append((entry["token"], entry["logprob"], tops))
        self.finish = choice.get("finish_reason") or self.finish
        self.events += 1

    def same_as(self, alone: Answer) -> None:
        """Assert this answer is the lone one: text, tool-call arguments, logprobs to the last bit, finish, usage."""
        assert self.text == alone.text
        assert self.arguments == alone.arguments
        assert self.logprobs == alone.logprobs
        assert self.finish == alone.finish
        assert self.usage is not None and alone.usage is not None
        assert self.usage["completion_tokens"] == alone.usage["completion_tokens"]
        assert self.usage["prompt_tokens"] == alone.usage["prompt_tokens"]


async def _stream(
    client: httpx.AsyncClient, body: dict[str, Any], answer: Answer, *, events: int | None = None
) -> Answer:
    """Stream ``body`` into ``answer``; with ``events``, close the connection after that many (a client leaving)."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", "chat/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                answer.add(json.loads(line[len("data: ") :]))
                if events is not None and answer.events >= events:
                    return answer
    return answer


async def test_eight_streams_in_a_batch_answer_as_alone(host: Host) -> None:
    async with host.client() as client:
        await _load(client, "--parallel 8")
        assert (await _entry(client))["slots"]["total"] == 8
        alone = {name: await _stream(client, body, Answer()) for name, body in FINISHING.items()}

        batched = {name: Answer() for name in FINISHING}
        leaving = Answer()
        tasks = [asyncio.ensure_future(_stream(client, FINISHING[n], batched[n])) for n in FINISHING]
        tasks.append(asyncio.ensure_future(_stream(client, _chat("eight", max_tokens=3000), leaving, events=3)))
        await asyncio.gather(*tasks)
        await _idle(client)  # the stream whose client left freed its slot
        stats = (await client.get("stats")).json()

    for name in FINISHING:
        batched[name].same_as(alone[name])
    # the grammars held (TINY's strings may run until max_tokens, so the JSON may be cut short)
    assert batched["json"].text.replace(" ", "").startswith('{"name":"')
    assert batched["tool"].arguments.replace(" ", "").startswith('{"q":"')
    assert batched["logprobs_stop"].logprobs and all(lp <= 0 for _, lp, _ in batched["logprobs_stop"].logprobs)
    assert batched["seeded"].text != batched["greedy"].text
    assert leaving.events == 3 and leaving.finish is None
    # /v1/stats describes one finished request, consistently
    assert stats["input_tokens"] == stats["prompt_tokens"] - stats["cache_tokens"]
    assert stats["output_tokens"] == len(stats["decode_token_times"])


async def test_slots_in_health_and_all_of_them_generate_at_once(host: Host) -> None:
    """N streams have all produced tokens while every one still holds its slot (none has finished)."""
    n = 3
    async with host.client() as client:
        await _load(client, f"--parallel {n}")
        assert (await _entry(client))["slots"] == {"total": n, "busy": 0, "idle": n}
        answers = [Answer() for _ in range(n)]
        # TINY never ends on its own: each stream runs until its client leaves (or the context is full)
        body = _chat("go", temperature=0, max_tokens=4000)
        streams = [client.stream("POST", "chat/completions", json={**body, "stream": True}) for _ in range(n)]
        responses = await asyncio.gather(*(s.__aenter__() for s in streams))
        try:
            lines = [r.aiter_lines() for r in responses]
            for answer, it in zip(answers, lines, strict=True):
                while not answer.text:
                    line = await anext(it)
                    if line.startswith("data: {"):
                        answer.add(json.loads(line[len("data: ") :]))
            entry = await _entry(client)
            assert entry["slots"] == {"total": n, "busy": n, "idle": 0}
            assert all(a.finish is None for a in answers)
        finally:
            for s in streams:
                await s.__aexit__(None, None, None)
        await _idle(client)


async def test_each_slot_keeps_its_own_prompt_cache(host: Host) -> None:
    """Two conversations interleaved on two slots: each second turn reuses its own first turn, answers unchanged."""
    first = {
        "a": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}],
        "b": [{"role": "user", "content": "Count to three, slowly, in a language of your choice."}],
    }
    greedy = {"temperature": 0, "max_tokens": 8}
    again = {"role": "user", "content": "Another one."}

    async def post(client: httpx.AsyncClient, messages: list[dict[str, Any]]) -> dict[str, Any]:
        response = await client.post("chat/completions", json={"model": TINY, "messages": messages, **greedy})
        assert response.status_code == 200, response.text
        result: dict[str, Any] = response.json()
        return result

    async with host.client() as client:
        await _load(client, "--parallel 2")
        one = {k: await post(client, m) for k, m in first.items()}
        second = {
            k: [*m, {"role": "assistant", "content": one[k]["choices"][0]["message"]["content"]}, again]
            for k, m in first.items()
        }
        two = {k: await post(client, m) for k, m in second.items()}
        await _load(client, "--parallel 2")
        fresh = {k: await post(client, m) for k, m in second.items()}
    for k in first:
        cached = two[k]["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == two[k]["timings"]["cache_n"]
        # the first turn's prompt (its answer may render differently in the template) came from the slot
        assert one[k]["usage"]["prompt_tokens"] - 8 <= cached < two[k]["usage"]["prompt_tokens"]
        assert fresh[k]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert two[k]["choices"][0]["message"] == fresh[k]["choices"][0]["message"]


async def test_the_prompts_of_one_completion_share_the_batch(host: Host) -> None:
    """A completion's prompts generate side by side, one slot each, and each answers as it does alone."""
    prompts = ["one", "two two", "three three three"]
    seeded = {"model": TINY, "max_tokens": 30, "temperature": 0.9, "seed": 7, "logprobs": 2}
    async with host.client() as client:
        await _load(client, "--parallel 3")
        alone = [(await client.post("completions", json={**seeded, "prompt": p})).json() for p in prompts]
        together = (await client.post("completions", json={**seeded, "prompt": prompts})).json()

        body = {"model": TINY, "prompt": prompts, "max_tokens": 4000, "temperature": 0, "stream": True}
        async with client.stream("POST", "completions", json=body) as response:
            assert response.status_code == 200
            seen: set[int] = set()
            lines = response.aiter_lines()
            # TINY never ends on its own: one after another, the second prompt would start 4000 tokens later
            while len(seen) < len(prompts):
                line = await anext(lines)
                if line.startswith("data: {"):
                    (choice,) = json.loads(line[len("data: ") :])["choices"]
                    assert choice["finish_reason"] is None
                    seen.add(choice["index"])
        await _idle(client)  # leaving ended all three

    assert [c["index"] for c in together["choices"]] == [0, 1, 2]
    for choice, lone in zip(together["choices"], alone, strict=True):
        (want,) = lone["choices"]
        assert (choice["text"], choice["logprobs"], choice["finish_reason"]) == (
            want["text"],
            want["logprobs"],
            want["finish_reason"],
        )
    assert together["usage"]["completion_tokens"] == sum(a["usage"]["completion_tokens"] for a in alone)


async def test_plain_kernels_without_batch_invariance(host: Host) -> None:
    """``--no-batch-invariant`` runs the bundled SmolLM2 on ggml's other CPU kernels: they answer (on AMX CPUs the
    repacked ones crashed the sidecar, so there lemonkit leaves repacking off unless ``--repack`` asks for it)."""
    from lemonkit.catalog.config import DEFAULT_CHAT_MODEL

    async with host.client() as client:
        body = {"model_name": DEFAULT_CHAT_MODEL, "llamacpp_args": "--no-batch-invariant"}
        assert (await client.post("load", json=body)).status_code == 200
        ask = {"model": DEFAULT_CHAT_MODEL, "messages": [{"role": "user", "content": "Name three colours."}]}
        answer = await client.post("chat/completions", json={**ask, "max_tokens": 8, "temperature": 0})
        assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"]
        health = (await client.get("health")).json()
        (entry,) = [m for m in health["all_models_loaded"] if m["model_name"] == DEFAULT_CHAT_MODEL]
        assert entry["model_name"] == DEFAULT_CHAT_MODEL
        await client.post("unload", json={"model_name": DEFAULT_CHAT_MODEL})


async def test_a_more_urgent_request_is_not_held_behind_less_urgent_prompts(host: Host) -> None:
    """Two long prompts of a batch's priority (1) are being evaluated, a step's budget at a time; a chat at the
    default priority (0) sent after them gets its prompt evaluated first and finishes before either."""
    async with host.client() as client:
        await _load(client, "--parallel 3 -b 64 -ub 64")
        long = {"model": TINY, "prompt": "word " * 600, "max_tokens": 1, "temperature": 0, "priority": 1}
        behind = [asyncio.ensure_future(client.post("completions", json=long)) for _ in range(2)]

        async def both_admitted() -> bool:
            return (await _entry(client))["slots"]["busy"] == 2

        await until(both_admitted, "the long prompts to take their slots")
        urgent = asyncio.ensure_future(client.post("completions", json={**long, "prompt": "hi", "priority": 0}))
        done, _ = await asyncio.wait([urgent, *behind], return_when=asyncio.FIRST_COMPLETED)
        assert urgent in done and not any(b in done for b in behind)
        for response in await asyncio.gather(urgent, *behind):
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["completion_tokens"] == 1
        bad = await client.post("completions", json={**long, "priority": "high"})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_argument"
        await _idle(client)


async def test_a_prompt_shares_a_busy_slots_prefix_and_answers_as_alone(host: Host) -> None:
    """While one slot generates after a long prompt, a second request with the same prefix goes to the other slot
    (the only idle one, holding nothing) and takes the prefix's cells from the busy slot: reported as cached, and the
    same answer as on a freshly loaded model."""
    prefix = "Instruction: label the following item carefully. " * 12
    second = {"model": TINY, "prompt": prefix + "Item: a lamp.", "max_tokens": 8, "temperature": 0}
    async with host.client() as client:
        await _load(client, "--parallel 2")
        alone = (await client.post("completions", json=second)).json()
        await _load(client, "--parallel 2")
        body = {"model": TINY, "prompt": prefix + "Item: a kettle.", "max_tokens": 4000, "temperature": 0}
        async with client.stream("POST", "completions", json={**body, "stream": True}) as busy:
            lines = busy.aiter_lines()
            while not (await anext(lines)).startswith("data: {"):
                pass  # the first slot is generating: its prompt is in the cache
            shared = (await client.post("completions", json=second)).json()
    assert shared["choices"][0]["text"] == alone["choices"][0]["text"]
    cached = shared["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert alone["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert shared["usage"]["prompt_tokens"] - 12 <= cached < shared["usage"]["prompt_tokens"], shared["usage"]
    async with host.client() as client:
        await _idle(client)


async def test_rows_of_one_template_sent_together_evaluate_the_instruction_once(host: Host) -> None:
    """Four prompts sharing a long instruction in one request (so they reach four idle slots at once): one slot
    evaluates the instruction, the others wait for it and share its cells; each answer is the one it has alone."""
    instruction = "Label the sentiment of the review below as positive or negative. " * 6
    prompts = [instruction + f"Review {i}: {word}" for i, word in enumerate(("great", "awful", "fine", "boring"))]
    body = {"model": TINY, "max_tokens": 8, "temperature": 0}
    async with host.client() as client:
        await _load(client, "--parallel 4")
        tokens = []
        for prompt in prompts:
            answer = await client.post("tokenize", json={"model": TINY, "content": prompt, "add_special": True})
            tokens.append(answer.json()["tokens"])
        alone = [
            (await client.post("completions", json={**body, "prompt": p, "cache_prompt": False})).json()
            for p in prompts
        ]
        await _load(client, "--parallel 4")  # no slot holds anything
        together = (await client.post("completions", json={**body, "prompt": prompts})).json()
        await _idle(client)
    shared = {common_prefix(a, b) for a in tokens for b in tokens if a is not b}
    assert len(shared) == 1 and next(iter(shared)) > 64
    assert [a["usage"]["prompt_tokens"] for a in alone] == [len(t) for t in tokens]
    assert [c["text"] for c in together["choices"]] == [a["choices"][0]["text"] for a in alone]
    assert together["usage"]["prompt_tokens_details"]["cached_tokens"] == 3 * next(iter(shared))


async def test_a_stream_keeps_generating_while_a_long_prompt_is_evaluated(host: Host) -> None:
    """Decoding goes first: with ``--prefill-budget 8`` another request's prompt of ~2,000 tokens is evaluated 8
    tokens a step, and the running stream gets a token in each of those steps (without the budget: 4 steps of 512,
    4 tokens). A short prompt sent meanwhile goes ahead of the long one and answers first."""
    async with host.client() as client:
        await _load(client, "--parallel 3 --prefill-budget 8")
        received: list[int] = []
        started = asyncio.Event()

        async def stream() -> None:
            body = {**_chat("Tell a long story."), "max_tokens": 1200, "temperature": 0, "stream": True}
            async with client.stream("POST", "chat/completions", json=body) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                        received.append(1)
                        if len(received) == 3:
                            started.set()
                        if long_done.is_set():
                            return  # the client leaves: the test has what it counts

        long_done = asyncio.Event()
        streaming = asyncio.ensure_future(stream())
        await asyncio.wait_for(started.wait(), 120)
        long = {"model": TINY, "prompt": "word " * 1000, "max_tokens": 1, "temperature": 0}
        before = len(received)
        evaluated = asyncio.ensure_future(client.post("completions", json=long))

        async def long_admitted() -> bool:
            return (await _entry(client))["slots"]["busy"] == 2

        await until(long_admitted, "the long prompt to take a slot")
        short = await client.post("completions", json={**long, "prompt": "hi"})
        assert short.status_code == 200 and not evaluated.done()  # the short prompt did not wait for the long one
        answer = await evaluated
        during = len(received) - before
        long_done.set()
        await streaming
        assert answer.status_code == 200, answer.text
        prompt_tokens = answer.json()["usage"]["prompt_tokens"]
        assert prompt_tokens > 900
        # a step of 8 prompt tokens each, and a token of the stream in every one of them (two steps of slack for
        # the stream's tokens still on their way when the long answer arrived)
        assert during >= prompt_tokens // 8 - 2, (during, prompt_tokens)
        bad = await client.post("load", json={"model_name": TINY, "llamacpp_args": "--prefill-budget 0"})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_argument"
        await _idle(client)


@pytest.fixture(scope="module")
def pinging() -> Iterator[Host]:
    """A ``lemonkit serve`` that pings a stream after 10 ms of silence."""
    server = Standalone({"LEMONADE_API_KEY": API_KEY, "LEMONKIT_PING_INTERVAL": "0.01"})
    yield Host("standalone", server.root, API_KEY)
    server.stop()


async def test_a_stream_waiting_for_its_prompt_hears_pings_that_clients_skip(pinging: Host) -> None:
    """While a long prompt is evaluated (16 tokens a decode: over a hundred decodes) the stream's headers are out
    and ``: ping`` comments keep it alive; the openai SDK reads the same answer as a request that is not streamed."""
    body = {"model": TINY, "prompt": "word " * 1000, "max_tokens": 8, "temperature": 0}
    async with pinging.client() as client:
        await _load(client, "--parallel 1 -b 16 -ub 16")
        lines: list[str] = []
        async with client.stream("POST", "completions", json={**body, "stream": True}) as response:
            assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
            lines = [line async for line in response.aiter_lines()]
        first = next(i for i, line in enumerate(lines) if line.startswith("data: "))
        assert ": ping" in lines[:first]  # the client heard from the server before the prompt was evaluated
        assert all(not line or line == ": ping" or line.startswith("data: ") for line in lines), lines
        streamed = "".join(json.loads(line[6:])["choices"][0]["text"] for line in lines if line.startswith("data: {"))
        whole = (await client.post("completions", json=body)).json()["choices"][0]["text"]
    sdk = openai.AsyncOpenAI(base_url=pinging.api, api_key=API_KEY, max_retries=0, timeout=120)
    chunks = [chunk async for chunk in await sdk.completions.create(**body, stream=True)]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == streamed == whole
