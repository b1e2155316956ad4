"""Recipes: named model roles wired into one pipeline (spec: ``audio-api.md``, ``GET /v1/recipes`` and
``POST /v1/recipes/run``).

This module is the catalogue (which recipes exist, their roles with the task and mode each needs, and why one is
not available here) and the checking of a run request: its ``models`` per role and its role-prefixed ``options``
(``asr.language``, ``conversation.max_tokens``, ``tts.voice``...). Running a recipe is
:mod:`lemonkit.serving.voice_pipeline`'s; serving it is :mod:`lemonkit.server.recipes`'. Nothing here touches a model.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from lemonkit.backends.task_engine import ARTIFACT_KINDS
from lemonkit.catalog import config
from lemonkit.errors import InvalidArgument, InvalidRequest, MissingArgument
from lemonkit.formats.bodies import decode_base64

__all__ = [
    "HISTORY_ARTIFACT",
    "RECIPES",
    "VOICE_CHAT",
    "Recipe",
    "Role",
    "RunRequest",
    "history_artifact",
    "parse_run",
]

#: the artifact that carries a voice chat's conversation from one turn to the next (spec: "send the accumulated
#: ... artifacts in request.artifacts"): the result returns it, the next request sends it back
HISTORY_ARTIFACT = "voice-chat.messages"
#: the conversation role's instructions when a request gives none in ``request.text``
DEFAULT_SYSTEM_PROMPT = (
    "You are a helpful assistant in a spoken conversation. Answer in plain sentences, without lists or markdown."
)


@dataclass(frozen=True)
class Role:
    """One model role of a recipe.

    Attributes:
        name: The role (``asr``, ``conversation``, ``tts``, ``avatar``): the key of ``models`` and the options
            prefix.
        task: The task its model performs (``asr``, ``chat``, ``tts``, ``s2s``, ``gen``).
        mode: ``offline`` (one request, one answer) or ``stream`` (output consumed as it is produced).
        model_type: lemonkit's model type serving the task (``transcription``, ``llm``, ``tts``); ``""`` when
            lemonkit has no engine for it.
        default: The model used when a request names none (a function: the defaults follow the environment).
        options: The role's options -> their parser (the value as sent -> the value passed on).
    """

    name: str
    task: str
    mode: str
    model_type: str = ""
    default: Callable[[], str] | None = None
    options: Mapping[str, Callable[[str, Any], Any]] = field(default_factory=dict)

    def describe(self) -> dict[str, Any]:
        """The role as ``GET /v1/recipes`` lists it."""
        out: dict[str, Any] = {"task": self.task, "mode": self.mode}
        if self.default is not None:
            out["default_model"] = self.default()
            out["options"] = [f"{self.name}.{option}" for option in self.options]
        return out


@dataclass(frozen=True)
class Recipe:
    """A recipe of the catalogue; ``unavailable`` says why it cannot run here (empty: it can)."""

    name: str
    description: str
    roles: tuple[Role, ...]
    unavailable: str = ""

    def role(self, name: str) -> Role:
        """The role called ``name``.

        Raises:
            InvalidArgument: The recipe has no such role.
        """
        for role in self.roles:
            if role.name == name:
                return role
        raise InvalidArgument(f"{name!r} is not a role of {self.name}; its roles are {self._names()}")

    def _names(self) -> str:
        return ", ".join(r.name for r in self.roles)

    def describe(self) -> dict[str, Any]:
        """The recipe as ``GET /v1/recipes`` lists it."""
        out: dict[str, Any] = {
            "name": self.name,
            "description": self.description,
            "available": not self.unavailable,
            "stream": True,
            "roles": {role.name: role.describe() for role in self.roles},
        }
        if self.unavailable:
            out["unavailable_reason"] = self.unavailable
        return out


# -- option values: the spec sends numbers and booleans as they are or as text ("12", "true") ---------------------


def _text(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise InvalidArgument(f"options.{name}: expected a string, got {type(value).__name__}")
    return value


def _number(low: float, high: float) -> Callable[[str, Any], float]:
    def parse(name: str, value: Any) -> float:
        number: float | None = None
        if isinstance(value, int | float) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                number = None
        if number is None or not low <= number <= high:
            raise InvalidArgument(f"options.{name}: expected a number from {low:g} to {high:g}, got {value!r}")
        return number

    return parse


def _integer(low: int) -> Callable[[str, Any], int]:
    def parse(name: str, value: Any) -> int:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise InvalidArgument(f"options.{name}: expected a whole number of at least {low}, got {value!r}")
        return value

    return parse


ASR = Role(
    "asr",
    "asr",
    "offline",
    "transcription",
    config.default_transcription_model,
    {"language": _text, "prompt": _text, "temperature": _number(0, 1)},
)
CONVERSATION = Role(
    "conversation",
    "chat",
    "stream",
    "llm",
    config.default_chat_model,
    {
        "max_tokens": _integer(1),
        "temperature": _number(0, 2),
        "top_p": _number(0, 1),
        "top_k": _integer(0),
        "repeat_penalty": _number(1, 2),
        "seed": _integer(0),
    },
)
TTS = Role(
    "tts",
    "tts",
    "offline",
    "tts",
    config.default_speech_model,
    {"voice": _text, "speed": _number(0.25, 4.0), "seed": _integer(0)},
)
_NO_AVATAR = (
    "lemonkit has no avatar ('gen') engine to animate a portrait from speech, and no speech-to-speech ('s2s') "
    "conversation model"
)
VOICE_CHAT = Recipe(
    "voice-chat",
    "Speech in, speech out: the question is transcribed (asr), answered by a chat model (conversation), and each "
    "sentence of the answer is spoken (tts) as soon as it is complete, while the rest is still being generated.",
    (ASR, CONVERSATION, TTS),
)
RECIPES: dict[str, Recipe] = {
    recipe.name: recipe
    for recipe in (
        VOICE_CHAT,
        Recipe(
            "speaking-avatar",
            "A streaming text-to-speech model feeding a streaming avatar video model through a bounded PCM pipe.",
            (Role("tts", "tts", "stream"), Role("avatar", "gen", "stream")),
            unavailable="lemonkit has no avatar ('gen') engine to animate a portrait from speech",
        ),
        Recipe(
            "voice-chat-avatar",
            "A speech-to-speech conversation model whose reply is spoken and fed to a streaming avatar video model.",
            (Role("conversation", "s2s", "stream"), Role("tts", "tts", "stream"), Role("avatar", "gen", "stream")),
            unavailable=_NO_AVATAR,
        ),
    )
}


# -- a run request ------------------------------------------------------------------------------------------------


@dataclass
class RunRequest:
    """A checked ``POST /v1/recipes/run`` body of the voice-chat recipe.

    Attributes:
        recipe: The recipe.
        stream: Answer with the SSE event/done envelope.
        models: Role -> model id (the defaults filled in).
        options: Role -> that role's options, without their prefix, parsed.
        audio_path: ``request.audio``: a server-local path (read by the server, inside the allowed directories).
        audio: ``request.audio_base64`` decoded.
        system_prompt: ``request.text``, the conversation's instructions.
        history: Earlier turns from the ``voice-chat.messages`` artifact.
    """

    recipe: Recipe
    stream: bool
    models: dict[str, str]
    options: dict[str, dict[str, Any]]
    audio_path: str | None = None
    audio: bytes | None = None
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    history: list[dict[str, str]] = field(default_factory=list)


def _object(value: Any, path: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidArgument(f"{path}: expected an object, got {type(value).__name__}")
    return value


def _bool(body: dict[str, Any], key: str) -> bool:
    value = body.get(key)
    if value is not None and not isinstance(value, bool):
        raise InvalidArgument(f"{key}: expected true or false, got {value!r}")
    return bool(value)


def _base64(value: Any, path: str) -> bytes:
    """Base64 text or a ``data:...;base64,`` URI, decoded.

    Raises:
        InvalidArgument: Anything else, or nothing once decoded.
    """
    if not isinstance(value, str):
        raise InvalidArgument(f"{path}: expected base64 text, got {type(value).__name__}")
    return decode_base64(value, what=path, noun="payload")


def _models(recipe: Recipe, given: dict[str, Any]) -> dict[str, str]:
    models = {}
    for name, model in given.items():
        recipe.role(name)
        if not isinstance(model, str) or not model:
            raise InvalidArgument(f"models.{name}: expected a model id")
        models[name] = model
    for role in recipe.roles:
        if role.name not in models and role.default is not None:
            models[role.name] = role.default()
    return models


def _options(recipe: Recipe, given: dict[str, Any]) -> dict[str, dict[str, Any]]:
    options: dict[str, dict[str, Any]] = {role.name: {} for role in recipe.roles}
    for key, value in given.items():
        prefix, dot, name = key.partition(".")
        if not dot:
            raise InvalidArgument(
                f"options.{key}: options are role-specific; prefix it with a role of {recipe.name} "
                f"({', '.join(f'{r.name}.' for r in recipe.roles)})"
            )
        role = recipe.role(prefix)
        if name not in role.options:
            raise InvalidArgument(
                f"options.{key}: not an option of the {prefix} role; it takes "
                + ", ".join(f"{prefix}.{o}" for o in role.options)
            )
        options[prefix][name] = role.options[name](key, value)
    return options


def _history(artifacts: Any) -> list[dict[str, str]]:
    """The earlier turns carried by a ``voice-chat.messages`` artifact; other well-formed artifacts are ignored
    (which ids a recipe reads is up to it), malformed ones refused naming their index."""
    if artifacts is None:
        return []
    if not isinstance(artifacts, list):
        raise InvalidArgument("request.artifacts: expected an array")
    history: list[dict[str, str]] = []
    for index, artifact in enumerate(artifacts):
        where = f"artifacts[{index}]"
        if not isinstance(artifact, dict) or not isinstance(artifact.get("id"), str) or not artifact["id"]:
            raise InvalidArgument(f"{where}: expected an object with a non-empty string id")
        where = f"{where} ({artifact['id']})"
        if artifact.get("kind") not in ARTIFACT_KINDS:
            raise InvalidArgument(f"{where}: unknown kind {artifact.get('kind')!r}")
        if artifact["id"] != HISTORY_ARTIFACT:
            continue
        if "payload" not in artifact:
            raise InvalidArgument(f"{where}: give the conversation as its payload")
        try:
            messages = json.loads(_base64(artifact["payload"], f"{where}.payload"))
        except ValueError:
            raise InvalidArgument(f"{where}: the payload is not the JSON this recipe returned") from None
        if not isinstance(messages, list) or not all(
            isinstance(m, dict)
            and m.get("role") in ("system", "user", "assistant")
            and isinstance(m.get("content"), str)
            for m in messages
        ):
            raise InvalidArgument(f"{where}: expected a list of {{role, content}} chat messages")
        history = [{"role": m["role"], "content": m["content"]} for m in messages if m["role"] != "system"]
    return history


def history_artifact(messages: list[dict[str, str]]) -> dict[str, Any]:
    """The artifact a voice chat's result returns: the conversation so far, for the next turn's request."""
    payload = base64.b64encode(json.dumps(messages).encode()).decode()
    return {"id": HISTORY_ARTIFACT, "kind": "custom", "payload": payload, "meta": {"format": "chat-messages"}}


def parse_run(body: dict[str, Any]) -> RunRequest:
    """Check a ``POST /v1/recipes/run`` body before any model is touched.

    Args:
        body: The parsed JSON body.

    Returns:
        The request, with every role's model and options resolved.

    Raises:
        MissingArgument: No ``recipe``, no ``request``, or no audio in it.
        InvalidArgument: An unknown recipe, role or option, a bad value, both ``audio`` and ``audio_base64``,
            invalid base64, a malformed artifact.
        InvalidRequest: The recipe needs engines lemonkit does not have (code ``recipe_not_available``).
    """
    name = body.get("recipe")
    if name is None:
        raise MissingArgument("recipe: required argument is missing")
    if not isinstance(name, str) or name not in RECIPES:
        raise InvalidArgument(f"recipe: expected one of {', '.join(RECIPES)}, got {name!r}")
    recipe = RECIPES[name]
    if recipe.unavailable:
        raise InvalidRequest(f"recipe: {name} is not available here: {recipe.unavailable}", code="recipe_not_available")
    if body.get("request") is None:
        raise MissingArgument("request: required argument is missing")
    request = _object(body["request"], "request")
    _bool(body, "include_artifacts")  # accepted: this recipe streams no artifacts, its result carries them
    options = _object(request.get("options"), "request.options")
    for field_name, option in (("voice_id", "tts.voice"), ("speaking_speed", "tts.speed")):
        if request.get(field_name) is not None:
            options = {option: request[field_name], **options}  # the role-specific option wins
    for field_name in ("max_tokens", "seed"):
        if request.get(field_name) is not None:
            options = {f"conversation.{field_name}": request[field_name], **options}
    if request.get("speaking_speed") is not None:
        _number(0.5, 2.0)("speaking_speed", request["speaking_speed"])
    run = RunRequest(
        recipe,
        _bool(body, "stream"),
        _models(recipe, _object(body.get("models"), "models")),
        _options(recipe, options),
        history=_history(request.get("artifacts")),
    )
    path, inline = request.get("audio"), request.get("audio_base64")
    if path is not None and inline is not None:
        raise InvalidArgument("request: give only one of audio (a server-local path) and audio_base64")
    if path is None and inline is None:
        raise MissingArgument("request.audio: required argument is missing (a server-local path, or audio_base64)")
    if inline is not None:
        run.audio = _base64(inline, "request.audio_base64")
    else:
        run.audio_path = path
    text = request.get("text")
    if text is not None:
        if not isinstance(text, str):
            raise InvalidArgument("request.text: expected a string (the conversation's system prompt)")
        run.system_prompt = text
    return run
