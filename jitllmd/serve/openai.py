"""The OpenAI dialect: chat completions, completions and the model list, translated to and from the engine."""

from __future__ import annotations

import base64
import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..engine.catalog import Catalog, ServedModel
from ..engine.kv import RoomError
from ..engine.request import Delta, Done, Failed, FinishReason
from ..engine.sampler import SamplingParams
from ..engine.sessions import Session
from .body import APIError, Fields, dialect, read_json
from .outbox import Outbox, embed, until_disconnect
from .prompt import (
    chat_prompt_ids,
    check_room,
    conversation,
    find_model,
    find_target,
    off_loop,
    remember,
    sampling_params,
    start,
    text_prompt_ids,
)
from .tools import Piece, Text, ToolCall, ToolCallParser, parse_reply

__all__ = ["OpenAI", "error_response"]


_ERROR_TYPES = {"invalid_request": "invalid_request_error", "unauthorized": "invalid_request_error", "forbidden": "invalid_request_error",
                "not_found": "invalid_request_error", "timeout": "invalid_request_error", "too_large": "invalid_request_error",
                "media_type": "invalid_request_error", "http_version": "invalid_request_error", "server": "server_error"}
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def error_response(exc: APIError) -> JSONResponse:
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""
    body = {"error": {"message": exc.message, "type": _ERROR_TYPES[exc.kind], "param": exc.param, "code": exc.code}}
    return JSONResponse(body, status_code=exc.status)


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


@dataclass(frozen=True)
class _Generation:
    """What both OpenAI routes ask of the engine, parsed from the body."""

    served: ServedModel
    model: str  # the name the client sent, echoed back
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int | None
    stop: list[str]
    stream: bool
    include_usage: bool
    ignore_eos: bool
    session: Session | None = None  # a named session (jitllm_session)
    chat: list[dict[str, Any]] | None = None  # the whole conversation, for the session to remember
    tool_names: frozenset[str] | None = None  # the declared tools: replies are parsed for calls to them

    def start(self, param: str, request_id: str) -> Outbox:
        return start(
            self.served, self.prompt_ids, self.params, param=param, max_tokens=self.max_tokens, stop=self.stop,
            ignore_eos=self.ignore_eos, session=self.session, request_id=request_id,
        )

    def done(self, reply: str | dict[str, Any]) -> None:
        if self.chat is not None:
            remember(self.session, self.chat, reply)


def _parse_common(
    f: Fields, served: ServedModel, model: str, prompt_ids: list[int], max_tokens_keys: tuple[str, ...], session: Session | None,
    chat: list[dict[str, Any]] | None = None, tools: list[dict[str, Any]] | None = None,
) -> _Generation:
    max_tokens = None
    for key in max_tokens_keys:  # the first one given wins
        if f.has(key):
            max_tokens = f.integer(key, low=1)
            break
    if f.integer("n", 1) != 1:
        raise f.error("n", "only n=1 is supported: send one request per choice")
    if f.raw("logprobs") not in (None, False, 0):
        raise f.error("logprobs", "log probabilities are not returned by this server")
    if f.raw("logit_bias"):
        raise f.error("logit_bias", "logit_bias is not supported")
    fmt = f.object("response_format")
    if fmt is not None and fmt.string("type", "text") != "text":
        raise f.error("response_format", "only {\"type\": \"text\"} is supported (no constrained decoding)")
    top_k = f.integer("top_k", 40, low=-1)
    params = sampling_params(
        temperature=f.number("temperature", 1.0, low=0.0, high=2.0),
        top_p=f.number("top_p", 1.0, low=0.0, high=1.0) or 1e-9,  # top_p 0 keeps only the most likely token
        top_k=max(0, top_k or 0),  # -1 (vLLM) and 0 both disable it
        min_p=f.number("min_p", 0.0, low=0.0, high=1.0),
        seed=f.integer("seed"),
        presence_penalty=f.number("presence_penalty", 0.0, low=-2.0, high=2.0),
        frequency_penalty=f.number("frequency_penalty", 0.0, low=-2.0, high=2.0),
        repetition_penalty=f.number("repetition_penalty", 1.0, low=0.0),
    )
    options = f.object("stream_options")
    if options is not None and not f.boolean("stream"):  # as OpenAI answers it
        raise f.error("stream_options", "only allowed when stream is true")
    return _Generation(
        served=served,
        model=model,
        prompt_ids=prompt_ids,
        params=params,
        max_tokens=max_tokens,
        stop=f.strings("stop"),
        stream=f.boolean("stream"),
        include_usage=options.boolean("include_usage") if options else False,
        ignore_eos=f.boolean("ignore_eos"),
        session=session,
        chat=chat,
        tool_names=frozenset(t["function"]["name"] for t in tools) if tools else None,
    )


def _usage(done: Done) -> dict[str, Any]:
    return {
        "prompt_tokens": done.prompt_tokens,
        "completion_tokens": done.completion_tokens,
        "total_tokens": done.prompt_tokens + done.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": done.prompt_tokens - done.fed_tokens},
    }


def _chat_messages(f: Fields) -> list[dict[str, Any]]:
    """The messages in the shape chat templates take: tool calls kept (arguments parsed by the template layer)."""
    raw = f.array("messages", required=True) or []
    if not raw:
        raise f.error("messages", "must hold at least one message")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(raw):
        m = Fields(item, f"messages[{i}].")
        role = m.string("role", required=True)
        if role not in _ROLES and role != "tool":
            raise m.error("role", f"{role!r} is not a role: use system, developer, user, assistant or tool")
        if m.has("function_call"):
            raise m.error("function_call", "the legacy function_call is not supported: use tool_calls")
        if role not in ("assistant", "tool") and m.raw("content") is None:
            raise m.error("content", "this field is required")
        msg: dict[str, Any] = {"role": _ROLES.get(role, role), "content": m.text("content", items="content parts")}
        if role == "assistant" and m.has("tool_calls"):
            msg["tool_calls"] = _message_tool_calls(m)
        if role == "tool":
            msg["tool_call_id"] = m.string("tool_call_id", required=True)
        out.append(msg)
    return out


def _message_tool_calls(m: Fields) -> list[dict[str, Any]]:
    calls = []
    for j, item in enumerate(m.array("tool_calls") or []):
        c = Fields(item, m.name(f"tool_calls[{j}]."))
        if c.string("type", "function") != "function":
            raise c.error("type", "only function tool calls are supported")
        fn = c.object("function")
        if fn is None:
            raise c.error("function", "this field is required")
        call: dict[str, Any] = {"id": c.string("id")} if c.has("id") else {}
        call.update(type="function", function={"name": fn.string("name", required=True), "arguments": fn.string("arguments", "{}")})
        calls.append(call)
    return calls


def _tools(f: Fields) -> list[dict[str, Any]] | None:
    """The tool definitions, exactly as sent; None when there are none or tool_choice is "none" (withheld).
    "auto", "required" and a named function all offer the tools and leave the choice to the model."""
    choice = f.raw("tool_choice")
    if choice is not None and choice not in ("none", "auto", "required"):
        named = Fields(choice, "tool_choice.")
        if named.string("type", required=True) != "function" or named.object("function") is None:
            raise f.error("tool_choice", 'expected "none", "auto", "required" or {"type": "function", "function": {"name": ...}}')
    tools = f.array("tools")
    if not tools or choice == "none":
        return None
    for j, item in enumerate(tools):
        t = Fields(item, f"tools[{j}].")
        if t.string("type", required=True) != "function":
            raise t.error("type", "only function tools are supported")
        fn = t.object("function")
        if fn is None:
            raise t.error("function", "this field is required")
        fn.string("name", required=True)
        if fn.has("parameters"):
            fn.object("parameters")
    return tools


def _tool_call(call: ToolCall) -> dict[str, Any]:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def _finish_reason(done: Done, calls: list[Any]) -> str:
    if calls and done.finish_reason is not FinishReason.CANCELLED:
        return "tool_calls"
    return done.finish_reason.value


class OpenAI:
    """The OpenAI routes over a Catalog."""

    def __init__(self, catalog: Catalog):
        self.catalog = catalog

    # -- routes ---------------------------------------------------------------------------------

    @dialect(error_response)
    async def chat_completions(self, request: Request) -> Response:
        f = Fields(await read_json(request))
        tools = _tools(f)
        name = f.string("model")
        served, session = find_target(self.catalog, name, f.string("jitllm_session"))
        chat = conversation(session, _chat_messages(f))
        prompt_ids = await chat_prompt_ids(served, chat, session, tools=tools)
        gen = _parse_common(f, served, name or served.id, prompt_ids, ("max_completion_tokens", "max_tokens"), session, chat, tools)
        outbox = gen.start("messages", request.state.request_id)
        ident, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if gen.stream:
            return StreamingResponse(self._chat_stream(gen, outbox, ident, created), media_type="text/event-stream", headers=SSE_HEADERS)
        result = await until_disconnect(request, outbox.collect)
        if result is None:
            return Response(status_code=499)  # nobody is listening
        text, done = result
        calls: list[ToolCall] = []
        if gen.tool_names:
            text, calls = parse_reply(text, gen.tool_names)
        message: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None, "refusal": None}
        if calls:
            message["tool_calls"] = [_tool_call(c) for c in calls]
        gen.done(message)
        body = {
            "id": ident,
            "object": "chat.completion",
            "created": created,
            "model": gen.model,
            "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": _finish_reason(done, calls)}],
            "usage": _usage(done),
            "jitllm": done.figures,
        }
        return JSONResponse(body)

    @dialect(error_response)
    async def completions(self, request: Request) -> Response:
        f = Fields(await read_json(request))
        name = f.string("model")
        served, session = find_target(self.catalog, name, f.string("jitllm_session"))
        if f.raw("suffix"):
            raise f.error("suffix", "suffix (fill in the middle) is not supported")
        if f.integer("best_of", 1, low=1) != 1:
            raise f.error("best_of", "only best_of=1 is supported")
        prompt_ids, prompt_text = await off_loop(_completion_prompt, f, served, session)
        gen = _parse_common(f, served, name or served.id, prompt_ids, ("max_tokens",), session)
        echo = f.boolean("echo")
        outbox = gen.start("prompt", request.state.request_id)
        ident, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        if gen.stream:
            head = prompt_text if echo else ""
            return StreamingResponse(self._completion_stream(gen, outbox, ident, created, head), media_type="text/event-stream", headers=SSE_HEADERS)
        result = await until_disconnect(request, outbox.collect)
        if result is None:
            return Response(status_code=499)
        text, done = result
        body = {
            "id": ident,
            "object": "text_completion",
            "created": created,
            "model": gen.model,
            "choices": [{"index": 0, "text": (prompt_text if echo else "") + text, "logprobs": None, "finish_reason": done.finish_reason.value}],
            "usage": _usage(done),
            "jitllm": done.figures,
        }
        return JSONResponse(body)

    @dialect(error_response)
    async def embeddings(self, request: Request) -> Response:
        f = Fields(await read_json(request))
        name = f.string("model")
        served = find_model(self.catalog, name)
        loaded = served.engine.loaded
        if not loaded.embeds:
            raise f.error("model", f"{served.id} generates text; embeddings need an embedding model (use /v1/chat/completions with it)")
        fmt = f.string("encoding_format", "float")
        if fmt not in ("float", "base64"):
            raise f.error("encoding_format", f"expected float or base64, got {fmt!r}")
        width = int(loaded.model.cfg.hidden_size)
        dims = f.integer("dimensions", low=1)
        if dims is not None and dims != width:
            raise f.error("dimensions", f"{served.id} makes {width}-dimensional vectors and does not truncate them: leave dimensions out or give {width}")
        batch = await off_loop(_embedding_inputs, f, served)
        try:
            result = await embed(served.engine, batch)
        except RoomError as exc:
            raise f.error("input", str(exc)) from None
        data = []
        for i, vector in enumerate(result.vectors):
            value: Any = base64.b64encode(vector.astype("<f4").tobytes()).decode() if fmt == "base64" else vector.tolist()
            data.append({"object": "embedding", "index": i, "embedding": value})
        usage = {"prompt_tokens": result.num_tokens, "total_tokens": result.num_tokens}
        return JSONResponse({"object": "list", "data": data, "model": name or served.id, "usage": usage, "jitllm": result.figures})

    @dialect(error_response)
    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [_model_card(e.id, e.created, e.loaded, e.aliases) for e in self.catalog.entries()]})

    @dialect(error_response)
    async def model(self, request: Request) -> Response:
        name = request.path_params["model"]
        for e in self.catalog.entries():
            if e.id == name:
                return JSONResponse(_model_card(e.id, e.created, e.loaded, e.aliases))
        try:
            served = self.catalog.get(name)
        except KeyError as exc:
            raise APIError(str(exc.args[0]), param="model", kind="not_found", code="model_not_found") from None
        return JSONResponse(_model_card(name, served.created, True, (served.id, *(a for a in served.aliases if a != name))))

    # -- streams --------------------------------------------------------------------------------

    async def _chat_stream(self, gen: _Generation, outbox: Outbox, ident: str, created: int) -> AsyncIterator[bytes]:
        out = _Chunks(ident, "chat.completion.chunk", created, gen.model, gen.include_usage)
        yield out.choice(delta={"role": "assistant", "content": ""})
        parts: list[str] = []
        calls: list[dict[str, Any]] = []
        parser = ToolCallParser(gen.tool_names) if gen.tool_names else None

        def pieces(found: list[Piece]) -> Iterator[bytes]:
            for piece in found:
                if isinstance(piece, Text):
                    if piece.text:
                        parts.append(piece.text)
                        yield out.choice(delta={"content": piece.text})
                else:
                    calls.append(_tool_call(piece))
                    yield out.choice(delta={"tool_calls": [{"index": len(calls) - 1, **calls[-1]}]})

        async for ev in outbox:
            if isinstance(ev, Delta):
                if ev.text:
                    for b in pieces(parser.feed(ev.text) if parser else [Text(ev.text)]):
                        yield b
            elif isinstance(ev, Done):
                for b in pieces(parser.finish() if parser else []):
                    yield b
                text = "".join(parts)
                gen.done({"role": "assistant", "content": text or None, "tool_calls": calls} if calls else text)
                yield out.choice(_finish_reason(ev, calls), {"jitllm": ev.figures}, delta={})
                if gen.include_usage:
                    yield out.usage(ev)
            elif isinstance(ev, Failed):
                yield out.failed(ev.message)
        yield b"data: [DONE]\n\n"

    async def _completion_stream(self, gen: _Generation, outbox: Outbox, ident: str, created: int, head: str) -> AsyncIterator[bytes]:
        out = _Chunks(ident, "text_completion", created, gen.model, gen.include_usage)
        if head:
            yield out.choice(text=head)
        async for ev in outbox:
            if isinstance(ev, Delta):
                if ev.text:
                    yield out.choice(text=ev.text)
            elif isinstance(ev, Done):
                yield out.choice(ev.finish_reason.value, {"jitllm": ev.figures}, text="")
                if gen.include_usage:
                    yield out.usage(ev)
            elif isinstance(ev, Failed):
                yield out.failed(ev.message)
        yield b"data: [DONE]\n\n"


@dataclass(frozen=True)
class _Chunks:
    """The SSE events of one stream: every chunk carries the same id, object, created and model, and `usage: null`
    until the usage chunk when the client asked for one."""

    ident: str
    object: str
    created: int
    model: str
    include_usage: bool

    def _event(self, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        obj = {"id": self.ident, "object": self.object, "created": self.created, "model": self.model, "choices": choices}
        return _sse(obj | extra)

    def choice(self, finish: str | None = None, extra: dict[str, Any] | None = None, **fields: Any) -> bytes:
        """A chunk of choice 0: its delta (chat) or text (completions), and the finish reason on the last."""
        usage = {"usage": None} if self.include_usage else {}
        return self._event([{"index": 0, **fields, "logprobs": None, "finish_reason": finish}], **usage, **(extra or {}))

    def usage(self, done: Done) -> bytes:
        return self._event([], usage=_usage(done), jitllm=done.figures)

    def failed(self, message: str) -> bytes:
        return _sse({"error": {"message": message, "type": "server_error", "param": None, "code": None}})


def _completion_prompt(f: Fields, served: ServedModel, session: Session | None) -> tuple[list[int], str]:
    """prompt: a string, token ids, or a one-element array of either. Returns (ids, the prompt's text for echo).
    Runs on a prompt thread (off_loop)."""
    prompt = f.raw("prompt")
    if prompt is None:
        raise f.error("prompt", "this field is required")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) != 1:
            raise f.error("prompt", f"{len(prompt)} prompts in one request are not supported: send one prompt per request")
        prompt = prompt[0]
    if isinstance(prompt, str):
        check_room(served, session, prompt, "prompt")
        return text_prompt_ids(served, prompt), prompt
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not prompt:
            raise f.error("prompt", "the prompt is empty")
        vocab = served.engine.loaded.tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise f.error("prompt", f"token ids must be in [0, {vocab})")
        return list(prompt), served.engine.loaded.tokenizer.decode(prompt, skip_special_tokens=False)
    raise f.error("prompt", "expected a string, an array of token ids, or a one-element array of either")


def _embedding_inputs(f: Fields, served: ServedModel) -> list[list[int]]:
    """input: a string, strings, token ids, or lists of token ids -> one token-id list per input."""
    value = f.raw("input")
    if value is None:
        raise f.error("input", "this field is required")
    tokenizer = served.engine.loaded.tokenizer
    is_ids = lambda v: isinstance(v, list) and bool(v) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)
    if isinstance(value, str):
        items: list[Any] = [value]
    elif is_ids(value):
        items = [value]
    elif isinstance(value, list) and value and all(isinstance(v, str) or is_ids(v) for v in value):
        items = value
    else:
        raise f.error("input", "expected a string, an array of strings, an array of token ids, or an array of arrays of token ids (none empty)")
    if len(items) > 2048:
        raise f.error("input", f"at most 2048 inputs per request, got {len(items)}")
    batch = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            if not item:
                raise f.error("input", f"input {i} is an empty string")
            batch.append(tokenizer.encode(item))
        else:
            if any(not 0 <= t < tokenizer.vocab_size for t in item):
                raise f.error("input", f"input {i}: token ids must be in [0, {tokenizer.vocab_size})")
            batch.append(list(item))
    return batch


def _model_card(model_id: str, created: int, loaded: bool, aliases: tuple[str, ...] = ()) -> dict[str, Any]:
    """An OpenAI model object; `jitllm.aliases` lists the other names the model answers to."""
    return {"id": model_id, "object": "model", "created": created, "owned_by": "jitllmd", "jitllm": {"loaded": loaded, "aliases": list(aliases)}}
