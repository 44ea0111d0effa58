"""`jitllmd stats`: a running server's engine counters, once or streamed."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ..client import DEFAULT_ADDR, to_dict
from ..console import ApiKey, connect, console, fail

if TYPE_CHECKING:
    from rich.console import RenderableType

    from ..gen.jitllm.v1.telemetry_pb2 import GetStatsResponse

__all__ = ["stats"]


def stats(
    watch: Annotated[bool, typer.Option("-watch", "--watch", help="Stream the counters and redraw them in place until Ctrl-C.")] = False,
    interval: Annotated[int | None, typer.Option("-interval", "--interval", help="With -watch: milliseconds between updates, at least 100. Default: 1000.", show_default=False)] = None,
    addr: Annotated[str, typer.Option("-addr", "--addr", help="The server, HOST:PORT.")] = DEFAULT_ADDR,
    api_key: ApiKey = None,
    as_json: Annotated[bool, typer.Option("-json", "--json", help="Print the answer as one JSON object (with -watch, one per line).")] = False,
) -> None:
    """Show a running server's counters per model: requests, tokens, speed, rows per step, queue, sessions and memory."""
    if interval is not None and not watch:
        raise fail("-interval goes with -watch", 2)
    if interval is not None and interval < 100:
        raise fail("-interval must be at least 100 (milliseconds)", 2)
    client = connect(addr, api_key)

    from connectrpc.errors import ConnectError

    from ..gen.jitllm.v1 import telemetry_pb2 as pb

    try:
        if not watch:
            resp = client.telemetry.get_stats(pb.GetStatsRequest())
            if as_json:
                print(json.dumps(to_dict(resp)))
            else:
                console.print(_table(resp))
            return
        stream = client.telemetry.watch_stats(pb.WatchStatsRequest(interval_ms=interval or 1000))
        if as_json:
            for resp in stream:
                print(json.dumps(to_dict(resp)), flush=True)
            return
        from rich.live import Live

        with Live(console=console, auto_refresh=False, transient=False) as live:
            for resp in stream:
                live.update(_table(resp), refresh=True)
    except ConnectError as exc:
        raise fail(client.explain(exc)) from None
    except KeyboardInterrupt:  # the way out of -watch
        return


def _joint(m: Any) -> str:
    """The joint-step mode, and per row count what auto chose (j joint, s sequential, ? still measuring)."""
    picks = " ".join(f"{j.rows}:{j.choice[0] if j.choice != 'measuring' else '?'}" for j in m.joint)
    return f"{m.joint_steps} {picks}".strip()


def _table(resp: GetStatsResponse) -> RenderableType:
    """Two tables that fit 80 columns: traffic per model (with totals), then steps and memory per model."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    caption = f"up {resp.uptime_s:.0f} s, server RSS {resp.rss_bytes / 1e6:.0f} MB"
    if not resp.models:
        return Text(f"no models loaded; {caption}")
    traffic = Table(box=None, pad_edge=False, show_footer=True)
    traffic.add_column("model", no_wrap=True, footer="total")
    totals = (resp.requests, resp.generated_tokens, f"{resp.tokens_per_second:.1f}", resp.active_rows, resp.queue_depth, resp.sessions)
    for name, total in zip(("requests", "generated", "tok/s", "active", "queue", "sessions"), totals):
        traffic.add_column(name, justify="right", footer=str(total), no_wrap=True)
    steps = Table(box=None, pad_edge=False)
    steps.add_column("model", no_wrap=True)
    for name in ("rows/step", "prompt/step", "weight MB", "KV MB"):
        steps.add_column(name, justify="right", no_wrap=True)
    steps.add_column("joint steps", overflow="fold")
    for m in resp.models:
        traffic.add_row(
            Text(m.model), str(m.requests), str(m.generated_tokens), f"{m.tokens_per_second:.1f}", str(m.active_rows),
            str(m.queue_depth), str(m.sessions),
        )
        steps.add_row(
            Text(m.model), f"{m.rows_per_step:.2f}", f"{m.prompt_tokens_per_step:.1f}", f"{m.weight_bytes / 1e6:.1f}",
            f"{m.kv_bytes / 1e6:.1f}", _joint(m),
        )
    why = [f"{m.model}: at most {m.max_rows} rows a step ({m.rows_why}), prompt chunk {m.prompt_chunk} ({m.prompt_chunk_why})" for m in resp.models if m.rows_why]
    relocating = [f"{m.model} {m.demotions} moves to the host, {m.promotions} back" for m in resp.models if m.relocation or m.demotions or m.promotions]
    lines = [Text("relocation: " + ", ".join(relocating), overflow="fold")] if relocating else []
    lines += [Text(line, overflow="fold") for line in why]
    lines += [Text(f"{m.model}: speculative decoding {m.speculative}, {m.accepted_tokens} of {m.drafted_tokens} guesses taken"
                   + (f" ({m.accepted_tokens / m.drafted_tokens:.0%})" if m.drafted_tokens else ""), overflow="fold")
              for m in resp.models if m.speculative and m.speculative != "off"]
    lines += [Text(_pages(m), overflow="fold") for m in resp.models if m.kv_pages_held or m.kv_pages_cached or m.kv_pages_free or m.kv_pages_file]
    return Group(traffic, Text(""), steps, *lines, Text(caption))


def _pages(m: Any) -> str:
    """One model's KV pages and prefix cache, in a line."""
    line = f"{m.model}: KV pages {m.kv_pages_held} held ({m.kv_pages_shared} shared), {m.kv_pages_cached} cached, {m.kv_pages_free} free"
    if m.kv_pages_host or m.kv_pages_file:
        line += f", out of the pool {m.kv_pages_host} in host memory and {m.kv_pages_file} in the spill file"
    if not m.prefix_cache:
        return line + "; prefix cache off"
    share = f" ({m.prefix_hit_tokens / m.prefix_query_tokens:.0%})" if m.prefix_query_tokens else ""
    return line + f"; prefix cache: {m.prefix_hit_tokens} of {m.prefix_query_tokens} prompt tokens found{share}"
