"""Omni collections (``collection.omni``) through real HTTP on both hosts, with the openai SDK: the server-side tool
loop on the tiny generated chat model, the tiny random diffusers pipeline and the bundled Piper voice.

What the tests prove, honestly: the tiny chat model is random and never chooses a tool by itself, so each round that
calls a tool is forced by ``tool_choice`` (the grammar path: a named function, or ``"required"``). The loop's own
work is real and checked: the forced call reaches the right component, whose output (a PNG from the pipeline, MP3
speech from Piper) comes back embedded in the answer as the spec shows; a client tool comes back as ``tool_calls``
and the conversation resumes; ``"required"`` runs into the round limit, which ends the answer cleanly; a stream
carries media in deltas of at most 16,000 characters. What the random model writes as text means nothing and is not
checked beyond its type.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import subprocess
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from IPython.core.formatters import DisplayFormatter
from PIL import Image

from lemonkit.catalog.omni.media import MAX_DELTA_CHARS, find_media
from lemonkit.catalog.registry import Registry
from lemonkit.client import Client
from lemonkit.client.results import ChatResult
from lemonkit.testing.tiny_diffusers import TINY_SIZE, write_tiny_pipeline
from tests.support.hosts import API_KEY, Host, Standalone
from tests.support.session import CACHE_DIR, HF_CACHE
from tests.support.system_tools import tool
from tests.support.tiny_models import TINY

pytestmark = pytest.mark.slow  # every test that runs the loop loads a chat model, the pipeline (torch) or Piper

PIPER = "Piper-Joe-Medium-Bundled"
OMNI_SD = "user.omni-sd"
TINY_SD_REPO = "lemonkit-test/tiny-sd"
#: every component: a chat model, an image model, a voice
KIT = "user.omni-kit"
#: a chat model and a voice: text_to_speech is the one built-in tool
VOICE_KIT = "user.omni-voice"
#: the random model's words are many tokens: room for a bounded string argument and its closing brace
MAX_TOKENS = 700
USER = [{"role": "user", "content": "Please draw a cat and say hello."}]


def sdk(host: Host) -> openai.AsyncOpenAI:
    """The host's SDK client, patient: a round can load torch and a pipeline on a loaded 2-core machine (a bound,
    not a timed assertion)."""
    return openai.AsyncOpenAI(base_url=host.api, api_key=host.token or "none", max_retries=0, timeout=600)


def named(tool: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": tool}}


def client_tool(name: str) -> dict[str, Any]:
    """A client tool whose one argument the random model closes in time (a length cap)."""
    schema = {"type": "object", "properties": {"q": {"type": "string", "maxLength": 8}}, "required": ["q"]}
    return {"type": "function", "function": {"name": name, "parameters": schema}}


@pytest.fixture(scope="session", autouse=True)
def components() -> Iterator[None]:
    """The tiny pipeline as a downloaded hub repo registered as ``user.omni-sd``, and the two collections."""
    snapshot = HF_CACHE / f"models--{TINY_SD_REPO.replace('/', '--')}" / "snapshots" / ("b" * 40)
    if not (snapshot / "model_index.json").exists():  # test_images.py writes the same pipeline
        write_tiny_pipeline(snapshot)
        (snapshot.parents[1] / "refs").mkdir(exist_ok=True)
        (snapshot.parents[1] / "refs" / "main").write_text("b" * 40)
    registry = Registry(CACHE_DIR, hf_cache=HF_CACHE)
    defaults = {"steps": 1, "cfg_scale": 1.0, "width": TINY_SIZE, "height": TINY_SIZE}
    registry.register(OMNI_SD, {"checkpoint": TINY_SD_REPO, "recipe": "diffusers", "image_defaults": defaults})
    registry.register(KIT, {"recipe": "collection.omni", "components": [TINY, OMNI_SD, PIPER]})
    registry.register(VOICE_KIT, {"recipe": "collection.omni", "components": [TINY, PIPER]})
    yield


def assert_error(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "code"} and error["code"] == code, error
    return dict(error)


def png_of(media_b64: str) -> Image.Image:
    data = base64.b64decode(media_b64)
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    return Image.open(io.BytesIO(data))


def seconds_of_mp3(data: bytes) -> float:
    """The duration ffmpeg decodes from ``data`` (it fails on what is not audio)."""
    pcm = subprocess.run(
        [tool("ffmpeg"), "-v", "error", "-f", "mp3", "-i", "pipe:0", "-f", "s16le", "-ac", "1", "-ar", "16k", "pipe:1"],
        input=data,
        capture_output=True,
        check=True,
    ).stdout
    return len(pcm) / 2 / 16000


def kinds(text: str) -> list[str]:
    return [m.kind for m in find_media(text)]


# -- the loop, one tool at a time ----------------------------------------------------------------------------------


async def test_image_round(host: Host) -> None:
    completion = await sdk(host).chat.completions.create(
        model=KIT, messages=USER, tool_choice=named("generate_image"), max_tokens=MAX_TOKENS, seed=1
    )
    assert completion.model == KIT and completion.object == "chat.completion"
    choice = completion.choices[0]
    # the named function was forced in the first round only: the second answered in text and ended the loop
    assert choice.finish_reason in ("stop", "length") and not choice.message.tool_calls
    content = choice.message.content or ""
    assert kinds(content) == ["image"]
    (image,) = find_media(content)
    assert content.count("![generated image](data:image/png;base64,") == 1
    assert png_of(image.b64).size == (TINY_SIZE, TINY_SIZE)
    assert completion.usage is not None and completion.usage.completion_tokens > 0


async def test_edit_round_edits_the_user_s_image(host: Host) -> None:
    client = sdk(host)
    picture = io.BytesIO()
    Image.new("RGB", (TINY_SIZE, TINY_SIZE), (10, 200, 10)).save(picture, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(picture.getvalue()).decode()
    parts = [{"type": "text", "text": "Make it blue."}, {"type": "image_url", "image_url": {"url": url}}]
    edit = named("edit_image")
    edited = await client.chat.completions.create(
        model=KIT, messages=[{"role": "user", "content": parts}], tool_choice=edit, max_tokens=MAX_TOKENS, seed=8
    )
    (image,) = find_media(edited.choices[0].message.content or "")
    assert png_of(image.b64).size == (TINY_SIZE, TINY_SIZE) and image.data != picture.getvalue()
    # nothing to edit: the component is not asked, the model is told, and the answer ends without media
    nothing = await client.chat.completions.create(model=KIT, messages=USER, tool_choice=edit, max_tokens=MAX_TOKENS)
    assert nothing.choices[0].finish_reason in ("stop", "length") and not find_media(
        nothing.choices[0].message.content or ""
    )


async def test_speech_round(host: Host) -> None:
    completion = await sdk(host).chat.completions.create(
        model=VOICE_KIT, messages=USER, tool_choice=named("text_to_speech"), max_tokens=MAX_TOKENS, seed=2
    )
    content = completion.choices[0].message.content or ""
    assert kinds(content) == ["audio"] and "<audio>data:audio/mpeg;base64," in content
    assert seconds_of_mp3(find_media(content)[0].data) > 0.1


async def test_client_tool_is_returned_and_the_conversation_resumes(host: Host) -> None:
    client = sdk(host)
    tools = [client_tool("lookup")]
    first = await client.chat.completions.create(
        model=KIT, messages=USER, tools=tools, tool_choice=named("lookup"), max_tokens=MAX_TOKENS, seed=3
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "lookup" and isinstance(json.loads(call.function.arguments)["q"], str)
    assert call.id
    # the client runs its tool and sends the result back; the loop goes on: here the model is made to draw
    resumed = [
        *USER,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "a cat is a small furry animal"},
    ]
    second = await client.chat.completions.create(
        model=KIT, messages=resumed, tools=tools, tool_choice=named("generate_image"), max_tokens=MAX_TOKENS, seed=3
    )
    assert second.choices[0].finish_reason in ("stop", "length")
    assert kinds(second.choices[0].message.content or "") == ["image"]
    # and an answer holding media goes back in later turns: the chat model gets a placeholder, not the picture
    again = [*resumed, second.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "thanks"}]
    third = await client.chat.completions.create(model=KIT, messages=again, tool_choice="none", max_tokens=4)
    assert third.usage is not None and third.usage.prompt_tokens < 2000  # the PNG alone is ~10,000 characters


# -- the round limit -----------------------------------------------------------------------------------------------


@pytest.fixture(params=["jupyter", "standalone"])
def two_rounds(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Host]:
    """A host whose omni loop runs at most two rounds of tools (``LEMONKIT_OMNI_MAX_ROUNDS``)."""
    monkeypatch.setenv("LEMONKIT_OMNI_MAX_ROUNDS", "2")
    if request.param == "jupyter":
        yield request.getfixturevalue("jupyter_host")  # the extension reads its settings as it starts: after this
        return
    server = Standalone({"LEMONADE_API_KEY": API_KEY})
    try:
        yield Host("standalone", server.root, API_KEY)
    finally:
        server.stop()


async def test_round_limit_ends_the_answer_cleanly(two_rounds: Host) -> None:
    completion = await sdk(two_rounds).chat.completions.create(
        model=VOICE_KIT, messages=USER, tool_choice="required", max_tokens=MAX_TOKENS, seed=4
    )
    choice = completion.choices[0]
    # "required" makes every round call text_to_speech (the collection's one tool): two rounds ran it, then the
    # model answered once more without tools
    assert kinds(choice.message.content or "") == ["audio", "audio"]
    assert choice.finish_reason in ("stop", "length") and not choice.message.tool_calls


# -- streaming -----------------------------------------------------------------------------------------------------


async def test_stream_carries_media_in_bounded_deltas(host: Host) -> None:
    stream = await sdk(host).chat.completions.create(
        model=KIT,
        messages=USER,
        tool_choice=named("text_to_speech"),
        max_tokens=MAX_TOKENS,
        seed=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    deltas: list[str] = []
    finishes, usage = [], None
    async for chunk in stream:
        assert chunk.model == KIT and chunk.object == "chat.completion.chunk"
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                deltas.append(choice.delta.content)
            if choice.finish_reason:
                finishes.append(choice.finish_reason)
    assert finishes in (["stop"], ["length"]) and usage is not None and usage.total_tokens > 0
    assert all(len(d) <= MAX_DELTA_CHARS for d in deltas)
    content = "".join(deltas)
    (audio,) = find_media(content)
    tag = f"<audio>data:audio/mpeg;base64,{audio.b64}</audio>"
    # longer than one delta may be: it came in several, and put together they are the spec's element again
    assert len(tag) > MAX_DELTA_CHARS and tag in content
    assert seconds_of_mp3(audio.data) > 0.1


async def test_stream_returns_a_client_tool_call(host: Host) -> None:
    stream = await sdk(host).chat.completions.create(
        model=KIT, messages=USER, tools=[client_tool("lookup")], tool_choice=named("lookup"), max_tokens=64, stream=True
    )
    calls, finishes = [], []
    async for chunk in stream:
        for choice in chunk.choices:
            calls.extend(choice.delta.tool_calls or [])
            if choice.finish_reason:
                finishes.append(choice.finish_reason)
    assert finishes == ["tool_calls"]
    (call,) = calls
    assert call.index == 0 and call.id and call.function and call.function.name == "lookup"
    assert isinstance(json.loads(call.function.arguments or "")["q"], str)


async def test_stream_of_an_image(host: Host) -> None:
    async with host.client() as client:
        body = {"model": KIT, "messages": USER, "tool_choice": named("generate_image"), "max_tokens": MAX_TOKENS}
        stream = {**body, "stream": True}
        async with client.stream("POST", "chat/completions", json=stream, timeout=600) as response:
            assert response.status_code == 200
            # the chat component's provenance: the model whose answer this is, which called the tools
            assert json.loads(response.headers["X-Lemonkit-Provenance"])["model"] == TINY
            lines = [line async for line in response.aiter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    (image,) = find_media(content)
    assert png_of(image.b64).size == (TINY_SIZE, TINY_SIZE)


# -- the Python API -----------------------------------------------------------------------------------------------


async def test_python_api_chat_on_a_collection_shows_its_media(host: Host) -> None:
    def run() -> ChatResult:
        with Client(host.root, token=host.token) as client:  # streamed: the media is folded from its deltas
            return client.chat("Draw a cat.", KIT, tool_choice=named("generate_image"), max_tokens=MAX_TOKENS)

    result = await asyncio.to_thread(run)
    assert [m.kind for m in result.media] == ["image"] and result.images[0].size == (TINY_SIZE, TINY_SIZE)
    bundle, _ = DisplayFormatter().format(result)
    assert f'<img src="data:image/png;base64,{result.media[0].b64}"' in bundle["text/html"]


# -- targeting, errors, the model object, load and unload ----------------------------------------------------------


async def test_naming_a_component_bypasses_the_loop(host: Host) -> None:
    client = sdk(host)
    # the collection offers generate_image; its chat component, named directly, is a plain model without it
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(model=TINY, messages=USER, tool_choice=named("generate_image"))
    assert "no 'tools'" in str(caught.value)
    plain = await client.chat.completions.create(model=TINY, messages=USER, max_tokens=4, temperature=0)
    looped = await client.chat.completions.create(model=KIT, messages=USER, max_tokens=4, temperature=0)
    assert plain.model == TINY and looped.model == KIT
    # the built-in system prompt and tools went into the collection's prompt only
    assert plain.usage is not None and looped.usage is not None
    assert looped.usage.prompt_tokens > plain.usage.prompt_tokens + 50


async def test_model_object_lists_components_models_and_system_prompt(host: Host) -> None:
    name = "user.omni-prompted"
    async with host.client() as client:
        body = {
            "model_name": name,
            "recipe": "collection.omni",
            "components": [TINY, PIPER],
            "system_prompt": "Be brief.",
        }
        assert (await client.post("pull", json=body)).json()["status"] == "success"
        kit = (await client.get(f"models/{KIT}")).json()
        prompted = (await client.get(f"models/{name}")).json()
        listed = {m["id"]: m for m in (await client.get("models")).json()["data"]}
        not_omni = {
            "model_name": "user.omni-bad",
            "checkpoint": "a/b:c.gguf",
            "recipe": "llamacpp",
            "system_prompt": "x",
        }
        assert_error(await client.post("pull", json=not_omni), 400, "invalid_argument")
        assert (await client.post("delete", json={"model_name": name})).json()["status"] == "success"
    assert kit["components"] == [TINY, OMNI_SD, PIPER] and [m["id"] for m in kit["models"]] == kit["components"]
    assert kit["system_prompt"] == ""  # no override: the built-in prompt applies
    assert prompted["system_prompt"] == "Be brief." and prompted["components"] == [TINY, PIPER]
    assert listed[KIT]["components"] == kit["components"] and "system_prompt" in listed[KIT]
    assert listed[TINY]["components"] == [] and "system_prompt" not in listed[TINY]


async def test_load_and_unload_act_on_every_component(host: Host) -> None:
    async with host.client() as client:

        async def loaded() -> set[str]:
            return {m["model_name"] for m in (await client.get("health")).json()["all_models_loaded"]}

        assert (await client.post("load", json={"model_name": VOICE_KIT})).json()["status"] == "success"
        assert {TINY, PIPER} <= await loaded()
        assert (await client.post("unload", json={"model_name": VOICE_KIT})).json()["status"] == "success"
        assert not {TINY, PIPER} & await loaded()
        assert_error(await client.post("unload", json={"model_name": VOICE_KIT}), 404, "model_not_found")


async def test_a_component_that_fails_to_load_is_the_spec_s_error(host: Host) -> None:
    registry = Registry(CACHE_DIR, hf_cache=HF_CACHE)
    voice, kit = "user.omni-broken-voice", "user.omni-broken"
    # a voice whose file is an HTML page: the Piper engine cannot start on it
    registry.register(voice, {"checkpoint": "lemonkit-test/tiny-GGUF:not-gguf.gguf", "recipe": "piper"})
    registry.register(kit, {"recipe": "collection.omni", "components": [TINY, voice]})
    try:
        body = {"model": kit, "messages": USER, "tool_choice": named("text_to_speech"), "max_tokens": MAX_TOKENS}
        async with host.client() as client:
            failed = await client.post("chat/completions", json=body, timeout=600)
            assert voice in assert_error(failed, 500, "model_load_error")["message"]
    finally:
        registry.unregister(kit)
        registry.unregister(voice)


async def test_missing_or_absent_components_are_errors(host: Host) -> None:
    registry = Registry(CACHE_DIR, hf_cache=HF_CACHE)
    gone, kit, chatless = "user.omni-gone", "user.omni-missing", "user.omni-chatless"
    registry.register(gone, {"checkpoint": "lemonkit-test/tiny-GGUF:tiny-llama.gguf", "recipe": "llamacpp"})
    registry.register(kit, {"recipe": "collection.omni", "components": [gone, PIPER]})
    registry.register(chatless, {"recipe": "collection.omni", "components": [PIPER]})
    registry.unregister(gone)  # the collection's row stays, naming a model that is no longer there
    try:
        body = {"messages": USER, "max_tokens": 4}
        async with host.client() as client:
            for stream in (False, True):
                missing = await client.post("chat/completions", json={**body, "model": kit, "stream": stream})
                assert gone in assert_error(missing, 404, "model_not_found")["message"]
            no_chat = await client.post("chat/completions", json={**body, "model": chatless})
            assert_error(no_chat, 400, "model_not_applicable")
            # a forced call of a tool the collection cannot serve (no image model) is refused by the chat model
            no_tool = {**body, "model": VOICE_KIT, "tool_choice": named("generate_image")}
            assert_error(await client.post("chat/completions", json=no_tool), 400, "invalid_argument")
            # once a stream has started, the spec's form: the error as text, then a normal end
            async with client.stream("POST", "chat/completions", json={**no_tool, "stream": True}) as response:
                assert response.status_code == 200
                lines = [line async for line in response.aiter_lines() if line.startswith("data: ")]
            assert lines[-1] == "data: [DONE]"
            chunks = [json.loads(line[6:])["choices"][0] for line in lines[:-1]]
            text = "".join(c["delta"].get("content") or "" for c in chunks)
            assert text.startswith("Error: ") and "generate_image" in text
            assert [c["finish_reason"] for c in chunks if c["finish_reason"]] == ["stop"]
    finally:
        registry.unregister(kit)
        registry.unregister(chatless)


def test_media_pattern_is_the_spec_s() -> None:
    """The two forms the spec shows, and nothing looser, are what clients and the notebook find."""
    text = "a ![generated image](data:image/png;base64,QUJD) b <audio>data:audio/mpeg;base64,REVG</audio>"
    assert [(m.kind, m.mime, m.data) for m in find_media(text)] == [
        ("image", "image/png", b"ABC"),
        ("audio", "audio/mpeg", b"DEF"),
    ]
    assert not find_media("![x](https://example.com/a.png) <audio src='a.mp3'></audio>")
