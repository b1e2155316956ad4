"""Each model family's real chat template (``tests/data/chat_templates``) and what a model of that family writes when
it calls ``get_weather(city="Paris", days=3)``, spelled as the template teaches it."""

from __future__ import annotations

from dataclasses import dataclass

from tests.support.paths import DATA

TEMPLATES = DATA / "chat_templates"

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather forecast for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
ARGUMENTS = {"city": "Paris", "days": 3}


@dataclass(frozen=True)
class Case:
    template: str  # file name under TEMPLATES
    format: str  # the ChatFormat detect_format must find
    output: str  # the model's text after the prompt
    reasoning: str | None = None
    content: str | None = None
    call_id: str = "call_0123456789abcdef01234567"  # the id the history's call carries (Mistral: 9 characters)
    thinking: bool | None = None  # enable_thinking for the render (None: the template's default)

    @property
    def source(self) -> str:
        return (TEMPLATES / self.template).read_text(encoding="utf-8")


CASES = [
    Case(
        "qwen3.jinja",
        "hermes",
        "<think>\nThe user wants the forecast.\n</think>\n\nLet me look.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>',
        reasoning="The user wants the forecast.",
        content="Let me look.",
    ),
    Case(
        "qwen2.5.jinja",
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>',
    ),
    Case(
        "qwen3-coder.jinja",
        "qwen3_coder",
        "I will check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
        content="I will check.",
    ),
    Case(
        "glm-4.6.jinja",
        "glm",
        "<think>A forecast is needed.</think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
        "<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>",
        reasoning="A forecast is needed.",
    ),
    Case("llama-3.2.jinja", "llama3", '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}'),
    Case(
        "mistral-nemo-2407.jinja",
        "mistral",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}, "id": "Ab3dE6gH9"}]',
        call_id="Ab3dE6gH9",
    ),
    Case(
        "devstral-small-2507.jinja",
        "mistral",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}',
        call_id="Ab3dE6gH9",
    ),
    Case(
        "mistral-small-3.2.jinja",
        "mistral",
        'Sure.[TOOL_CALLS]get_weather[CALL_ID]Ab3dE6gH9[ARGS]{"city": "Paris", "days": 3}',
        content="Sure.",
        call_id="Ab3dE6gH9",
    ),
    Case(
        "ministral-3-reasoning.jinja",
        "mistral",
        '[THINK]The forecast tool fits.[/THINK][TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}',
        reasoning="The forecast tool fits.",
        call_id="Ab3dE6gH9",
    ),
    Case(
        "lfm2.jinja",
        "lfm2",
        '<|tool_call_start|>[get_weather(city="Paris", days=3)]<|tool_call_end|>Checking the forecast.',
        content="Checking the forecast.",
    ),
    Case(
        "phi-4-mini.jinja",
        "phi4",
        '<|tool_call|>{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}<|/tool_call|>',
    ),
    Case(
        "deepseek-r1-distill.jinja",
        "deepseek",
        "Paris, three days.\n</think>\n\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
        '```json\n{"city": "Paris", "days": 3}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        reasoning="Paris, three days.",
        thinking=True,
    ),
    Case(
        "deepseek-v3.1.jinja",
        "deepseek",
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris", "days": 3}'
        "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
    ),
    Case(
        "gemma-4.jinja",
        "gemma4",
        '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>',
    ),
    Case(
        "gpt-oss.jinja",
        "harmony",
        "<|channel|>analysis<|message|>Need the forecast.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", "days": 3}',
        reasoning="Need the forecast.",
    ),
    # templates that declare no tools: the Hermes tool prompt, and Hermes calls
    Case(
        "gemma-2.jinja",
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>',
    ),
    Case(
        "smollm3.jinja",
        "hermes",
        '<think>\nForecast.\n</think>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'
        "\n</tool_call>",
        reasoning="Forecast.",
    ),
]


def history(case: Case) -> list[dict]:
    """A conversation that already holds a call and its result, so the template renders both."""
    call = {
        "id": case.call_id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
    }
    return [
        {"role": "system", "content": "You help with the weather."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": case.call_id, "name": "get_weather", "content": '{"temp": 4}'},
        {"role": "assistant", "content": "It is 4 degrees in Oslo."},
        {"role": "user", "content": "And in Paris for three days?"},
    ]
