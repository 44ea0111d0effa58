"""The OpenAI Responses API: /v1/responses create (whole or streamed), retrieve, delete, cancel, input_items and
input_tokens, over the same generation path as chat completions (a body read: responses_request.py; the store that
previous_response_id continues from: response_store.py)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..engine.catalog import Catalog
from ..engine.request import Delta, Done, Failed, FinishReason
from ..engine.sampler import TokenLogprobs
from ..engine.tokenizer import Tokenizer
from .body import APIError, Fields, dialect, read_json
from .openai_request import Limits, OpenAIGeneration, parse_common
from .outbox import Outbox, collect_all, until_disconnect
from .prompt import chat_prompt_ids, conversation, find_target
from .reasoning import Split, split_reasoning
from .rendering import SSE_HEADERS, chat_logprobs, error_response, tool_call
from .response_store import ResponseStore, Stored
from .responses_request import ResponsesRequest, item_id, not_found, read_request
from .tools import Piece, Text, ToolCall, ToolCallParser, parse_pieces

__all__ = ["Responses"]


class Responses:
    """The /v1/responses routes over a Catalog and a ResponseStore."""

    def __init__(self, catalog: Catalog, store: ResponseStore, limits: Limits | None = None):
        self.catalog, self.store, self.limits = catalog, store, limits or Limits()

    # -- routes ---------------------------------------------------------------------------------

    @dialect(error_response)
    async def create(self, request: Request) -> Response:
        req, history, gen, prompt_ids = await self._prompt(await read_json(request))
        [outbox] = await gen.start_all("input", request.state.request_id, [prompt_ids])
        run = _Run(item_id("resp"), int(time.time()), req, gen, Stored({}, req.items, [*history, *req.messages], cancel=outbox.end))
        run.stored.response = run.response("in_progress")
        if req.store:
            self.store.put(run.stored)
        if req.stream:
            return StreamingResponse(self._stream(run, outbox), media_type="text/event-stream", headers=SSE_HEADERS)
        try:
            results = await until_disconnect(request, lambda: collect_all([outbox]))
        except BaseException as exc:  # the engine failed it (a rank gone, a bug): stored as failed, never left in progress
            self._finish(run, "failed", error=exc.message if isinstance(exc, APIError) else "the model failed to generate a response")
            raise
        if results is None:
            self._finish(run, "cancelled")
            return Response(status_code=499)  # nobody is listening
        [(text, done)] = results
        if gen.reasoning is not None and gen.reasoning.markers is not None:  # the thought first; calls are the answer's
            thought, text = split_reasoning(text, gen.reasoning.markers, inside=gen.reasoning.inside(gen.tokenizer, prompt_ids))
            if thought is not None:
                run.add_thought(thought)
        pieces = parse_pieces(text, gen.tool_names, cut=done.finish_reason is FinishReason.LENGTH) if gen.tool_names else [Text(text)]
        for piece in pieces:
            run.add(piece)
        if not run.output:
            run.add(Text(""))  # a reply always has its message, if empty
        if gen.params.logprobs is not None:
            run.set_logprobs(chat_logprobs(gen.tokenizer, outbox.scores)["content"])
        return JSONResponse(self._finish(run, *_status(done), done=done))

    @dialect(error_response)
    async def retrieve(self, request: Request) -> Response:
        if request.query_params.get("stream") in ("true", "1"):
            raise APIError("stream: a stored response is read whole; stream it as it is created instead", param="stream")
        return JSONResponse(self._stored(request).response)

    @dialect(error_response)
    async def delete(self, request: Request) -> Response:
        stored = self._stored(request)
        stored.deleted = True
        if stored.cancel is not None:
            stored.cancel()  # nobody can read it any more: stop the work too
        self.store.delete(stored.id)
        return JSONResponse({"id": stored.id, "object": "response", "deleted": True})

    @dialect(error_response)
    async def cancel(self, request: Request) -> Response:
        """Stop a response still being generated: its stream or its waiting create ends with status cancelled."""
        stored = self._stored(request)
        if not stored.running or stored.cancel is None:
            raise APIError(f"response {stored.id!r} is {stored.response['status']}: only one in progress can be cancelled", param="response_id")
        stored.cancel()
        stored.response = {**stored.response, "status": "cancelled"}
        return JSONResponse(stored.response)

    @dialect(error_response)
    async def input_items(self, request: Request) -> Response:
        """The response's own input items, newest first unless order=asc, `limit` (1-100, default 20) after `after`."""
        stored = self._stored(request)
        q = Fields(dict(request.query_params))
        order = q.string("order", "desc")
        if order not in ("asc", "desc"):
            raise q.error("order", f"{order!r}: expected asc or desc")
        raw_limit = q.string("limit", "20") or "20"
        if not raw_limit.isdigit() or not 1 <= int(raw_limit) <= 100:
            raise q.error("limit", f"expected an integer from 1 to 100, got {raw_limit[:20]!r}")
        items = stored.input_items if order == "asc" else stored.input_items[::-1]
        after = q.string("after")
        if after is not None:
            at = next((i for i, it in enumerate(items) if it["id"] == after), None)
            if at is None:
                raise q.error("after", f"no input item {after!r} in response {stored.id!r}")
            items = items[at + 1:]
        page = items[: int(raw_limit)]
        return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                             "last_id": page[-1]["id"] if page else None, "has_more": len(items) > len(page)})

    @dialect(error_response)
    async def input_tokens(self, request: Request) -> Response:
        """POST /v1/responses/input_tokens: the input tokens a create of the same body reports."""
        *_, prompt_ids = await self._prompt(await read_json(request), counting=True)
        return JSONResponse({"object": "response.input_tokens", "input_tokens": len(prompt_ids)})

    # -- the parts --------------------------------------------------------------------------------

    async def _prompt(self, body: dict[str, Any], *, counting: bool = False) -> tuple[ResponsesRequest, list[dict[str, Any]], OpenAIGeneration, list[int]]:
        """A body read (`counting`: input_tokens'), the conversation it continues, its generation (chat's parse_common
        over the translated fields) and its prompt ids through the model's template."""
        req = read_request(body, counting=counting)
        history = self._history(req)
        served, session = find_target(self.catalog, req.model, Fields(body).string("jitllm_session"))
        if session is not None and req.previous_response_id is not None:
            raise APIError("previous_response_id: a named session keeps its own conversation; send one or the other", param="previous_response_id")
        chat = conversation(session, [*req.system(), *history, *req.messages])
        gen = parse_common(Fields(req.chat), served, req.model or served.id, ("max_completion_tokens",), session, chat, req.chat_tools,
                           limits=self.limits)
        if gen.grammar_param == "response_format":
            gen = replace(gen, grammar_param="text.format")  # a schema the grammar refuses is a 400 naming the field the client sent
        return req, history, gen, await chat_prompt_ids(served, chat, session, tools=req.chat_tools, extra=gen.template_kwargs)

    def _history(self, req: ResponsesRequest) -> list[dict[str, Any]]:
        """The conversation previous_response_id continues (its instructions left out, as OpenAI's are)."""
        if req.previous_response_id is None:
            return []
        prev = self.store.get(req.previous_response_id)
        if prev is None:
            raise not_found(req.previous_response_id, "previous_response_id")
        if prev.running:
            raise APIError(f"previous_response_id: response {prev.id!r} is still in progress", param="previous_response_id")
        return prev.messages

    def _stored(self, request: Request) -> Stored:
        ident = request.path_params["response_id"]
        stored = self.store.get(ident)
        if stored is None:
            raise not_found(ident)
        return stored

    def _finish(self, run: _Run, status: str, incomplete: str | None = None, *, done: Done | None = None, error: str | None = None) -> dict[str, Any]:
        """The final response: stored (when asked and not deleted meanwhile), and the conversation it ends remembered."""
        stored = run.stored
        final = run.response(status, incomplete=incomplete, done=done, error=error)
        stored.response, stored.cancel = final, None
        stored.messages = [*stored.messages, run.reply()]
        if done is not None:
            run.gen.done(run.reply())  # a named session's conversation
        if run.req.store and not stored.deleted:
            self.store.put(stored)
        return final

    async def _stream(self, run: _Run, outbox: Outbox) -> AsyncIterator[bytes]:
        """response.created, response.in_progress, then each output item as it comes (output_item.added, its content
        part or arguments, their deltas and done events, output_item.done), then response.completed (incomplete at
        max_output_tokens; failed on an engine error), each event with its sequence_number."""
        ended = False
        events = aiter(outbox)
        try:
            yield run.event("response.created", response=run.stored.response)
            yield run.event("response.in_progress", response=run.stored.response)
            gen = run.gen
            parser = ToolCallParser(gen.tool_names) if gen.tool_names else None
            splitter = gen.reasoning.splitter(gen.tokenizer, outbox.request.prompt_ids) if gen.reasoning is not None else None

            def answer(text: str) -> list[Piece]:
                return parser.feed(text) if parser else [Text(text)]

            def pieces(split: Split) -> list[bytes]:
                return [*run.stream_thought(split.reasoning), *(run.stream_pieces(answer(split.answer)) if split.answer else [])]

            async for ev in events:
                if isinstance(ev, Delta):
                    run.pending.extend(ev.logprobs or [])
                    if ev.text:
                        for b in pieces(splitter.feed(ev.text)) if splitter else run.stream_pieces(answer(ev.text)):
                            yield b
                elif isinstance(ev, Done):
                    for b in pieces(splitter.finish()) if splitter else []:
                        yield b
                    for b in run.close_thought():
                        yield b
                    for b in run.stream_pieces(parser.finish(cut=ev.finish_reason is FinishReason.LENGTH) if parser else []):
                        yield b
                    if not run.output:
                        for b in run.stream_pieces([Text("")]):
                            yield b
                    for b in run.close_message():
                        yield b
                    status, incomplete = _status(ev)
                    final = self._finish(run, status, incomplete, done=ev)
                    ended = True
                    yield run.event("response.completed" if status == "completed" else "response.incomplete", response=final)
                elif isinstance(ev, Failed):
                    for b in [*run.close_thought(), *run.close_message()]:
                        yield b
                    final = self._finish(run, "failed", error=ev.message)
                    ended = True
                    yield run.event("response.failed", response=final)
        finally:
            await events.aclose()  # a client gone: the request is cancelled now, not when the generator is collected
            if not ended:
                self._finish(run, "cancelled")


def _status(done: Done) -> tuple[str, str | None]:
    """(status, incomplete_details.reason) of a finished generation."""
    if done.finish_reason is FinishReason.LENGTH:
        return "incomplete", "max_output_tokens"
    if done.finish_reason is FinishReason.CANCELLED:
        return "cancelled", None
    return "completed", None


@dataclass
class _Run:
    """One response being made: its output items so far, the message item open for text, the events' numbering."""

    ident: str
    created: int
    req: ResponsesRequest
    gen: OpenAIGeneration
    stored: Stored
    output: list[dict[str, Any]] = field(default_factory=list)
    calls: list[dict[str, Any]] = field(default_factory=list)  # chat-shaped, for the conversation
    pending: list[TokenLogprobs] = field(default_factory=list)  # streamed tokens whose text has not gone out
    open_index: int | None = None  # the output index of the message item receiving text
    thought_index: int | None = None  # the output index of the reasoning item receiving the thought
    seq: int = 0

    @property
    def tokenizer(self) -> Tokenizer:
        return self.gen.tokenizer

    def response(self, status: str, *, incomplete: str | None = None, done: Done | None = None, error: str | None = None) -> dict[str, Any]:
        req = self.req
        body: dict[str, Any] = {
            "id": self.ident,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": {"code": "server_error", "message": error} if error is not None else None,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": req.instructions,
            "model": self.gen.model,
            "output": [dict(item) for item in self.output],
            "previous_response_id": req.previous_response_id,
            "store": req.store,
            "text": req.text,
            "tool_choice": req.tool_choice,
            "tools": [_tool_echo(t) for t in req.tools],
            "metadata": req.metadata,
            **req.echo,
        }
        if done is not None:  # the document's usage is an object, never null: left out until there is one
            body["usage"], body["jitllm"] = _usage(done), done.figures.to_json()
        return body

    def event(self, kind: str, **fields: Any) -> bytes:
        obj = {"type": kind, **fields, "sequence_number": self.seq}
        self.seq += 1
        return f"event: {kind}\ndata: ".encode() + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"

    # whole responses

    def add(self, piece: Piece) -> None:
        if isinstance(piece, Text):
            if self.open_index is None:
                self.open_index = len(self.output)
                self.output.append(_message(item_id("msg"), "", "completed"))
            self.output[self.open_index]["content"][0]["text"] += piece.text
        else:
            self.open_index = None
            self.output.append(self._call(piece, "completed"))

    def add_thought(self, text: str) -> None:
        self.output.append(self._reasoning(text, "completed"))

    def _reasoning(self, text: str, status: str) -> dict[str, Any]:
        """A reasoning item: the thought as its content; as its summary too where the request asked for one (no model
        here writes a summary of its own)."""
        item: dict[str, Any] = {"id": item_id("rs"), "type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text}],
                                "status": status}
        if self.req.summary and status == "completed":
            item["summary"] = [{"type": "summary_text", "text": text}]
        return item

    def set_logprobs(self, entries: list[dict[str, Any]]) -> None:
        for item in self.output:
            if item["type"] == "message":
                item["content"][0]["logprobs"] = entries
                return

    def reply(self) -> dict[str, Any]:
        """The assistant turn as chat messages hold it: the text, its thought, and the calls with their call ids."""
        text = "".join(item["content"][0]["text"] for item in self.output if item["type"] == "message")
        out: dict[str, Any] = {"role": "assistant", "content": text}
        thought = "".join(item["content"][0]["text"] for item in self.output if item["type"] == "reasoning")
        if thought:
            out["reasoning_content"] = thought
        if self.calls:
            out["tool_calls"] = self.calls
        return out

    def _call(self, call: ToolCall, status: str) -> dict[str, Any]:
        c = tool_call(call)
        self.calls.append(c)
        return {"id": item_id("fc"), "type": "function_call", "call_id": c["id"], "name": call.name, "arguments": call.arguments, "status": status}

    # streams

    def stream_pieces(self, pieces: list[Piece]) -> list[bytes]:
        out: list[bytes] = self.close_thought() if pieces else []
        for piece in pieces:
            if isinstance(piece, Text):
                if self.open_index is None:
                    self.open_index = len(self.output)
                    item = _message(item_id("msg"), "", "in_progress")
                    self.output.append(item)
                    out.append(self.event("response.output_item.added", output_index=self.open_index, item={**item, "content": []}))
                    out.append(self.event("response.content_part.added", item_id=item["id"], output_index=self.open_index, content_index=0,
                                          part={"type": "output_text", "text": "", "annotations": [], "logprobs": []}))
                item = self.output[self.open_index]
                logprobs = self._scored()
                item["content"][0]["text"] += piece.text
                item["content"][0]["logprobs"] += logprobs
                if piece.text:
                    out.append(self.event("response.output_text.delta", item_id=item["id"], output_index=self.open_index, content_index=0,
                                          delta=piece.text, logprobs=logprobs))
            else:
                out += self.close_message()
                index = len(self.output)
                item = self._call(piece, "completed")
                self.output.append(item)
                out.append(self.event("response.output_item.added", output_index=index, item={**item, "arguments": "", "status": "in_progress"}))
                out.append(self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index, delta=item["arguments"]))
                out.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index, name=item["name"],
                                      arguments=item["arguments"]))
                out.append(self.event("response.output_item.done", output_index=index, item=item))
        return out

    def stream_thought(self, text: str) -> list[bytes]:
        """The thought's text as it comes: its reasoning item opened on the first."""
        if not text:
            return []
        out: list[bytes] = []
        if self.thought_index is None:
            self.thought_index = len(self.output)
            item = self._reasoning("", "in_progress")
            self.output.append(item)
            out.append(self.event("response.output_item.added", output_index=self.thought_index, item={**item, "content": []}))
        item = self.output[self.thought_index]
        item["content"][0]["text"] += text
        out.append(self.event("response.reasoning_text.delta", item_id=item["id"], output_index=self.thought_index, content_index=0, delta=text))
        return out

    def close_thought(self) -> list[bytes]:
        """The thought's done events (and its summary's, where asked), once the answer starts or the reply ends."""
        if self.thought_index is None or self.output[self.thought_index]["status"] == "completed":
            return []
        index = self.thought_index
        done = self._reasoning(self.output[index]["content"][0]["text"], "completed")
        item = self.output[index] = {**done, "id": self.output[index]["id"]}
        text = item["content"][0]["text"]
        out = [self.event("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0, text=text)]
        if item["summary"]:
            part = {"type": "summary_text", "text": ""}
            out += [self.event("response.reasoning_summary_part.added", item_id=item["id"], output_index=index, summary_index=0, part=part),
                    self.event("response.reasoning_summary_text.delta", item_id=item["id"], output_index=index, summary_index=0, delta=text),
                    self.event("response.reasoning_summary_text.done", item_id=item["id"], output_index=index, summary_index=0, text=text),
                    self.event("response.reasoning_summary_part.done", item_id=item["id"], output_index=index, summary_index=0,
                               part={**part, "text": text})]
        out.append(self.event("response.output_item.done", output_index=index, item=item))
        return out

    def close_message(self) -> list[bytes]:
        if self.open_index is None:
            return []
        index, self.open_index = self.open_index, None
        item = self.output[index]
        item["status"] = "completed"
        part = item["content"][0]
        return [
            self.event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0, text=part["text"], logprobs=part["logprobs"]),
            self.event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=part),
            self.event("response.output_item.done", output_index=index, item=item),
        ]

    def _scored(self) -> list[dict[str, Any]]:
        if self.gen.params.logprobs is None or not self.pending:
            return []
        entries = chat_logprobs(self.tokenizer, self.pending)["content"]
        self.pending.clear()
        return entries


def _message(ident: str, text: str, status: str) -> dict[str, Any]:
    return {"id": ident, "type": "message", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _tool_echo(tool: dict[str, Any]) -> dict[str, Any]:
    """A function tool as a Response lists it: every field present."""
    return {"type": "function", "name": tool.get("name"), "description": tool.get("description"), "parameters": tool.get("parameters"),
            "strict": bool(tool.get("strict", False))}


def _usage(done: Done) -> dict[str, Any]:
    return {
        "input_tokens": done.prompt_tokens,
        "input_tokens_details": {"cached_tokens": done.prompt_tokens - done.fed_tokens, "cache_write_tokens": 0},
        "output_tokens": done.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": done.reasoning_tokens},
        "total_tokens": done.prompt_tokens + done.completion_tokens,
    }
