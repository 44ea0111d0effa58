"""Placement work a running model takes between steps: moving blocks with every session's KV, re-placing them over
devices, re-budgeting the host pager and timing the seam. Each is a callable the engine thread runs."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ..tuning.seam import SeamCandidate, tune_seam
from .devices import spendable_bytes

if TYPE_CHECKING:
    from ..kv import SessionKV
    from ..loader import LoadedModel
    from .placement import Placement, Room

__all__ = ["PlacementJobs"]


class PlacementJobs:
    """The work of each placement change of one model. `kvs` lists every KV cache of the model now (they move with
    their blocks); `placed` runs after blocks moved (the engine re-reads what a step may hold and costs); `room`: what
    a device may take beyond its driver's figure (the server's, memory/placement.py; None: the driver's figure)."""

    def __init__(self, loaded: LoadedModel, kvs: Callable[[], list[SessionKV]], placed: Callable[[], None],
                 room: Room | None = None):
        self.loaded = loaded
        self._kvs = kvs
        self._placed = placed
        self._room = room

    def placement(self) -> Placement:
        if self.loaded.placement is None:
            raise ValueError(f"model {self.loaded.name} is an embedding model: it runs whole on its device, with no placement to change")
        return self.loaded.placement

    def relocate(self, first: int, last: int, to: str) -> Callable[[], None]:
        """Blocks first..last (0 is embed) to `to` (host or one of the model's devices), with every session's KV."""

        def work() -> None:
            self.placement().move(first, last, to, self._kvs())
            self._placed()

        return work

    def replace(self, devices: list[str], gpu_layers: int = -1) -> Callable[[], None]:
        """Every block re-placed over `devices` (none: all home to the host), at most `gpu_layers` on them (-1: all that fit)."""

        def work() -> None:
            placement = self.placement()
            places = placement.plan(devices, gpu_layers, self.spendable)
            placement.apply(places, self._kvs())
            placement.gpu_layers = gpu_layers
            self._placed()

        return work

    def set_page_budget(self, budget: int) -> Callable[[], None]:
        """The host page budget changed: blocks are read in or dropped to fit it."""
        return lambda: self.placement().pager.set_budget(budget)

    def tune_seam(self) -> Callable[[], list[SeamCandidate]]:
        """Decode timed for candidate device-block counts that fit; the fastest kept. -> what each count measured."""

        def work() -> list[SeamCandidate]:
            runner = self.loaded.runner
            assert runner is not None
            measured = tune_seam(runner, self._kvs(), self.spendable)
            self._placed()
            return measured

        return work

    def spendable(self, device: str) -> int:
        """What `device` can take: its free memory, within -device-mem beside every model's blocks."""
        driver = self.spendable_driver(device)
        return driver if self._room is None else self._room.spendable(self.placement(), device, driver)

    def spendable_driver(self, device: str) -> int:
        """The device's free memory (the CPU's less what the host page budget may still read in)."""
        cluster = self.loaded.cluster
        return spendable_bytes(device, self.placement().pager.unspent_bytes(), cluster.free_bytes if cluster is not None else None)
