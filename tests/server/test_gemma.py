"""The bundled Gemma 3 270M: real weights, real text, through both hosts."""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from tests.support.hosts import Host
from tests.support.tiny_models import GEMMA

pytestmark = pytest.mark.gemma

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current time in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 30}, "hours24": {"type": "boolean"}},
            "required": ["zone", "hours24"],
        },
    },
}
TOOLS = {"get_weather": WEATHER, "get_time": CLOCK}


def _huge_pages_possible() -> bool:
    """glibc asks for transparent huge pages from 2.35 on, and the kernel grants them unless its mode is never."""
    libc, version = platform.libc_ver()
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if libc != "glibc" or tuple(map(int, version.split(".")[:2])) < (2, 35) or not mode.exists():
        return False
    return "[never]" not in mode.read_text()


def _memory(pid: int) -> tuple[set[str], int]:
    """The GGUF files a process maps, and its anonymous memory on huge pages, in bytes."""
    mapped = {line.split()[-1] for line in Path(f"/proc/{pid}/maps").read_text().splitlines() if ".gguf" in line}
    huge = next(line for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines() if "AnonHuge" in line)
    return mapped, int(huge.split()[1]) * 1024


async def test_gemma_weights_are_read_into_huge_pages_unless_mmap_is_asked(host: Host) -> None:
    """The sidecar reads the weights into memory its malloc backs with huge pages (faster decoding than 4 KiB pages
    of the mapped file); ``--mmap`` maps the file instead."""
    async with host.client() as client:
        pids = []
        for args in ("--mmap", ""):
            response = await client.post("load", json={"model_name": GEMMA, "llamacpp_args": args})
            assert response.status_code == 200, response.text
            (loaded,) = (await client.get("health")).json()["all_models_loaded"]
            pids.append(loaded["pid"])
            if args:
                (gguf,) = _memory(loaded["pid"])[0]
            else:
                mapped, huge = _memory(loaded["pid"])
                assert not mapped
                if _huge_pages_possible():
                    # the weights themselves, not only the KV cache and compute buffers
                    assert huge >= 0.8 * Path(gguf).stat().st_size
        await client.post("unload", json={"model_name": GEMMA})
    assert pids[0] != pids[1]  # the second load started a sidecar of its own


async def test_gemma_completion_is_real_text(host: Host) -> None:
    client = host.openai()
    result = await client.completions.create(
        model=GEMMA, prompt="Monday, Tuesday, Wednesday,", max_tokens=8, temperature=0
    )
    text = result.choices[0].text
    assert text.startswith(" Thursday, Friday")
    stream = await client.completions.create(
        model=GEMMA, prompt="Monday, Tuesday, Wednesday,", max_tokens=8, temperature=0, stream=True
    )
    assert "".join([c.choices[0].text async for c in stream if c.choices]) == text


async def test_gemma_chat_and_stream(host: Host) -> None:
    client = host.openai()
    messages = [{"role": "user", "content": "Name a color of the sky."}]
    completion = await client.chat.completions.create(model=GEMMA, messages=messages, max_tokens=16, temperature=0)
    text = completion.choices[0].message.content or ""
    assert text.strip()
    assert completion.usage is not None and 0 < completion.usage.completion_tokens <= 16
    stream = await client.chat.completions.create(
        model=GEMMA, messages=messages, max_tokens=16, temperature=0, stream=True
    )
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text


@pytest.mark.parametrize(
    ("tool_choice", "stream"),
    [("required", False), ({"type": "function", "function": {"name": "get_time"}}, True)],
    ids=["required", "named-streamed"],
)
async def test_gemma_forced_tool_call(host: Host, tool_choice: Any, stream: bool) -> None:
    # Gemma's chat template knows no tools: they reach it as a system prompt, and a grammar forces the call.
    client = host.openai()
    kwargs: dict[str, Any] = dict(
        model=GEMMA,
        messages=[{"role": "user", "content": "What's the weather in Paris right now?"}],
        tools=[WEATHER, CLOCK],
        tool_choice=tool_choice,
        max_tokens=96,
        temperature=0,
    )
    if stream:
        chunks = [c async for c in await client.chat.completions.create(stream=True, **kwargs)]
        parts = [p for c in chunks if c.choices for p in c.choices[0].delta.tool_calls or []]
        assert parts and all(p.index == 0 for p in parts)
        call_id, name = parts[0].id, parts[0].function.name
        arguments = "".join(p.function.arguments or "" for p in parts)
        finish = chunks[-1].choices[0].finish_reason
    else:
        completion = await client.chat.completions.create(**kwargs)
        choice = completion.choices[0]
        assert choice.message.tool_calls is not None and len(choice.message.tool_calls) == 1
        (call,) = choice.message.tool_calls
        call_id, name, arguments, finish = call.id, call.function.name, call.function.arguments, choice.finish_reason
    assert finish == "tool_calls"
    assert call_id and call_id.startswith("call_")
    if isinstance(tool_choice, dict):
        assert name == "get_time"
    assert name in TOOLS
    jsonschema.validate(json.loads(arguments), TOOLS[name]["function"]["parameters"])
