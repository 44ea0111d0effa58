"""/v1/rerank in Jina's and Cohere's shape and /v1/score in vLLM's, as vLLM serves them: an embedding model scores a
query and a document by the cosine of their vectors (as vLLM's score API does for embedders); a cross-encoder scores
the pair itself, [CLS] query [SEP] document [SEP] through its classifier."""

from __future__ import annotations

import dataclasses
import time
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..engine.catalog import Catalog, ServedModel
from ..engine.figures import Figures
from ..engine.kv import RoomError
from ..engine.request import Embedded
from .body import APIError, Fields, dialect, read_json
from .embeddings import MOST_INPUTS
from .outbox import embed
from .prompt import encode_at_most, find_model, off_loop
from .rendering import error_response

__all__ = ["MOST_TEXTS", "Ranked", "Scoring", "Text", "rank"]

MOST_TEXTS = MOST_INPUTS  # /v1/embeddings' bound: texts on one side of a request (documents, text_1, text_2), inputs per engine job
_EPS = 1e-8  # torch's CosineSimilarity's, which vLLM's score API uses


@dataclass(frozen=True)
class Text:
    """One text of a request and the field that holds it (`query`, `documents[3]`), for the errors that name it."""

    text: str
    param: str


@dataclass(frozen=True)
class Scored:
    """One score per pair, the tokens the model ran, and the `jitllm` figures."""

    scores: list[float]
    num_tokens: int
    figures: Figures


class Scoring:
    """The rerank and score routes over a Catalog."""

    def __init__(self, catalog: Catalog):
        self.catalog = catalog

    @dialect(error_response)
    async def rerank(self, request: Request) -> Response:
        """{model, query, documents, top_n, return_documents} -> the documents by relevance_score, highest first."""
        f = Fields(await read_json(request))
        name = f.string("model")
        served = find_model(self.catalog, name)  # rank checks it scores
        query = f.string("query", required=True) or ""
        documents = _texts(f, "documents")  # vLLM's takes one string too
        top_n = f.integer("top_n", low=1)
        with_text = f.boolean("return_documents", True)
        scored = await rank(served, Text(query, "query"), documents, top_n)
        results: list[dict[str, Any]] = []
        for i, score in scored.order:
            results.append({"index": i, "relevance_score": score} | ({"document": {"text": documents[i].text}} if with_text else {}))
        usage = {"prompt_tokens": scored.num_tokens, "total_tokens": scored.num_tokens}
        return JSONResponse({"id": f"rerank-{uuid.uuid4().hex}", "model": name or served.id, "results": results, "usage": usage,
                             "jitllm": scored.figures.to_json()})

    @dialect(error_response)
    async def score(self, request: Request) -> Response:
        """{model, text_1, text_2}: one text_1 against each text_2, or text_1[i] against text_2[i] -> a score per pair."""
        f = Fields(await read_json(request))
        name = f.string("model")
        served = _scorer(find_model(self.catalog, name))
        left, right = _texts(f, "text_1"), _texts(f, "text_2")
        if len(left) > 1 and len(left) != len(right):
            raise f.error("text_1", f"{len(left)} texts against {len(right)} in text_2: give one text_1 for all of text_2, or one for each")
        scored = await _score(served, left, right)
        data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scored.scores)]
        usage = {"prompt_tokens": scored.num_tokens, "total_tokens": scored.num_tokens, "completion_tokens": 0}
        return JSONResponse({"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": name or served.id,
                             "data": data, "usage": usage, "jitllm": scored.figures.to_json()})


@dataclass(frozen=True)
class Ranked(Scored):
    """Scored, with the documents' (index, score) highest first."""

    order: list[tuple[int, float]]


async def rank(served: ServedModel, query: Text, documents: list[Text], top_n: int | None = None) -> Ranked:
    """The documents scored against the query and ordered by score, highest first (ties keep their order), at most
    top_n of them: /v1/rerank's path and Connect's Rerank. Bad input raises APIError naming its field."""
    scored = await _score(_scorer(served), [query], documents)
    order = sorted(range(len(documents)), key=lambda i: -scored.scores[i])[:top_n]
    return Ranked(scored.scores, scored.num_tokens, scored.figures, [(i, scored.scores[i]) for i in order])


def _scorer(served: ServedModel) -> ServedModel:
    """The model that scores, checked: an embedding model or a cross-encoder (every path to _score comes here first)."""
    if not served.engine.loaded.embeds:
        raise APIError(f"model: {served.id} generates text; scoring needs an embedding model or a cross-encoder", param="model")
    return served


def _texts(f: Fields, key: str) -> list[Text]:
    """A field of texts: one string, or a non-empty array of them."""
    value = f.raw(key)
    if value is None:
        raise f.error(key, "this field is required")
    if isinstance(value, str):
        return [Text(value, f.name(key))]
    if not isinstance(value, list) or not value:
        raise f.error(key, "expected a string or a non-empty array of strings")
    if len(value) > MOST_TEXTS:
        raise f.error(key, f"at most {MOST_TEXTS} texts per request, got {len(value)}")
    for i, v in enumerate(value):
        if not isinstance(v, str):
            raise f.error(f"{key}[{i}]", "expected a string")
    return [Text(v, f.name(f"{key}[{i}]")) for i, v in enumerate(value)]


def _too_long(param: str, tokens: str, room: int, model: str) -> APIError:
    return APIError(f"{param}: {tokens} tokens, but {model} takes at most {room}", param=param, code="context_length_exceeded")


def _encode(served: ServedModel, texts: list[Text]) -> list[list[int]]:
    """Each text's ids, [CLS] ... [SEP] (on a prompt thread). One longer than the model takes is refused naming its field,
    a huge one once a piece of it shows that (not after tokenizing all of it)."""
    room = served.engine.loaded.max_seq
    out = []
    for t in texts:
        try:
            out.append(encode_at_most(served, t.text, room))
        except RoomError as exc:
            raise _too_long(t.param, f"it makes {exc}", room, served.id) from None
    return out


async def _score(served: ServedModel, left: list[Text], right: list[Text]) -> Scored:
    """Score left[0] (or left[i]) against each right[i]: a cross-encoder runs each pair; an embedding model embeds every
    text once and takes the cosines."""
    loaded = served.engine.loaded
    texts = left + right
    ids = await off_loop(_encode, served, texts, size=sum(len(t.text) for t in texts))
    left_ids, right_ids = ids[: len(left)], ids[len(left):]
    model: Any = loaded.model  # an encoder; a cross-encoder scores pairs (engine/models/bert.py)
    if not getattr(model, "scores_pairs", False):  # an embedding model: the cosines of its vectors
        vectors, num_tokens, figures = await _run(served, ids)
        a, b = vectors[: len(left)].astype(np.float64), vectors[len(left):].astype(np.float64)
        a = np.broadcast_to(a, b.shape) if len(left) == 1 else a
        cos = (a * b).sum(1) / np.maximum(np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1), _EPS)
        return Scored([float(s) for s in cos], num_tokens, figures)
    room, sep = loaded.max_seq, model.sep_token_id
    for t, q in zip(left, left_ids, strict=True):
        if sep in q[1:-1]:  # the model's second segment starts after the first [SEP]: the query must not hold one
            raise APIError(f"{t.param}: it holds the separator token {loaded.tokenizer.id_to_token(sep)!r}, which cannot be scored "
                           "inside the first text of a pair", param=t.param)
    pairs = []
    for i, (t, d) in enumerate(zip(right, right_ids, strict=True)):
        j = 0 if len(left) == 1 else i
        pair = left_ids[j] + d[1:]  # [CLS] a [SEP] + b [SEP]: the pair template, as convert checked it
        if len(pair) > room:
            raise _too_long(t.param, f"with {left[j].param} it makes {len(pair)}", room, served.id)
        pairs.append(pair)
    vectors, num_tokens, figures = await _run(served, pairs)
    return Scored([float(s) for s in vectors[:, 0]], num_tokens, figures)


async def _run(served: ServedModel, batch: list[list[int]]) -> tuple[np.ndarray, int, Figures]:
    """The batch through the model's engine thread, MOST_TEXTS inputs a job -> its vectors, tokens, and figures (of
    several jobs: queued as the first, computing as all of them)."""
    jobs: list[Embedded] = []
    for start in range(0, len(batch), MOST_TEXTS):
        try:
            jobs.append(await embed(served.engine, batch[start : start + MOST_TEXTS]))
        except RoomError as exc:  # checked above, per field: only a model whose room changed gets here
            raise APIError(str(exc)) from None
    num_tokens = sum(j.num_tokens for j in jobs)
    figures = jobs[0].figures
    if len(jobs) > 1:
        figures = dataclasses.replace(figures, prefill_ms=round(sum(j.figures.prefill_ms for j in jobs), 3),
                                      bytes_per_token=sum(j.figures.bytes_per_token * j.num_tokens for j in jobs) // max(1, num_tokens))
    return np.concatenate([j.vectors for j in jobs]), num_tokens, figures
