"""Tokenizing as a service: /tokenize and /detokenize in llama-server's and vLLM's shapes, vLLM's /tokenizer_info, and
the one path they and ModelService's Tokenize and Detokenize share (tokenize_text, detokenize_ids, token_strs)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..engine.catalog import Catalog, ServedModel
from ..engine.kv import RoomError
from ..engine.loader import LoadedModel
from ..engine.tokenizer import Tokenizer
from .body import APIError, Fields, dialect, read_json
from .openai_request import chat_messages, tools_of
from .prompt import chars, encode_at_most, find_model, off_loop, render_chat
from .rendering import error_response

__all__ = ["MOST_TOKENS", "Tokenizing", "detokenize_ids", "piece", "tokenize_text", "token_strs", "tokenizer_info"]

# Ids one request tokenizes or detokenizes: a client counts and splits documents longer than a prompt can be (lm-eval's
# rolling windows, RAG chunking), so the bound is not the room; it keeps one request's memory to ~100 MB (tokenizers
# holds ~0.5 KB per token while it encodes). A model whose room is larger has that.
MOST_TOKENS = 1 << 18
_RESERVED = ("messages", "tools", "add_generation_prompt")  # what a template's context takes from the request itself
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_ON_LOOP = 4096  # tokens in an answer written on the event loop (~1 ms); more are written on a prompt thread
_PIECE_COST = 8  # a piece costs about this many ids' worth to find and write (two decodes)
_KINDS = {str: "a string", bool: "a boolean", list: "an array", dict: "an object", type(None): "null"}


def _most(served: ServedModel) -> int:
    return max(MOST_TOKENS, served.engine.loaded.max_seq)


def _encode(served: ServedModel, text: str, add_special_tokens: bool, param: str) -> list[int]:
    """text's ids, on a prompt thread; RoomError naming `param` past _most (a text far too long costs what the bound's
    worth of tokens costs: encode_at_most)."""
    most = _most(served)
    try:
        return encode_at_most(served, text, most, add_special_tokens=add_special_tokens)
    except RoomError as exc:
        raise RoomError(f"{param}: the text makes {exc} tokens; this server tokenizes at most {most} in one request") from None


async def tokenize_text(served: ServedModel, text: str, *, add_special_tokens: bool, param: str) -> list[int]:
    """The ids of `text` (with the model's BOS, or an encoder's [CLS] ... [SEP], where `add_special_tokens`), off the
    event loop. RoomError (naming `param`) past the bound."""
    return await off_loop(_encode, served, text, add_special_tokens, param, size=len(text))


def _decode(served: ServedModel, ids: list[Any], skip_special_tokens: bool, param: str) -> str:
    tokenizer = served.engine.loaded.tokenizer
    vocab = tokenizer.vocab_size
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int):
            raise ValueError(f"{param}[{i}]: expected a token id (an integer), got {_KINDS.get(type(t), 'a number')}")
        if not 0 <= t < vocab:
            raise ValueError(f"{param}[{i}]: {t} is not a token id of this model: ids are in [0, {vocab})")
    return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


async def detokenize_ids(served: ServedModel, ids: list[Any], *, skip_special_tokens: bool, param: str) -> str:
    """The text of `ids`, off the event loop. ValueError naming `param[i]` for an id that is not an integer of the
    vocabulary, or for more ids than the bound."""
    most = _most(served)
    if len(ids) > most:
        raise ValueError(f"{param}: {len(ids)} ids; this server detokenizes at most {most} in one request")
    return await off_loop(_decode, served, ids, skip_special_tokens, param, size=len(ids))


def token_strs(tokenizer: Tokenizer, ids: list[int]) -> list[str]:
    """Each id's vocabulary string ("Ġworld", "<|im_end|>"), as vLLM's token_strs and Connect's tokens give them."""
    return [tokenizer.id_to_token(i) or "" for i in ids]


def _byte_level() -> dict[str, int]:
    """GPT-2's byte-level alphabet, read backwards: the byte each character of a byte-level vocabulary stands for."""
    shown = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out = {chr(b): b for b in shown}
    hidden = [b for b in range(256) if b not in shown]
    out.update({chr(256 + n): b for n, b in enumerate(hidden)})
    return out


_BYTES = _byte_level()


def piece(tokenizer: Tokenizer, token: int) -> str | list[int]:
    """A token's text as llama-server's with_pieces gives it: as it reads mid-text (SentencePiece's leading space
    kept), a string where it is valid UTF-8, else its bytes (part of a character), as a list of byte values."""
    one = tokenizer.decode([token], skip_special_tokens=False)
    two = tokenizer.decode([token, token], skip_special_tokens=False)  # the second copy reads as the token does mid-text
    text = two[len(one):] if two.startswith(one) else one
    if "\ufffd" not in text:
        return text
    raw = _raw_bytes(tokenizer.id_to_token(token) or "", one)
    if raw is None:
        return text
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return list(raw)


def _raw_bytes(vocab: str, text: str) -> bytes | None:
    """The bytes of a token whose `text` (decoded alone) holds a replacement character: a byte-fallback token
    (<0xE6>), or a byte-level one whose bytes decode to exactly that text; None when they cannot be told."""
    m = _BYTE_FALLBACK.fullmatch(vocab)
    if m:
        return bytes([int(m[1], 16)])
    if vocab and all(c in _BYTES for c in vocab):
        raw = bytes(_BYTES[c] for c in vocab)
        if raw.decode("utf-8", errors="replace") == text:
            return raw
    return None


def tokenizer_info(loaded: LoadedModel) -> dict[str, Any]:
    """vLLM's /tokenizer_info: a tokenizer_config.json of what the .jlm knows. Its tokenizer is a tokenizers document
    (transformers loads one as PreTrainedTokenizerFast); bos_token and eos_token are always there, null where the model
    has none (lm-eval's remote tokenizer looks for eos_token before it uses the server)."""
    tokenizer, chat = loaded.tokenizer, loaded.chat
    named = lambda token, token_id: token or (tokenizer.id_to_token(token_id) if token_id is not None else None)
    info: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": named(chat.bos_token, tokenizer.bos_token_id),
        "eos_token": named(chat.eos_token, tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else None),
        "add_bos_token": tokenizer.add_bos_token,
        "add_eos_token": False,
        "model_max_length": loaded.context_length,
        "max_model_len": loaded.max_seq,
        "vocab_size": tokenizer.vocab_size,
    }
    special = loaded.jlm.meta.get("special_tokens") or {}
    for role in ("cls_token", "sep_token", "pad_token"):  # an encoder's
        if isinstance(special.get(role), str):
            info[role] = special[role]
    if chat.available:
        info["chat_template"] = chat.source
    return info


async def _answer(build: Callable[[], dict[str, Any]], num_tokens: int) -> Response:
    """The JSON that `build` makes; for many tokens, made and written on a prompt thread (262k ids with their pieces
    take ~0.2 s to write), so one large answer does not hold the event loop."""
    if num_tokens <= _ON_LOOP:
        return JSONResponse(build())
    body = await off_loop(lambda: json.dumps(build(), ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode(), size=num_tokens)
    return Response(body, media_type="application/json")


def _room_error(exc: RoomError, param: str) -> APIError:
    return APIError(str(exc), param=param, code="context_length_exceeded")


class Tokenizing:
    """The tokenizer routes over a Catalog. The two shapes are told apart by their fields: llama-server's sends
    `content`, vLLM's `prompt` or `messages`; both detokenize `tokens`, so /detokenize answers both shapes' field
    (`content`, `prompt`). `model` may be left out where the server holds one model."""

    def __init__(self, catalog: Catalog):
        self.catalog = catalog

    @dialect(error_response)
    async def tokenize(self, request: Request) -> Response:
        f = Fields(await read_json(request))
        served = find_model(self.catalog, f.string("model"))
        if f.has("content"):
            for key in ("prompt", "messages"):
                if f.has(key):
                    raise f.error(key, "content (llama-server's shape) and prompt or messages (vLLM's) are two ways to ask: send one")
            return await self._llama(f, served)
        if f.has("prompt") and f.has("messages"):
            raise f.error("messages", "send prompt or messages, not both")
        strs = f.boolean("return_token_strs")
        if f.has("messages"):
            ids = await self._chat(f, served)
        elif f.has("prompt"):
            text = f.string("prompt") or ""
            add = f.boolean("add_special_tokens", True)
            try:
                ids = await tokenize_text(served, text, add_special_tokens=add, param="prompt")
            except RoomError as exc:
                raise _room_error(exc, "prompt") from None
        else:
            raise f.error("prompt", "this field is required: send prompt or messages (vLLM's shape), or content (llama-server's)")
        loaded = served.engine.loaded
        return await _answer(lambda: {"count": len(ids), "max_model_len": loaded.max_seq, "tokens": ids,
                                      "token_strs": token_strs(loaded.tokenizer, ids) if strs else None}, len(ids))

    async def _llama(self, f: Fields, served: ServedModel) -> Response:
        """llama-server's: {"tokens": [ids]}, or with_pieces {"tokens": [{"id", "piece"}]}."""
        text = f.string("content") or ""
        add = f.boolean("add_special")
        if not f.boolean("parse_special", True):
            raise f.error("parse_special", "special-token strings in content always become their tokens here: leave it out or send true")
        with_pieces = f.boolean("with_pieces")
        try:
            ids = await tokenize_text(served, text, add_special_tokens=add, param="content")
        except RoomError as exc:
            raise _room_error(exc, "content") from None
        tokenizer = served.engine.loaded.tokenizer
        if not with_pieces:
            return await _answer(lambda: {"tokens": ids}, len(ids))
        return await _answer(lambda: {"tokens": [{"id": i, "piece": piece(tokenizer, i)} for i in ids]}, len(ids) * _PIECE_COST)

    async def _chat(self, f: Fields, served: ServedModel) -> list[int]:
        """vLLM's messages: through the model's template as /v1/chat/completions renders them (the same message and
        tool parsing, the same template call and encoding), with add_generation_prompt, continue_final_message (the
        last, assistant, message continued: rendered as Anthropic's prefill is) and chat_template_kwargs."""
        loaded = served.engine.loaded
        messages = chat_messages(f)
        tools = tools_of(f)
        if not loaded.chat.available:
            raise f.error("messages", f"model {served.id!r} has no chat template: send its text as prompt")
        cont = f.boolean("continue_final_message")
        if cont and f.boolean("add_generation_prompt"):
            raise f.error("add_generation_prompt", "cannot be true with continue_final_message, which continues the last message instead")
        generation = f.boolean("add_generation_prompt", not cont)
        if cont and messages[-1]["role"] != "assistant":
            raise f.error("continue_final_message", f"the last message is the {messages[-1]['role']}'s: only an assistant's message is continued")
        kwargs = f.object("chat_template_kwargs")
        extra = kwargs.obj if kwargs is not None else {}
        for key in _RESERVED:
            if key in extra:
                raise f.error("chat_template_kwargs", f"{key!r} comes from the request itself, not from chat_template_kwargs")
        add = f.boolean("add_special_tokens", True)  # as the chat route feeds it: a BOS only where the model wants one and the template did not write it

        def render() -> list[int]:
            if cont:  # the last message continued, as a prefill is
                text = render_chat(loaded, messages[:-1], tools=tools, prefill=messages[-1]["content"], extra=extra)
            else:
                text = render_chat(loaded, messages, tools=tools, add_generation_prompt=generation, extra=extra)
            return _encode(served, text, add, "messages")

        try:
            return await off_loop(render, size=chars([messages, tools, extra]))
        except RoomError as exc:
            raise _room_error(exc, "messages") from None

    @dialect(error_response)
    async def detokenize(self, request: Request) -> Response:
        f = Fields(await read_json(request))
        served = find_model(self.catalog, f.string("model"))
        ids = f.array("tokens", required=True) or []
        try:
            text = await detokenize_ids(served, ids, skip_special_tokens=False, param="tokens")
        except ValueError as exc:
            raise APIError(str(exc), param="tokens") from None
        return await _answer(lambda: {"content": text, "prompt": text}, len(ids))  # llama-server's field, vLLM's

    @dialect(error_response)
    async def tokenizer_info(self, request: Request) -> Response:
        served = find_model(self.catalog, request.query_params.get("model"))
        return JSONResponse(tokenizer_info(served.engine.loaded))
