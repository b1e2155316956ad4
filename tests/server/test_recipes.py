"""``GET /v1/recipes`` and ``POST /v1/recipes/run`` (the voice-chat recipe) on both hosts, through real HTTP, on the
bundled Whisper tiny.en, SmolLM2-135M and Piper voice, with espeak-ng speech in: the catalogue, a round trip whose
reply audio Whisper hears back as the reply's text, the event/done stream and speech that starts before the reply
ends, a client that leaves, the refusals; and ``lemonkit.voice_chat()``."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import wave
from pathlib import Path
from typing import Any

import httpx
import pytest
from IPython.core.formatters import DisplayFormatter

import lemonkit
from lemonkit.client import AsyncClient
from lemonkit.serving.voice_pipeline import SentenceChunker
from tests.support.hosts import Host
from tests.support.speech import SENTENCES, normalised_words, speech_samples, speech_wav, word_errors
from tests.support.waiting import until

WHISPER, CHAT, PIPER = "Whisper-Tiny-En-Bundled", "SmolLM2-135M-Instruct-Bundled", "Piper-Joe-Medium-Bundled"
#: greedy replies: the same question gets the same answer
GREEDY = {"conversation.temperature": 0, "conversation.seed": 1}
#: SmolLM2's greedy reply to this is a story of many sentences
STORY = "Tell me a story about a cat."


@pytest.fixture(scope="module")
def allowed(allowed: Path) -> Path:
    """The operator's allowed directory (holding a question), beside one that is not allowed."""
    root = allowed
    (root / "allowed" / "question.wav").write_bytes(speech_wav(SENTENCES[2]))
    (root / "outside" / "question.wav").write_bytes(speech_wav(SENTENCES[2]))
    return root


@pytest.fixture
def served(allowed_host: Host) -> Host:
    """A host whose operator allowed ``allowed/allowed`` for server-local files."""
    return allowed_host


def inline(text: str) -> str:
    return base64.b64encode(speech_wav(text)).decode()


def run_body(audio: dict[str, Any], *, stream: bool = False, **options: Any) -> dict[str, Any]:
    return {"recipe": "voice-chat", "stream": stream, "request": {**audio, "options": {**GREEDY, **options}}}


def assert_error(response: httpx.Response, status: int, code: str) -> str:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "code"} and error["code"] == code, error
    return str(error["message"])


def wav_pcm(data: str) -> tuple[bytes, int]:
    with wave.open(io.BytesIO(base64.b64decode(data))) as w:
        assert (w.getnchannels(), w.getsampwidth()) == (1, 2)
        return w.readframes(w.getnframes()), w.getframerate()


async def heard(client: httpx.AsyncClient, audio: str) -> str:
    """What Whisper hears in a result's base64 WAV."""
    files = {"file": ("reply.wav", base64.b64decode(audio))}
    response = await client.post("audio/transcriptions", data={"model": WHISPER}, files=files)
    assert response.status_code == 200, response.text
    return str(response.json()["text"])


async def frames(response: httpx.Response) -> list[Any]:
    """Every SSE data frame of a stream: JSON objects, and ``[DONE]`` as the string."""
    out: list[Any] = []
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            out.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
        else:
            assert line == "", line  # nothing but data lines and the blank line ending each
    return out


# -- the catalogue ------------------------------------------------------------------------------------------------


async def test_recipes_are_listed_with_roles_and_reasons(host: Host) -> None:
    async with host.client() as client:
        response = await client.get("recipes")
    assert response.status_code == 200
    listed = {r["name"]: r for r in response.json()["recipes"]}
    assert set(listed) == {"voice-chat", "speaking-avatar", "voice-chat-avatar"}
    chat = listed["voice-chat"]
    assert chat["available"] is True and "unavailable_reason" not in chat
    assert list(chat["roles"]) == ["asr", "conversation", "tts"]
    defaults = {role: spec["default_model"] for role, spec in chat["roles"].items()}
    assert defaults == {"asr": WHISPER, "conversation": CHAT, "tts": PIPER}
    assert {role: (spec["task"], spec["mode"]) for role, spec in chat["roles"].items()} == {
        "asr": ("asr", "offline"),
        "conversation": ("chat", "stream"),
        "tts": ("tts", "offline"),
    }
    assert "conversation.max_tokens" in chat["roles"]["conversation"]["options"]
    assert "tts.voice" in chat["roles"]["tts"]["options"]
    for name, roles in (
        ("speaking-avatar", ["tts", "avatar"]),
        ("voice-chat-avatar", ["conversation", "tts", "avatar"]),
    ):
        recipe = listed[name]
        assert recipe["available"] is False and "avatar" in recipe["unavailable_reason"], recipe
        assert list(recipe["roles"]) == roles and recipe["roles"]["avatar"]["task"] == "gen"


# -- refusals before anything loads --------------------------------------------------------------------------------


async def test_bad_requests_are_refused_before_any_model_loads(served: Host) -> None:
    question = {"audio_base64": inline(SENTENCES[5])}
    cases: list[tuple[dict[str, Any], int, str]] = [
        ({"request": {"audio_base64": "AAAA"}}, 400, "missing_argument"),
        ({"recipe": "karaoke", "request": question}, 400, "invalid_argument"),
        ({"recipe": "speaking-avatar", "request": {"text": "Hi."}}, 400, "recipe_not_available"),
        ({"recipe": "voice-chat"}, 400, "missing_argument"),
        ({"recipe": "voice-chat", "request": {}}, 400, "missing_argument"),
        ({"recipe": "voice-chat", "request": {**question, "audio": "/tmp/x.wav"}}, 400, "invalid_argument"),
        ({"recipe": "voice-chat", "request": {"audio_base64": "not base64!"}}, 400, "invalid_argument"),
        ({"recipe": "voice-chat", "request": {"audio_base64": "data:audio/wav,abc"}}, 400, "invalid_argument"),
        ({"recipe": "voice-chat", "stream": "yes", "request": question}, 400, "invalid_argument"),
        ({"recipe": "voice-chat", "models": {"avatar": CHAT}, "request": question}, 400, "invalid_argument"),
        ({"recipe": "voice-chat", "models": {"asr": CHAT}, "request": question}, 400, "model_not_applicable"),
        ({"recipe": "voice-chat", "models": {"tts": "No-Such-Voice"}, "request": question}, 404, "model_not_found"),
        ({"recipe": "voice-chat", "request": {**question, "options": {"max_tokens": 5}}}, 400, "invalid_argument"),
        ({"recipe": "voice-chat", "request": {**question, "options": {"avatar.x": 1}}}, 400, "invalid_argument"),
        ({"recipe": "voice-chat", "request": {**question, "options": {"tts.pitch": 1}}}, 400, "invalid_argument"),
        (
            {"recipe": "voice-chat", "request": {**question, "options": {"conversation.max_tokens": "many"}}},
            400,
            "invalid_argument",
        ),
        ({"recipe": "voice-chat", "request": {**question, "speaking_speed": 3}}, 400, "invalid_argument"),
        (
            {"recipe": "voice-chat", "request": {**question, "artifacts": [{"id": "a", "kind": "tokens"}]}},
            400,
            "invalid_argument",
        ),
    ]
    async with served.client() as client:
        for body, status, code in cases:
            for stream in (False, True):  # a stream refused up front keeps the status too
                response = await client.post("recipes/run", json={**body, "stream": body.get("stream", stream)})
                assert_error(response, status, code)
        bad_artifact = await client.post(
            "recipes/run", json={"recipe": "voice-chat", "request": {**question, "artifacts": [{"id": "", "kind": 1}]}}
        )
        assert "artifacts[0]" in assert_error(bad_artifact, 400, "invalid_argument")
        named = await client.post(
            "recipes/run",
            json={"recipe": "voice-chat", "request": {**question, "artifacts": [{"id": "x.tokens", "kind": "tokens"}]}},
        )
        assert "artifacts[0] (x.tokens): unknown kind 'tokens'" in assert_error(named, 400, "invalid_argument")
        assert_error(await client.post("recipes/run", content=b"{not json"), 400, "invalid_json")
        health = (await client.get("health")).json()
    if served.kind == "jupyter":  # (the module's standalone keeps models from other tests)
        assert health["all_models_loaded"] == []


async def test_paths_outside_the_allowed_dirs_are_refused(served: Host, allowed: Path) -> None:
    async with served.client() as client:
        for path in (str(allowed / "outside" / "question.wav"), f"{allowed}/allowed/../outside/question.wav"):
            for stream in (False, True):
                response = await client.post("recipes/run", json=run_body({"audio": path}, stream=stream))
                assert "LEMONKIT_ALLOWED_DIRS" in assert_error(response, 403, "forbidden")
        relative = await client.post("recipes/run", json=run_body({"audio": "question.wav"}))
        assert_error(relative, 400, "invalid_argument")
        missing = await client.post("recipes/run", json=run_body({"audio": str(allowed / "allowed" / "none.wav")}))
        assert_error(missing, 400, "invalid_argument")


# -- running it ---------------------------------------------------------------------------------------------------


@pytest.mark.slow
async def test_voice_chat_round_trip(served: Host, allowed: Path) -> None:
    async with served.client() as client:
        body = run_body({"audio_base64": inline(SENTENCES[2])}, **{"conversation.max_tokens": 30})
        response = await client.post("recipes/run", json=body)
        assert response.status_code == 200, response.text
        result = response.json()
        assert normalised_words(result["transcript"]) == normalised_words(SENTENCES[2])
        assert result["language"] == "en" and result["models"] == {"asr": WHISPER, "conversation": CHAT, "tts": PIPER}
        assert normalised_words(result["text"]), result
        pcm, rate = wav_pcm(result["audio"])
        assert rate == result["sample_rate"] == 22050 and result["channels"] == 1
        assert result["duration"] == pytest.approx(len(pcm) / 2 / rate)
        # the reply was spoken: Whisper hears its words back (Piper may be misheard by one word)
        assert word_errors(result["text"], await heard(client, result["audio"])) <= 1
        timing = result["timing"]
        assert 0 < timing["ttft_ms"] <= timing["ttfa_ms"] <= timing["wall_ms"], timing

        # the next turn: the question from a server-local file, the conversation carried by the artifact
        [artifact] = result["artifacts"]
        assert (artifact["id"], artifact["kind"]) == ("voice-chat.messages", "custom")
        second = run_body({"audio": str(allowed / "allowed" / "question.wav")}, **{"conversation.max_tokens": 8})
        second["request"]["artifacts"] = [artifact]
        second["request"]["text"] = "You are a travel agent."
        response = await client.post("recipes/run", json=second)
        assert response.status_code == 200, response.text
        following = response.json()
    history = json.loads(base64.b64decode(following["artifacts"][0]["payload"]))
    assert [m["role"] for m in history] == ["user", "assistant", "user", "assistant"]
    assert history[1]["content"] == result["text"] and history[3]["content"] == following["text"]


@pytest.mark.slow
async def test_voice_chat_streams_and_speaks_before_the_reply_ends(served: Host) -> None:
    body = run_body({"audio_base64": inline(STORY)}, stream=True, **{"conversation.max_tokens": 60})
    async with served.client() as client, client.stream("POST", "recipes/run", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["x-accel-buffering"] == "no"
        received = await frames(response)
    assert received[-1] == "[DONE]" and received[-2]["type"] == "task.stream.done"
    assert all(f["type"] == "task.stream.event" for f in received[:-2]), received
    events = [f["event"] for f in received[:-2]]
    result = received[-2]["result"]

    asr = events[0]
    assert asr["role"] == "asr" and asr["is_final"] is True
    assert (
        normalised_words(asr["partial_text"]["text"])
        == normalised_words(STORY)
        == normalised_words(result["transcript"])
    )
    order = [e["role"] for e in events]
    deltas = [i for i, e in enumerate(events) if e["role"] == "conversation" and not e["is_final"]]
    reply_end = order.index("conversation", deltas[-1] + 1)
    assert events[reply_end] == {"role": "conversation", "is_final": True}
    spoken = [i for i, e in enumerate(events) if e["role"] == "tts" and not e["is_final"]]
    assert events[-1] == {"role": "tts", "is_final": True}

    reply = "".join(events[i]["partial_text"]["text"] for i in deltas)
    assert reply.strip() == result["text"]
    chunker = SentenceChunker()
    sentences = [s for i in deltas for s in chunker.feed(events[i]["partial_text"]["text"])] + chunker.flush()
    assert len(sentences) >= 4, reply  # the precondition of the order below: a reply of several sentences
    assert len(spoken) == len(sentences)
    # speech starts while the reply is still being generated: the first sentence's audio comes before the
    # reply's last text and its end
    assert spoken[0] < deltas[-1] < reply_end, order
    # the result's audio is the events' audio, in order
    pieces = [wav_pcm(events[i]["audio"]) for i in spoken]
    assert {rate for _, rate in pieces} == {result["sample_rate"]}
    assert b"".join(pcm for pcm, _ in pieces) == wav_pcm(result["audio"])[0]


@pytest.mark.slow
async def test_a_client_that_leaves_stops_every_stage(served: Host) -> None:
    body = run_body({"audio_base64": inline(STORY)}, stream=True, **{"conversation.max_tokens": 1000})
    async with served.client() as client:
        async with client.stream("POST", "recipes/run", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {") and json.loads(line[6:])["event"]["role"] == "tts":
                    break  # gone mid-reply, with the chat model generating and the voice speaking

        async def idle() -> bool:
            models = {m["model_name"]: m for m in (await client.get("health")).json()["all_models_loaded"]}
            return all(models[name]["slots"]["busy"] == 0 for name in (CHAT, PIPER))

        await until(idle, "the chat model and the voice to be released")
        # and they serve the next request at once: nothing is still generating the abandoned reply
        again = await client.post(
            "recipes/run", json=run_body({"audio_base64": inline(SENTENCES[5])}, **{"conversation.max_tokens": 4})
        )
        assert again.status_code == 200, again.text


@pytest.mark.slow
async def test_a_stage_that_fails_mid_run_ends_the_stream_with_an_error(served: Host) -> None:
    # the voice turns the request away only when the first sentence reaches it: after the stream started
    body = run_body({"audio_base64": inline(SENTENCES[2])}, **{"conversation.max_tokens": 30, "tts.voice": "nobody"})
    async with served.client() as client:
        refused = await client.post("recipes/run", json=body)
        assert "nobody" in assert_error(refused, 400, "invalid_argument")
        async with client.stream("POST", "recipes/run", json={**body, "stream": True}) as response:
            assert response.status_code == 200
            received = await frames(response)
    assert received[0]["event"]["role"] == "asr"
    error = received[-1]
    assert set(error) == {"type", "error"} and error["type"] == "error" and "nobody" in error["error"]["message"]
    assert not any(f == "[DONE]" or f["type"] == "task.stream.done" for f in received)


@pytest.mark.slow
async def test_undecodable_inline_audio_is_refused(served: Host) -> None:
    junk = base64.b64encode(b"this is not audio at all" * 40).decode()
    async with served.client() as client:
        for stream in (False, True):
            response = await client.post("recipes/run", json=run_body({"audio_base64": junk}, stream=stream))
            assert response.status_code == 400, response.text
            assert response.json()["error"]["code"] in ("invalid_audio", "invalid_argument")


@pytest.mark.slow
async def test_voice_chat_in_python(served: Host, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LEMONKIT_URL", served.root)
    monkeypatch.setenv("LEMONKIT_TOKEN", served.token or "")
    monkeypatch.setattr(lemonkit.client._client, "_default", None)
    question = speech_samples(SENTENCES[2], 16000)  # samples, as transcribe() takes them
    reply = await asyncio.to_thread(
        lemonkit.voice_chat, question, sample_rate=16000, max_tokens=30, temperature=0, seed=1
    )
    assert isinstance(reply, lemonkit.VoiceChatReply)
    assert normalised_words(reply.transcript) == normalised_words(SENTENCES[2])
    assert normalised_words(reply.text) and reply.speech.text == reply.text
    assert reply.models == {"asr": WHISPER, "conversation": CHAT, "tts": PIPER} and reply.speech.model == PIPER
    assert reply.provenance["route"] == "recipes/run" and reply.timing["wall_ms"] > 0
    # in a notebook it shows the question, the reply and a player holding the reply's audio
    data, _ = DisplayFormatter().format(reply)
    page = data["text/html"]
    assert "<audio controls" in page and "data:audio/wav;base64," in page
    assert reply.text.split()[0] in page and "Heard:" in page
    # the audio saved is the reply spoken: Whisper hears its words
    saved = reply.save(tmp_path / "reply.wav")
    async with AsyncClient(served.root, token=served.token) as client:
        heard_back = await client.transcribe(saved)
        assert word_errors(reply.text, heard_back.text) <= 1
        # the next turn, from a file's bytes, through the async client, carries on the conversation
        following = await client.voice_chat(speech_wav(SENTENCES[5]), history=reply, max_tokens=6, temperature=0)
    conversation = json.loads(base64.b64decode(following.artifacts[0]["payload"]))
    assert [m["content"] for m in conversation][:2] == [reply.transcript, reply.text]
    assert len(conversation) == 4 and following.speech.duration > 0
    assert lemonkit.client._client._default is not None  # the module functions' client, made by the first of them
    lemonkit.client._client._default.close()


def test_sentences_are_cut_as_they_complete() -> None:
    chunker = SentenceChunker()
    pieces = ["Hello", " there.", " How are", " you? I", " am fine.\n", "Bye", " ...", " now"]
    out = [chunker.feed(p) for p in pieces]
    assert out == [[], [], ["Hello there."], ["How are you?"], ["I am fine."], [], [], ["Bye ..."]]
    assert chunker.flush() == ["now"]
    assert SentenceChunker().feed("... ?! ") == []  # nothing to say is not handed to the voice
    long = SentenceChunker().feed("word " * 100)
    assert long and all(len(s) <= 300 for s in long)
