"""Which block is where: the plan (pure arithmetic over block sizes and device memory), and a loaded model's placed
blocks, moved between the host and its devices at runtime with their sessions' KV."""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from typing import Any, Protocol

import torch

from ..cluster.remote import RemoteModel, RemoteRun
from ..kv import META, SessionKV
from ..pages import PagePool
from .devices import is_remote, split_place, synchronize
from .pager import ROW_BLOCKS, Pager

__all__ = ["HOST", "BlockCosts", "Placement", "Room", "plan_places"]

HOST = "host"
_RECENT = 0.2  # weight of the newest step in the running cost figures


def plan_places(block_bytes: list[int], kv_bytes: list[int], devices: list[tuple[str, int]], gpu_layers: int,
                local_only: frozenset[int] = frozenset()) -> list[str]:
    """A place per block: from the head backwards onto the devices in the order given, each block while its weights
    and the KV reserved for it fit in what is left of that device's spendable bytes; the rest (a prefix, so seams stay
    few) on the host. `gpu_layers` caps the blocks on devices; -1 places as many as fit. The blocks `local_only` (embed
    and head: sampling is on rank 0) never go to another rank's device: where one would, it stays on the host."""
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
        if i in local_only and is_remote(devices[d][0]):
            continue
        places[i] = devices[d][0]
        left -= need
        placed += 1
    return places


class BlockCosts:
    """What a block costs where it runs, measured on the steps the model runs anyway: seconds per weight byte of a host
    block's compute (its wait for a paged read apart) and of a device block's (the step's time less the host part),
    and the bytes per second a move onto a device has copied. What relocation weighs a move with."""

    def __init__(self) -> None:
        self.host_s_per_byte: float | None = None
        self.device_s_per_byte: float | None = None
        self.copy_bytes_per_s: float | None = None
        self._host_s = 0.0  # this step's host compute so far
        self._wait_s = 0.0  # ... and its waits for paged reads
        self._host_bytes = 0

    def begin_step(self) -> None:
        self._host_s = self._wait_s = 0.0
        self._host_bytes = 0

    def host_block(self, nbytes: int, wait_s: float, compute_s: float) -> None:
        self._host_bytes += nbytes
        self._wait_s += wait_s
        self._host_s += compute_s

    def end_step(self, total_s: float, device_bytes: int) -> None:
        """The step took `total_s` in all (its devices synchronized), with `device_bytes` of weights on devices."""
        if self._host_bytes:
            self.host_s_per_byte = _mean(self.host_s_per_byte, self._host_s / self._host_bytes)
        if device_bytes:
            self.device_s_per_byte = _mean(self.device_s_per_byte, max(0.0, total_s - self._host_s - self._wait_s) / device_bytes)

    def copied(self, nbytes: int, seconds: float) -> None:
        if nbytes and seconds > 0:
            self.copy_bytes_per_s = _mean(self.copy_bytes_per_s, nbytes / seconds)


def _mean(old: float | None, new: float) -> float:
    return new if old is None else old + _RECENT * (new - old)


def layer_of(name: str) -> int | None:
    """The KV layer a block owns (`blocks.N` -> N); embed and head own none."""
    return int(name.split(".", 1)[1]) if name.startswith("blocks.") else None


class Room(Protocol):
    """What a device may take for one model's blocks, where more than its driver decides: a server's -device-mem
    shared by its models, and idle models that give up blocks for another (memory/relocation.py, wired by Catalog)."""

    def spendable(self, placement: Placement, device: str, driver: int) -> int:
        """What `device` can take for `placement`'s blocks, its driver saying `driver` bytes are free."""

    def prepare(self, placement: Placement, asking: str, devices: list[str], gpu_layers: int, driver: Callable[[str], int], reason: str) -> None:
        """Before `placement` is planned over `devices`: make the room it would have with other models' idle blocks gone."""


class Placement:
    """The blocks of one model on their places: device blocks held built on their device, host blocks in the pager.

    Only the engine thread calls `walk`, `apply`, `move`: a move happens between steps, never inside one. Blocks on
    another rank's device (`1:cpu`) are held there (engine/cluster/remote.py, opened by `remote` on first use); their KV layers
    are `meta` here.
    """

    def __init__(
        self, names: list[str], pager: Pager, build: Callable[[str, dict[str, Any], torch.device, bool], Any], devices: list[str], kv_layer_bytes: int,
        remote: Callable[[int], RemoteModel] | None = None,
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
        self.gpu_layers = -1  # the cap on device blocks the placement was last made with (-1: none)
        self._device_bytes = 0
        self.costs = BlockCosts()
        self._open_remote = remote
        self.remotes: dict[int, RemoteModel] = {}  # rank -> the model there
        self.kv_pool: PagePool | None = None  # the sessions' K/V pages (the runner's), each layer's where its block is

    # -- what is where --------------------------------------------------------------------------

    @staticmethod
    def torch_device(place: str) -> torch.device:
        """The torch device a place computes on here: another rank's is `meta` (its shapes are here, its data there)."""
        if is_remote(place):
            return META
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
        """Wait for the work queued on every device holding blocks (a clock read after it times the work, not its queueing;
        another rank's work is done when it answers)."""
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

    def local_layers(self) -> list[Any] | None:
        """Every layer's block where one call may run them all: each on this rank's CPU and held there (a resident host
        block, or one placed on the `cpu` device); None where one is paged, on an accelerator, or on another rank."""
        blocks = []
        for name, place in zip(self.names, self.places):
            if layer_of(name) is None:
                continue
            block = self.pager.resident.get(name) if place == HOST else self.held.get(name) if self.torch_device(place).type == "cpu" else None
            if block is None:
                return None
            blocks.append(block)
        return blocks

    def ran_layers(self, seconds: float) -> None:
        """The layers ran in one call (local_layers) in `seconds`: each host layer's share, by its bytes, to `costs`."""
        host = [i for i, (n, p) in enumerate(zip(self.names, self.places)) if p == HOST and layer_of(n) is not None]
        total = sum(self.block_bytes[i] for i in host)
        for i in host:
            self.costs.host_block(self.block_bytes[i], 0.0, seconds * self.block_bytes[i] / total if total else 0.0)

    def walk(self, layers: bool = True) -> Generator[tuple[Any, torch.device], None, None]:
        """Each block in model order with the device it runs on; a paged block is read for its turn and let go after.
        A host block's wait and compute are timed into `costs` (the host computes in order: the clock is the work). A run of
        layers on one other rank's device comes as one RemoteRun (one call over the seam), on `meta`. Without `layers`:
        the embedding and the head alone (the layers run in one call: local_layers)."""
        i = 0
        while i < len(self.names):
            name, place = self.names[i], self.places[i]
            if not layers and layer_of(name) is not None:
                i += 1
                continue
            if is_remote(place):
                j = i
                while j + 1 < len(self.names) and self.places[j + 1] == place:
                    j += 1
                first, last = layer_of(name), layer_of(self.names[j])
                assert first is not None and last is not None  # only layers go to another rank
                yield RemoteRun(self.remotes[split_place(place)[0]], first, last), META
                i = j + 1
                continue
            index, i = i, i + 1
            if place != HOST:
                yield self.held[name], self.torch_device(place)
                continue
            t0 = time.perf_counter()
            block = self.pager.acquire(name)
            t1 = time.perf_counter()
            try:
                yield block, self.torch_device(HOST)
            finally:
                self.pager.release(name)
                self.costs.host_block(self.block_bytes[index], t1 - t0, time.perf_counter() - t1)

    def device_weight_bytes(self) -> int:
        """Weight bytes on devices (read every step, for BlockCosts: set when blocks move)."""
        return self._device_bytes

    def saving_s(self, index: int) -> float:
        """What a step would save with host block `index` on a device, measured on the steps so far: its compute's
        difference (a device never measured counts as free), and a read: its own where it is paged, else that of the
        paged block nearest the seam, which takes its place in the page budget."""
        c = self.costs
        compute = self.block_bytes[index] * max(0.0, (c.host_s_per_byte or 0.0) - (c.device_s_per_byte or 0.0))
        for name in reversed(self.names[: index + 1]):  # itself, else the paged block nearest the seam before it
            if name in self.pager.host and name not in self.pager.resident:
                return compute + self._read_s(name)
        return compute

    def _read_s(self, name: str) -> float:
        stats = self.pager.reader.stats.get(name)
        return stats.seconds / stats.reads if stats is not None and stats.reads else 0.0

    def copy_s(self, index: int) -> float:
        """What moving block `index` onto a device would take: at the rate moves have copied, else at the rate its reads
        from the file ran, else at 1 GB/s."""
        nbytes = self.block_bytes[index]
        rate = self.costs.copy_bytes_per_s
        stats = self.pager.reader.stats.get(self.names[index])
        if rate is None and stats is not None and stats.seconds > 0:
            rate = stats.bytes / stats.seconds
        return nbytes / (rate or 1e9)

    # -- moving ---------------------------------------------------------------------------------

    def check_place(self, place: str) -> None:
        if place != HOST and place not in self.devices:
            loaded = ", ".join(self.devices) or "no device"
            raise ValueError(f"{place!r} is not one of the model's devices ({loaded}): a block goes to host or to a device the model was loaded with")

    def _local_only(self) -> frozenset[int]:
        """The blocks that stay on rank 0 (embed and head: tokens come in and are sampled there)."""
        return frozenset(i for i, n in enumerate(self.names) if layer_of(n) is None)

    def apply(self, places: list[str], kvs: list[SessionKV], progress: Callable[[int, int], None] | None = None) -> None:
        """Put each block on its new place, carrying every session's KV of the blocks that move."""
        if len(places) != len(self.names):
            raise ValueError(f"a placement needs {len(self.names)} places, got {len(places)}")
        for p in set(places):
            self.check_place(p)
        pinned = [self.names[i] for i in self._local_only() if is_remote(places[i])]
        if pinned:
            raise ValueError(f"{', '.join(pinned)} stay on this host (tokens are embedded and sampled on rank 0): only layers go to another rank")
        old = list(self.places)
        remote_held = self._hold_remote(places)  # before anything here changes: a rank that fails leaves the placement as it was
        drops: dict[int, list[str]] = {}
        for i, name in enumerate(self.names):  # free device memory before anything is read
            if old[i] != HOST and places[i] != old[i]:
                del self.held[name]
                self._held_parts.pop(name, None)
                rank = split_place(old[i])[0]
                if rank > 0 and split_place(places[i])[0] != rank:  # not to another device of the same rank
                    drops.setdefault(rank, []).append(name)
        self.held.update(remote_held)
        self.places = list(places)
        self._device_bytes = sum(b for b, p in zip(self.block_bytes, places) if p != HOST)
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
                    t0 = time.perf_counter()
                    parts = self._read_on(name, self.torch_device(places[i]))
                    self._held_parts[name] = parts
                    self.held[name] = self._build(name, parts, self.torch_device(places[i]), False)
                    synchronize(places[i])
                    self.costs.copied(self.block_bytes[i], time.perf_counter() - t0)
                    tick()
        finally:
            self._progress = None
        if progress is not None:
            progress(total, total)
        for i, name in enumerate(self.names):
            layer = layer_of(name)
            if layer is not None:
                self._carry(kvs, layer, old[i], places[i])
        for rank, names in drops.items():  # their KV came back first
            self.remotes[rank].drop(names)

    def _hold_remote(self, places: list[str]) -> dict[str, Any]:
        """Blocks going to another rank's device are read and built there (from its own copy of the .jlm). -> the
        model there, by the names it now holds."""
        out: dict[str, Any] = {}
        runs: dict[str, list[int]] = {}
        for i, place in enumerate(places):
            if is_remote(place) and self.places[i] != place:
                runs.setdefault(place, []).append(i)
        for place, indices in runs.items():
            rank, device = split_place(place)
            remote = self._remote(rank)
            remote.hold([self.names[i] for i in indices], device, sum(self.block_bytes[i] for i in indices))
            for i in indices:
                out[self.names[i]] = remote
        return out

    def _remote(self, rank: int) -> RemoteModel:
        if rank not in self.remotes:
            if self._open_remote is None:
                raise ValueError(f"rank {rank} names another host, and this model was loaded without a cluster")
            self.remotes[rank] = self._open_remote(rank)
        return self.remotes[rank]

    def _carry(self, kvs: list[SessionKV], layer: int, src: str, dst: str) -> None:
        """One layer's K/V of every session from its block's old place to its new one, across ranks where it must be."""
        pool = self.kv_pool
        if not is_remote(src) and not is_remote(dst):
            if pool is not None:
                pool.move(layer, self.torch_device(dst))
            return
        if src == dst:
            return
        for kv in kvs:  # across ranks the K/V themselves move: pages out of the pool (kv_spill.py) come back first
            kv.fill()
        taken = [self.remotes[split_place(src)[0]].take_kv(kv, layer) if is_remote(src) else None for kv in kvs]
        if is_remote(dst):
            rank, device = split_place(dst)
            for kv, filled in zip(kvs, taken):
                self._remote(rank).put_kv(kv, layer, filled if filled is not None else (kv.start(layer), *kv.filled(layer)), device)
            if pool is not None:
                pool.move(layer, META)
        else:
            if pool is not None:
                pool.move(layer, self.torch_device(dst))
            for kv, filled in zip(kvs, taken):
                if filled is not None:
                    kv.put(layer, *filled)

    def move(self, first: int, last: int, to: str, kvs: list[SessionKV]) -> None:
        """Blocks first..last (inclusive; 0 is embed) to `to`: host or one of the model's devices."""
        last_index = len(self.names) - 1
        if not 0 <= first <= last <= last_index:
            raise ValueError(f"blocks {first}:{last} are out of range: give FIRST:LAST with 0 <= FIRST <= LAST <= {last_index}")
        self.check_place(to)
        if is_remote(to) and (first == 0 or last == last_index):
            raise ValueError(f"blocks {first}:{last} include {'embed (0)' if first == 0 else f'head ({last_index})'}, which stays on this host: "
                             f"only layers (1:{last_index - 1}) go to another rank")
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
        return plan_places(self.block_bytes, kv, room, gpu_layers, self._local_only())

    def wants(self, devices: list[str], gpu_layers: int, spendable: Callable[[str], int]) -> dict[str, int]:
        """Bytes each device would hold (blocks and their KV) were `spendable` its room: what a re-placement asks."""
        kv = [self.kv_layer_bytes if layer_of(n) is not None else 0 for n in self.names]
        places = self.plan(devices, gpu_layers, spendable)
        return {d: sum(b + k for b, k, p in zip(self.block_bytes, kv, places) if p == d) for d in devices}

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
            elif device.type == "cpu":  # kept in this process's memory: the file's pages where they can be
                out[part] = self.pager.reader.keep(name, names)
            else:
                out[part] = self.pager.reader.read(name, {part: names})[part].to(device)
        return out

    def close(self) -> None:
        """Let go of every block, on devices and in the pager (the engine has stopped)."""
        self.held.clear()
        self._held_parts.clear()
        self.pager.close()
        for remote in self.remotes.values():
            remote.close()
        self.remotes.clear()

