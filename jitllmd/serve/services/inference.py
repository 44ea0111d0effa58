"""InferenceService: Generate, Complete, Cancel, Embed and Rerank over the same engine and sessions the HTTP surfaces use."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from connectrpc.code import Code
from connectrpc.errors import ConnectError

from ...engine.catalog import Catalog, ServedModel
from ...engine.request import Delta, Done, Failed, FinishReason, Generation
from ...engine.sampler import SamplingParams
from ...engine.sessions import Session
from ...gen.jitllm.v1 import common_pb2 as common
from ...gen.jitllm.v1 import inference_pb2 as inf
from ...gen.jitllm.v1.inference_connect import InferenceService
from ..body import APIError
from ..outbox import Outbox, embed
from ..prompt import conversation, encode_in_room, off_loop, remember
from ..rerank import MOST_TEXTS, Text, rank
from .control import model_of, session_of

__all__ = ["Inference"]

_FINISH = {
    FinishReason.STOP: common.FINISH_REASON_STOP,
    FinishReason.LENGTH: common.FINISH_REASON_LENGTH,
    FinishReason.CANCELLED: common.FINISH_REASON_CANCELLED,
}


def _params(p: common.SamplingParams) -> SamplingParams:
    kw: dict[str, Any] = {}
    for name in ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        if p.HasField(name):
            kw[name] = getattr(p, name)
    return SamplingParams(**kw)  # ValueError names the field: invalid_argument


def _finished(done: Done) -> inf.Finished:
    return inf.Finished(
        finish_reason=_FINISH[done.finish_reason],
        stop_sequence=done.stop or "",
        usage=common.Usage(prompt_tokens=done.prompt_tokens, completion_tokens=done.completion_tokens, cached_tokens=done.prompt_tokens - done.fed_tokens),
        figures=common.Figures(**done.figures.to_json()),
    )


@dataclass
class _Run:
    """One Generate/Complete in flight: its outbox, and what a named session remembers when it ends."""

    outbox: Outbox
    session: Session | None
    chat: list[dict[str, str]] | None

    def remember(self, text: str) -> None:
        if self.chat is not None:
            remember(self.session, self.chat, text)


class Inference(InferenceService):
    def __init__(self, catalog: Catalog):
        self.catalog = catalog
        self.running: dict[str, Outbox] = {}  # request_id -> its outbox, for Cancel

    async def generate(self, request: inf.GenerateRequest, ctx: Any) -> AsyncIterator[inf.GenerateResponse]:
        run = await self._start(request)
        req = run.outbox.request
        yield inf.GenerateResponse(started=inf.Started(request_id=req.request_id, session_id=req.session.id, prompt_tokens=len(req.prompt_ids)))
        parts: list[str] = []
        try:
            async for ev in run.outbox:
                if isinstance(ev, Delta):
                    if ev.text or ev.token_ids:
                        parts.append(ev.text)
                        yield inf.GenerateResponse(delta=inf.Delta(text=ev.text, token_ids=ev.token_ids))
                elif isinstance(ev, Done):
                    run.remember("".join(parts))
                    yield inf.GenerateResponse(finished=_finished(ev))
                elif isinstance(ev, Failed):
                    raise ConnectError(Code.UNAVAILABLE, ev.message) if ev.unavailable else RuntimeError(ev.message)
        finally:  # also when the client went away while this generator waited at a yield
            self.running.pop(req.request_id, None)
            if not req.finished:
                run.outbox.engine.cancel(req)

    async def complete(self, request: inf.GenerateRequest, ctx: Any) -> inf.CompleteResponse:
        run = await self._start(request)
        req = run.outbox.request
        ids: list[int] = []
        parts: list[str] = []
        try:
            async for ev in run.outbox:
                if isinstance(ev, Delta):
                    parts.append(ev.text)
                    ids.extend(ev.token_ids)
                elif isinstance(ev, Done):
                    text = "".join(parts)
                    run.remember(text)
                    return inf.CompleteResponse(request_id=req.request_id, text=text, token_ids=ids, finished=_finished(ev))
                elif isinstance(ev, Failed):
                    raise ConnectError(Code.UNAVAILABLE, ev.message) if ev.unavailable else RuntimeError(ev.message)
        finally:
            self.running.pop(req.request_id, None)
        raise RuntimeError("the engine ended the request without a final event")

    async def cancel(self, request: inf.CancelRequest, ctx: Any) -> inf.CancelResponse:
        outbox = self.running.get(request.request_id)
        if outbox is None:
            return inf.CancelResponse(cancelled=False)
        outbox.engine.cancel(outbox.request)
        return inf.CancelResponse(cancelled=not outbox.request.finished)

    async def embed(self, request: inf.EmbedRequest, ctx: Any) -> inf.EmbedResponse:
        served = model_of(self.catalog, request.model)
        loaded = served.engine.loaded
        if not loaded.embeds:
            raise ConnectError(Code.FAILED_PRECONDITION, f"model {served.id} generates text; embeddings need an embedding model")
        if getattr(loaded.model, "scores_pairs", False):  # an encoder's answer; a decoder has none
            raise ConnectError(Code.FAILED_PRECONDITION, f"model {served.id} is a cross-encoder: it scores pairs (use /v1/rerank or /v1/score)")
        if not request.inputs:
            raise ConnectError(Code.INVALID_ARGUMENT, "inputs: at least one text")
        for i, text in enumerate(request.inputs):
            if not text:
                raise ConnectError(Code.INVALID_ARGUMENT, f"inputs[{i}] is empty")
        batch = await off_loop(lambda: [loaded.tokenizer.encode(text) for text in request.inputs], size=request.ByteSize())
        result = await embed(served.engine, batch)  # RoomError: resource_exhausted
        return inf.EmbedResponse(embeddings=[inf.Embedding(values=v.tolist()) for v in result.vectors], prompt_tokens=result.num_tokens)

    async def rerank(self, request: inf.RerankRequest, ctx: Any) -> inf.RerankResponse:
        """/v1/rerank's path: its errors (a text too long, a generating model) are invalid_argument naming the field."""
        served = model_of(self.catalog, request.model)
        if not request.documents:
            raise ConnectError(Code.INVALID_ARGUMENT, "documents: at least one text")
        if len(request.documents) > MOST_TEXTS:
            raise ConnectError(Code.INVALID_ARGUMENT, f"documents: at most {MOST_TEXTS} texts per request, got {len(request.documents)}")
        documents = [Text(d, f"documents[{i}]") for i, d in enumerate(request.documents)]
        try:
            ranked = await rank(served, Text(request.query, "query"), documents, request.top_n or None)
        except APIError as exc:
            raise ConnectError(Code.INVALID_ARGUMENT, exc.message) from None
        return inf.RerankResponse(results=[inf.RerankResult(index=i, relevance_score=s) for i, s in ranked.order], prompt_tokens=ranked.num_tokens)

    async def _start(self, request: inf.GenerateRequest) -> _Run:
        """Resolve the model or session, build the prompt ids, submit."""
        session: Session | None = None
        if request.session_id:
            served, session = session_of(self.catalog, request.session_id)
        else:
            served = model_of(self.catalog, request.model)
        if request.request_id and request.request_id in self.running:
            raise ConnectError(Code.ALREADY_EXISTS, f"request_id {request.request_id!r} is already running")
        ids, chat = await off_loop(self._prompt, served, session, request, size=request.ByteSize())
        outbox = Outbox(served.engine, Generation(
            ids, _params(request.sampling), max_tokens=request.max_tokens if request.HasField("max_tokens") else None, stop=list(request.stop),
            session=session, ignore_eos=request.ignore_eos, request_id=request.request_id or f"r-{uuid.uuid4().hex[:12]}",
            speculative=request.speculative if request.HasField("speculative") else None,
            draft_max=min(request.draft_max, 64) if request.HasField("draft_max") else None,
        ))
        self.running[outbox.request.request_id] = outbox
        return _Run(outbox, session, chat)

    def _prompt(self, served: ServedModel, session: Session | None, request: inf.GenerateRequest) -> tuple[list[int], list[dict[str, str]] | None]:
        loaded = served.engine.loaded
        kind = request.WhichOneof("input")
        if request.continue_session:
            if session is None:
                raise ConnectError(Code.INVALID_ARGUMENT, "continue_session needs a session_id")
            if kind != "prompt":
                raise ConnectError(Code.INVALID_ARGUMENT, "continue_session takes a raw prompt")
            return session.token_ids + encode_in_room(served, session, request.prompt, add_special_tokens=False), None
        if kind == "prompt":
            return encode_in_room(served, session, request.prompt), None
        if kind == "tokens":
            return list(request.tokens.token_ids), None
        if kind == "chat":
            if not loaded.chat.available:
                raise ConnectError(Code.FAILED_PRECONDITION, f"model {served.id} has no chat template: send a raw prompt")
            messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
            if not messages:
                raise ConnectError(Code.INVALID_ARGUMENT, "chat.messages: at least one message")
            chat = conversation(session, messages)
            text = loaded.chat.render(chat, add_generation_prompt=True)
            return encode_in_room(served, session, text), chat
        raise ConnectError(Code.INVALID_ARGUMENT, "input: give a prompt, chat or tokens")
