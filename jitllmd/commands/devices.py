"""`jitllmd devices`: a running server's hardware and the memory it can still spend."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from ..client import DEFAULT_ADDR, to_dict
from ..console import ApiKey, connect, console, fail

__all__ = ["devices"]


def devices(
    addr: Annotated[str, typer.Option("-addr", "--addr", help="The server, HOST:PORT.")] = DEFAULT_ADDR,
    api_key: ApiKey = None,
    as_json: Annotated[bool, typer.Option("-json", "--json", help="Print the answer as one JSON object.")] = False,
) -> None:
    """List the devices a running server can place blocks on, with total, free and spendable memory, and the host's memory.

    In a cluster (serve -cluster), other ranks' devices come with their rank first (1:cpu) and their host.
    """
    client = connect(addr, api_key)

    from connectrpc.errors import ConnectError
    from rich.table import Table
    from rich.text import Text

    from ..gen.jitllm.v1 import device_pb2 as pb

    try:
        resp = client.devices.list_devices(pb.ListDevicesRequest())
    except ConnectError as exc:
        raise fail(client.explain(exc)) from None
    if as_json:
        print(json.dumps(to_dict(resp)))
        return
    cluster = any(d.rank for d in resp.devices)  # other ranks' devices: which host each is on, and whether it answers
    table = Table(box=None, pad_edge=False)
    table.add_column("id", no_wrap=True)
    if cluster:
        table.add_column("host")
    table.add_column("kind")
    table.add_column("name")
    for name in ("total GB", "free GB", "spendable GB"):
        table.add_column(name, justify="right")
    table.add_column("opened")
    for d in resp.devices:
        where = (d.host or "this host") + ("" if d.reachable or not d.rank else " (unreachable)")
        cells = (d.id, *([where] if cluster else []), d.kind, d.name, _gb(d.total_bytes), _gb(d.free_bytes), _gb(d.spendable_bytes), "yes" if d.opened else "no")
        table.add_row(*map(Text, cells))
    console.print(table)
    for d in resp.devices:
        if d.quantized and d.kind != "cpu":  # the CPU's: the kernels line below
            console.print(f"{d.id}: quantized blocks {d.quantized}", markup=False)
        if d.HasField("budget_bytes"):  # -device-mem: what the server's blocks may take, and what they take
            console.print(f"{d.id}: -device-mem {d.budget_bytes / 2**20:.0f} MiB, {d.held_bytes / 2**20:.1f} MiB held by device blocks and their KV", markup=False)
    host = resp.host
    budget = f", page budget {_gb(host.page_budget_bytes)} GB" if host.HasField("page_budget_bytes") else ""
    cpu = f" ({host.cpu_name})" if host.cpu_name else ""
    console.print(f"host: {_gb(host.total_bytes)} GB total, {_gb(host.available_bytes)} GB available{budget}; {host.num_cpus} CPUs{cpu}", markup=False)
    if host.kernels:  # empty from a server older than the field
        console.print(f"kernels: {host.kernels}", markup=False)


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f}"
