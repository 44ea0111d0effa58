"""Session KV caches (per block) and the row layout a forward attends with."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["RoomError", "RowSpan", "SessionKV"]

_GROW = 256  # positions added at least per growth: few reallocations, little waste
# A sliding-window layer drops the positions no query can see any more in steps of this many (a multiple of the bf16
# attention's key blocks of 32, so a key's block is where it was: the same bits whatever was dropped before it)
_ALIGN = 64
# ... and keeps this many positions more than its window needs, so a session rewound a little (a regenerated reply,
# prefix reuse) still finds the keys its next query sees
_REWIND = 64
_KEYS = itertools.count(1)  # a session KV's key, by which another rank holding some of its layers knows it
META = torch.device("meta")  # a layer held by another rank: its shapes are kept here, its K/V there


class RoomError(ValueError):
    """A prompt or generation does not fit in the session's KV capacity."""


class SessionKV:
    """K and V for every attention block of one session: [num_kv_heads, slots, head_dim] per block.

    A session costs what it uses, up to `capacity` (the session's -max-seq): on the CPU a full-attention layer's
    storage is its whole capacity from the first reservation, whose pages the OS maps only as positions are written (so
    it never grows by copying, which held the old and the new copy at once: ~150 MB of a 4k-token SmolLM2 session's
    peak); on another device it grows on demand, doubling. A sliding-window layer (`windows`, one per layer: its
    window, or None for full attention) keeps only what its queries can still see: positions `offsets[i]` on, slot 0
    holding position `offsets[i]`; when its storage is full it drops the positions older than its window (moving the
    rest to the front), so a long generation does not grow it past about its window. `nbytes` counts the positions
    reserved either way. Each layer's K/V live on its block's place (`devices`, one per layer); `move` carries the
    filled positions across. A layer whose block is on another rank is on the `meta` device here: its bookkeeping
    (offsets, slots) goes on as for any layer, and its K/V are that rank's (`remotes`: engine/cluster/remote.py's proxies of
    the ranks holding some of this cache's layers, told of a copy).
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device | str | list[torch.device] = "cpu",
        windows: list[int | None] | None = None,
    ):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.capacity = capacity
        self.dtype = dtype
        self.devices = list(device) if isinstance(device, list) else [torch.device(device)] * num_layers
        # a window at least as long as the session is no window for its storage
        self.windows = [w if w is not None and w < capacity else None for w in (windows or [None] * num_layers)]
        if len(self.windows) != num_layers or len(self.devices) != num_layers:
            raise ValueError(f"windows and devices name {num_layers} layers")
        self._full = self.windows.count(None)  # bytes_at's terms, once: it runs for every decode row of every step
        self._sliding = [w for w in self.windows if w is not None]
        self.offsets = [0] * num_layers  # the position each layer's slot 0 holds
        self.length = 0  # positions filled
        self._layer_bytes = 2 * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()  # one position of one layer
        self._allocated = 0  # positions reserved in every full-attention layer
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.key = next(_KEYS)
        self.remotes: set[Any] = set()

    def bytes_per_position(self) -> int:
        """One position's K/V in every layer."""
        return self._layer_bytes * self.num_layers

    def bytes_at(self, length: int) -> int:
        """The K/V bytes `length` positions hold (and a step at that length reads): a window layer's at most its
        window's."""
        return self._layer_bytes * (self._full * length + sum(min(length, w) for w in self._sliding))

    def nbytes(self) -> int:
        return sum(self.layer_nbytes(i) for i in range(self.num_layers))

    def layer_nbytes(self, layer: int) -> int:
        """Bytes of one layer's K/V storage now (on this rank: none where another holds it)."""
        if self.devices[layer] == META:
            return 0
        if self.windows[layer] is None:
            return self._allocated * self._layer_bytes  # the positions reserved (a CPU layer maps only those it writes)
        return self.k[layer].shape[1] * self._layer_bytes if layer < len(self.k) else 0

    # K/V storage is written inside forwards (torch.inference_mode: what a forward reserves is an inference tensor) and
    # outside them (forks, moves, slides): each method that writes storage it did not just make runs in inference mode,
    # where writing either kind of tensor is allowed (reserve itself, called for every row of every step, does not)
    def reserve(self, total: int) -> None:
        """Make room for positions up to `total` (grows storage, never past capacity; a window layer first drops what
        its queries from position `length` on cannot see)."""
        if total > self.capacity:
            raise RoomError(f"{total} positions do not fit in the session's {self.capacity}")
        if total > self._allocated:
            self._allocated = min(self.capacity, max(total, self._allocated * 2, _GROW))
        for i in range(self.num_layers):
            window = self.windows[i]
            have = self.k[i].shape[1] if i < len(self.k) else 0
            if window is not None and total - self.offsets[i] > have:
                self._slide(i, window)
            need = total - self.offsets[i]
            if need <= have and i < len(self.k):
                continue
            if window is None:
                size = self.capacity if self.devices[i].type == "cpu" else self._allocated
            else:
                size = min(self.capacity, max(need, window + _REWIND + _ALIGN + _GROW))  # a longer chunk than ever: what it needs
            k, v = self._storage(self.devices[i], size)
            if i < len(self.k):
                filled = self.length - self.offsets[i]
                k[:, :filled] = self.k[i][:, :filled]
                v[:, :filled] = self.v[i][:, :filled]
                self.k[i], self.v[i] = k, v
            else:
                self.k.append(k)
                self.v.append(v)

    @torch.inference_mode()
    def _slide(self, layer: int, window: int) -> None:
        """Drop layer's positions before what a query at `length` sees (less _REWIND, in steps of _ALIGN)."""
        keep = max(0, self.length - window + 1 - _REWIND) // _ALIGN * _ALIGN
        drop = keep - self.offsets[layer]
        if drop <= 0:
            return
        n = self.length - keep
        for cache in (self.k[layer], self.v[layer]):
            src = cache[:, drop : drop + n]
            cache[:, :n] = src.clone() if drop < n else src  # overlapping slices: copied out first
        self.offsets[layer] = keep

    def _storage(self, device: torch.device, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (self.num_kv_heads, slots, self.head_dim)
        return torch.empty(shape, dtype=self.dtype, device=device), torch.empty(shape, dtype=self.dtype, device=device)

    @property
    def device(self) -> torch.device:
        """Where the first layer's K/V are (the masks of a forward are built there)."""
        return self.devices[0]

    @torch.inference_mode()
    def move(self, layer: int, device: torch.device, filled: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Carry one layer's K/V (the positions filled) to `device`, where its block now runs: a full-attention
        layer's storage there for the positions reserved, a window layer's as it was. `filled`: the K/V another rank
        held (the layer was on `meta` here); to `meta` nothing is copied (the other rank was sent them)."""
        if self.devices[layer] == device and filled is None:
            return
        source = self.devices[layer]
        self.devices[layer] = device
        if layer < len(self.k):
            slots = self.k[layer].shape[1] if self.windows[layer] is not None else self._allocated
            k, v = self._storage(device, slots)
            n = self.length - self.offsets[layer]
            if filled is not None:
                n = min(n, filled[0].shape[1])
                k[:, :n] = filled[0][:, :n].to(device)
                v[:, :n] = filled[1][:, :n].to(device)
            elif device != META and source != META:
                k[:, :n] = self.k[layer][:, :n]
                v[:, :n] = self.v[layer][:, :n]
            self.k[layer], self.v[layer] = k, v

    def filled(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's K/V positions filled, [Hkv, n, D] each (empty before the first reservation)."""
        if layer >= len(self.k):
            empty = torch.empty((self.num_kv_heads, 0, self.head_dim), dtype=self.dtype)
            return empty, empty
        n = self.length - self.offsets[layer]
        return self.k[layer][:, :n], self.v[layer][:, :n]

    def reusable(self, length: int) -> int:
        """How much of a prefix of `length` positions the cache can go on from: all of it where every window layer
        still holds the keys a query at `length` sees, else none (a shorter prefix needs older keys still)."""
        ok = all(w is None or off == 0 or length - w + 1 >= off for w, off in zip(self.windows, self.offsets))
        return length if ok else 0

    def truncate(self, length: int) -> None:
        """Forget positions from `length` on (prefix reuse, reset); a window layer must still hold what a query at
        `length` sees (`reusable`)."""
        length = max(0, min(self.length, length))
        assert self.reusable(length) == length, "a window layer dropped keys the truncated session needs"
        self.length = length
        if length == 0:
            self.offsets = [0] * self.num_layers

    def reset(self) -> None:
        self.truncate(0)

    def forkable(self) -> bool:
        """Whether copy_from can take this cache's positions: every window layer still holds them from position 0."""
        return not any(self.offsets)

    @torch.inference_mode()
    def copy_from(self, src: SessionKV, length: int) -> None:
        """Become a copy of `src`'s first `length` positions (a prompt run once for several rows); src.forkable()."""
        assert src.forkable() and length <= src.length and src.num_layers == self.num_layers
        self.reset()
        self.reserve(length)
        for i in range(self.num_layers):
            if self.devices[i] != META:
                self.k[i][:, :length] = src.k[i][:, :length]
                self.v[i][:, :length] = src.v[i][:, :length]
        self.length = length
        for remote in src.remotes:  # the layers other ranks hold are copied there
            remote.copy_kv(src, self, length)

    def slot(self, layer: int, position: int) -> int:
        """Where `position` is in layer's storage."""
        return position - self.offsets[layer]


@dataclass
class RowSpan:
    """One row of a packed batch: tokens [start, start + num_tokens) attend to `kv` from position `kv.length`.

    A causal mask is made on first use, once per forward, device and (group, window), and shared by the layers that
    ask for it (the compiled chunk attention needs none; a single token sees everything).
    """

    start: int
    num_tokens: int
    kv: SessionKV
    prompt: bool = False  # tokens of a prompt (even one): quantized projections multiply them exactly
    short: bool = False  # ... unless it is a short feed: its tokens multiply as decode rows do (runner.pack)
    many: bool = False  # ... as a prompt chunk's (a feed past rows_feed), though a layer with a fused call still runs them in it
    exact: bool = field(init=False)  # its tokens take the prompt chunks' products (a prompt's, or any row of several)
    _masks: dict[tuple[int, int | None], dict[torch.device, torch.Tensor]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.exact = (self.num_tokens > 1 or self.prompt) and not self.short  # once: every layer of a forward asks

    def begin(self) -> None:
        """Before a forward: the masks of the last one no longer apply."""
        self._masks.clear()

    def key_start(self, window: int | None) -> int:
        """The first key any query of this chunk sees: with a sliding `window` a query at q sees keys in (q - window, q]."""
        return max(0, self.kv.length - window + 1) if window else 0

    def mask_on(self, device: torch.device, group: int, window: int | None) -> torch.Tensor | None:
        """Causal mask for this chunk against its history from `key_start(window)` on `device`, tiled for the GQA query
        layout [Hkv, group*n, D] (`group` query heads per kv head): [group*n, keys]. None for a single token."""
        if self.num_tokens == 1:
            return None
        masks = self._masks.setdefault((group, window), {})
        if device not in masks:
            if masks:  # made for another place of this forward: copied
                masks[device] = next(iter(masks.values())).to(device)
            else:
                n, p = self.num_tokens, self.kv.length
                keys = torch.arange(self.key_start(window), p + n, device=device)
                queries = torch.arange(p, p + n, device=device)
                mask = keys[None, :] <= queries[:, None]  # [n, keys]
                if window:
                    mask &= keys[None, :] > queries[:, None] - window
                masks[device] = mask.repeat(group, 1) if group > 1 else mask
        return masks[device]
