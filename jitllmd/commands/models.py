"""`jitllmd models`: a running server's model directory; load and unload models while it runs."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Annotated

import typer

from ..client import DEFAULT_ADDR, to_dict
from ..console import ApiKey, connect, console, fail

if TYPE_CHECKING:
    from ..gen.jitllm.v1.model_pb2 import Model

__all__ = ["models"]


def models(
    load: Annotated[str | None, typer.Option("-load", "--load", help="Load this .jlm (or .gguf) of the server's model directory.", show_default=False)] = None,
    model_id: Annotated[str | None, typer.Option("-id", "--id", help="With -load: the id clients send, as in qwen3 or Qwen/Qwen2.5-0.5B-Instruct (see serve -id). Default: generated.", show_default=False)] = None,
    devices: Annotated[str | None, typer.Option("-devices", "--devices", help="With -load: devices to place it on (cpu, cuda:0, cuda:0,cuda:1; another rank's as 1:cpu). Default: the server's -devices.", show_default=False)] = None,
    gpu_layers: Annotated[int | None, typer.Option("-gpu-layers", "--gpu-layers", help="With -load: blocks to put on the devices. Default: the server's -gpu-layers.", show_default=False)] = None,
    max_seq: Annotated[int | None, typer.Option("-max-seq", "--max-seq", help="With -load: default KV capacity of its sessions. Default: the server's -max-seq.", show_default=False)] = None,
    draft: Annotated[str | None, typer.Option("-draft", "--draft", metavar="FILE", help="With -load: a draft model of the model directory (same tokenizer) for speculative decoding.", show_default=False)] = None,
    spec: Annotated[str | None, typer.Option("-spec", "--spec", metavar="auto|ngram|draft|off", help="With -load: its speculative decoding (see serve -spec). Default: the server's -spec.", show_default=False)] = None,
    draft_max: Annotated[int | None, typer.Option("-draft-max", "--draft-max", metavar="N", help="With -load: the most tokens a row guesses a step. Default: the server's -draft-max.", show_default=False)] = None,
    kv_dtype: Annotated[str | None, typer.Option("-kv-dtype", "--kv-dtype", metavar="auto|f32|f16|bf16|q8_0", help="With -load: its sessions' K/V (see serve -kv-dtype). Default: the server's -kv-dtype.", show_default=False)] = None,
    unload: Annotated[str | None, typer.Option("-unload", "--unload", help="Unload this model: its requests end as cancelled, its sessions close.", show_default=False)] = None,
    addr: Annotated[str, typer.Option("-addr", "--addr", help="The server, HOST:PORT.")] = DEFAULT_ADDR,
    api_key: ApiKey = None,
    as_json: Annotated[bool, typer.Option("-json", "--json", help="Print the answer as one JSON object.")] = False,
) -> None:
    """List a running server's models (loaded ones first, then the model directory's other .jlm files), or load or unload one."""
    if load is not None and unload is not None:
        raise fail("-load and -unload do not go together", 2)
    if load is None and any(v is not None for v in (model_id, devices, gpu_layers, max_seq, draft, spec, draft_max, kv_dtype)):
        raise fail("-id, -devices, -gpu-layers, -max-seq, -draft, -spec, -draft-max and -kv-dtype go with -load", 2)
    if max_seq is not None and max_seq <= 0:
        raise fail("-max-seq must be positive", 2)
    if draft_max is not None and draft_max < 0:
        raise fail("-draft-max must be >= 0", 2)
    client = connect(addr, api_key)

    from connectrpc.errors import ConnectError

    from ..gen.jitllm.v1 import model_pb2 as pb

    try:
        if load is not None:
            req = pb.LoadModelRequest(file=load, id=model_id or "", devices=devices or "")
            if gpu_layers is not None:
                req.gpu_layers = gpu_layers
            if max_seq is not None:
                req.max_seq = max_seq
            req.draft, req.spec, req.kv_dtype = draft or "", spec or "", kv_dtype or ""
            if draft_max is not None:
                req.draft_max = draft_max
            model = client.models.load_model(req).model
            if as_json:
                print(json.dumps(to_dict(model)))
                return
            console.print(f"loaded {model.id} from {model.file}: {model.arch}, {model.num_blocks} blocks, on {_places(model)}, max_seq {model.max_seq}", markup=False)
        elif unload is not None:
            gone = client.models.unload_model(pb.UnloadModelRequest(model=unload))
            if as_json:
                print(json.dumps(to_dict(gone)))
                return
            console.print(f"unloaded {unload}: {gone.cancelled_requests} requests cancelled, {gone.closed_sessions} sessions closed", markup=False)
        else:
            resp = client.models.list_models(pb.ListModelsRequest())
            if as_json:
                print(json.dumps(to_dict(resp)))
                return
            _print_table(resp.models)
            for m in resp.models:
                if m.error:
                    console.print(m.error if m.error.startswith(m.file) else f"{m.file}: {m.error}", soft_wrap=True, highlight=False, markup=False)
    except ConnectError as exc:
        raise fail(client.explain(exc)) from None


def _places(model: Model) -> str:
    return ",".join(model.device_ids) or "host"


def _weights(m: Model) -> str:
    """How its weights are stored: the quantized types (its norms' F32 left out), or the float dtype."""
    kinds = list(m.weight_types)
    return "+".join([k for k in kinds if k != "F32"] or kinds).lower()


def _print_table(models: Sequence[Model]) -> None:
    from rich.table import Table
    from rich.text import Text

    if not models:
        console.print("no models (the server's model directory has no .jlm files)")
        return
    table = Table(box=None, pad_edge=False)
    for name in ("id", "loaded", "arch", "weights", "blocks", "devices", "max_seq", "file"):
        table.add_column(name, justify="right" if name in ("blocks", "max_seq") else "left", no_wrap=name != "file")
    for m in models:
        table.add_row(*map(Text, (
            m.id, "yes" if m.loaded else "no", "unreadable" if m.error else m.arch, _weights(m), str(m.num_blocks),
            _places(m) if m.loaded else "", str(m.max_seq) if m.max_seq else "", m.file,
        )))
    console.print(table)
