"""A /v1/responses body, read: its input items as chat-template messages, its tools, tool_choice and text format in
chat completions' shapes (so one path, openai_request.parse_common, turns both into a generation), and what the
response echoes back. Each error names the field as the body spells it."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from .body import APIError, Fields
from .openai_request import ROLES
from .prompt import check_tool_schema
from .reasoning import EFFORTS

__all__ = ["ResponsesRequest", "item_id", "not_found", "read_request"]

# Fields chat completions reads that a Responses body may carry as they are (vLLM's Responses API takes its sampling
# and template extensions too; `jitllm` holds this server's own: speculative, draft_max).
_CHAT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
                "ignore_eos", "chat_template_kwargs", "thinking_token_budget", "jitllm")
_LOGPROBS = "message.output_text.logprobs"


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass(frozen=True)
class ResponsesRequest:
    """What a create (or input_tokens) body asks."""

    model: str | None
    instructions: str | None
    items: list[dict[str, Any]]  # this request's input items, each with an id, as input_items lists them
    messages: list[dict[str, Any]]  # the same as chat messages (instructions apart)
    tools: list[dict[str, Any]]  # as sent, for the echo
    chat_tools: list[dict[str, Any]] | None  # in chat's shape; None with no tools or tool_choice "none"
    tool_choice: Any  # as sent (default "auto"), for the echo
    text: dict[str, Any]  # {"format": ...} as sent (default text), for the echo
    chat: dict[str, Any]  # the chat completions body parse_common reads: sampling, max tokens, format, tool_choice
    previous_response_id: str | None
    store: bool
    stream: bool
    metadata: dict[str, str]
    echo: dict[str, Any]  # the rest a Response echoes: temperature, top_p, max_output_tokens, parallel_tool_calls, ...
    logprobs: bool  # output_text parts carry their tokens' logprobs
    summary: bool = False  # reasoning.summary asked: a reasoning item's summary holds its thought

    def system(self) -> list[dict[str, Any]]:
        return [{"role": "system", "content": self.instructions}] if self.instructions else []


def read_request(body: dict[str, Any], *, counting: bool = False) -> ResponsesRequest:
    """A create body (`counting`: an input_tokens body, which has no sampling fields but the same input)."""
    f = Fields(body)
    if f.boolean("background"):
        raise f.error("background", "background responses are not supported: stream, or wait for the response")
    for key, why in (("conversation", "conversation objects are not supported: chain responses with previous_response_id"),
                     ("prompt", "prompt templates are not supported: send instructions and input")):
        if f.has(key):
            raise f.error(key, why)
    truncation = f.string("truncation", "disabled")
    if truncation not in ("disabled", "auto"):
        raise f.error("truncation", f"{truncation!r}: expected disabled or auto")
    if truncation == "auto":
        raise f.error("truncation", "only disabled is supported: an input longer than the context is a 400 that says both lengths")
    instructions = _instructions(f)
    items, messages = _input(f)
    tools, chat_tools, tool_choice = _tools(f)
    text, response_format = _text(f)
    reasoning = f.object("reasoning")
    effort = summary = None
    if reasoning is not None:
        effort = reasoning.string("effort")
        if effort is not None and effort not in EFFORTS:
            raise reasoning.error("effort", f"{effort!r}: expected one of {', '.join(EFFORTS)}")
        summary = reasoning.string("summary") or reasoning.string("generate_summary")
        if summary is not None and summary not in ("auto", "concise", "detailed"):
            raise reasoning.error("summary", f"{summary!r}: expected auto, concise or detailed")
    include = f.strings("include", most=32, single=False)
    top = f.integer("top_logprobs", low=0, high=20)
    logprobs = top is not None or _LOGPROBS in include
    max_output = f.integer("max_output_tokens", low=1)
    chat: dict[str, Any] = {k: body[k] for k in _CHAT_FIELDS if body.get(k) is not None}
    if effort is not None:
        chat["reasoning_effort"] = effort  # a thinking model's switch and budget, as chat's reasoning_effort sets them
    if max_output is not None:
        chat["max_completion_tokens"] = max_output
    if logprobs:
        chat.update(logprobs=True, top_logprobs=top or 0)
    if response_format is not None:
        chat["response_format"] = response_format
    if chat_tools and tool_choice != "auto":
        chat["tool_choice"] = "required" if tool_choice == "required" else {"type": "function", "function": {"name": tool_choice["name"]}}
    if not counting:
        chat["stream"] = f.boolean("stream")
    previous = f.string("previous_response_id")
    echo = {
        "temperature": f.number("temperature", 1.0),
        "top_p": f.number("top_p", 1.0),
        "max_output_tokens": max_output,
        "parallel_tool_calls": f.boolean("parallel_tool_calls", True),
        "top_logprobs": top,
        "reasoning": {"effort": reasoning.raw("effort"), "summary": reasoning.raw("summary")} if reasoning is not None else {"effort": None, "summary": None},
        "truncation": truncation,
        "background": False,
        "service_tier": "default",
    }
    if f.has("user"):  # the document's Response has it as a string, never null: left out when not sent
        echo["user"] = f.string("user")
    for key in ("safety_identifier", "prompt_cache_key"):
        f.string(key)  # OpenAI's routing hints: a string, read by nobody here
    return ResponsesRequest(
        model=f.string("model"), instructions=instructions, items=items, messages=messages, tools=tools, chat_tools=chat_tools,
        tool_choice=tool_choice, text=text, chat=chat, previous_response_id=previous, store=f.boolean("store", True), stream=f.boolean("stream"),
        metadata=_metadata(f), echo=echo, logprobs=logprobs, summary=summary is not None,
    )


def _instructions(f: Fields) -> str | None:
    """instructions: a string (or an array of input messages' text, as the document allows), the system message."""
    value = f.raw("instructions")
    if value is None or isinstance(value, str):
        return value or None
    if not isinstance(value, list):
        raise f.error("instructions", "expected a string")
    return "\n\n".join(_content(Fields(m, f"instructions[{i}]."), "content") for i, m in enumerate(value)) or None


def _content(m: Fields, key: str) -> str:
    """A message's content: a string, or an array of text parts (input_text, output_text, refusal) joined."""
    value = m.raw(key)
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise m.error(key, "expected a string or an array of content parts")
    texts = []
    for j, part in enumerate(value):
        p = Fields(part, m.name(f"{key}[{j}]."))
        kind = p.string("type", required=True)
        if kind in ("input_text", "output_text", "text", "reasoning_text", "summary_text"):
            texts.append(p.string("text", required=True) or "")
        elif kind == "refusal":
            texts.append(p.string("refusal", required=True) or "")
        else:
            raise p.error("type", f"{kind!r} parts are not supported: this server takes text (input_text)")
    return "".join(texts)


def _input(f: Fields) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """input: a string (one user message) or an array of items: messages, function_call, function_call_output, and
    reasoning (its text becomes the next assistant turn's reasoning_content, for templates that show past thoughts)."""
    raw = f.raw("input")
    if raw is None:
        raise f.error("input", "this field is required")
    if isinstance(raw, str):
        return [_message_item(item_id("msg"), "user", raw)], [{"role": "user", "content": raw}]
    if not isinstance(raw, list):
        raise f.error("input", "expected a string or an array of input items")
    if not raw:
        raise f.error("input", "must hold at least one item")
    items: list[dict[str, Any]] = []
    messages: list[dict[str, Any]] = []
    thought: str | None = None  # a reasoning item's text, for the assistant turn that follows it
    for i, value in enumerate(raw):
        it = Fields(value, f"input[{i}].")
        kind = it.string("type", "message")
        ident = it.string("id")
        if kind == "message":
            role = it.string("role", required=True) or ""
            if role not in ROLES:
                raise it.error("role", f"{role!r}: expected user, assistant, system or developer")
            if not it.has("content"):
                raise it.error("content", "this field is required")
            text = _content(it, "content")
            items.append(_message_item(ident or item_id("msg"), role, text))
            messages.append({"role": ROLES[role], "content": text})
            if role == "assistant" and thought is not None:
                messages[-1]["reasoning_content"], thought = thought, None
        elif kind == "function_call":
            call_id, name, arguments = it.string("call_id", required=True), it.string("name", required=True), it.string("arguments", required=True)
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            items.append({"id": ident or item_id("fc"), "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
                          "status": "completed"})
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # the text before the calls, or an earlier call of the same turn
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            if thought is not None:
                messages[-1]["reasoning_content"], thought = thought, None
        elif kind == "function_call_output":
            call_id = it.string("call_id", required=True)
            output = _content(it, "output")
            items.append({"id": ident or item_id("fco"), "type": "function_call_output", "call_id": call_id, "output": output, "status": "completed"})
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind == "reasoning":  # a past turn's thought: the template shows it or drops it, as it does chat's reasoning_content
            parts = [*(it.array("content") or []), *([] if it.has("content") else it.array("summary") or [])]
            thought = _content(Fields({"content": parts}, f"input[{i}]."), "content") if parts else thought
        elif kind == "item_reference":
            raise it.error("type", "item references are not supported: send the item itself, or chain with previous_response_id")
        else:
            raise it.error("type", f"{kind!r} items are not supported: input takes message, function_call and function_call_output items")
    if not messages:
        raise f.error("input", "holds no message, function call or function call output")
    return items, messages


def _message_item(ident: str, role: str, text: str) -> dict[str, Any]:
    part = "output_text" if role == "assistant" else "input_text"
    content: dict[str, Any] = {"type": part, "text": text}
    if part == "output_text":
        content.update(annotations=[], logprobs=[])
    return {"id": ident, "type": "message", "role": role, "content": [content], "status": "completed"}


def _tools(f: Fields) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, Any]:
    """tools (function tools only; a built-in tool type is a 400 naming it) and tool_choice, as sent and in chat's shape."""
    tools = f.array("tools") or []
    chat_tools = []
    for j, value in enumerate(tools):
        t = Fields(value, f"tools[{j}].")
        kind = t.string("type", required=True)
        if kind != "function":
            raise t.error("type", f"{kind!r} tools are not supported: this server runs function tools, which your code answers")
        fn: dict[str, Any] = {"name": t.string("name", required=True)}
        if t.has("description"):
            fn["description"] = t.string("description")
        parameters = t.object("parameters")
        if parameters is not None:
            check_tool_schema(parameters)
            fn["parameters"] = parameters.obj
        t.boolean("strict")
        chat_tools.append({"type": "function", "function": fn})
    choice = f.raw("tool_choice")
    if choice is None:
        choice = "auto"
    elif isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise f.error("tool_choice", f'{choice!r}: expected "none", "auto", "required" or {{"type": "function", "name": ...}}')
    else:
        c = Fields(choice, "tool_choice.")
        kind = c.string("type", required=True)
        if kind != "function":
            raise c.error("type", f"{kind!r}: this server runs function tools only; name one as {{\"type\": \"function\", \"name\": ...}}")
        c.string("name", required=True)
    if choice != "none" and choice != "auto" and not chat_tools:
        raise f.error("tool_choice", "asks for a tool call, but tools declares none")
    return tools, (chat_tools if chat_tools and choice != "none" else None), choice


def _text(f: Fields) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """text.format: text, json_object or json_schema ({name, schema, strict}); as sent, and as chat's response_format."""
    text = f.object("text")
    fmt = text.object("format") if text is not None else None
    if text is not None:
        verbosity = text.string("verbosity")
        if verbosity is not None and verbosity not in ("low", "medium", "high"):
            raise text.error("verbosity", f"{verbosity!r}: expected low, medium or high")
    if fmt is None:
        return {"format": {"type": "text"}}, None
    kind = fmt.string("type", required=True)
    if kind == "text":
        return {"format": {"type": "text"}}, None
    if kind == "json_object":
        return {"format": {"type": "json_object"}}, {"type": "json_object"}
    if kind != "json_schema":
        raise fmt.error("type", f"{kind!r}: expected text, json_object or json_schema")
    name = fmt.string("name", required=True)
    schema = fmt.object("schema")
    if schema is None:
        raise fmt.error("schema", "this field is required")
    echo = {"type": "json_schema", "name": name, "schema": schema.obj, "strict": fmt.boolean("strict", False)}
    if fmt.has("description"):
        echo["description"] = fmt.string("description")
    return {"format": echo}, {"type": "json_schema", "json_schema": {"name": name, "schema": schema.obj}}


def _metadata(f: Fields) -> dict[str, str]:
    """metadata: at most 16 string pairs, keys up to 64 characters, values up to 512 (OpenAI's bounds)."""
    m = f.object("metadata")
    if m is None:
        return {}
    if len(m.obj) > 16:
        raise f.error("metadata", f"at most 16 keys, got {len(m.obj)}")
    for key, value in m.obj.items():
        if len(key) > 64:
            raise f.error("metadata", f"keys are at most 64 characters, got {len(key)}")
        if not isinstance(value, str) or len(value) > 512:
            raise m.error(key, "expected a string of at most 512 characters")
    return dict(m.obj)


def not_found(ident: str, param: str | None = None) -> APIError:
    """An unknown response id, in OpenAI's shape (a 404)."""
    code = "previous_response_not_found" if param == "previous_response_id" else None
    what = "Previous response" if param else "Response"
    return APIError(f"{what} with id {ident!r} not found.", param=param, kind="not_found", code=code)
