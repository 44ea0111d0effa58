"""OpenAI's /v1/embeddings: its fields, its inputs (strings or token ids) as token-id lists, the vectors as float or
base64, with usage and the `jitllm` figures."""

from __future__ import annotations

import base64
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..engine.catalog import Catalog, ServedModel
from ..engine.kv import RoomError
from .body import Fields, dialect, read_json
from .outbox import embed
from .prompt import find_model, off_loop
from .rendering import error_response

__all__ = ["MOST_INPUTS", "Embeddings"]

MOST_INPUTS = 2048  # inputs one request embeds (and one engine job holds)


class Embeddings:
    """The embeddings route over a Catalog."""

    def __init__(self, catalog: Catalog):
        self.catalog = catalog

    @dialect(error_response)
    async def endpoint(self, request: Request) -> Response:
        f = Fields(await read_json(request))
        name = f.string("model")
        served = find_model(self.catalog, name)
        loaded = served.engine.loaded
        if not loaded.embeds:
            raise f.error("model", f"{served.id} generates text; embeddings need an embedding model (use /v1/chat/completions with it)")
        if getattr(loaded.model, "scores_pairs", False):  # an encoder's answer; a decoder has none
            raise f.error("model", f"{served.id} is a cross-encoder: it scores pairs (use /v1/rerank or /v1/score)")
        fmt = f.string("encoding_format", "float")
        if fmt not in ("float", "base64"):
            raise f.error("encoding_format", f"expected float or base64, got {fmt!r}")
        width = int(loaded.model.cfg.hidden_size)
        dims = f.integer("dimensions", low=1)
        if dims is not None and dims != width:
            raise f.error("dimensions", f"{served.id} makes {width}-dimensional vectors and does not truncate them: leave dimensions out or give {width}")
        batch = await off_loop(_inputs, f, served)
        try:
            result = await embed(served.engine, batch)
        except RoomError as exc:
            raise f.error("input", str(exc)) from None
        data = []
        for i, vector in enumerate(result.vectors):
            value: Any = base64.b64encode(vector.astype("<f4").tobytes()).decode() if fmt == "base64" else vector.tolist()
            data.append({"object": "embedding", "index": i, "embedding": value})
        usage = {"prompt_tokens": result.num_tokens, "total_tokens": result.num_tokens}
        return JSONResponse({"object": "list", "data": data, "model": name or served.id, "usage": usage, "jitllm": result.figures.to_json()})


def _inputs(f: Fields, served: ServedModel) -> list[list[int]]:
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
    if len(items) > MOST_INPUTS:
        raise f.error("input", f"at most {MOST_INPUTS} inputs per request, got {len(items)}")
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
