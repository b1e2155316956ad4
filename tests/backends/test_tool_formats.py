"""Each family's tool-call format on its real chat template: detected from the template, the template renders a
conversation with calls and results, and recorded output of that format parses, whole and in any split, with
the call's name first and its arguments in pieces."""

from __future__ import annotations

import json
import random

import pytest

from lemonkit.backends.chat import (
    FORMATS,
    ChatTemplate,
    detect_format,
    make_parser,
    merge_system_messages,
    normalize_messages,
    parse_tools,
    prompt_opens_thinking,
    split_output,
    tool_system_prompt,
    with_system,
)
from tests.support.tool_format_cases import ARGUMENTS, CASES, WEATHER, Case, history

TOOLS = parse_tools([WEATHER])


def _render(case: Case) -> tuple[ChatTemplate, str]:
    template = ChatTemplate(case.source, bos_token="<s>", eos_token="</s>")
    messages = normalize_messages(history(case), tools_in_template=template.supports_tools)
    if not template.supports_tools:
        messages = with_system(messages, tool_system_prompt(TOOLS))
    if not template.supports_system:
        messages = merge_system_messages(messages)
    assert TOOLS is not None
    tools = TOOLS.tools if template.supports_tools else None
    return template, template.render(messages, tools=tools, enable_thinking=case.thinking)


def _expected(case: Case) -> list[tuple[str, object]]:
    out: list[tuple[str, object]] = []
    if case.reasoning:
        out.append(("reasoning", case.reasoning))
    call = ("tool_call", ARGUMENTS)
    if case.content and case.output.index(case.content) > 0 and case.format == "lfm2":
        return [*out, call, ("content", case.content)]
    if case.content:
        out.append(("content", case.content))
    return [*out, call]


def _assembled(events: list) -> list[tuple[str, object]]:
    """Events merged by kind, each call as ``("tool_call", its arguments parsed)`` (its name checked)."""
    out: list = []
    for kind, value in events:
        if kind == "tool_name":
            assert value == "get_weather"
            out.append(["tool_call", ""])
        elif kind == "tool_args":
            out[-1][1] += value
        elif out and out[-1][0] == kind:
            out[-1][1] += value
        else:
            out.append([kind, value])
    return [(k, json.loads(v) if k == "tool_call" else v) for k, v in out]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.template)
def test_format_is_read_off_the_template(case: Case) -> None:
    assert detect_format(case.source).name == case.format


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.template)
def test_template_renders_calls_and_results(case: Case) -> None:
    _, prompt = _render(case)
    assert "get_weather" in prompt and "Oslo" in prompt and "temp" in prompt  # declared, called, answered
    assert prompt.rstrip().endswith(prompt.rstrip()[-8:])
    assert "And in Paris for three days?" in prompt


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.template)
def test_output_parses_whole_and_in_any_split(case: Case) -> None:
    fmt = FORMATS[case.format]
    _, prompt = _render(case)
    opens = prompt_opens_thinking(prompt, fmt.think)
    think = fmt.think
    assert opens == (case.reasoning is not None and think is not None and not case.output.startswith(think[0]))
    expected = _expected(case)
    whole = split_output(case.output, in_reasoning=opens, tools=TOOLS, fmt=fmt)
    assert [(k, json.loads(v["arguments"]) if k == "tool_call" else v) for k, v in whole] == expected
    rng = random.Random(case.template)
    for split in ("chars", "random", "once"):
        parser = make_parser(fmt, in_reasoning=opens, tools=TOOLS)
        events: list = []
        text = case.output
        i = 0
        while i < len(text):
            step = 1 if split == "chars" else rng.randint(1, 7) if split == "random" else len(text)
            events += parser.feed(text[i : i + step])
            i += step
        events += parser.finish()
        assert _assembled(events) == expected, split
        if split == "chars":
            kinds = [k for k, _ in events]
            first = kinds.index("tool_name")
            assert "tool_args" not in kinds[:first]  # the name goes out before any argument
            assert kinds.count("tool_args") >= 2  # and the arguments in pieces, as they are written


def test_markers_of_each_format_are_rendered_as_text() -> None:
    # the markup the parser reads is made of special tokens: each format lists them for the engine to render
    for fmt in FORMATS.values():
        for opener in fmt.openers:
            assert opener in fmt.markers
    assert "<|channel|>" in FORMATS["harmony"].preserved and "[TOOL_CALLS]" in FORMATS["mistral"].preserved


def test_plain_text_and_lookalikes_stay_content() -> None:
    for fmt in FORMATS.values():
        text = "a [b] <c> {d} call:e(f) to=functions.g"
        events = split_output(text, tools=TOOLS, fmt=fmt)
        assert events == [("content", text)], fmt.name
        assert split_output(text, fmt=fmt) == [("content", text)]


def test_broken_calls_fall_back_to_text() -> None:
    assert split_output("<tool_call>not a call</tool_call>", tools=TOOLS, fmt=FORMATS["hermes"])[0][0] == "content"
    bad_python = split_output("<|tool_call_start|>[not valid]<|tool_call_end|>", tools=TOOLS, fmt=FORMATS["lfm2"])
    assert bad_python[0] == ("content", "<|tool_call_start|>[not valid]<|tool_call_end|>")
    cut = split_output('[TOOL_CALLS]get_weather[ARGS]{"city": "Pa', tools=TOOLS, fmt=FORMATS["mistral"])
    assert cut == [("tool_call", {"name": "get_weather", "arguments": '{"city": "Pa'})]  # what came is kept


def test_calls_without_tools_are_text() -> None:
    # tool_choice "none" (or no tools): a call the model writes anyway is not turned into tool_calls
    call = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}'
    assert split_output(call, fmt=FORMATS["harmony"]) == [("content", '{"city": "Oslo"}')]
    hermes = '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
    assert split_output(hermes, fmt=FORMATS["hermes"]) == [("content", hermes)]
