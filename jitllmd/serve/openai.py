"""The OpenAI dialect: chat completions, completions and the model list, translated to and from the engine (its
rendering: rendering.py; /v1/embeddings: embeddings.py)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, replace
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..engine.catalog import Catalog, ServedModel
from ..engine.grammar import GrammarSpec
from ..engine.request import Delta, Done, Failed, FinishReason, Generation
from ..engine.sampler import MAX_LOGPROBS, SamplingParams, TokenLogprobs
from ..engine.sessions import Session
from ..engine.tokenizer import Tokenizer
from .body import APIError, Fields, dialect, read_json
from .outbox import Outbox, until_disconnect
from .prompt import (
    chat_prompt_ids,
    check_room,
    constraints,
    conversation,
    find_target,
    off_loop,
    remember,
    sampling_params,
    start,
    text_prompt_ids,
    tool_grammar,
)
from .rendering import (
    SSE_HEADERS,
    Chunks,
    chat_logprobs,
    completion_logprobs,
    error_response,
    finish_reason,
    interleaved,
    model_card,
    tool_call,
    usage,
)
from .tools import Piece, Text, ToolCall, ToolCallParser, parse_reply

__all__ = ["OpenAI"]


_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}



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
    prompt_logprobs: int | None = None  # completions' echo with logprobs: the prompt scored too
    n: int = 1  # choices per prompt
    grammar: GrammarSpec | None = None  # what every reply must be: response_format's JSON, or a forced tool call
    grammar_param: str = "response_format"  # the field that asked for it, for its errors

    async def start_all(self, param: str, request_id: str, prompt_ids: list[int]) -> list[Outbox]:
        """The n choices of one prompt: the first runs the prompt, the others follow it (the prompt is fed once) and
        sample on their own, with seed + i when a seed is given, each under its own matcher of the grammar, if any. A
        refusal cancels what already started."""
        matchers = await constraints(self.served, self.grammar, self.n, self.grammar_param)
        outboxes: list[Outbox] = []
        try:
            for i in range(self.n):
                params = self.params
                if i and params.seed is not None:
                    params = replace(params, seed=(params.seed + i) % (1 << 64))
                spec = Generation(
                    prompt_ids, params, max_tokens=self.max_tokens, stop=self.stop, session=self.session, ignore_eos=self.ignore_eos,
                    request_id=request_id + (f"-{i}" if i else ""), prompt_logprobs=self.prompt_logprobs, constraint=matchers[i],
                )
                outboxes.append(start(self.served, spec, param=param, follows=outboxes[0].request if i else None, hold=True))
        except BaseException:
            for o in outboxes:
                o.end()  # never queued: the engine releases their slots
            raise
        self.served.engine.enqueue([o.request for o in outboxes])
        return outboxes

    @property
    def tokenizer(self) -> Tokenizer:
        return self.served.engine.loaded.tokenizer

    def done(self, reply: str | dict[str, Any]) -> None:
        if self.chat is not None:
            remember(self.session, self.chat, reply)


def _parse_common(
    f: Fields, served: ServedModel, model: str, prompt_ids: list[int], max_tokens_keys: tuple[str, ...], session: Session | None,
    chat: list[dict[str, Any]] | None = None, tools: list[dict[str, Any]] | None = None,
) -> _Generation:
    max_tokens = None
    echo = chat is None and f.boolean("echo")
    for key in max_tokens_keys:  # the first one given wins
        if f.has(key):
            max_tokens = f.integer(key, low=0 if echo else 1)  # echo with max_tokens 0: the prompt alone (scored)
            break
    n = f.integer("n", 1, low=1, high=MAX_CHOICES) or 1
    if n > 1 and session is not None:
        raise f.error("n", "a named session holds one conversation: n must be 1 with jitllm_session")
    if chat is not None:  # chat: logprobs true, top_logprobs 0-20
        top = f.integer("top_logprobs", low=0, high=MAX_LOGPROBS)
        if top is not None and not f.boolean("logprobs"):
            raise f.error("top_logprobs", "needs logprobs: true")
        logprobs = (top or 0) if f.boolean("logprobs") else None
    else:  # completions: logprobs 0-5, the alternatives per token
        logprobs = f.integer("logprobs", low=0, high=5)
    if echo and logprobs is not None and session is not None:
        raise f.error("echo", "echo with logprobs scores the whole prompt: send it without jitllm_session")
    grammar, grammar_param = _response_grammar(f), "response_format"
    forced, name = _forced_tool(f)
    if tools and forced:  # the reply is a call: the tool grammar wins over response_format
        grammar, grammar_param = tool_grammar(served, tools, name, "tool_choice"), "tool_choice"
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
        logit_bias=_logit_bias(f),
        logprobs=logprobs,
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
        prompt_logprobs=logprobs if echo else None,
        n=n,
        grammar=grammar,
        grammar_param=grammar_param,
    )


def _response_grammar(f: Fields) -> GrammarSpec | None:
    """response_format: text (free), json_object (any JSON object), json_schema (JSON valid against its schema)."""
    fmt = f.object("response_format")
    kind = fmt.string("type", required=True) if fmt is not None else "text"
    if fmt is None or kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec(schema={"type": "object"})
    if kind == "json_schema":
        spec = fmt.object("json_schema")
        if spec is None:
            raise fmt.error("json_schema", "this field is required")
        spec.string("name", required=True)
        schema = spec.object("schema")
        return GrammarSpec(schema=schema.obj if schema is not None else {"type": "object"})
    raise fmt.error("type", f"{kind!r}: expected text, json_object or json_schema")


def _forced_tool(f: Fields) -> tuple[bool, str | None]:
    """tool_choice as a constraint: (True, None) for "required" (some tool), (True, name) for a named function."""
    choice = f.raw("tool_choice")
    if choice == "required":
        return True, None
    if isinstance(choice, dict):
        fn = Fields(choice, "tool_choice.").object("function")
        return True, fn.string("name", required=True) if fn is not None else None
    return False, None


def _logit_bias(f: Fields) -> tuple[tuple[int, float], ...]:
    """logit_bias: {"token id": bias in [-100, 100]} -> ((id, bias), ...) sorted by id."""
    biases = f.object("logit_bias")
    if biases is None:
        return ()
    out = []
    for key in biases.obj:
        if not key.isdigit():
            raise f.error("logit_bias", f"keys are token ids (strings of digits), got {key!r}")
        out.append((int(key), biases.number(key, 0.0, low=-100.0, high=100.0)))
    return tuple(sorted(out))


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
    "auto" leaves the choice to the model; "required" and a named function make the reply a call (_forced_tool)."""
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
        outboxes = await gen.start_all("messages", request.state.request_id, prompt_ids)
        ident, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if gen.stream:
            return StreamingResponse(self._chat_stream(gen, outboxes, ident, created), media_type="text/event-stream", headers=SSE_HEADERS)
        results = await until_disconnect(request, lambda: asyncio.gather(*(o.collect() for o in outboxes)))
        if results is None:
            return Response(status_code=499)  # nobody is listening
        choices = []
        for i, ((text, done), outbox) in enumerate(zip(results, outboxes)):
            calls: list[ToolCall] = []
            if gen.tool_names:
                text, calls = parse_reply(text, gen.tool_names, cut=done.finish_reason is FinishReason.LENGTH)
            message: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None, "refusal": None}
            if calls:
                message["tool_calls"] = [tool_call(c) for c in calls]
            if i == 0:
                gen.done(message)
            choices.append({"index": i, "message": message, "finish_reason": finish_reason(done, calls),
                            "logprobs": chat_logprobs(gen.tokenizer, outbox.scores) if gen.params.logprobs is not None else None})
        dones = [done for _, done in results]
        body = {
            "id": ident,
            "object": "chat.completion",
            "created": created,
            "model": gen.model,
            "choices": choices,
            "usage": usage(dones, gen.n),
            "jitllm": dones[0].figures.to_json(),
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
        prompts = await off_loop(_completion_prompts, f, served, session)
        gen = _parse_common(f, served, name or served.id, prompts[0][0], ("max_tokens",), session)
        if len(prompts) > 1 and session is not None:
            raise f.error("prompt", "a named session takes one prompt")
        echo = f.boolean("echo")
        outboxes = [o for k, (ids, _) in enumerate(prompts) for o in await gen.start_all("prompt", request.state.request_id + (f"-p{k}" if k else ""), ids)]
        heads = [text if echo else "" for _, text in prompts for _ in range(gen.n)]  # per choice: the echoed prompt
        ident, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        if gen.stream:
            return StreamingResponse(self._completion_stream(gen, outboxes, ident, created, heads), media_type="text/event-stream", headers=SSE_HEADERS)
        results = await until_disconnect(request, lambda: asyncio.gather(*(o.collect() for o in outboxes)))
        if results is None:
            return Response(status_code=499)
        choices = []
        for i, ((text, done), outbox) in enumerate(zip(results, outboxes)):
            logprobs = None
            if gen.params.logprobs is not None:
                scores = [*((outbox.prompt_scores or []) if echo else []), *outbox.scores]
                logprobs = completion_logprobs(gen.tokenizer, scores, outbox.request.prompt_ids, 0)
            choices.append({"index": i, "text": heads[i] + text, "logprobs": logprobs, "finish_reason": done.finish_reason.value})
        dones = [done for _, done in results]
        body = {
            "id": ident,
            "object": "text_completion",
            "created": created,
            "model": gen.model,
            "choices": choices,
            "usage": usage(dones, gen.n),
            "jitllm": dones[0].figures.to_json(),
        }
        return JSONResponse(body)

    @dialect(error_response)
    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [model_card(e.id, e.created, e.loaded, e.aliases) for e in self.catalog.entries()]})

    @dialect(error_response)
    async def model(self, request: Request) -> Response:
        name = request.path_params["model"]
        for e in self.catalog.entries():
            if e.id == name:
                return JSONResponse(model_card(e.id, e.created, e.loaded, e.aliases))
        try:
            served = self.catalog.get(name)
        except KeyError as exc:
            raise APIError(str(exc.args[0]), param="model", kind="not_found", code="model_not_found") from None
        return JSONResponse(model_card(name, served.created, True, (served.id, *(a for a in served.aliases if a != name))))

    # -- streams --------------------------------------------------------------------------------

    async def _chat_stream(self, gen: _Generation, outboxes: list[Outbox], ident: str, created: int) -> AsyncIterator[bytes]:
        out = Chunks(ident, "chat.completion.chunk", created, gen.model, gen.include_usage)
        choices = [_ChatChoice(i, gen, out) for i in range(len(outboxes))]
        for c in choices:
            yield out.choice(index=c.index, delta={"role": "assistant", "content": ""})
        dones: list[Done | None] = [None] * len(outboxes)
        async for i, ev in interleaved(outboxes):
            c = choices[i]
            if isinstance(ev, Delta):
                c.pending.extend(ev.logprobs or [])
                if ev.text:
                    for b in c.pieces(c.parser.feed(ev.text) if c.parser else [Text(ev.text)]):
                        yield b
            elif isinstance(ev, Done):
                for b in c.pieces(c.parser.finish(cut=ev.finish_reason is FinishReason.LENGTH) if c.parser else []):
                    yield b
                if i == 0:
                    text = "".join(c.parts)
                    gen.done({"role": "assistant", "content": text or None, "tool_calls": c.calls} if c.calls else text)
                dones[i] = ev
                yield out.choice(finish_reason(ev, c.calls), {"jitllm": ev.figures.to_json()}, index=i, delta={}, **(c.scored() if c.pending else {}))
            elif isinstance(ev, Failed):
                yield out.failed(ev.message)
        if gen.include_usage and all(d is not None for d in dones):
            yield out.usage([d for d in dones if d is not None], gen.n)
        yield b"data: [DONE]\n\n"

    async def _completion_stream(self, gen: _Generation, outboxes: list[Outbox], ident: str, created: int, heads: list[str]) -> AsyncIterator[bytes]:
        out = Chunks(ident, "text_completion", created, gen.model, gen.include_usage)
        scoring = gen.params.logprobs is not None
        offsets = [0] * len(outboxes)  # where each choice's next token's text starts, for text_offset
        pending: list[list[TokenLogprobs | None]] = [[] for _ in outboxes]

        def scored(i: int, ids: list[int]) -> dict[str, Any]:
            if not scoring:
                return {}
            logprobs = completion_logprobs(gen.tokenizer, pending[i], ids, offsets[i])
            offsets[i] += sum(len(t) for t in logprobs["tokens"])
            pending[i].clear()
            return {"logprobs": logprobs}

        heads = list(heads)
        for i, head in enumerate(heads):
            if head and not (scoring and gen.prompt_logprobs is not None):  # no scores to wait for
                yield out.choice(index=i, text=head)
                heads[i] = ""
        dones: list[Done | None] = [None] * len(outboxes)
        async for i, ev in interleaved(outboxes):
            if heads[i] and isinstance(ev, (Delta, Done)):  # the echoed prompt, with its scores, once the prompt ran
                pending[i].extend(ev.prompt_logprobs or [])
                yield out.choice(index=i, text=heads[i], **scored(i, outboxes[i].request.prompt_ids))
                heads[i] = ""
            if isinstance(ev, Delta):
                pending[i].extend(ev.logprobs or [])
                if ev.text:
                    yield out.choice(index=i, text=ev.text, **scored(i, []))
            elif isinstance(ev, Done):
                dones[i] = ev
                yield out.choice(ev.finish_reason.value, {"jitllm": ev.figures.to_json()}, index=i, text="", **(scored(i, []) if pending[i] else {}))
            elif isinstance(ev, Failed):
                yield out.failed(ev.message)
        if gen.include_usage and all(d is not None for d in dones):
            yield out.usage([d for d in dones if d is not None], gen.n)
        yield b"data: [DONE]\n\n"


MAX_PROMPTS = 64  # prompts in one /v1/completions
MAX_CHOICES = 16  # choices (n) per prompt


def _completion_prompts(f: Fields, served: ServedModel, session: Session | None) -> list[tuple[list[int], str]]:
    """prompt: a string, token ids, or an array of either (one choice per prompt). Returns (ids, the prompt's text
    for echo) per prompt. Runs on a prompt thread (off_loop)."""
    prompt = f.raw("prompt")
    if prompt is None:
        raise f.error("prompt", "this field is required")
    many = isinstance(prompt, list) and bool(prompt) and all(isinstance(p, (str, list)) for p in prompt)
    items = prompt if many else [prompt]
    if len(items) > MAX_PROMPTS:
        raise f.error("prompt", f"{len(items)} prompts in one request: at most {MAX_PROMPTS}")
    return [_one_prompt(f, served, session, p, f"prompt[{k}]" if many else "prompt") for k, p in enumerate(items)]


def _one_prompt(f: Fields, served: ServedModel, session: Session | None, prompt: Any, param: str) -> tuple[list[int], str]:
    if isinstance(prompt, str):
        check_room(served, session, prompt, param)
        if not prompt:
            raise APIError(f"{param}: the prompt is empty", param="prompt")
        return text_prompt_ids(served, prompt), prompt
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not prompt:
            raise APIError(f"{param}: the prompt is empty", param="prompt")
        vocab = served.engine.loaded.tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise APIError(f"{param}: token ids must be in [0, {vocab})", param="prompt")
        return list(prompt), served.engine.loaded.tokenizer.decode(prompt, skip_special_tokens=False)
    raise APIError(f"{param}: expected a string, an array of token ids, or an array of either", param="prompt")


class _ChatChoice:
    """One choice of a chat stream: its text so far, its tool calls, the parser holding back what may be a call, and
    the scores of tokens whose text has not gone out yet."""

    def __init__(self, index: int, gen: _Generation, out: Chunks):
        self.index, self.gen, self.out = index, gen, out
        self.parts: list[str] = []
        self.calls: list[dict[str, Any]] = []
        self.parser = ToolCallParser(gen.tool_names) if gen.tool_names else None
        self.pending: list[TokenLogprobs] = []

    def scored(self) -> dict[str, Any]:
        if self.gen.params.logprobs is None:
            return {}
        scores = self.pending[:]
        self.pending.clear()
        return {"logprobs": chat_logprobs(self.gen.tokenizer, scores)}

    def pieces(self, found: list[Piece]) -> Iterator[bytes]:
        for piece in found:
            if isinstance(piece, Text):
                if piece.text:
                    self.parts.append(piece.text)
                    yield self.out.choice(index=self.index, delta={"content": piece.text}, **self.scored())
            else:
                self.calls.append(tool_call(piece))
                yield self.out.choice(index=self.index, delta={"tool_calls": [{"index": len(self.calls) - 1, **self.calls[-1]}]})
