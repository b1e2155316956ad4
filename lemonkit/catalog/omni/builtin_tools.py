"""What an omni collection offers its chat model: the roles its components play, the built-in tools those roles
make possible, and the system prompt that tells the model about them (spec: openai-api.md, "Server-Side Tools")."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lemonkit.catalog.model_info import ModelInfo

__all__ = ["EDIT_IMAGE", "GENERATE_IMAGE", "OMNI_TOOLS", "TEXT_TO_SPEECH", "Roles", "system_prompt", "tool_definitions"]

GENERATE_IMAGE = "generate_image"
EDIT_IMAGE = "edit_image"
TEXT_TO_SPEECH = "text_to_speech"

# Bounded strings: a forced call is generated under a grammar of these schemas, and a small model would otherwise
# run to max_tokens inside one string, leaving a call that does not parse.
_PROMPT = {"type": "string", "minLength": 1, "maxLength": 400}
#: tool name -> (description, parameters)
OMNI_TOOLS: dict[str, tuple[str, dict[str, Any]]] = {
    GENERATE_IMAGE: (
        "Draw a new image from a text description and show it to the user.",
        {
            "type": "object",
            "properties": {"prompt": {**_PROMPT, "description": "What the image shows, in detail."}},
            "required": ["prompt"],
        },
    ),
    EDIT_IMAGE: (
        "Change the most recent image of the conversation as described, and show the result to the user.",
        {
            "type": "object",
            "properties": {"prompt": {**_PROMPT, "description": "What the edited image shows."}},
            "required": ["prompt"],
        },
    ),
    TEXT_TO_SPEECH: (
        "Speak a text aloud: the user hears it.",
        {
            "type": "object",
            "properties": {"text": {**_PROMPT, "description": "The words to say."}},
            "required": ["text"],
        },
    ),
}

_PROMPT_HEAD = (
    "You are a helpful assistant that can create media for the user with tools. "
    "Media you create is shown to the user as soon as the tool finishes: never write out its data, "
    "say in a sentence what you made instead."
)
_PROMPT_LINES = {
    GENERATE_IMAGE: f"- {GENERATE_IMAGE}: when the user asks for a picture, drawing or photo.",
    EDIT_IMAGE: f"- {EDIT_IMAGE}: when the user asks to change the latest image.",
    TEXT_TO_SPEECH: f"- {TEXT_TO_SPEECH}: when the user asks you to say, read or speak something aloud.",
}


@dataclass(frozen=True)
class Roles:
    """Which component of a collection does what: the first chat model chats; the first image model that is not
    an upscaler draws, and one labelled ``edit`` (else the same) edits (spec: the ``edit`` label "selects the model
    for the ``edit_image`` role"); the first text-to-speech model speaks. A role no component plays has no tool."""

    chat: ModelInfo | None
    image: ModelInfo | None
    edit: ModelInfo | None
    tts: ModelInfo | None

    @classmethod
    def of(cls, parts: Sequence[ModelInfo]) -> Roles:
        """The roles of a collection's components (in the collection's order)."""
        images = [p for p in parts if p.type == "image" and "upscaling" not in p.labels]
        editors = [p for p in images if "edit" in p.labels]
        drawers = [p for p in images if "edit" not in p.labels] or images
        return cls(
            chat=next((p for p in parts if p.type == "llm"), None),
            image=next(iter(drawers), None),
            edit=next(iter(editors or images), None),
            tts=next((p for p in parts if p.type == "tts"), None),
        )

    @property
    def tools(self) -> list[str]:
        """The built-in tools these roles serve, in a fixed order."""
        played = {GENERATE_IMAGE: self.image, EDIT_IMAGE: self.edit, TEXT_TO_SPEECH: self.tts}
        return [name for name, part in played.items() if part is not None]


def tool_definitions(names: Sequence[str]) -> list[dict[str, Any]]:
    """The OpenAI ``tools`` entries of built-in tools ``names``."""
    return [
        {
            "type": "function",
            "function": {"name": n, "description": OMNI_TOOLS[n][0], "parameters": OMNI_TOOLS[n][1]},
        }
        for n in names
    ]


def system_prompt(names: Sequence[str] | None = None) -> str:
    """The built-in system prompt, naming tools ``names`` (all of them when ``None``)."""
    listed = [_PROMPT_LINES[n] for n in (OMNI_TOOLS if names is None else names)]
    if not listed:
        return _PROMPT_HEAD.split(" that can create", 1)[0] + "."
    return "\n".join([_PROMPT_HEAD, "Tools:", *listed])
