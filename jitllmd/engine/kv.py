"""Session KV caches (per block) and the row layout a forward attends with."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["RoomError", "RowSpan", "SessionKV"]

_GROW = 256  # positions added at least per growth: few reallocations, little waste


class RoomError(ValueError):
    """A prompt or generation does not fit in the session's KV capacity."""


class SessionKV:
    """K and V for every attention block of one session: [num_kv_heads, capacity, head_dim] per block.

    A session costs what it uses, up to `capacity` (the session's -max-seq): on the CPU a layer's storage is its whole
    capacity from the first reservation, whose pages the OS maps only as positions are written (so it never grows by
    copying, which held the old and the new copy at once: ~150 MB of a 4k-token SmolLM2 session's peak); on another
    device it grows on demand, doubling. `nbytes` counts the positions reserved either way. Each layer's K/V live on
    its block's place (`devices`, one per layer); `move` carries the filled positions across.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device | str | list[torch.device] = "cpu",
    ):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.capacity = capacity
        self.dtype = dtype
        self.devices = list(device) if isinstance(device, list) else [torch.device(device)] * num_layers
        self.length = 0  # positions filled
        self._bytes_per_position = 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
        self._allocated = 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []

    def bytes_per_position(self) -> int:
        return self._bytes_per_position

    def nbytes(self) -> int:
        return self._allocated * self.bytes_per_position()

    def reserve(self, total: int) -> None:
        """Make room for `total` positions (grows storage; never past capacity)."""
        if total > self.capacity:
            raise RoomError(f"{total} positions do not fit in the session's {self.capacity}")
        if total <= self._allocated:
            return
        new = min(self.capacity, max(total, self._allocated * 2, _GROW))
        for i in range(self.num_layers):
            if i < len(self.k) and self.k[i].shape[1] >= new:
                continue  # a CPU layer's storage: already whole
            k, v = self._storage(self.devices[i], new)
            if i < len(self.k):
                k[:, : self.length] = self.k[i][:, : self.length]
                v[:, : self.length] = self.v[i][:, : self.length]
                self.k[i], self.v[i] = k, v
            else:
                self.k.append(k)
                self.v.append(v)
        self._allocated = new

    def _storage(self, device: torch.device, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Empty K and V for one layer holding `positions` on `device`: the whole capacity on the CPU (unwritten
        pages cost nothing there), just `positions` elsewhere."""
        room = self.capacity if device.type == "cpu" else positions
        shape = (self.num_kv_heads, room, self.head_dim)
        return torch.empty(shape, dtype=self.dtype, device=device), torch.empty(shape, dtype=self.dtype, device=device)

    @property
    def device(self) -> torch.device:
        """Where the first layer's K/V are (the masks of a forward are built there)."""
        return self.devices[0]

    def move(self, layer: int, device: torch.device) -> None:
        """Carry one layer's K/V (the positions filled) to `device`, where its block now runs."""
        if self.devices[layer] == device:
            return
        self.devices[layer] = device
        if self._allocated:
            k, v = self._storage(device, self._allocated)
            k[:, : self.length] = self.k[layer][:, : self.length]
            v[:, : self.length] = self.v[layer][:, : self.length]
            self.k[layer], self.v[layer] = k, v

    def layer_nbytes(self) -> int:
        """Bytes of one layer's K/V storage now."""
        return self.nbytes() // max(1, self.num_layers)

    def truncate(self, length: int) -> None:
        """Forget positions from `length` on (prefix reuse, reset)."""
        self.length = max(0, min(self.length, length))

    def reset(self) -> None:
        self.length = 0


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
    _masks: dict[tuple[int, int | None], dict[torch.device, torch.Tensor]] = field(default_factory=dict, repr=False)

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
