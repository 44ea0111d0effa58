"""How OpenAI's responses look: its error shape, SSE chunks, logprobs, usage, tool call objects, finish reasons and
model cards, and the interleaving of n choices' streams. The routes (openai.py) build these from engine events."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.responses import JSONResponse

from ..engine.request import Done, Event, FinishReason
from ..engine.sampler import TokenLogprobs
from ..engine.tokenizer import Tokenizer
from .body import APIError
from .outbox import Outbox
from .tools import ToolCall

__all__ = ["SSE_HEADERS", "Chunks", "chat_logprobs", "completion_logprobs", "error_response", "finish_reason", "interleaved", "model_card", "sse",
           "token_text", "tool_call", "usage"]

_ERROR_TYPES = {"invalid_request": "invalid_request_error", "unauthorized": "invalid_request_error", "forbidden": "invalid_request_error",
                "not_found": "invalid_request_error", "timeout": "invalid_request_error", "too_large": "invalid_request_error",
                "media_type": "invalid_request_error", "http_version": "invalid_request_error", "unavailable": "server_error", "server": "server_error"}
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def error_response(exc: APIError) -> JSONResponse:
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""
    body = {"error": {"message": exc.message, "type": _ERROR_TYPES[exc.kind], "param": exc.param, "code": exc.code}}
    return JSONResponse(body, status_code=exc.status)


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def token_text(tokenizer: Tokenizer, token: int) -> tuple[str, list[int]]:
    """A token as OpenAI's logprobs show it: its text and that text's UTF-8 bytes (a token holding part of a
    character shows the replacement character, as vLLM does)."""
    text = tokenizer.decode([token], skip_special_tokens=False)
    return text, list(text.encode("utf-8", errors="replace"))


def chat_logprobs(tokenizer: Tokenizer, scores: list[TokenLogprobs]) -> dict[str, Any]:
    """Chat's `logprobs`: {"content": [{token, logprob, bytes, top_logprobs}], "refusal": null}."""
    def entry(token: int, logprob: float) -> dict[str, Any]:
        text, raw = token_text(tokenizer, token)
        return {"token": text, "logprob": logprob, "bytes": raw}

    return {"content": [{**entry(s.token, s.logprob), "top_logprobs": [entry(t, lp) for t, lp in s.top]} for s in scores], "refusal": None}


def completion_logprobs(tokenizer: Tokenizer, scores: list[TokenLogprobs | None], prompt_ids: list[int], offset: int) -> dict[str, Any]:
    """Completions' `logprobs`: tokens, token_logprobs, top_logprobs, text_offset (None where a token has no score:
    the prompt's first). `prompt_ids` name the unscored tokens; `offset` is where the first token's text starts.
    Each top_logprobs holds the N likeliest and the token itself where it is not among them (N + 1 entries, as
    OpenAI's and vLLM's: with logprobs 0, the token alone)."""
    out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for i, s in enumerate(scores):
        token = s.token if s is not None else prompt_ids[i]
        text = token_text(tokenizer, token)[0]
        out["tokens"].append(text)
        out["token_logprobs"].append(s.logprob if s is not None else None)
        out["top_logprobs"].append(_top(tokenizer, s, text) if s is not None else None)
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def _top(tokenizer: Tokenizer, s: TokenLogprobs, text: str) -> dict[str, float]:
    """One position's top_logprobs: {text: logprob} of the likeliest, then of the token (`text`) if not among them (a
    likelier token of the same text keeps its own)."""
    top = {token_text(tokenizer, t)[0]: lp for t, lp in s.top}
    if all(t != s.token for t, _ in s.top):
        top.setdefault(text, s.logprob)
    return top


def usage(dones: list[Done], n: int, *, reasoning: bool = False) -> dict[str, Any]:
    """The usage of every choice: each prompt counted once (the first of its n choices ran it), every choice's tokens;
    with `reasoning` (a model that thinks), how many of them were its thoughts'."""
    runs = dones[::n]
    prompt, completion = sum(d.prompt_tokens for d in runs), sum(d.completion_tokens for d in dones)
    out: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(d.prompt_tokens - d.fed_tokens for d in runs)},
    }
    if reasoning:
        out["completion_tokens_details"] = {"reasoning_tokens": sum(d.reasoning_tokens for d in dones)}
    return out


def tool_call(call: ToolCall) -> dict[str, Any]:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def finish_reason(done: Done, calls: list[Any]) -> str:
    """tool_calls only for a reply the model ended: max_tokens cutting a call (or the text after one) is length."""
    if calls and done.finish_reason is FinishReason.STOP:
        return "tool_calls"
    return done.finish_reason.value


async def interleaved(outboxes: list[Outbox]) -> AsyncIterator[tuple[int, Event]]:
    """The events of several generations as they come, each with its choice's index, until every one has ended.
    Leaving early (a client gone) ends every generation."""
    if len(outboxes) == 1:
        async for ev in outboxes[0]:
            yield 0, ev
        return
    queue: asyncio.Queue[tuple[int, Event | None]] = asyncio.Queue()

    async def pump(i: int, outbox: Outbox) -> None:
        try:
            async for ev in outbox:
                queue.put_nowait((i, ev))
                await asyncio.sleep(0)  # the others' events that came meanwhile go next: the choices interleave
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.ensure_future(pump(i, o)) for i, o in enumerate(outboxes)]
    try:
        left = len(tasks)
        while left:
            i, got = await queue.get()
            if got is None:
                left -= 1
            else:
                yield i, got
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@dataclass(frozen=True)
class Chunks:
    """The SSE events of one stream: every chunk carries the same id, object, created and model, and `usage: null`
    until the usage chunk when the client asked for one."""

    ident: str
    object: str
    created: int
    model: str
    include_usage: bool
    reasoning: bool = False  # a model that thinks: usage counts its reasoning tokens

    def _event(self, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        obj = {"id": self.ident, "object": self.object, "created": self.created, "model": self.model, "choices": choices}
        return sse(obj | extra)

    def choice(self, finish: str | None = None, extra: dict[str, Any] | None = None, *, index: int = 0, **fields: Any) -> bytes:
        """A chunk of one choice: its delta (chat) or text (completions), its logprobs, and the finish reason on its last."""
        usage = {"usage": None} if self.include_usage else {}
        return self._event([{"index": index, "logprobs": None, **fields, "finish_reason": finish}], **usage, **(extra or {}))

    def usage(self, dones: list[Done], n: int) -> bytes:
        return self._event([], usage=usage(dones, n, reasoning=self.reasoning), jitllm=dones[0].figures.to_json())

    def failed(self, message: str) -> bytes:
        return sse({"error": {"message": message, "type": "server_error", "param": None, "code": None}})


def model_card(model_id: str, created: int, loaded: bool, aliases: tuple[str, ...] = ()) -> dict[str, Any]:
    """An OpenAI model object; `jitllm.aliases` lists the other names the model answers to."""
    return {"id": model_id, "object": "model", "created": created, "owned_by": "jitllmd", "jitllm": {"loaded": loaded, "aliases": list(aliases)}}
