"""Which block is where: the plan (pure arithmetic over block sizes and device memory), and a loaded model's placed
blocks, moved between the host and its devices at runtime with their sessions' KV."""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

import torch

from .devices import synchronize
from .kv import SessionKV
from .pager import ROW_BLOCKS, Pager

__all__ = ["HOST", "Placement", "plan_places"]

HOST = "host"


def plan_places(block_bytes: list[int], kv_bytes: list[int], devices: list[tuple[str, int]], gpu_layers: int) -> list[str]:
    """A place per block: from the head backwards onto the devices in the order given, each block while its weights
    and the KV reserved for it fit in what is left of that device's spendable bytes; the rest (a prefix, so seams stay
    few) on the host. `gpu_layers` caps the blocks on devices; -1 places as many as fit."""
    if len(block_bytes) != len(kv_bytes):
        raise ValueError("block_bytes and kv_bytes must have one entry per block")
    places = [HOST] * len(block_bytes)
    if not devices or gpu_layers == 0:
        return places
    cap = len(block_bytes) if gpu_layers < 0 else gpu_layers
    d, left, placed = 0, devices[0][1], 0
    for i in reversed(range(len(block_bytes))):
        if placed == cap:
            break
        need = block_bytes[i] + kv_bytes[i]
        while need > left:
            d += 1
            if d == len(devices):
                return places
            left = devices[d][1]
        places[i] = devices[d][0]
        left -= need
        placed += 1
    return places


def layer_of(name: str) -> int | None:
    """The KV layer a block owns (`blocks.N` -> N); embed and head own none."""
    return int(name.split(".", 1)[1]) if name.startswith("blocks.") else None


class Placement:
    """The blocks of one model on their places: device blocks held built on their device, host blocks in the pager.

    Only the engine thread calls `walk`, `apply`, `move`: a move happens between steps, never inside one.
    """

    def __init__(
        self, names: list[str], pager: Pager, build: Callable[[str, dict[str, Any], torch.device, bool], Any], devices: list[str], kv_layer_bytes: int
    ):
        self.names = names
        self.pager = pager
        self.devices = list(devices)  # what the model was loaded with: the only devices its blocks may go to
        self.kv_layer_bytes = kv_layer_bytes  # KV reserved per layer block on its place (-sessions x -max-seq)
        self.places = [HOST] * len(names)
        self.held: dict[str, Any] = {}
        self._held_parts: dict[str, dict[str, torch.Tensor]] = {}
        self._build = build
        self._progress: Callable[[], None] | None = None
        pager.build = self._build_host
        self.block_bytes = [pager.block_bytes(n) for n in names]

    # -- what is where --------------------------------------------------------------------------

    @staticmethod
    def torch_device(place: str) -> torch.device:
        return torch.device("cpu" if place == HOST else place)

    def device_of(self, index: int) -> torch.device:
        return self.torch_device(self.places[index])

    @property
    def device_ids(self) -> list[str]:
        """The devices holding blocks now, in the order the model was loaded with them."""
        return [d for d in self.devices if d in self.places]

    @property
    def num_device_blocks(self) -> int:
        return sum(p != HOST for p in self.places)

    @property
    def num_seams(self) -> int:
        return sum(a != b for a, b in zip(self.places, self.places[1:]))

    @property
    def one_device(self) -> bool:
        """Every block on one device: the model batches its requests as rows."""
        return self.places[0] != HOST and len(set(self.places)) == 1

    def synchronize(self) -> None:
        """Wait for the work queued on every device holding blocks (a clock read after it times the work, not its queueing)."""
        for device in self.device_ids:
            synchronize(device)

    def kv_devices(self) -> list[torch.device]:
        """Where each layer's KV lives: on its block's place."""
        return [self.device_of(i) for i, n in enumerate(self.names) if layer_of(n) is not None]

    def decode_bytes(self) -> int:
        """Weight bytes one decode step reads whatever their place: every block but the token embedding, which reads a row."""
        return sum(b for n, b in zip(self.names, self.block_bytes) if n not in ROW_BLOCKS)

    def residency(self, index: int) -> str:
        """device, resident (a host block kept in memory) or paged (read from the file for its turn)."""
        name = self.names[index]
        if self.places[index] != HOST:
            return "device"
        return "resident" if name in self.pager.resident else "paged"

    # -- a forward's pass -----------------------------------------------------------------------

    def walk(self) -> Generator[tuple[Any, torch.device], None, None]:
        """Each block in model order with the device it runs on; a paged block is read for its turn and let go after."""
        for i, name in enumerate(self.names):
            place = self.places[i]
            if place != HOST:
                yield self.held[name], self.torch_device(place)
                continue
            block = self.pager.acquire(name)
            try:
                yield block, self.torch_device(HOST)
            finally:
                self.pager.release(name)

    # -- moving ---------------------------------------------------------------------------------

    def check_place(self, place: str) -> None:
        if place != HOST and place not in self.devices:
            loaded = ", ".join(self.devices) or "no device"
            raise ValueError(f"{place!r} is not one of the model's devices ({loaded}): a block goes to host or to a device the model was loaded with")

    def apply(self, places: list[str], kvs: list[SessionKV], progress: Callable[[int, int], None] | None = None) -> None:
        """Put each block on its new place, carrying every session's KV of the blocks that move."""
        if len(places) != len(self.names):
            raise ValueError(f"a placement needs {len(self.names)} places, got {len(places)}")
        for p in set(places):
            self.check_place(p)
        for i, name in enumerate(self.names):  # free device memory before anything is read
            if self.places[i] != HOST and places[i] != self.places[i]:
                del self.held[name], self._held_parts[name]
        self.places = list(places)
        done, total = 0, len(self.names)

        def tick() -> None:
            nonlocal done
            done += 1
            if progress is not None:
                progress(min(done, total), total)

        self._progress = tick
        try:
            self.pager.configure([n for n, p in zip(self.names, places) if p == HOST])
            for i, name in enumerate(self.names):
                if places[i] != HOST and name not in self.held:
                    parts = self._read_on(name, self.torch_device(places[i]))
                    self._held_parts[name] = parts
                    self.held[name] = self._build(name, parts, self.torch_device(places[i]), False)
                    tick()
        finally:
            self._progress = None
        if progress is not None:
            progress(total, total)
        for i, name in enumerate(self.names):
            layer = layer_of(name)
            if layer is not None:
                for kv in kvs:
                    kv.move(layer, self.device_of(i))

    def move(self, first: int, last: int, to: str, kvs: list[SessionKV]) -> None:
        """Blocks first..last (inclusive; 0 is embed) to `to`: host or one of the model's devices."""
        last_index = len(self.names) - 1
        if not 0 <= first <= last <= last_index:
            raise ValueError(f"blocks {first}:{last} are out of range: give FIRST:LAST with 0 <= FIRST <= LAST <= {last_index}")
        self.check_place(to)
        places = list(self.places)
        places[first : last + 1] = [to] * (last - first + 1)
        self.apply(places, kvs)

    def plan(self, devices: list[str], gpu_layers: int, spendable: Callable[[str], int]) -> list[str]:
        """The places a re-placement over `devices` gives (blocks this model holds there count as free)."""
        for d in devices:
            self.check_place(d)
        kv = [self.kv_layer_bytes if layer_of(n) is not None else 0 for n in self.names]
        room = []
        for d in devices:
            mine = sum(b for b, p in zip(self.block_bytes, self.places) if p == d)
            room.append((d, spendable(d) + mine))
        return plan_places(self.block_bytes, kv, room, gpu_layers)

    # -- reading blocks -------------------------------------------------------------------------

    def _build_host(self, name: str, parts: dict[str, Any], once: bool = False) -> Any:
        block = self._build(name, parts, self.torch_device(HOST), once)
        if self._progress is not None:
            self._progress()
        return block

    def _read_on(self, name: str, device: torch.device) -> dict[str, torch.Tensor]:
        """A device block's parts on `device`; a part another block there already holds (a tied head's table) is shared."""
        layout = self.pager.layouts[name]
        shared = {
            tuple(self.pager.layouts[n][p]): t
            for n, parts in self._held_parts.items()
            for p, t in parts.items()
            if t.device == device
        }
        out: dict[str, torch.Tensor] = {}
        for part, names in layout.items():
            key = tuple(names)
            if key in shared:
                out[part] = shared[key]
            else:
                t = self.pager.reader.read(name, {part: names})[part]
                out[part] = t.to(device)  # the tensor itself where it is already there
        return out

    def close(self) -> None:
        """Let go of every block, on devices and in the pager (the engine has stopped)."""
        self.held.clear()
        self._held_parts.clear()
        self.pager.close()

