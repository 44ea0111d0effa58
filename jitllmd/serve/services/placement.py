"""PlacementService: where each block of a model is, moving blocks with their KV, the seam, and the host pager's budget."""

from __future__ import annotations

import asyncio
from typing import Any

from connectrpc.code import Code
from connectrpc.errors import ConnectError

from ...engine.catalog import Catalog, ServedModel
from ...engine.memory.placement import HOST, layer_of
from ...engine.memory.relocation import Move, Relocation
from ...engine.sessions import Session
from ...gen.jitllm.v1 import placement_pb2 as plc
from ...gen.jitllm.v1.placement_connect import PlacementService
from .control import model_of, session_of

__all__ = ["Placement"]

_RESIDENCY = {"device": plc.RESIDENCY_DEVICE, "resident": plc.RESIDENCY_RESIDENT, "paged": plc.RESIDENCY_PAGED}


def _moves(relocation: Relocation, model: str) -> list[plc.RelocationMove]:
    return [_move(m) for m in relocation.moves(model)]


def _move(m: Move) -> plc.RelocationMove:
    return plc.RelocationMove(at_unix=m.at, direction=m.direction, first=m.first, last=m.last, source=m.source, to=m.to, bytes=m.bytes, reason=m.reason)


def _placement(served: ServedModel, session: Session | None, relocation: Relocation) -> plc.Placement:
    loaded = served.engine.loaded
    placement = loaded.placement
    names = loaded.jlm.block_names
    if placement is None:  # an encoder: whole on its device, or the host
        place = loaded.device_ids[0] if loaded.device_ids else HOST
        residency = plc.RESIDENCY_DEVICE if loaded.device_ids else plc.RESIDENCY_RESIDENT
        blocks = [plc.BlockPlacement(index=i, name=n, place=place, bytes=loaded.jlm.block_nbytes(n), residency=residency) for i, n in enumerate(names)]
        on_device = len(blocks) if loaded.device_ids else 0
        return plc.Placement(model=served.id, session_id=session.id if session else "", blocks=blocks, device_blocks=on_device, host_blocks=len(blocks) - on_device)
    places = list(placement.places)
    blocks = [
        plc.BlockPlacement(
            index=i, name=name, place=places[i], bytes=placement.block_bytes[i],
            kv_bytes=session.kv.layer_nbytes(layer) if session is not None and (layer := layer_of(name)) is not None else 0, residency=_RESIDENCY[placement.residency(i)],
        )
        for i, name in enumerate(placement.names)
    ]
    on_device = sum(p != HOST for p in places)
    return plc.Placement(
        model=served.id, session_id=session.id if session else "", blocks=blocks,
        device_blocks=on_device, host_blocks=len(blocks) - on_device, num_seams=sum(a != b for a, b in zip(places, places[1:])),
        relocation=relocation.enabled(served.id), moves=_moves(relocation, served.id),
    )


def _residency(served: ServedModel, relocation: Relocation) -> plc.GetResidencyResponse:
    loaded = served.engine.loaded
    placement = loaded.placement
    if placement is None:
        raise ConnectError(Code.FAILED_PRECONDITION, f"model {served.id} is an embedding model: it runs whole on its device, with no pager")
    pager = placement.pager
    stats = dict(pager.reader.stats)
    blocks = []
    for i, name in enumerate(placement.names):
        s = stats.get(name)
        blocks.append(plc.BlockResidency(
            index=i, name=name, residency=_RESIDENCY[placement.residency(i)], bytes=placement.block_bytes[i],
            reads=s.reads if s else 0, read_ms=round(s.seconds * 1000, 3) if s else 0.0,
        ))
    out = plc.GetResidencyResponse(model=served.id, blocks=blocks, resident_bytes=pager.resident_bytes(),
                                   relocation=relocation.enabled(served.id), moves=_moves(relocation, served.id))
    if pager.budget is not None:
        out.page_budget_bytes = pager.budget
    return out


class Placement(PlacementService):
    def __init__(self, catalog: Catalog):
        self.catalog = catalog
        self.relocation = catalog.relocation

    def _target(self, session_id: str, model: str) -> tuple[ServedModel, Session | None]:
        if session_id:
            return session_of(self.catalog, session_id)
        if model:
            return model_of(self.catalog, model), None
        raise ConnectError(Code.INVALID_ARGUMENT, "give session_id or model")

    async def get_placement(self, request: plc.GetPlacementRequest, ctx: Any) -> plc.GetPlacementResponse:
        return plc.GetPlacementResponse(placement=_placement(*self._target(request.session_id, request.model), self.relocation))

    async def get_residency(self, request: plc.GetResidencyRequest, ctx: Any) -> plc.GetResidencyResponse:
        return _residency(model_of(self.catalog, request.model), self.relocation)

    async def set_placement(self, request: plc.SetPlacementRequest, ctx: Any) -> plc.SetPlacementResponse:
        served, session = self._target(request.session_id, request.model)
        devices = self.catalog.parse_devices(request.devices)  # the grammar; an unknown device is a ValueError naming what exists
        gpu_layers = request.gpu_layers if request.HasField("gpu_layers") else -1
        if gpu_layers < -1:
            raise ValueError(f"gpu_layers must be -1 (as many as fit) or >= 0, got {gpu_layers}")
        await asyncio.to_thread(self.catalog.replace, served, devices, gpu_layers, session)  # idle models may give up room first
        return plc.SetPlacementResponse(placement=_placement(served, session, self.relocation))

    async def relocate_blocks(self, request: plc.RelocateBlocksRequest, ctx: Any) -> plc.RelocateBlocksResponse:
        served, session = self._target(request.session_id, request.model)
        if not request.to:
            raise ConnectError(Code.INVALID_ARGUMENT, "to: give host or a device id")
        await asyncio.to_thread(self.catalog.relocate, served, request.first, request.last, request.to, session)  # RoomError: resource_exhausted
        return plc.RelocateBlocksResponse(placement=_placement(served, session, self.relocation))

    async def set_relocation(self, request: plc.SetRelocationRequest, ctx: Any) -> plc.SetRelocationResponse:
        served = model_of(self.catalog, request.model)
        if served.engine.loaded.placement is None:
            raise ConnectError(Code.FAILED_PRECONDITION, f"model {served.id} is an embedding model: it runs whole on its device, with no blocks to move")
        if request.enabled and not served.engine.loaded.placement.devices:
            raise ConnectError(Code.FAILED_PRECONDITION, f"model {served.id} was loaded with no devices: relocation moves blocks between the host and "
                                                         "the model's devices (load it with -devices)")
        self.relocation.set_enabled(served.id, request.enabled)
        return plc.SetRelocationResponse(enabled=request.enabled, placement=_placement(served, None, self.relocation))

    async def tune_seam(self, request: plc.TuneSeamRequest, ctx: Any) -> plc.TuneSeamResponse:
        served, session = self._target(request.session_id, request.model)
        measured = await asyncio.wrap_future(served.engine.tune_seam(session))
        candidates = [plc.SeamCandidate(device_blocks=c.device_blocks, decode_tokens_per_second=c.decode_tokens_per_second) for c in measured]
        return plc.TuneSeamResponse(candidates=candidates, placement=_placement(served, session, self.relocation))

    async def set_page_budget(self, request: plc.SetPageBudgetRequest, ctx: Any) -> plc.SetPageBudgetResponse:
        served = model_of(self.catalog, request.model)
        if request.budget_bytes == 0:
            raise ConnectError(Code.INVALID_ARGUMENT, "budget_bytes: give the host page budget in bytes (more than 0)")
        await asyncio.wrap_future(served.engine.set_page_budget(request.budget_bytes))
        return plc.SetPageBudgetResponse(residency=_residency(served, self.relocation))
