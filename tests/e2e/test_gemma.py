"""The bundled Gemma 3 270M: real weights, real text, through both hosts."""

from __future__ import annotations

import pytest
from conftest import GEMMA, Host

pytestmark = pytest.mark.gemma


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
