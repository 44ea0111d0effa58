"""How each dialect hands tools and tool turns to a chat template: definitions as sent, Anthropic's in OpenAI's shape."""

from __future__ import annotations

import json

from jitllmd.engine.chat import ChatTemplate
from jitllmd.serve import anthropic, openai_request
from jitllmd.serve.body import Fields

# A template that shows exactly what it was given.
DUMP = ChatTemplate("{{ tools | tojson }}\n{% for m in messages %}{{ m | tojson }}\n{% endfor %}")
SCHEMA_TEXT = '{"required": ["city"], "type": "object", "properties": {"city": {"type": "string", "description": "é"}}}'


def test_anthropic_definitions_become_openai_shape_with_the_schema_unchanged():
    body = json.loads('{"tools": [{"name": "get_weather", "description": "d", "input_schema": ' + SCHEMA_TEXT + "}]}")
    tools = anthropic._tools(Fields(body))
    assert tools == [{"type": "function", "function": {"name": "get_weather", "description": "d", "parameters": json.loads(SCHEMA_TEXT)}}]
    rendered = DUMP.render([{"role": "user", "content": "hi"}], tools=tools)
    assert SCHEMA_TEXT in rendered  # key order and all
    assert anthropic._tools(Fields({**body, "tool_choice": {"type": "none"}})) is None
    assert anthropic._tools(Fields({**body, "tool_choice": {"type": "any"}})) == tools


def test_openai_definitions_reach_the_template_as_sent():
    sent = json.loads('[{"type": "function", "function": {"name": "f", "parameters": ' + SCHEMA_TEXT + ', "strict": true}}]')
    tools = openai_request.tools_of(Fields({"tools": sent, "tool_choice": "required"}))
    assert tools == sent and json.dumps(sent, ensure_ascii=False) in DUMP.render([{"role": "user", "content": "hi"}], tools=tools)
    assert openai_request.tools_of(Fields({"tools": sent, "tool_choice": "none"})) is None


def test_tool_turns_render_with_arguments_as_objects():
    openai_turns = openai_request.chat_messages(Fields({"messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
    ]}))
    anthropic_turns, prefill = anthropic._messages(Fields({"messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": [{"type": "text", "text": "18C"}]}]},
    ]}))
    assert prefill is None
    a, b = DUMP.render(openai_turns), DUMP.render(anthropic_turns)
    assert '"arguments": {"city": "Paris"}' in a and '"tool_call_id": "call_1"' in a
    assert a == b  # the same turns either way
