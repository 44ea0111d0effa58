"""`jitllmd sessions`: a running server's named sessions: create, list, reset, close, save to a file and restore;
and its request queues."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ..client import DEFAULT_ADDR, to_dict
from ..console import ApiKey, connect, console, err_console, fail

if TYPE_CHECKING:
    from collections.abc import Iterator

    from ..gen.jitllm.v1.session_pb2 import GetDeviceQueueResponse, ListSessionsResponse

__all__ = ["sessions"]


def sessions(
    new: Annotated[bool, typer.Option("-new", "--new", help="Create a session on -model; prints its id.")] = False,
    model: Annotated[str | None, typer.Option("-model", "--model", help="With -new: the model. With -restore: the model to restore into (default: the one the file was saved from). Otherwise: only this model's sessions or queue.", show_default=False)] = None,
    devices: Annotated[str | None, typer.Option("-devices", "--devices", help="With -new: devices among the model's. Default: the model's own.", show_default=False)] = None,
    max_seq: Annotated[int | None, typer.Option("-max-seq", "--max-seq", help="With -new: KV capacity in positions. Default: the model's -max-seq.", show_default=False)] = None,
    reset: Annotated[str | None, typer.Option("-reset", "--reset", help="Empty this session's cache and conversation (back to position 0).", show_default=False)] = None,
    close: Annotated[str | None, typer.Option("-close", "--close", help="Close this session and free its KV cache.", show_default=False)] = None,
    queue: Annotated[bool, typer.Option("-queue", "--queue", help="Show what runs and what waits on each model's engine.")] = False,
    save: Annotated[str | None, typer.Option("-save", "--save", metavar="SESSION", help="Save this session to FILE (the argument): its KV cache, tokens and conversation, after its current generation.", show_default=False)] = None,
    restore: Annotated[bool, typer.Option("-restore", "--restore", help="Restore the session saved in FILE (the argument) as a named session of the model it was saved from (or -model's: the same weights); prints its id, the saved one where it is free.")] = False,
    file: Annotated[Path | None, typer.Argument(metavar="FILE", help="With -save or -restore: the session file, on this machine.", show_default=False)] = None,
    addr: Annotated[str, typer.Option("-addr", "--addr", help="The server, HOST:PORT.")] = DEFAULT_ADDR,
    api_key: ApiKey = None,
    as_json: Annotated[bool, typer.Option("-json", "--json", help="Print the answer as one JSON object.")] = False,
) -> None:
    """List a running server's sessions, or create, reset, close, save or restore one, or show the request queues (-queue).

    A session keeps a conversation's KV cache between requests; send its id as "jitllm_session" or to `jitllmd run -session`.
    `-save S FILE` writes it to a file here and `-restore FILE` brings it back, after a restart or on another server of
    the same model, and the conversation goes on with the same tokens.
    """
    actions = [flag for flag, on in (("-new", new), ("-reset", reset is not None), ("-close", close is not None), ("-queue", queue),
                                     ("-save", save is not None), ("-restore", restore)) if on]
    if len(actions) > 1:
        raise fail(f"{' and '.join(actions)} do not go together", 2)
    if (save is not None or restore) != (file is not None):
        raise fail("-save SESSION FILE and -restore FILE take a FILE; nothing else does" if file is None else f"{file}: a FILE goes with -save or -restore", 2)
    if new and not model:
        raise fail("-new needs -model", 2)
    if not new and (devices is not None or max_seq is not None):
        raise fail("-devices and -max-seq go with -new", 2)
    if model is not None and (reset is not None or close is not None or save is not None):
        raise fail("-model does not go with -reset, -close or -save", 2)
    if restore and file is not None and not file.is_file():
        raise fail(f"{file}: no such file", 2)
    if max_seq is not None and max_seq <= 0:
        raise fail("-max-seq must be positive", 2)
    client = connect(addr, api_key)

    from connectrpc.errors import ConnectError

    from ..gen.jitllm.v1 import session_pb2 as pb

    try:
        if new:
            req = pb.CreateSessionRequest(model=model, devices=devices or "")
            if max_seq is not None:
                req.max_seq = max_seq
            s = client.sessions.create_session(req).session
            if as_json:
                print(json.dumps(to_dict(s)))
                return
            err_console.print(f"session on {s.model}: max_seq {s.max_seq}, on {','.join(s.device_ids) or 'host'}", markup=False)
            print(s.id)  # alone on stdout, so S=$(jitllmd sessions -new ...) captures it
        elif reset is not None:
            s = client.sessions.reset_session(pb.ResetSessionRequest(session_id=reset)).session
            if as_json:
                print(json.dumps(to_dict(s)))
                return
            console.print(f"reset {s.id}: position {s.position}/{s.max_seq}", markup=False)
        elif close is not None:
            resp = client.sessions.close_session(pb.CloseSessionRequest(session_id=close))
            if as_json:
                print(json.dumps(to_dict(resp)))
                return
            console.print(f"closed {close}", markup=False)
        elif save is not None:
            assert file is not None
            _save(client, save, file, as_json)
        elif restore:
            assert file is not None
            _restore(client, file, model or "", as_json)
        elif queue:
            qresp = client.sessions.get_device_queue(pb.GetDeviceQueueRequest(model=model or ""))
            if as_json:
                print(json.dumps(to_dict(qresp)))
                return
            _print_queues(qresp)
        else:
            lresp = client.sessions.list_sessions(pb.ListSessionsRequest(model=model or ""))
            if as_json:
                print(json.dumps(to_dict(lresp)))
                return
            _print_sessions(lresp)
    except ConnectError as exc:
        raise fail(client.explain(exc)) from None


def _save(client: Any, sid: str, file: Path, as_json: bool) -> None:
    """The session's file, written beside FILE and moved over it once whole (a failed save leaves FILE as it was)."""
    from ..gen.jitllm.v1 import session_pb2 as pb

    part = file.with_name(file.name + ".part")
    size = 0
    try:
        with open(part, "wb") as out:
            for chunk in client.sessions.save_session(pb.SaveSessionRequest(session_id=sid)):
                out.write(chunk.data)
                size += len(chunk.data)
        part.replace(file)
    except OSError as exc:
        part.unlink(missing_ok=True)
        raise fail(f"{file}: {exc.strerror or exc}") from None
    except BaseException:
        part.unlink(missing_ok=True)
        raise
    if as_json:
        print(json.dumps({"session_id": sid, "file": str(file), "bytes": size}))
    else:
        console.print(f"saved {sid} to {file} ({size / 1e6:.1f} MB)", markup=False)


def _restore(client: Any, file: Path, model: str, as_json: bool) -> None:
    from ..gen.jitllm.v1 import session_pb2 as pb

    def chunks() -> Iterator[pb.SessionChunk]:
        with open(file, "rb") as f:
            first = True
            while data := f.read(1 << 20):
                yield pb.SessionChunk(data=data, model=model if first else "")
                first = False

    try:
        resp = client.sessions.restore_session(chunks())
    except OSError as exc:
        raise fail(f"{file}: {exc.strerror or exc}") from None
    if as_json:
        print(json.dumps(to_dict(resp)))
        return
    s = resp.session
    err_console.print(f"restored {resp.positions} positions on {s.model}: position {s.position}/{s.max_seq}", markup=False)
    print(s.id)  # alone on stdout, as -new prints it


def _print_sessions(resp: ListSessionsResponse) -> None:
    from rich.table import Table
    from rich.text import Text

    if not resp.sessions:
        console.print("no sessions (jitllmd sessions -new -model MODEL creates one)")
        return
    table = Table(box=None, pad_edge=False)
    for name in ("id", "model", "position", "busy", "devices", "KV MB", "messages"):
        table.add_column(name, no_wrap=name in ("id", "model"), justify="right" if name in ("position", "KV MB", "messages") else "left")
    for s in resp.sessions:
        table.add_row(*map(Text, (
            s.id, s.model, f"{s.position}/{s.max_seq}", "yes" if s.busy else "no",
            ",".join(s.device_ids) or "host", f"{s.kv_bytes / 1e6:.1f}", str(s.num_messages),
        )))
    console.print(table)


def _print_queues(resp: GetDeviceQueueResponse) -> None:
    from rich.table import Table
    from rich.text import Text

    from ..gen.jitllm.v1.session_pb2 import RequestState

    if not resp.queues:
        console.print("no models loaded")
        return
    table = Table(box=None, pad_edge=False)
    for name in ("model", "devices", "max rows", "running", "waiting"):
        table.add_column(name, no_wrap=name == "model", justify="right" if name in ("max rows", "running", "waiting") else "left")
    for q in resp.queues:
        table.add_row(*map(Text, (q.model, ",".join(q.device_ids) or "host", str(q.max_rows), str(len(q.running)), str(len(q.waiting)))))
    console.print(table)
    entries = [(q.model, e) for q in resp.queues for e in (*q.running, *q.waiting)]
    if not entries:
        return
    table = Table(box=None, pad_edge=False)
    for name in ("model", "request", "session", "state", "prompt", "generated", "age ms"):
        table.add_column(name, no_wrap=True, justify="right" if name in ("prompt", "generated", "age ms") else "left")
    for model, e in entries:
        state = RequestState.Name(e.state).removeprefix("REQUEST_STATE_").lower()
        table.add_row(*map(Text, (model, e.request_id, e.session_id, state, str(e.prompt_tokens), str(e.generated_tokens), f"{e.age_ms:.0f}")))
    console.print()
    console.print(table)
