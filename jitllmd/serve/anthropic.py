"""The Anthropic dialect: POST /v1/messages, translated to and from the engine."""

from __future__ import annotations

import functools
import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..engine.catalog import Catalog
from ..engine.request import Delta, Done, Failed, FinishReason
from .body import APIError, Fields, read_json
from .outbox import Outbox, until_disconnect
from .prompt import chat_prompt_ids, conversation, find_target, remember, sampling_params, start

__all__ = ["Anthropic", "error_response"]

log = logging.getLogger("jitllmd.serve")

_ERROR_TYPES = {"invalid_request": "invalid_request_error", "not_found": "not_found_error", "too_large": "request_too_large"}
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def error_response(exc: APIError) -> JSONResponse:
    """Anthropic's error shape: {"type": "error", "error": {"type", "message"}}."""
    return JSONResponse({"type": "error", "error": {"type": _ERROR_TYPES[exc.kind], "message": exc.message}}, status_code=exc.status)


def _dialect(handler: Callable[[Any, Request], Awaitable[Response]]) -> Callable[[Any, Request], Awaitable[Response]]:
    @functools.wraps(handler)
    async def wrapper(self: Any, request: Request) -> Response:
        try:
            return await handler(self, request)
        except APIError as exc:
            return error_response(exc)
        except Exception:
            log.exception("%s %s failed", request.method, request.url.path)
            body = {"type": "error", "error": {"type": "api_error", "message": "internal server error (logged on the server)"}}
            return JSONResponse(body, status_code=500)

    return wrapper


def _event(name: str, obj: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: ".encode() + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def _text(f: Fields, key: str) -> str:
    """A string, or an array of text blocks joined (system and message content)."""
    value = f.raw(key)
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise f.error(key, "expected a string or an array of content blocks")
    texts = []
    for j, block in enumerate(value):
        b = Fields(block, f.name(f"{key}[{j}]."))
        kind = b.string("type", required=True)
        if kind in ("tool_use", "tool_result"):
            raise b.error("type", "tool use is not supported by this server yet")
        if kind != "text":
            raise b.error("type", f"{kind!r} blocks are not supported: this server takes text blocks")
        texts.append(b.string("text", required=True) or "")
    return "".join(texts)


def _messages(f: Fields) -> tuple[list[dict[str, str]], str | None]:
    """The system prompt and messages in the OpenAI shape chat templates take; a final assistant turn is a prefill."""
    raw = f.array("messages", required=True) or []
    if not raw:
        raise f.error("messages", "must hold at least one message")
    out: list[dict[str, str]] = []
    if f.has("system"):
        system = _text(f, "system")
        if system:
            out.append({"role": "system", "content": system})
    for i, item in enumerate(raw):
        m = Fields(item, f"messages[{i}].")
        role = m.string("role", required=True)
        if role not in ("user", "assistant"):
            raise m.error("role", f"{role!r} is not a role here: use user or assistant (the system prompt is the top-level system field)")
        m.required("content")
        out.append({"role": role, "content": _text(m, "content")})
    prefill = None
    if out[-1]["role"] == "assistant":  # Anthropic continues a final assistant message
        prefill = out.pop()["content"]
        if prefill != prefill.rstrip():
            raise APIError(f"messages[{len(raw) - 1}].content: a final assistant message cannot end with whitespace", param=f"messages[{len(raw) - 1}].content")
    return out, prefill


def _stop_reason(done: Done) -> tuple[str, str | None]:
    if done.stop is not None:
        return "stop_sequence", done.stop
    if done.finish_reason is FinishReason.LENGTH:
        return "max_tokens", None
    return "end_turn", None  # end of sequence (or cancelled: the turn ends where it was cut)


class Anthropic:
    """The Anthropic routes over a Catalog."""

    def __init__(self, catalog: Catalog):
        self.catalog = catalog

    @_dialect
    async def messages(self, request: Request) -> Response:
        f = Fields(await read_json(request))
        choice = f.object("tool_choice")
        if f.has("tools") and (choice is None or choice.string("type") != "none"):
            raise f.error("tools", "tool use is not supported by this server yet")
        name = f.string("model", required=not f.has("jitllm_session"))
        max_tokens = f.integer("max_tokens", required=True, low=1)
        served, session = find_target(self.catalog, name, f.string("jitllm_session"))
        messages, prefill = _messages(f)
        chat = conversation(session, messages)
        prompt_ids = chat_prompt_ids(served, chat, prefill=prefill)
        params = sampling_params(
            temperature=f.number("temperature", 1.0, low=0.0, high=1.0),
            top_p=f.number("top_p", 1.0, low=0.0, high=1.0) or 1e-9,
            top_k=f.integer("top_k", 0, low=0) or 0,
        )
        stop = f.strings("stop_sequences", most=64)
        stream = f.boolean("stream")
        ignore_eos = f.boolean("ignore_eos")  # vLLM's extension: keep going past end of sequence (benchmarks)
        outbox = start(served, prompt_ids, params, param="messages", max_tokens=max_tokens, stop=stop, ignore_eos=ignore_eos, session=session)
        record = lambda text: remember(session, chat, (prefill or "") + text)
        ident = f"msg_{uuid.uuid4().hex}"
        model = name or served.id
        if stream:
            return StreamingResponse(self._stream(outbox, ident, model, len(prompt_ids), record), media_type="text/event-stream", headers=SSE_HEADERS)
        result = await until_disconnect(request, outbox.collect)
        if result is None:
            return Response(status_code=499)
        text, done = result
        record(text)
        reason, stop_sequence = _stop_reason(done)
        body = {
            "id": ident,
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [{"type": "text", "text": text}],
            "stop_reason": reason,
            "stop_sequence": stop_sequence,
            "usage": _usage(done),
            "jitllm": done.figures,
        }
        return JSONResponse(body)

    async def _stream(self, outbox: Outbox, ident: str, model: str, num_prompt: int, record: Callable[[str], None]) -> AsyncIterator[bytes]:
        message: dict[str, Any] = {
            "id": ident,
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": num_prompt, "output_tokens": 0},
        }
        yield _event("message_start", {"type": "message_start", "message": message})
        yield _event("content_block_start", {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}})
        yield _event("ping", {"type": "ping"})
        parts: list[str] = []
        async for ev in outbox:
            if isinstance(ev, Delta):
                if ev.text:
                    parts.append(ev.text)
                    yield _event("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": ev.text}})
            elif isinstance(ev, Done):
                record("".join(parts))
                reason, stop_sequence = _stop_reason(ev)
                yield _event("content_block_stop", {"type": "content_block_stop", "index": 0})
                delta = {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": stop_sequence}, "usage": _usage(ev), "jitllm": ev.figures}
                yield _event("message_delta", delta)
                yield _event("message_stop", {"type": "message_stop"})
            elif isinstance(ev, Failed):
                yield _event("error", {"type": "error", "error": {"type": "api_error", "message": ev.message}})


def _usage(done: Done) -> dict[str, int]:
    cached = done.prompt_tokens - done.fed_tokens
    return {"input_tokens": done.fed_tokens, "output_tokens": done.completion_tokens, "cache_read_input_tokens": cached}
