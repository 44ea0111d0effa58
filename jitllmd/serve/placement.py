"""PlacementService: where each block of a model is, read from the loaded model; moving blocks is not built yet."""

from __future__ import annotations

from typing import Any

from connectrpc.code import Code
from connectrpc.errors import ConnectError

from ..engine.catalog import Catalog, ServedModel
from ..engine.sessions import Session
from ..gen.jitllm.v1 import placement_pb2 as plc
from ..gen.jitllm.v1.placement_connect import PlacementService
from .control import PLACEMENT_LATER, model_of, session_of

__all__ = ["Placement"]


def _placement(served: ServedModel, session: Session | None) -> plc.Placement:
    loaded = served.engine.loaded
    place = loaded.device_ids[0] if loaded.device_ids else "host"
    residency = plc.RESIDENCY_DEVICE if loaded.device_ids else plc.RESIDENCY_RESIDENT
    names = loaded.jlm.block_names
    kv_per_layer = session.kv.nbytes() // max(1, int(loaded.model.cfg.num_layers)) if session is not None else 0
    blocks = [
        plc.BlockPlacement(
            index=i, name=name, place=place, bytes=loaded.jlm.block_nbytes(name),
            kv_bytes=kv_per_layer if name.startswith("blocks.") else 0, residency=residency,
        )
        for i, name in enumerate(names)
    ]
    on_device = len(blocks) if loaded.device_ids else 0
    return plc.Placement(
        model=served.id, session_id=session.id if session else "", blocks=blocks,
        device_blocks=on_device, host_blocks=len(blocks) - on_device, num_seams=0,
    )


class Placement(PlacementService):
    def __init__(self, catalog: Catalog):
        self.catalog = catalog

    def _target(self, session_id: str, model: str) -> tuple[ServedModel, Session | None]:
        if session_id:
            return session_of(self.catalog, session_id)
        if model:
            return model_of(self.catalog, model), None
        raise ConnectError(Code.INVALID_ARGUMENT, "give session_id or model")

    async def get_placement(self, request: plc.GetPlacementRequest, ctx: Any) -> plc.GetPlacementResponse:
        return plc.GetPlacementResponse(placement=_placement(*self._target(request.session_id, request.model)))

    async def get_residency(self, request: plc.GetResidencyRequest, ctx: Any) -> plc.GetResidencyResponse:
        served = model_of(self.catalog, request.model)
        placement = _placement(served, None)
        blocks = [plc.BlockResidency(index=b.index, name=b.name, residency=b.residency, bytes=b.bytes) for b in placement.blocks]
        out = plc.GetResidencyResponse(model=served.id, blocks=blocks, resident_bytes=sum(b.bytes for b in blocks))
        if self.catalog.config.maxmem is not None:
            out.page_budget_bytes = self.catalog.config.maxmem
        return out

    async def set_placement(self, request: plc.SetPlacementRequest, ctx: Any) -> plc.SetPlacementResponse:
        self._target(request.session_id, request.model)
        raise ConnectError(Code.UNIMPLEMENTED, f"SetPlacement: {PLACEMENT_LATER}")

    async def relocate_blocks(self, request: plc.RelocateBlocksRequest, ctx: Any) -> plc.RelocateBlocksResponse:
        served, _ = self._target(request.session_id, request.model)
        last = served.engine.loaded.num_blocks - 1
        if request.first > request.last or request.last > last:
            raise ConnectError(Code.INVALID_ARGUMENT, f"blocks {request.first}:{request.last}: give first <= last within 0:{last}")
        raise ConnectError(Code.UNIMPLEMENTED, f"RelocateBlocks: {PLACEMENT_LATER}")

    async def set_relocation(self, request: plc.SetRelocationRequest, ctx: Any) -> plc.SetRelocationResponse:
        model_of(self.catalog, request.model)
        raise ConnectError(Code.UNIMPLEMENTED, f"SetRelocation: {PLACEMENT_LATER}")

    async def tune_seam(self, request: plc.TuneSeamRequest, ctx: Any) -> plc.TuneSeamResponse:
        self._target(request.session_id, request.model)
        raise ConnectError(Code.UNIMPLEMENTED, f"TuneSeam: {PLACEMENT_LATER}")

    async def set_page_budget(self, request: plc.SetPageBudgetRequest, ctx: Any) -> plc.SetPageBudgetResponse:
        model_of(self.catalog, request.model)
        raise ConnectError(Code.UNIMPLEMENTED, f"SetPageBudget: {PLACEMENT_LATER}")
