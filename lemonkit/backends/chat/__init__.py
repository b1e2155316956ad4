"""Chat prompt rendering and output parsing, model-free so it is unit-tested without weights.

- :mod:`~lemonkit.backends.chat.messages`: OpenAI messages normalised for a template, system-turn merging;
- :mod:`~lemonkit.backends.chat.templates`: Jinja chat templates (HF semantics) and llama-cpp-python's named formats;
- :mod:`~lemonkit.backends.chat.tools`: request tools, their declaration for templates that know none, call ids;
- :mod:`~lemonkit.backends.chat.grammars`: GBNF for ``response_format`` and forced tool calls;
- :mod:`~lemonkit.backends.chat.tool_formats`: each model family's tool-call and reasoning markup, found from its
template;
- :mod:`~lemonkit.backends.chat.stream`: streamed text to content / reasoning / tool-call events, stop strings.

The llama.cpp engine (:mod:`lemonkit.backends.llamacpp`) glues them to a model.
"""

from lemonkit.backends.chat.grammars import (
    json_object_grammar,
    json_schema_grammar,
    response_format_grammar,
    tool_call_grammar,
)
from lemonkit.backends.chat.messages import merge_system_messages, normalize_messages, with_system
from lemonkit.backends.chat.stream import (
    Event,
    ForcedToolStream,
    StopMatcher,
    StreamParser,
    make_parser,
    split_output,
)
from lemonkit.backends.chat.templates import ChatTemplate, formatter_by_name, prompt_opens_thinking
from lemonkit.backends.chat.tool_formats import FORMATS, ChatFormat, detect_format
from lemonkit.backends.chat.tools import ToolSpec, new_call_id, parse_tools, tool_system_prompt

__all__ = [
    "FORMATS",
    "ChatFormat",
    "ChatTemplate",
    "Event",
    "ForcedToolStream",
    "StopMatcher",
    "StreamParser",
    "ToolSpec",
    "detect_format",
    "formatter_by_name",
    "json_object_grammar",
    "json_schema_grammar",
    "make_parser",
    "merge_system_messages",
    "new_call_id",
    "normalize_messages",
    "parse_tools",
    "prompt_opens_thinking",
    "response_format_grammar",
    "split_output",
    "tool_call_grammar",
    "tool_system_prompt",
    "with_system",
]
