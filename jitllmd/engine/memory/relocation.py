"""Blocks that follow demand across a server's models: what each device holds for them (against `-device-mem`), idle
models' blocks sent to the host when another model needs the room, and a busy model's host blocks brought back when
they repay their copy (SetRelocation, `place -relocate on`)."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol, TypeVar

from .placement import HOST, Placement, layer_of

__all__ = ["Move", "Relocation", "Tenant", "block_held", "held_on", "repays"]

T = TypeVar("T")

log = logging.getLogger("jitllmd.relocation")
_MOVES_KEPT = 256  # the newest automatic moves each model keeps for GetPlacement / GetResidency
_COPY_S = 0.05  # seconds of block copies a promotion may run at one step boundary (one block at least)


@dataclass(frozen=True)
class Move:
    """One automatic move: blocks first..last of `model` from `source` to `to`, and why."""

    at: float  # unix seconds
    model: str
    first: int
    last: int
    source: str
    to: str
    bytes: int  # weights and the KV reserved for them
    reason: str

    @property
    def direction(self) -> str:
        return "demote" if self.to == HOST else "promote"


class Tenant(Protocol):
    """What relocation sees of one model on the devices (an Engine is one): Catalog registers it, and relocation never
    reaches further into it."""

    @property
    def name(self) -> str: ...

    @property
    def placement(self) -> Placement | None:
        """Which block is where; None for a model with nothing to place (an encoder)."""

    @property
    def draft_placement(self) -> Placement | None:
        """A draft model's blocks it holds beside its own (counted as its own, never moved by relocation); None if none."""

    @property
    def rows_per_step(self) -> float:
        """The rows its recent steps ran (a step makes this many tokens)."""

    @property
    def last_active(self) -> float:
        """time.monotonic() of its last step with rows."""

    def idle_for(self, now: float) -> float | None:
        """Seconds since its last row; None while it has rows (read from any thread)."""

    def spendable_driver(self, device: str) -> int:
        """The device's free memory as its driver says (the CPU's less what its host pager may still read in)."""

    def move_blocks(self, first: int, last: int, to: str) -> None:
        """On its own thread, between steps: blocks first..last to `to`, with every session's KV."""

    def run_job(self, work: Callable[[], T]) -> Future[T]:
        """`work` on its own thread between steps; the future holds the result."""


def repays(saving_s: float, copy_s: float, horizon: int, rows: float) -> bool:
    """Whether a block's copy pays for itself within `horizon` tokens: it saves `saving_s` in every step it runs, and a
    step makes `rows` tokens."""
    return saving_s > 0 and saving_s * horizon / max(1.0, rows) >= copy_s


class Relocation:
    """The server's devices and the models on them. Demotions run as jobs on the idle model's own engine thread
    (between its steps, never under a generation); a busy model promotes on its own thread and never waits for another
    engine, so no two engine threads wait on each other."""

    def __init__(self, device_mem: int | None = None, idle_s: float = 10.0, horizon: int = 256, default: bool = False):
        """The serve flags -device-mem, -relocate-idle, -relocate-horizon and -relocate (EngineConfig validates them)."""
        self.device_mem = device_mem  # bytes each device may hold for this server's blocks and their KV; None: its free memory
        self.idle_s = idle_s
        self.horizon = horizon
        self.default = default
        self._tenants: dict[str, Tenant] = {}
        self._enabled: dict[str, bool] = {}
        self._moves: dict[str, deque[Move]] = {}
        self._counts: dict[str, dict[str, int]] = {}  # model -> direction -> moves (all of them, not only those kept)
        self._asked: dict[str, list[Future[int]]] = {}  # model -> the demotions its promotion asked for (its thread's)
        self._lock = threading.Lock()

    # -- the models -----------------------------------------------------------------------------

    def register(self, name: str, engine: Tenant, enabled: bool | None = None) -> None:
        with self._lock:
            self._tenants[name] = engine
            self._enabled[name] = self.default if enabled is None else enabled
            self._moves[name] = deque(maxlen=_MOVES_KEPT)
            self._counts[name] = {"demote": 0, "promote": 0}

    def unregister(self, name: str) -> None:
        with self._lock:
            self._tenants.pop(name, None)
            for table in (self._enabled, self._moves, self._counts, self._asked):
                table.pop(name, None)  # type: ignore[attr-defined]

    def set_enabled(self, name: str, on: bool) -> None:
        with self._lock:
            if name not in self._tenants:
                raise KeyError(f"model {name!r} is not loaded")
            self._enabled[name] = on
        log.info("%s: relocation %s", name, "on" if on else "off")

    def enabled(self, name: str) -> bool:
        return self._enabled.get(name, False)

    def moves(self, name: str) -> list[Move]:
        """The newest automatic moves of a model, oldest first."""
        with self._lock:
            return list(self._moves.get(name, ()))

    def counts(self, name: str) -> dict[str, int]:
        with self._lock:
            return dict(self._counts.get(name, {"demote": 0, "promote": 0}))

    def record(self, move: Move) -> None:
        with self._lock:
            if move.model in self._moves:
                self._moves[move.model].append(move)
                self._counts[move.model][move.direction] += 1
        log.info("%s: blocks %d:%d %s -> %s (%.1f MiB): %s", move.model, move.first, move.last, move.source, move.to, move.bytes / 2**20, move.reason)

    # -- memory ---------------------------------------------------------------------------------

    def used(self, device: str) -> int:
        """Bytes the loaded models hold on `device`: device blocks and the KV reserved for them, their draft models' too."""
        with self._lock:
            engines = list(self._tenants.values())
        return sum(held_on(p, device) for e in engines for p in (e.placement, e.draft_placement) if p is not None)

    def room(self, device: str, spendable: int) -> int:
        """What `device` can still take: its spendable memory (`spendable`, the driver's figure), and no more than
        what -device-mem leaves beside every model's blocks there."""
        if self.device_mem is None:
            return spendable
        return max(0, min(spendable, self.device_mem - self.used(device)))

    def spendable(self, placement: Placement, device: str, driver: int) -> int:
        """What `device` can take for `placement`'s blocks (memory/placement.py's Room): its room, and the KV the
        model already reserves there."""
        return self.room(device, driver) + self.own_kv(placement, device)

    def own_kv(self, placement: Placement, device: str) -> int:
        """Under -device-mem, the KV a model reserves on `device` counts as room when that model is re-placed (its
        blocks' weights are counted by Placement.plan); without it, the driver's figure already holds what KV took."""
        if self.device_mem is None:
            return 0
        return sum(placement.kv_layer_bytes for n, p in zip(placement.names, placement.places) if p == device and layer_of(n) is not None)

    def reclaimable(self, device: str, asking: str | None) -> int:
        """Bytes the idle relocation-enabled models other than `asking` hold on `device`: what demoting could free."""
        return sum(held_on(e.placement, device) for e in self._idle(device, asking) if e.placement is not None)

    def reclaim(self, device: str, need: int, asking: str | None, reason: str) -> list[Future[int]]:
        """Demote blocks of idle relocation-enabled models (not `asking`), the coldest model first and each from its
        front (its host part stays a prefix), until `need` bytes of `device` are freed or none is left to demote. Each
        demotion runs on its model's engine thread, which looks again that the model is idle. -> a future per model
        asked, each the bytes it freed. An engine thread never waits on these (see the class)."""
        futures = []
        for engine in self._idle(device, asking):
            if need <= 0:
                break
            placement = engine.placement
            assert placement is not None
            blocks = _front_blocks(placement, device, need)
            if blocks is None:
                continue
            first, last, freed = blocks
            futures.append(engine.run_job(self._demote_work(engine, first, last, device, reason)))
            need -= freed
        return futures

    def make_room(self, device: str, need: int, asking: str | None, reason: str) -> int:
        """reclaim, waiting for the demotions (never from an engine thread). -> bytes freed (0 by a model that was
        unloaded meanwhile, or whose move failed: the log says why)."""
        freed = 0
        for f in self.reclaim(device, need, asking, reason):
            try:
                freed += f.result()
            except Exception:  # cancelled by an unload, or out of memory on the host: that room is not made
                log.exception("a demotion for %s did not run", asking)
        return freed

    def prepare(self, placement: Placement, asking: str | None, devices: list[str], gpu_layers: int, driver: Callable[[str], int], reason: str) -> None:
        """Before `placement` is made over `devices` (never on an engine thread): demote what idle models must give
        up for it to be the placement it would be with their blocks gone."""
        spend = lambda d: self.room(d, driver(d)) + self.own_kv(placement, d)  # noqa: E731
        if not any(self.reclaimable(d, asking) for d in devices):
            return
        wants = placement.wants(devices, gpu_layers, lambda d: spend(d) + self.reclaimable(d, asking))
        for d in devices:
            mine = sum(b for b, p in zip(placement.block_bytes, placement.places) if p == d)
            need = wants[d] - mine - spend(d)
            if need > 0:
                self.make_room(d, need, asking, reason)

    def promote(self, engine: Tenant) -> None:
        """Between steps of a busy model, on its engine thread: its host blocks nearest the seam go to the device
        after them while the saving measured repays each one's copy within `horizon` tokens (its last host block
        whenever there is room: whole on the device, it batches). Where the device has no room for them, idle models
        are asked to demote (this thread never waits for them: the next step looks again). At most _COPY_S of copies
        run at one step boundary, so the model's own rows are not held up long."""
        name = engine.name
        placement = engine.placement
        if not self.enabled(name) or placement is None or not placement.devices or HOST not in placement.places:
            return
        places = placement.places
        seam = places.count(HOST)  # the host part is a prefix: its last block is next to the seam
        to = places[seam] if seam < len(places) else placement.devices[0]
        cap = len(places) if placement.gpu_layers < 0 else placement.gpu_layers - placement.num_device_blocks
        room = self.room(to, engine.spendable_driver(to))
        asked = self._asked.get(name, ())
        if cap <= 0 or (room < block_held(placement, seam - 1) and all(f.done() for f in asked) and not self.reclaimable(to, name)):
            return  # nothing can come back now: no room, and none to be made
        wanted: list[tuple[int, float, float]] = []  # (block, saving a step, copy), nearest the seam first
        for i in range(seam - 1, max(-1, seam - 1 - cap), -1):
            whole = i == 0 and len(set(places[seam:])) <= 1
            saving, copy = placement.saving_s(i), placement.copy_s(i)
            if not whole and not repays(saving, copy, self.horizon, engine.rows_per_step):
                break
            wanted.append((i, saving, copy))
        if not wanted:
            return
        need = sum(block_held(placement, i) for i, _, _ in wanted)
        if need > room and all(f.done() for f in asked):
            self._asked[name] = self.reclaim(to, need - room, name, f"room for {name}'s blocks {wanted[-1][0]}:{wanted[0][0]}")
        moving: list[int] = []
        saving = spent = 0.0
        for i, saves, copy in wanted:
            held = block_held(placement, i)
            if held > room or (moving and spent + copy > _COPY_S):
                break
            moving.append(i)
            room -= held
            saving += saves
            spent += copy
        if not moving:
            return
        first, last = moving[-1], moving[0]
        engine.move_blocks(first, last, to)
        why = f"{name} is busy: saves {saving * 1e3:.2f} ms a step, the copy {spent * 1e3:.1f} ms"
        if first == 0 and placement.one_device:
            why += f"; whole on {to}, it batches its requests"
        self.record(Move(time.time(), name, first, last, HOST, to, sum(block_held(placement, i) for i in moving), why))

    def _idle(self, device: str, asking: str | None) -> list[Tenant]:
        """Relocation-enabled models other than `asking` with blocks on `device` and no row for idle_s, coldest first."""
        now = time.monotonic()
        with self._lock:
            found = [e for n, e in self._tenants.items() if n != asking and self._enabled[n]]
        found = [e for e in found if e.placement is not None and held_on(e.placement, device) > 0 and self._is_idle(e, now)]
        return sorted(found, key=lambda e: e.last_active)

    def _is_idle(self, engine: Tenant, now: float) -> bool:
        idle = engine.idle_for(now)
        return idle is not None and idle >= self.idle_s

    def _demote_work(self, engine: Tenant, first: int, last: int, device: str, reason: str) -> Callable[[], int]:
        def work() -> int:
            if not self._is_idle(engine, time.monotonic()):
                return 0  # traffic came meanwhile: it keeps its blocks
            placement = engine.placement
            assert placement is not None
            freed = sum(block_held(placement, i) for i in range(first, last + 1) if placement.places[i] != HOST)
            source = placement.places[last]
            engine.move_blocks(first, last, HOST)
            self.record(Move(time.time(), engine.name, first, last, source, HOST, freed, reason))
            return freed

        return work


def block_held(placement: Placement, index: int) -> int:
    """What block `index` holds on its place: its weights and, for a layer, the KV reserved for it."""
    return placement.block_bytes[index] + (placement.kv_layer_bytes if layer_of(placement.names[index]) is not None else 0)


def held_on(placement: Placement, device: str) -> int:
    return sum(block_held(placement, i) for i, p in enumerate(placement.places) if p == device)


def _front_blocks(placement: Placement, device: str, need: int) -> tuple[int, int, int] | None:
    """The device blocks from the model's first one on, as few as free `need` bytes of `device` (all of them if they
    cannot): (first, last, bytes of `device` freed); None when the model holds nothing there."""
    places = placement.places
    on = [i for i, p in enumerate(places) if p != HOST]
    if not on or all(places[i] != device for i in on):
        return None
    freed = 0
    for i in range(on[0], len(places)):
        if places[i] == device:
            freed += block_held(placement, i)
        if freed >= need:
            return on[0], i, freed
    return on[0], len(places) - 1, freed
