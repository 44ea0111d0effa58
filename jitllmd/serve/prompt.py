"""What every dialect does the same way: find the model, turn messages or text into prompt ids, start the engine request."""

from __future__ import annotations

from typing import Any

from ..engine.catalog import Catalog, ServedModel
from ..engine.chat import ChatTemplateError
from ..engine.kv import RoomError
from ..engine.sampler import SamplingParams
from ..engine.sessions import Session
from .body import APIError
from .outbox import Outbox

__all__ = ["chat_prompt_ids", "conversation", "find_model", "find_target", "remember", "sampling_params", "start", "text_prompt_ids"]


def find_target(catalog: Catalog, name: str | None, session_id: str | None) -> tuple[ServedModel, Session | None]:
    """The model and named session a request runs in: `jitllm_session` takes precedence over `model`."""
    if session_id is None:
        return find_model(catalog, name), None
    try:
        return catalog.find_session(session_id)
    except KeyError:
        raise APIError(f"jitllm_session: no session {session_id!r} (create one with `jitllmd sessions -new`)", param="jitllm_session", kind="not_found") from None


def conversation(session: Session | None, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The whole chat a request runs: on a named session its messages follow the session's conversation, unless
    they begin with it (a client that resends the history), in which case they are the whole conversation."""
    if session is None:
        return messages
    so_far = session.messages
    if messages[: len(so_far)] == so_far:
        return messages
    return so_far + messages


def remember(session: Session | None, chat: list[dict[str, Any]], reply: str | dict[str, Any]) -> None:
    """After a reply on a named session, its conversation is the chat plus the reply (text, or an assistant
    message with tool calls)."""
    if session is not None:
        session.messages = [*chat, reply if isinstance(reply, dict) else {"role": "assistant", "content": reply}]


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


def chat_prompt_ids(
    served: ServedModel, messages: list[dict[str, Any]], *, prefill: str | None = None, tools: list[dict[str, Any]] | None = None
) -> list[int]:
    """Messages (and tool definitions, OpenAI shape) through the model's own chat template; `prefill` is the start
    of the answer, continued as is. A template that does not use tools renders without them."""
    loaded = served.engine.loaded
    if loaded.embeds:
        raise APIError(f"model {served.id!r} is an embedding model: send its inputs to /v1/embeddings", param="model")
    if not loaded.chat.available:
        raise APIError(f"model {served.id!r} has no chat template: send a raw prompt to /v1/completions instead", param="model")
    try:
        text = loaded.chat.render(messages, add_generation_prompt=True, tools=tools)
    except ChatTemplateError as exc:
        raise APIError(f"messages: {exc}", param="messages") from None
    return loaded.tokenizer.encode(text + (prefill or ""))


def text_prompt_ids(served: ServedModel, text: str) -> list[int]:
    return served.engine.loaded.tokenizer.encode(text)


def start(served: ServedModel, prompt_ids: list[int], params: SamplingParams, *, param: str, **submit_kw: Any) -> Outbox:
    """Submit to the model's engine. A prompt that does not fit, or bad ids, is a 400 naming `param`."""
    if served.engine.loaded.embeds:
        raise APIError(f"model {served.id!r} is an embedding model: send its inputs to /v1/embeddings", param="model")
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
