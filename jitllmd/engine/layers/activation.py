"""The gated MLP's activation: silu(gate) * up of a [T, 2 * I] projection, in one pass where the kernel applies."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels import rows_kernel, silu_mul_rows

__all__ = ["SiluMul"]


class SiluMul:
    """gate_up [T, 2*I] -> silu(gate) * up [T, I]."""

    __slots__ = ("intermediate", "kernel")

    def __init__(self, intermediate: int, device: torch.device):
        self.intermediate = intermediate
        self.kernel = device.type == "cpu" and intermediate % 8 == 0 and rows_kernel() is not None

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.kernel and gate_up.dtype == torch.float32:
            return silu_mul_rows(gate_up)
        i = self.intermediate
        return F.silu(gate_up[:, :i]).mul_(gate_up[:, i:])  # in place: one pass fewer
