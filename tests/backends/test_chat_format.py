"""Unit tests for the model-free chat helpers in :mod:`lemonkit.backends.chat`."""

from __future__ import annotations

import json
import re

import pytest

from lemonkit.backends.chat import (
    ChatTemplate,
    ForcedToolStream,
    StopMatcher,
    StreamParser,
    json_object_grammar,
    json_schema_grammar,
    merge_system_messages,
    new_call_id,
    normalize_messages,
    parse_tools,
    prompt_opens_thinking,
    response_format_grammar,
    split_output,
    tool_call_grammar,
    tool_system_prompt,
)
from lemonkit.errors import InvalidArgument
from lemonkit.testing.tiny_gguf import CHATML_TEMPLATE

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}


def feed_chars(obj, text: str) -> list:
    """Feed ``text`` one character at a time (the worst case for held-back tags)."""
    events = []
    for ch in text:
        events.extend(obj.feed(ch))
    return events


def merged(events: list) -> list:
    out: list = []
    for kind, value in events:
        if kind != "tool_call" and out and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + value)
        else:
            out.append((kind, value))
    return out


def assembled(events: list) -> list:
    """Events merged by kind, each call's name and argument pieces assembled as ``split_output`` gives them."""
    out: list = []
    for kind, value in events:
        if kind == "tool_name":
            out.append(("tool_call", {"name": value, "arguments": ""}))
        elif kind == "tool_args":
            out[-1][1]["arguments"] += value
        elif out and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + value)
        else:
            out.append((kind, value))
    return out


# --------------------------------------------------------------------------- messages


def test_normalize_joins_text_parts_and_maps_developer():
    msgs = normalize_messages(
        [
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}]},
            {"role": "assistant", "content": None},
        ]
    )
    assert msgs == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello\nworld"},
        {"role": "assistant", "content": ""},
    ]


@pytest.mark.parametrize(
    "messages",
    [
        [],
        "hi",
        [{"role": "wizard", "content": "x"}],
        [{"role": "user", "content": [{"type": "audio", "audio": "x"}]}],
        [{"role": "user", "content": [{"type": "text"}]}],
        [{"role": "user", "content": 3}],
    ],
)
def test_normalize_rejects_bad_messages(messages):
    with pytest.raises(InvalidArgument):
        normalize_messages(messages)


def test_images_refused_without_vision_and_collected_with_it():
    msg = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "what?"}, {"type": "image_url", "image_url": {"url": "data:x"}}],
        }
    ]
    with pytest.raises(InvalidArgument, match="image"):
        normalize_messages(msg)
    images: list[str] = []
    out = normalize_messages(msg, image_marker="<__media__>", images=images)
    assert images == ["data:x"]
    assert out[0]["content"] == "what?\n<__media__>"


def test_tool_history_structured_or_as_text():
    history = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
    ]
    structured = normalize_messages(history)
    assert structured[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}  # templates tojson a dict
    assert structured[2] == {"role": "tool", "content": "rain", "tool_call_id": "call_1"}
    text = normalize_messages(history, tools_in_template=False)
    assert "<tool_call>" in text[1]["content"] and '"city": "Oslo"' in text[1]["content"]
    assert text[2] == {"role": "user", "content": "<tool_response>\nrain\n</tool_response>"}


def test_merge_system_messages():
    out = merge_system_messages([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}])
    assert out == [{"role": "user", "content": "S\n\nU"}]
    assert merge_system_messages([{"role": "system", "content": "S"}]) == [{"role": "user", "content": "S"}]


# --------------------------------------------------------------------------- templates


def test_chatml_template_renders_tools_and_generation_prompt():
    tmpl = ChatTemplate(CHATML_TEMPLATE, bos_token="<s>", eos_token="</s>")
    assert tmpl.supports_tools
    msgs = normalize_messages([{"role": "user", "content": "hi"}])
    plain = tmpl.render(msgs)
    assert plain == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tmpl.render(msgs, add_generation_prompt=False) == "<|im_start|>user\nhi<|im_end|>\n"
    with_tools = tmpl.render(msgs, tools=parse_tools([WEATHER]).tools)
    assert "<tools>" in with_tools and '"name": "get_weather"' in with_tools


def test_template_variables_left_undefined_unless_given():
    tmpl = ChatTemplate(
        "{% if enable_thinking is defined and not enable_thinking %}OFF{% elif enable_thinking is defined %}ON"
        "{% else %}DEFAULT{% endif %}{{ bos_token }}"
    )
    msgs = [{"role": "user", "content": "x"}]
    assert tmpl.supports_thinking
    assert tmpl.render(msgs) == "DEFAULT"
    assert tmpl.render(msgs, enable_thinking=False) == "OFF"
    assert tmpl.render(msgs, enable_thinking=True) == "ON"
    tools = ChatTemplate("{% if tools is defined %}TOOLS{% else %}NONE{% endif %}")
    assert tools.render(msgs) == "NONE" and tools.render(msgs, tools=[WEATHER]) == "TOOLS"


def test_template_raise_exception_and_strftime():
    tmpl = ChatTemplate("{{ raise_exception('only user turns') }}")
    with pytest.raises(InvalidArgument, match="only user turns"):
        tmpl.render([{"role": "user", "content": "x"}])
    assert re.fullmatch(r"\d{4}", ChatTemplate("{{ strftime_now('%Y') }}").render([]))
    with pytest.raises(ValueError):
        ChatTemplate("{% if %}")


def test_prompt_opens_thinking():
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_thinking("plain")


# --------------------------------------------------------------------------- tools and grammars


def test_parse_tools_validates_and_defaults_parameters():
    spec = parse_tools([WEATHER, TIME])
    assert spec is not None and spec.names == ["get_weather", "get_time"]
    assert spec.params["get_time"] == {"type": "object", "properties": {}}
    assert parse_tools(None) is None and parse_tools([]) is None
    for bad in (
        [{"type": "function"}],
        [{"type": "retrieval", "function": {"name": "x"}}],
        [WEATHER, WEATHER],
        [{"type": "function", "function": {"name": "x", "parameters": "no"}}],
        {"a": 1},
    ):
        with pytest.raises(InvalidArgument):
            parse_tools(bad)


def test_tool_system_prompt_declares_every_tool():
    text = tool_system_prompt(parse_tools([WEATHER, TIME]))  # type: ignore[arg-type]
    assert "get_weather" in text and "get_time" in text and "<tool_call>" in text


def test_tool_call_grammar_constrains_name_and_arguments():
    spec = parse_tools([WEATHER, TIME])
    assert spec is not None
    both = tool_call_grammar(spec)
    assert '"\\"get_weather\\""' in both and '"\\"get_time\\""' in both
    assert both.startswith("alternative-0") or "root ::= alternative-0 | alternative-1" in both
    only = tool_call_grammar(spec, "get_time")
    assert "get_weather" not in only and "get_time" in only
    # JSON strings may not contain raw control characters: the converter's char rule is tightened.
    assert '[^"\\\\\\x7F\\x00-\\x1F]' in both


def test_tool_call_grammar_hoists_defs():
    tool = {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {
                "type": "object",
                "properties": {"p": {"$ref": "#/$defs/P"}},
                "required": ["p"],
                "$defs": {"P": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}},
            },
        },
    }
    gbnf = tool_call_grammar(parse_tools([tool]))  # type: ignore[arg-type]
    assert "integer" in gbnf and "P ::=" in gbnf


def test_response_format_grammar():
    assert response_format_grammar(None) is None
    assert response_format_grammar({"type": "text"}) is None
    assert response_format_grammar({"type": "json_object"}) == json_object_grammar()
    gbnf = response_format_grammar(
        {
            "type": "json_schema",
            "json_schema": {
                "name": "x",
                "schema": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
            },
        }
    )
    assert gbnf is not None and '"\\"ok\\""' in gbnf
    for bad in (
        {"type": "json_schema"},
        {"type": "json_schema", "json_schema": {"schema": 3}},
        {"type": "yaml"},
        "json",
    ):
        with pytest.raises(InvalidArgument):
            response_format_grammar(bad)


_NEGATED_CLASS = re.compile(r"\[\^((?:\\.|[^\]\\])*)\]")


@pytest.mark.parametrize(
    "schema",
    [
        {},
        {"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]},
        {"type": "object", "additionalProperties": {"type": "string", "minLength": 2, "maxLength": 5}},
        {"type": "object", "properties": {"p": {"type": "string", "pattern": "^a.b$"}}},
        {
            "type": "array",
            "items": {"type": "object", "properties": {"x": {"enum": ["a", 1]}, "y": {"type": "string"}}},
        },
    ],
)
def test_grammar_strings_hold_no_raw_quote_backslash_or_control_character(schema: dict) -> None:
    # Every "any character but" class inside a JSON string must exclude what json.loads refuses raw: the converter's
    # own `char` and a pattern's `.` allow some of it, so they are tightened.
    for gbnf in (json_schema_grammar(schema), json_object_grammar()):
        classes = _NEGATED_CLASS.findall(gbnf)
        assert classes
        for chars in classes:
            assert '"' in chars and "\\\\" in chars and "\\x00-\\x1F" in chars, chars


def test_json_schema_grammar_rejects_unsupported_schema():
    with pytest.raises(InvalidArgument):
        json_schema_grammar({"type": "no-such-type"})
    assert json_schema_grammar({}) == json_object_grammar()


def test_new_call_id():
    a, b = new_call_id(), new_call_id()
    assert a != b and re.fullmatch(r"call_[0-9a-f]{24}", a)


# --------------------------------------------------------------------------- streaming


def test_stop_matcher_across_pieces():
    m = StopMatcher(["STOP", "\n\n"])
    out = "".join(m.feed(c) for c in "abc ST") + m.feed("O") + m.feed("P and more")
    assert out == "abc " and m.stopped
    assert m.feed("later") == "" and m.finish() == ""


def test_stop_matcher_holds_back_then_releases():
    m = StopMatcher(["</end>"])
    assert m.feed("a </e") == "a "
    assert m.feed("x") == "</ex"  # not a stop after all
    assert m.feed("</") == "" and m.finish() == "</"
    assert StopMatcher([]).feed("free") == "free"


def test_stop_matcher_earliest_stop_wins():
    m = StopMatcher(["cd", "b"])
    assert m.feed("abcd") == "a"


def test_stream_parser_splits_think_char_by_char():
    text = "<think>\nLet me see.\n</think>\n\nThe answer."
    events = merged(feed_chars(p := StreamParser(), text) + p.finish())
    assert events == [("reasoning", "Let me see."), ("content", "The answer.")]
    assert split_output(text) == events


def test_stream_parser_prompt_opened_thinking():
    assert split_output("plan...</think>done", in_reasoning=True) == [("reasoning", "plan..."), ("content", "done")]
    # cut off while thinking: everything is reasoning
    assert split_output("still thinking", in_reasoning=True) == [("reasoning", "still thinking")]


def test_stream_parser_passes_lookalike_tags():
    text = "a < b and <thin ice> and <tool_call> stays"
    assert merged(feed_chars(p := StreamParser(), text) + p.finish()) == [("content", text)]


TOOLS = parse_tools([WEATHER, TIME])


def test_stream_parser_tool_calls_in_tags():
    text = (
        'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
        '<tool_call>{"name": "get_time", "arguments": "{}"}</tool_call>'
    )
    for events in (
        split_output(text, tools=TOOLS),
        assembled(feed_chars(p := StreamParser(tools=TOOLS), text) + p.finish()),
    ):
        assert events[0] == ("content", "Checking.")
        calls = [v for k, v in events if k == "tool_call"]
        assert [c["name"] for c in calls] == ["get_weather", "get_time"]
        assert json.loads(calls[0]["arguments"]) == {"city": "Oslo"} and json.loads(calls[1]["arguments"]) == {}
        assert len(events) == 3


def test_stream_parser_bare_json_tool_call():
    text = '  {"name": "get_weather", "parameters": {"city": "Rome"}}'
    events = split_output(text, tools=TOOLS)
    assert events == [("tool_call", {"name": "get_weather", "arguments": '{"city": "Rome"}'})]
    # JSON that names no tool is an ordinary answer
    assert split_output('{"name": "Bob"}', tools=TOOLS) == [("content", '{"name": "Bob"}')]
    # without tools, JSON streams as content at once
    assert StreamParser().feed('{"a"') == [("content", '{"a"')]
    # with tools, JSON whose first key is not "name" streams as soon as that is clear
    parser = StreamParser(tools=TOOLS)
    assert parser.feed(' {"n') == [] and parser.feed("am") == []
    assert parser.feed('ber": 1') == [("content", ' {"namber": 1')]
    assert parser.feed("}") == [("content", "}")]
    # the call's name goes out as soon as it is a tool's, the arguments as they come
    parser = StreamParser(tools=TOOLS)
    assert parser.feed('{"name": "get_weather", "arguments": {"ci') == [
        ("tool_name", "get_weather"),
        ("tool_args", '{"ci'),
    ]
    assert parser.feed('ty": "Oslo"}}') == [("tool_args", 'ty": "Oslo"}')]
    parser = StreamParser(tools=TOOLS)
    assert parser.feed('{"name": "x", "argu') == [("content", '{"name": "x", "argu')]  # "x" is no tool


def test_stream_parser_broken_tool_call_is_content():
    events = split_output("<tool_call>{not json</tool_call>", tools=TOOLS)
    assert events == [("content", "<tool_call>{not json</tool_call>")]
    events = split_output('<tool_call>{"name": "f", "arguments": {}}', tools=TOOLS)  # cut before the close tag
    assert events == [("tool_call", {"name": "f", "arguments": "{}"})]


def test_forced_tool_stream_char_by_char():
    text = '{ "name": "get_weather", "arguments": {"city": "Oslo}", "n": {"a": 1}} } '
    fts = ForcedToolStream()
    events = feed_chars(fts, text)
    tail, call = fts.finish()
    events += tail
    assert events[0] == ("tool_name", "get_weather")
    args = "".join(v for k, v in events if k == "tool_args")
    assert json.loads(args) == {"city": "Oslo}", "n": {"a": 1}}
    assert call == {"name": "get_weather", "arguments": json.dumps({"city": "Oslo}", "n": {"a": 1}})}


def test_forced_tool_stream_cut_off():
    fts = ForcedToolStream()
    events = fts.feed('{"name": "f", "arguments": {"x": "abc')
    tail, call = fts.finish()
    assert call is None
    assert events[0] == ("tool_name", "f")
    assert "".join(v for k, v in events + tail if k == "tool_args") == '{"x": "abc'
