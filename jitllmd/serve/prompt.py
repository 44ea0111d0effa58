"""What every dialect does the same way: find the model, turn messages or text into prompt ids, start the engine request."""

from __future__ import annotations

from typing import Any

from ..engine.catalog import Catalog, ServedModel
from ..engine.chat import ChatTemplateError
from ..engine.kv import RoomError
from ..engine.sampler import SamplingParams
from .body import APIError
from .outbox import Outbox

__all__ = ["chat_prompt_ids", "find_model", "sampling_params", "start", "text_prompt_ids"]


def find_model(catalog: Catalog, name: str | None) -> ServedModel:
    """The model a request names; with no name, the only loaded model."""
    if name is None:
        loaded = catalog.loaded()
        if len(loaded) == 1:
            return loaded[0]
        raise APIError("model: this field is required" + (" (several models are loaded)" if loaded else ""), param="model")
    try:
        return catalog.get(name)
    except KeyError as exc:
        raise APIError(str(exc.args[0]), param="model", kind="not_found", code="model_not_found") from None


def chat_prompt_ids(served: ServedModel, messages: list[dict[str, Any]], *, prefill: str | None = None) -> list[int]:
    """Messages through the model's own chat template; `prefill` is the start of the answer, continued as is."""
    loaded = served.engine.loaded
    if not loaded.chat.available:
        raise APIError(f"model {served.id!r} has no chat template: send a raw prompt to /v1/completions instead", param="model")
    try:
        text = loaded.chat.render(messages, add_generation_prompt=True)
    except ChatTemplateError as exc:
        raise APIError(f"messages: {exc}", param="messages") from None
    return loaded.tokenizer.encode(text + (prefill or ""))


def text_prompt_ids(served: ServedModel, text: str) -> list[int]:
    return served.engine.loaded.tokenizer.encode(text)


def start(served: ServedModel, prompt_ids: list[int], params: SamplingParams, *, param: str, **submit_kw: Any) -> Outbox:
    """Submit to the model's engine. A prompt that does not fit, or bad ids, is a 400 naming `param`."""
    try:
        return Outbox(served.engine, prompt_ids, params, **submit_kw)
    except RoomError as exc:
        raise APIError(f"{param}: {exc}", param=param, code="context_length_exceeded") from None
    except ValueError as exc:
        raise APIError(f"{param}: {exc}", param=param) from None


def sampling_params(**kw: Any) -> SamplingParams:
    """SamplingParams whose ValueError (naming the field) becomes a 400."""
    try:
        return SamplingParams(**kw)
    except ValueError as exc:
        field = str(exc).split(" ", 1)[0]
        raise APIError(str(exc), param=field) from None
