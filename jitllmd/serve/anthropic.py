"""The Anthropic dialect: POST /v1/messages (and its count_tokens), translated to and from the engine."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..engine.catalog import Catalog, ServedModel
from ..engine.grammar import GrammarSpec
from ..engine.request import Delta, Done, Event, Failed, FinishReason, Generation
from ..engine.sessions import Session
from .body import APIError, Fields, dialect, read_json
from .outbox import Outbox, until_disconnect
from .prompt import (
    chat_prompt_ids,
    check_tool_schema,
    constraints,
    conversation,
    find_target,
    remember,
    request_options,
    sampling_params,
    start,
    tool_grammar,
)
from .reasoning import Markers, Reasoning, ReasoningSplitter, markers_of, plan_reasoning, split_reasoning
from .tools import Piece, Text, ToolCall, ToolCallParser, complete_members, parse_pieces

__all__ = ["Anthropic", "content_blocks", "error_response"]


_ERROR_TYPES = {"invalid_request": "invalid_request_error", "unauthorized": "authentication_error", "forbidden": "permission_error",
                "not_found": "not_found_error", "timeout": "invalid_request_error", "too_large": "request_too_large",
                "media_type": "invalid_request_error", "http_version": "invalid_request_error", "unavailable": "api_error", "server": "api_error"}
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def error_response(exc: APIError) -> JSONResponse:
    """Anthropic's error shape: {"type": "error", "error": {"type", "message"}}."""
    return JSONResponse({"type": "error", "error": {"type": _ERROR_TYPES[exc.kind], "message": exc.message}}, status_code=exc.status)


def _event(name: str, obj: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: ".encode() + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def _turn(m: Fields, role: str) -> list[dict[str, Any]]:
    """One Anthropic message as OpenAI-shape messages: tool_result blocks become tool messages (before the user's
    text), tool_use blocks become the assistant's tool_calls (input kept as an object)."""
    content = m.required("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise m.error("content", "expected a string or an array of content blocks")
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        b = Fields(block, m.name(f"content[{j}]."))
        kind = b.string("type", required=True)
        if kind == "text":
            texts.append(b.string("text", required=True) or "")
        elif kind == "thinking" and role == "assistant":  # a past turn's thought: the template's reasoning_content
            b.string("signature")
            thoughts.append(b.string("thinking", required=True) or "")
        elif kind == "redacted_thinking" and role == "assistant":  # another server's encrypted thought: nothing to show
            b.string("data", required=True)
        elif kind == "tool_use" and role == "assistant":
            tool_input = b.raw("input") if b.has("input") else {}
            if not isinstance(tool_input, dict):
                raise b.error("input", "expected an object")
            calls.append({"id": b.string("id", required=True), "type": "function", "function": {"name": b.string("name", required=True), "arguments": tool_input}})
        elif kind == "tool_result" and role == "user":
            result = b.text("content", items="content blocks") if b.has("content") else ""
            results.append({"role": "tool", "content": result, "tool_call_id": b.string("tool_use_id", required=True)})
        else:
            raise b.error("type", f"{kind!r} blocks are not supported in a {role} message")
    out: list[dict[str, Any]] = list(results)
    thought = {"reasoning_content": "".join(thoughts)} if thoughts else {}
    if calls:
        out.append({"role": "assistant", "content": "".join(texts), **thought, "tool_calls": calls})
    elif texts or thoughts or not results:
        out.append({"role": role, "content": "".join(texts), **thought})
    return out


def _messages(f: Fields) -> tuple[list[dict[str, Any]], str | None]:
    """The system prompt and messages in the OpenAI shape chat templates take; a final assistant turn is a prefill."""
    raw = f.array("messages", required=True) or []
    if not raw:
        raise f.error("messages", "must hold at least one message")
    out: list[dict[str, Any]] = []
    if f.has("system"):
        system = f.text("system", items="content blocks")
        if system:
            out.append({"role": "system", "content": system})
    for i, item in enumerate(raw):
        m = Fields(item, f"messages[{i}].")
        role = m.string("role", required=True) or ""
        if role not in ("user", "assistant"):
            raise m.error("role", f"{role!r} is not a role here: use user or assistant (the system prompt is the top-level system field)")
        out += _turn(m, role)
    prefill = None
    last = out[-1]
    if last["role"] == "assistant" and "tool_calls" not in last:  # Anthropic continues a final assistant message
        prefill = out.pop()["content"]
        if prefill != prefill.rstrip():
            raise APIError(f"messages[{len(raw) - 1}].content: a final assistant message cannot end with whitespace", param=f"messages[{len(raw) - 1}].content")
    return out, prefill


def _forced_tool(f: Fields) -> tuple[bool, str | None]:
    """tool_choice as a constraint: (True, None) for {"type": "any"}, (True, name) for {"type": "tool", "name": ...}."""
    choice = f.object("tool_choice")
    kind = choice.string("type") if choice is not None else "auto"
    if choice is not None and kind == "tool":
        return True, choice.string("name", required=True)
    return kind == "any", None


def _output_format(f: Fields) -> tuple[GrammarSpec, str] | None:
    """output_config.format (or the structured-outputs beta's top-level output_format), {"type": "json_schema",
    "schema": ...}: the reply is JSON valid against the schema, enforced by the grammar OpenAI's response_format
    json_schema compiles to; with the format's field name ("output_config.format" or "output_format")."""
    config = f.object("output_config")
    fmt = config.object("format") if config is not None else None
    if f.has("output_format"):
        if fmt is not None:
            raise f.error("output_format", "give the format once: output_config.format (output_format is its older beta spelling)")
        fmt = f.object("output_format")
    if fmt is None:
        return None
    kind = fmt.string("type", required=True)
    if kind != "json_schema":
        raise fmt.error("type", f"{kind!r}: expected json_schema")
    schema = fmt.object("schema")
    if schema is None:
        raise fmt.error("schema", "this field is required")
    return GrammarSpec(schema=schema.obj), fmt.prefix.rstrip(".")


_EFFORTS = ("low", "medium", "high", "xhigh", "max")  # output_config.effort: as reasoning.EFFORTS


def _thinking(f: Fields, markers: Markers | None) -> tuple[Reasoning, bool]:
    """`thinking`: {"type": "enabled", "budget_tokens": N} (tokens inside the thought before its close marker is
    forced), {"type": "disabled"}, {"type": "adaptive"} or {"type": "between_tools"} (on, the model's own length, or
    output_config.effort's: low 512, medium 2048, else unbounded); with `display` "summarized" (the default) or
    "omitted" (thinking blocks come back empty). -> the request's thought, and whether its text is omitted."""
    config, effort = f.object("output_config"), None
    if config is not None:
        effort = config.string("effort")
        if effort is not None and effort not in _EFFORTS:
            raise config.error("effort", f"{effort!r}: expected one of {', '.join(_EFFORTS)}")
    t = f.object("thinking")
    if t is None:
        return plan_reasoning(markers, effort=effort), False
    kind = t.string("type", required=True)
    if kind not in ("enabled", "disabled", "adaptive", "between_tools"):
        raise t.error("type", f"{kind!r}: expected enabled, disabled, adaptive or between_tools")
    display = t.string("display", "summarized")
    if display not in ("summarized", "omitted"):
        raise t.error("display", f"{display!r}: expected summarized or omitted")
    if kind == "disabled":
        return plan_reasoning(markers, enabled=False), False
    budget = t.integer("budget_tokens", required=kind == "enabled", low=0)
    return plan_reasoning(markers, enabled=True, budget=budget if kind == "enabled" else None,
                          effort=effort if kind != "enabled" else None), display == "omitted"


def _tools(f: Fields) -> list[dict[str, Any]] | None:
    """Anthropic tool definitions in the OpenAI shape chat templates take, input_schema kept as sent (key order and
    all); None without tools or with tool_choice {"type": "none"}. "auto" leaves the choice to the model; "any" and a
    named tool make the reply a call (_forced_tool)."""
    choice = f.object("tool_choice")
    kind = choice.string("type", required=True) if choice is not None else "auto"
    if kind not in ("auto", "any", "tool", "none"):
        raise f.error("tool_choice", f"type {kind!r}: expected auto, any, tool or none")  # any and tool: see _forced_tool
    tools = f.array("tools")
    if not tools or kind == "none":
        return None
    out = []
    for j, item in enumerate(tools):
        t = Fields(item, f"tools[{j}].")
        fn: dict[str, Any] = {"name": t.string("name", required=True)}
        if t.has("description"):
            fn["description"] = t.string("description")
        schema = t.object("input_schema")
        if schema is None:
            raise t.error("input_schema", "this field is required")
        check_tool_schema(schema)
        fn["parameters"] = schema.obj
        out.append({"type": "function", "function": fn})
    return out


def _stop_reason(done: Done, calls: list[ToolCall]) -> tuple[str, str | None]:
    if done.finish_reason is FinishReason.LENGTH:  # even after a call: max_tokens may have cut it, or the text after it
        return "max_tokens", None
    if done.finish_reason is FinishReason.CANCELLED:  # cut by the server (shutdown, unload): not a turn that ended
        return "cancelled", None
    if calls and done.finish_reason is not FinishReason.CANCELLED:
        return "tool_use", None
    if done.stop is not None:
        return "stop_sequence", done.stop
    return "end_turn", None


@dataclass(frozen=True)
class _Prompt:
    """What a messages body asks the model, read the same way by /v1/messages and its count_tokens."""

    name: str | None  # the model as the client named it
    served: ServedModel
    session: Session | None
    chat: list[dict[str, Any]]  # the whole conversation, in the OpenAI shape
    prefill: str | None
    tools: list[dict[str, Any]] | None
    prompt_ids: list[int]
    reasoning: Reasoning  # the thought it asks for (thinking), and the template variables that switch it
    omit: bool = False  # thinking.display "omitted": thinking blocks come back without their text


class Anthropic:
    """The Anthropic routes over a Catalog."""

    def __init__(self, catalog: Catalog):
        self.catalog = catalog

    async def _prompt(self, f: Fields) -> _Prompt:
        """The model, session, conversation and prompt ids of a messages body: system and tools included, through the
        model's chat template."""
        tools = _tools(f)
        name = f.string("model", required=not f.has("jitllm_session"))
        served, session = find_target(self.catalog, name, f.string("jitllm_session"))
        messages, prefill = _messages(f)
        chat = conversation(session, messages)
        reasoning, omit = _thinking(f, markers_of(served))
        prompt_ids = await chat_prompt_ids(served, chat, session, prefill=prefill, tools=tools, extra=dict(reasoning.template_kwargs))
        return _Prompt(name, served, session, chat, prefill, tools, prompt_ids, reasoning, omit)

    @dialect(error_response)
    async def count_tokens(self, request: Request) -> Response:
        """POST /v1/messages/count_tokens: the input tokens /v1/messages reports for the same body (all of them: its
        usage splits off those read from a cache as cache_read_input_tokens). No max_tokens, as Anthropic's has none."""
        prompt = await self._prompt(Fields(await read_json(request)))
        return JSONResponse({"input_tokens": len(prompt.prompt_ids)})

    @dialect(error_response)
    async def messages(self, request: Request) -> Response:
        f = Fields(await read_json(request))
        max_tokens = f.integer("max_tokens", required=True, low=1)
        output = _output_format(f)
        p = await self._prompt(f)
        params = sampling_params(
            temperature=f.number("temperature", 1.0, low=0.0, high=1.0),
            top_p=f.number("top_p", 1.0, low=0.0, high=1.0) or 1e-9,
            top_k=f.integer("top_k", 0, low=0) or 0,
        )
        stop = f.strings("stop_sequences", most=64, single=False)  # Anthropic's is an array, never a string
        stream = f.boolean("stream")
        forced = _forced_tool(f)
        grammar, grammar_param = None, ""
        if p.tools and forced[0]:  # the reply is a call: the tool grammar wins over the format, as over OpenAI's response_format
            grammar, grammar_param = tool_grammar(p.served, p.tools, forced[1], "tool_choice"), "tool_choice"
        elif output is not None:
            if p.prefill is not None:
                raise f.error(output[1], "a reply in this format is JSON from its first token: it cannot continue a final assistant message")
            grammar, grammar_param = output[0], output[1] + ".schema"  # a schema the grammar refuses: a 400 naming it
        [constraint] = await constraints(p.served, grammar, 1, grammar_param)
        tokenizer = p.served.engine.loaded.tokenizer
        spec = Generation(p.prompt_ids, params, max_tokens=max_tokens, stop=stop, session=p.session, **request_options(f),
                          request_id=request.state.request_id, constraint=constraint, thinking=p.reasoning.thinking(tokenizer, p.prompt_ids))
        outbox = start(p.served, spec, param="messages")
        tool_names = frozenset(t["function"]["name"] for t in p.tools) if p.tools else None
        reply = _Reply(ident=f"msg_{uuid.uuid4().hex}", model=p.name or p.served.id, tool_names=tool_names, omit=p.omit)

        def record(text: str, calls: list[ToolCall], thought: str | None) -> None:
            remember(p.session, p.chat, _remembered((p.prefill or "") + text, calls, thought))

        splitter = p.reasoning.splitter(tokenizer, p.prompt_ids)
        if stream:
            return StreamingResponse(self._stream(outbox, reply, len(p.prompt_ids), record, splitter), media_type="text/event-stream", headers=SSE_HEADERS)
        result = await until_disconnect(request, outbox.collect)
        if result is None:
            return Response(status_code=499)
        text, done = result
        thought = None
        if splitter is not None:  # the thought first; calls are the answer's (a splitter not fed: `thought` is the prompt's)
            thought, text = split_reasoning(text, splitter.markers, inside=splitter.thought)
        pieces: list[Piece] = parse_pieces(text, reply.tool_names, cut=done.finish_reason is FinishReason.LENGTH) if reply.tool_names else [Text(text)]
        calls = [p for p in pieces if isinstance(p, ToolCall)]
        record("".join(p.text for p in pieces if isinstance(p, Text)), calls, thought)
        reason, stop_sequence = _stop_reason(done, calls)
        content = content_blocks(pieces)
        if thought is not None:  # a thought that took the whole reply (max_tokens) is the content alone
            answered = any(not isinstance(p, Text) or p.text for p in pieces)
            content = [_thinking_block("" if reply.omit else thought), *(content if answered else [])]
        body = {
            "id": reply.ident,
            "type": "message",
            "role": "assistant",
            "model": reply.model,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": stop_sequence,
            "usage": _usage(done),
            "jitllm": done.figures.to_json(),
        }
        return JSONResponse(body)

    async def _stream(self, outbox: Outbox, reply: _Reply, num_prompt: int, record: Callable[[str, list[ToolCall], str | None], None],
                      splitter: ReasoningSplitter | None = None) -> AsyncIterator[bytes]:
        """message_start, then content blocks as they come (text deltas; a tool_use block per call, its input as one
        input_json_delta), then message_delta with the stop reason, usage and jitllm, then message_stop.

        message_start waits for the engine's first event: by then the session has said how much of the prompt it
        held, so its usage splits input_tokens and cache_read_input_tokens as message_delta's does."""
        events = aiter(outbox)
        try:
            async for b in self._events(outbox, events, reply, num_prompt, record, splitter):
                yield b
        finally:
            await events.aclose()  # a client gone: the request is cancelled now, not when the generator is collected

    async def _events(self, outbox: Outbox, events: AsyncIterator[Event], reply: _Reply, num_prompt: int,
                      record: Callable[[str, list[ToolCall], str | None], None], splitter: ReasoningSplitter | None) -> AsyncIterator[bytes]:
        ev: Event | None = await anext(events)
        cached = outbox.request.cached
        message: dict[str, Any] = {
            "id": reply.ident,
            "type": "message",
            "role": "assistant",
            "model": reply.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": num_prompt - cached, "output_tokens": 0, "cache_read_input_tokens": cached},
        }
        yield _event("message_start", {"type": "message_start", "message": message})
        blocks = _Blocks(reply.omit)
        parser = ToolCallParser(reply.tool_names) if reply.tool_names else None
        if parser is None and splitter is None:  # no calls to wait for, no thought: the text block opens at once
            yield blocks.open_text()
        yield _event("ping", {"type": "ping"})

        def answer(text: str) -> Iterator[bytes]:
            return blocks.add(parser.feed(text) if parser else [Text(text)]) if text else iter(())

        while ev is not None:
            if isinstance(ev, Delta):
                if ev.text and splitter is not None:
                    split = splitter.feed(ev.text)
                    for b in (*blocks.think(splitter, split.reasoning), *answer(split.answer)):
                        yield b
                elif ev.text:
                    for b in answer(ev.text):
                        yield b
            elif isinstance(ev, Done):
                if splitter is not None:
                    split = splitter.finish()
                    for b in (*blocks.think(splitter, split.reasoning, final=True), *answer(split.answer)):
                        yield b
                for b in blocks.add(parser.finish(cut=ev.finish_reason is FinishReason.LENGTH) if parser else []):
                    yield b
                for b in blocks.close():
                    yield b
                record("".join(blocks.texts), blocks.calls, "".join(blocks.thoughts) if splitter is not None and splitter.thought else None)
                reason, stop_sequence = _stop_reason(ev, blocks.calls)
                delta = {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": stop_sequence}, "usage": _usage(ev), "jitllm": ev.figures.to_json()}
                yield _event("message_delta", delta)
                yield _event("message_stop", {"type": "message_stop"})
            elif isinstance(ev, Failed):
                yield _event("error", {"type": "error", "error": {"type": "api_error", "message": ev.message}})
            ev = await anext(events, None)


@dataclass(frozen=True)
class _Reply:
    ident: str
    model: str
    tool_names: frozenset[str] | None
    omit: bool = False  # thinking blocks without their text (thinking.display "omitted")


class _Blocks:
    """The content blocks of a streamed message: a thinking block first, for a reply that thinks (its text as
    thinking_delta events, then an empty signature_delta before its content_block_stop, as Anthropic's), a text block
    opened when text comes, a tool_use block per call."""

    def __init__(self, omit: bool = False) -> None:
        self.index = -1
        self.text_open = False
        self.thinking = 0  # 0: no thinking block yet; 1: open; 2: closed
        self.omit = omit
        self.texts: list[str] = []
        self.thoughts: list[str] = []
        self.calls: list[ToolCall] = []

    def think(self, splitter: ReasoningSplitter, text: str, final: bool = False) -> Iterator[bytes]:
        """The thought's next text: its block opens once the reply opened a thought, and closes with the thought."""
        if not splitter.thought or self.thinking == 2:
            return
        if self.thinking == 0:
            self.index += 1
            self.thinking = 1
            block = {"type": "thinking", "thinking": "", "signature": ""}
            yield _event("content_block_start", {"type": "content_block_start", "index": self.index, "content_block": block})
        if text:
            self.thoughts.append(text)
            if not self.omit:
                delta = {"type": "thinking_delta", "thinking": text}
                yield _event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})
        if splitter.closed or final:
            yield from self._end_thinking()

    def _end_thinking(self) -> Iterator[bytes]:
        if self.thinking == 1:
            self.thinking = 2
            yield _event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": {"type": "signature_delta", "signature": ""}})
            yield _event("content_block_stop", {"type": "content_block_stop", "index": self.index})

    def open_text(self) -> bytes:
        self.index += 1
        self.text_open = True
        return _event("content_block_start", {"type": "content_block_start", "index": self.index, "content_block": {"type": "text", "text": ""}})

    def add(self, pieces: list[Piece]) -> Iterator[bytes]:
        for piece in pieces:
            if isinstance(piece, Text) and not piece.text:
                continue
            yield from self._end_thinking()  # the answer comes after the thought
            if isinstance(piece, Text):
                if not self.text_open:
                    yield self.open_text()
                self.texts.append(piece.text)
                yield _event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": {"type": "text_delta", "text": piece.text}})
            else:
                if self.text_open:
                    yield self._stop()
                self.calls.append(piece)
                self.index += 1
                use = _tool_use(piece)
                block = {**use, "input": {}}
                yield _event("content_block_start", {"type": "content_block_start", "index": self.index, "content_block": block})
                delta = {"type": "input_json_delta", "partial_json": piece.arguments if piece.complete else json.dumps(use["input"], ensure_ascii=False)}
                yield _event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})
                yield _event("content_block_stop", {"type": "content_block_stop", "index": self.index})

    def close(self) -> Iterator[bytes]:
        yield from self._end_thinking()
        if self.index < 0:  # nothing came: an empty text block, so the message has content
            yield self.open_text()
        if self.text_open:
            yield self._stop()

    def _stop(self) -> bytes:
        self.text_open = False
        return _event("content_block_stop", {"type": "content_block_stop", "index": self.index})


def content_blocks(pieces: list[Piece]) -> list[dict[str, Any]]:
    """A whole reply's content: its text and calls as blocks in the order they were generated (one empty text block
    for a reply with nothing)."""
    blocks = [{"type": "text", "text": p.text} if isinstance(p, Text) else _tool_use(p) for p in pieces if not isinstance(p, Text) or p.text]
    return blocks or [{"type": "text", "text": ""}]


def _tool_use(call: ToolCall) -> dict[str, Any]:
    """A call as a tool_use block; one max_tokens cut short has the members of its input that were whole."""
    arguments = json.loads(call.arguments) if call.complete else complete_members(call.arguments)
    return {"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}", "name": call.name, "input": arguments}


def _thinking_block(text: str) -> dict[str, Any]:
    """A thought as a thinking block; its signature is empty (nothing here signs it; clients send it back as is)."""
    return {"type": "thinking", "thinking": text, "signature": ""}


def _remembered(text: str, calls: list[ToolCall], thought: str | None = None) -> str | dict[str, Any]:
    if not calls and thought is None:
        return text
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if thought is not None:
        message["reasoning_content"] = thought
    if calls:
        message["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
    return message


def _usage(done: Done) -> dict[str, int]:
    cached = done.prompt_tokens - done.fed_tokens
    return {"input_tokens": done.fed_tokens, "output_tokens": done.completion_tokens, "cache_read_input_tokens": cached}
