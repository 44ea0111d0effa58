"""`jitllmd place`: where each block of a session's or model's weights is; moving blocks and the pager's budget."""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Annotated

import typer

from ..client import DEFAULT_ADDR, to_dict
from ..console import ApiKey, connect, console, fail

if TYPE_CHECKING:
    from ..gen.jitllm.v1.placement_pb2 import GetResidencyResponse, Placement

__all__ = ["parse_range", "place"]

_RANGE = re.compile(r"(\d+):(\d+)")


def parse_range(text: str) -> tuple[int, int]:
    """`A:B` -> (A, B), inclusive block indices with A <= B; ValueError otherwise."""
    m = _RANGE.fullmatch(text.strip())
    if not m or int(m.group(1)) > int(m.group(2)):
        raise ValueError(f"-move {text!r}: expected FIRST:LAST block indices, FIRST <= LAST (0 is embed)")
    return int(m.group(1)), int(m.group(2))


def place(
    session: Annotated[str | None, typer.Option("-session", "--session", help="A named session (what `sessions -new` printed).", show_default=False)] = None,
    model: Annotated[str | None, typer.Option("-model", "--model", help="A loaded model, for its own placement.", show_default=False)] = None,
    devices: Annotated[str | None, typer.Option("-devices", "--devices", help="Re-place every block over these devices (among the model's), from the head backwards; host (or \"\") brings them all home.", show_default=False)] = None,
    gpu_layers: Annotated[int | None, typer.Option("-gpu-layers", "--gpu-layers", help="With -devices: at most this many blocks on the devices (embed and head count); default as many as fit.", show_default=False)] = None,
    move: Annotated[str | None, typer.Option("-move", "--move", help="Move blocks FIRST:LAST (inclusive; 0 is embed) with their KV cache; needs -to.", show_default=False)] = None,
    to: Annotated[str | None, typer.Option("-to", "--to", help="With -move: host, or a device id; another rank's as 1:cpu (layers only: embed and head stay on rank 0).", show_default=False)] = None,
    maxmem: Annotated[str | None, typer.Option("-maxmem", "--maxmem", help="With -model: the host page budget, like 12G or 512M (binary units): resident host blocks, and the KV pages of idle sessions kept on the host (past it they go to a spill file).", show_default=False)] = None,
    tune: Annotated[bool, typer.Option("-tune", "--tune", help="Time decode for device-block counts that fit and move the seam to the fastest (TuneSeam).")] = False,
    relocate: Annotated[str | None, typer.Option("-relocate", "--relocate", metavar="on|off", help="With -model: automatic relocation (SetRelocation). On, the model's blocks leave its devices for the host while it is idle and another model needs the room, and come back while it is busy where that repays their copy.", show_default=False)] = None,
    addr: Annotated[str, typer.Option("-addr", "--addr", help="The server, HOST:PORT.")] = DEFAULT_ADDR,
    api_key: ApiKey = None,
    as_json: Annotated[bool, typer.Option("-json", "--json", help="Print the answer as one JSON object.")] = False,
) -> None:
    """Show where each block is (host or a device), or move blocks: -devices re-places them all, -move A:B -to moves a range.

    A move waits for the session's current generation to finish, then carries the blocks' weights and every session's
    KV for them, so the conversation goes on as if nothing happened. -devices must name devices the model was loaded
    with; -devices host brings every block home. -model M -maxmem SIZE re-budgets M's host pager live.

    Examples: place -session S;  place -session S -devices cpu -gpu-layers 22;  place -session S -move 20:29 -to host;
    place -model smol -maxmem 120M;  place -model smol -tune;  place -model smol -relocate on.
    """
    if (session is None) == (model is None):
        raise fail("name one of -session or -model", 2)
    actions = [flag for flag, v in (("-devices", devices), ("-move", move), ("-maxmem", maxmem), ("-tune", tune or None), ("-relocate", relocate)) if v is not None]
    if len(actions) > 1:
        raise fail(f"{' and '.join(actions)} do not go together", 2)
    if gpu_layers is not None and devices is None:
        raise fail("-gpu-layers goes with -devices", 2)
    if (move is None) != (to is None):
        raise fail("-move and -to go together", 2)
    if maxmem is not None and model is None:
        raise fail("-maxmem takes -model (the budget is the model's, not a session's)", 2)
    if relocate is not None and relocate not in ("on", "off"):
        raise fail(f"-relocate {relocate!r}: give on or off", 2)
    if relocate is not None and model is None:
        raise fail("-relocate takes -model (relocation is the model's, not a session's)", 2)
    from ..engine.config import parse_size  # no torch behind it

    try:
        span = parse_range(move) if move is not None else (0, 0)
        budget = parse_size(maxmem) if maxmem is not None else 0
    except ValueError as exc:
        raise fail(str(exc), 2) from None
    client = connect(addr, api_key)

    from connectrpc.errors import ConnectError

    from ..gen.jitllm.v1 import placement_pb2 as pb

    sid, mid = session or "", model or ""
    try:
        if maxmem is not None:
            residency = client.placement.set_page_budget(pb.SetPageBudgetRequest(model=mid, budget_bytes=budget)).residency
            if as_json:
                print(json.dumps(to_dict(residency)))
                return
            _print_residency(residency)
            return
        if devices is not None:
            req = pb.SetPlacementRequest(session_id=sid, model=mid, devices="" if devices == "host" else devices)
            if gpu_layers is not None:
                req.gpu_layers = gpu_layers
            placement = client.placement.set_placement(req).placement
        elif tune:
            tuned = client.placement.tune_seam(pb.TuneSeamRequest(session_id=sid, model=mid))
            if as_json:
                print(json.dumps(to_dict(tuned)))
                return
            for c in tuned.candidates:
                console.print(f"{c.device_blocks} blocks on devices: {c.decode_tokens_per_second:.1f} tokens/s", markup=False)
            placement = tuned.placement
        elif relocate is not None:
            placement = client.placement.set_relocation(pb.SetRelocationRequest(model=mid, enabled=relocate == "on")).placement
        elif move is not None:
            placement = client.placement.relocate_blocks(pb.RelocateBlocksRequest(session_id=sid, model=mid, first=span[0], last=span[1], to=to)).placement
        else:
            placement = client.placement.get_placement(pb.GetPlacementRequest(session_id=sid, model=mid)).placement
    except ConnectError as exc:
        raise fail(client.explain(exc)) from None
    if as_json:
        print(json.dumps(to_dict(placement)))
        return
    _print_placement(placement)


def _residency_name(value: int) -> str:
    from ..gen.jitllm.v1.placement_pb2 import Residency

    return Residency.Name(value).removeprefix("RESIDENCY_").lower()


def _print_placement(p: Placement) -> None:
    from rich.table import Table
    from rich.text import Text

    who = f"session {p.session_id} of {p.model}" if p.session_id else p.model
    console.print(f"{who}: {p.device_blocks} blocks on devices, {p.host_blocks} on the host, {p.num_seams} seams", markup=False)
    console.print(f"relocation: {'on' if p.relocation else 'off'}", markup=False)
    _print_moves(p.moves)
    table = Table(box=None, pad_edge=False)
    for name in ("block", "name", "place", "MB", "KV MB", "residency"):
        table.add_column(name, no_wrap=True, justify="right" if name in ("block", "MB", "KV MB") else "left")
    for b in p.blocks:
        table.add_row(*map(Text, (str(b.index), b.name, b.place, f"{b.bytes / 1e6:.1f}", f"{b.kv_bytes / 1e6:.1f}", _residency_name(b.residency))))
    console.print(table)


def _print_moves(moves) -> None:
    """Each automatic move: when, which blocks, from where to where, why."""
    import time

    for m in moves:
        when = time.strftime("%H:%M:%S", time.localtime(m.at_unix))
        console.print(f"  {when} {m.direction} blocks {m.first}:{m.last} {m.source} -> {m.to} ({m.bytes / 2**20:.1f} MiB): {m.reason}", markup=False)


def _print_residency(r: GetResidencyResponse) -> None:
    from rich.table import Table
    from rich.text import Text

    budget = f"{r.page_budget_bytes / 2**20:.0f} MiB" if r.HasField("page_budget_bytes") else "none"
    console.print(f"{r.model}: page budget {budget}, {r.resident_bytes / 2**20:.0f} MiB resident", markup=False)
    table = Table(box=None, pad_edge=False)
    for name in ("block", "name", "residency", "MB", "reads", "read ms"):
        table.add_column(name, no_wrap=True, justify="left" if name in ("name", "residency") else "right")
    for b in r.blocks:
        table.add_row(*map(Text, (str(b.index), b.name, _residency_name(b.residency), f"{b.bytes / 1e6:.1f}", str(b.reads), f"{b.read_ms:.1f}")))
    console.print(table)
