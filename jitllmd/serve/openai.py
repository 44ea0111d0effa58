"""The OpenAI dialect: chat completions, completions and the model list, translated to and from the engine (a body
read: openai_request.py; its rendering: rendering.py; /v1/embeddings: embeddings.py)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..engine.catalog import Catalog
from ..engine.request import Delta, Done, Failed, FinishReason
from ..engine.sampler import TokenLogprobs
from .body import APIError, Fields, dialect, read_json
from .openai_request import Limits, OpenAIGeneration, chat_messages, completion_prompts, parse_common, prompt_items, tools_of
from .outbox import Outbox, collect_all, until_disconnect
from .prompt import (
    chars,
    chat_prompt_ids,
    conversation,
    find_target,
    off_loop,
)
from .reasoning import Split, split_reasoning
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


class OpenAI:
    """The OpenAI routes over a Catalog."""

    def __init__(self, catalog: Catalog, limits: Limits | None = None):
        self.catalog, self.limits = catalog, limits or Limits()

    # -- routes ---------------------------------------------------------------------------------

    @dialect(error_response)
    async def chat_completions(self, request: Request) -> Response:
        f = Fields(await read_json(request))
        tools = tools_of(f)
        name = f.string("model")
        served, session = find_target(self.catalog, name, f.string("jitllm_session"))
        chat = conversation(session, chat_messages(f))
        gen = parse_common(f, served, name or served.id, ("max_completion_tokens", "max_tokens"), session, chat, tools, limits=self.limits)
        prompt_ids = await chat_prompt_ids(served, chat, session, tools=tools, extra=gen.template_kwargs)
        outboxes = await gen.start_all("messages", request.state.request_id, [prompt_ids])
        ident, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if gen.stream:
            return StreamingResponse(self._chat_stream(gen, outboxes, ident, created), media_type="text/event-stream", headers=SSE_HEADERS)
        results = await until_disconnect(request, lambda: collect_all(outboxes))
        if results is None:
            return Response(status_code=499)  # nobody is listening
        choices = []
        for i, ((text, done), outbox) in enumerate(zip(results, outboxes)):
            calls: list[ToolCall] = []
            reasoning = None
            if gen.reasoning is not None and gen.reasoning.markers is not None:  # the thought first; calls are the answer's
                reasoning, text = split_reasoning(text, gen.reasoning.markers, inside=gen.reasoning.inside(gen.tokenizer, outbox.request.prompt_ids))
            if gen.tool_names:
                text, calls = parse_reply(text, gen.tool_names, cut=done.finish_reason is FinishReason.LENGTH)
            message: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None, "refusal": None}
            if gen.thinks:
                message["reasoning_content"] = reasoning
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
            "usage": usage(dones, gen.n, reasoning=gen.thinks),
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
        items = prompt_items(f)
        if len(items) > 1 and session is not None:
            raise f.error("prompt", "a named session takes one prompt")
        gen = parse_common(f, served, name or served.id, ("max_tokens",), session, prompts=len(items), limits=self.limits)
        prompts = await off_loop(completion_prompts, f, served, session, items, size=chars(items))
        echo = f.boolean("echo")
        outboxes = await gen.start_all("prompt", request.state.request_id, [ids for ids, _ in prompts])
        heads = [text if echo else "" for _, text in prompts for _ in range(gen.n)]  # per choice: the echoed prompt
        ident, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        if gen.stream:
            return StreamingResponse(self._completion_stream(gen, outboxes, ident, created, heads), media_type="text/event-stream", headers=SSE_HEADERS)
        results = await until_disconnect(request, lambda: collect_all(outboxes))
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

    async def _chat_stream(self, gen: OpenAIGeneration, outboxes: list[Outbox], ident: str, created: int) -> AsyncIterator[bytes]:
        out = Chunks(ident, "chat.completion.chunk", created, gen.model, gen.include_usage, reasoning=gen.thinks)
        choices = [_ChatChoice(i, gen, out, outbox) for i, outbox in enumerate(outboxes)]
        for c in choices:
            yield out.choice(index=c.index, delta={"role": "assistant", "content": ""})
        dones: list[Done | None] = [None] * len(outboxes)
        async for i, ev in interleaved(outboxes):
            c = choices[i]
            if isinstance(ev, Delta):
                c.pending.extend(ev.logprobs or [])
                if ev.text:
                    for b in c.feed(ev.text):
                        yield b
            elif isinstance(ev, Done):
                for b in c.finish(cut=ev.finish_reason is FinishReason.LENGTH):
                    yield b
                if i == 0:
                    gen.done(c.message())
                dones[i] = ev
                yield out.choice(finish_reason(ev, c.calls), {"jitllm": ev.figures.to_json()}, index=i, delta={}, **(c.scored() if c.pending else {}))
            elif isinstance(ev, Failed):
                yield out.failed(ev.message)
        if gen.include_usage and all(d is not None for d in dones):
            yield out.usage([d for d in dones if d is not None], gen.n)
        yield b"data: [DONE]\n\n"

    async def _completion_stream(self, gen: OpenAIGeneration, outboxes: list[Outbox], ident: str, created: int, heads: list[str]) -> AsyncIterator[bytes]:
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


class _ChatChoice:
    """One choice of a chat stream: its text so far, its tool calls, the parser holding back what may be a call, and
    the scores of tokens whose text has not gone out yet; for a model that thinks, the splitter that sends its thought
    as reasoning_content first (the answer alone goes through the parser)."""

    def __init__(self, index: int, gen: OpenAIGeneration, out: Chunks, outbox: Outbox):
        self.index, self.gen, self.out = index, gen, out
        self.parts: list[str] = []
        self.thought: list[str] = []
        self.calls: list[dict[str, Any]] = []
        self.parser = ToolCallParser(gen.tool_names) if gen.tool_names else None
        self.splitter = gen.reasoning.splitter(gen.tokenizer, outbox.request.prompt_ids) if gen.reasoning is not None else None
        self.pending: list[TokenLogprobs] = []

    def feed(self, text: str) -> Iterator[bytes]:
        """A delta of the reply's text as chunks."""
        if self.splitter is None:
            yield from self.pieces(self.parser.feed(text) if self.parser else [Text(text)])
        else:
            yield from self._split(self.splitter.feed(text))

    def finish(self, cut: bool) -> Iterator[bytes]:
        """What was held back, once the reply ended (`cut`: by max_tokens)."""
        if self.splitter is not None:
            yield from self._split(self.splitter.finish())
        yield from self.pieces(self.parser.finish(cut=cut) if self.parser else [])

    def _split(self, split: Split) -> Iterator[bytes]:
        if split.reasoning:
            self.thought.append(split.reasoning)
            yield self.out.choice(index=self.index, delta={"reasoning_content": split.reasoning}, **self.scored())
        if split.answer:
            yield from self.pieces(self.parser.feed(split.answer) if self.parser else [Text(split.answer)])

    def message(self) -> str | dict[str, Any]:
        """The reply, as a named session remembers it."""
        text = "".join(self.parts)
        if self.splitter is not None and self.splitter.thought:
            return {"role": "assistant", "content": text or None, "reasoning_content": "".join(self.thought), **({"tool_calls": self.calls} if self.calls else {})}
        return {"role": "assistant", "content": text or None, "tool_calls": self.calls} if self.calls else text

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
