"""Chat templates: a GGUF / Hugging Face Jinja template, or one of llama-cpp-python's named formats.

Not llama-cpp-python's ``Jinja2ChatFormatter``: it sets ``tools``, ``functions`` and ``tool_choice`` (None when
absent) on every render, so a template's ``tools is defined`` test always passes; here unset stays undefined.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from lemonkit.backends.chat.messages import THINK_CLOSE, THINK_OPEN
from lemonkit.errors import InvalidArgument

__all__ = ["ChatTemplate", "formatter_by_name", "prompt_opens_thinking"]


class ChatTemplate:
    """A GGUF / HF Jinja chat template, compiled once, rendered like transformers does."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "") -> None:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        class _Generation(jinja2.ext.Extension):
            """HF's ``{% generation %}`` marker: render its body unchanged."""

            tags = {"generation"}

            def parse(self, parser: Any) -> Any:
                parser.stream.skip(1)
                return parser.parse_statements(("name:endgeneration",), drop_needle=True)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _Generation]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as exc:
            raise ValueError(f"invalid chat template: {exc}") from exc
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        #: The template declares tools itself (else the engine adds a system prompt).
        self.supports_tools = "tools" in source
        self.supports_thinking = "enable_thinking" in source
        #: Gemma's templates raise on a system turn: system text is folded into the first user turn instead
        self.supports_system = "System role not supported" not in source

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        enable_thinking: bool | None = None,
        **extra: Any,
    ) -> str:
        """The prompt text. Variables left out stay *undefined*, as templates' ``is defined`` tests expect."""
        import jinja2

        ctx: dict[str, Any] = {
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            **extra,
        }
        if tools:
            ctx["tools"] = tools
        if enable_thinking is not None:
            ctx["enable_thinking"] = enable_thinking
        try:
            return self._template.render(**ctx)
        except jinja2.TemplateError as exc:
            raise InvalidArgument(f"the chat template failed on these messages: {exc}") from exc
        except _TemplateRaised as exc:
            raise InvalidArgument(f"the chat template refused these messages: {exc}") from exc


class _TemplateRaised(Exception):
    pass


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def prompt_opens_thinking(prompt: str, tags: tuple[str, str] | None = (THINK_OPEN, THINK_CLOSE)) -> bool:
    """True when the rendered prompt leaves a reasoning tag (``<think>``, or the format's ``tags``) open: the model
    starts inside its reasoning."""
    if tags is None:
        return False
    i = prompt.rfind(tags[0])
    return i >= 0 and prompt.rfind(tags[1]) < i


def formatter_by_name(module: Any, name: str) -> Any:
    """A llama-cpp-python chat formatter (``format_<name>``) by its registered name, else None."""
    fn = getattr(module, "format_" + name.replace("-", "_").replace(".", "_"), None)
    if callable(fn):
        return fn
    # Registered names whose function is spelled differently ("vicuna" is ``format``, ...):
    # the registry keeps handlers that close over the formatter.
    try:
        handler = module.get_chat_completion_handler(name)
    except Exception:
        return None
    for cell in getattr(handler, "__closure__", None) or ():
        value = cell.cell_contents
        if callable(value) and getattr(value, "__name__", "").startswith("format"):
            return value
    return None
