"""The gated MLP's activation: act(gate) * up of a [T, 2 * I] projection, act silu (Llama's) or GELU's tanh form
(Gemma's), in one pass where the kernel applies."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels import rows_kernel
from ..kernels.ops import GATES, gated_rows

__all__ = ["GatedAct"]


class GatedAct:
    """gate_up [T, 2*I] -> act(gate) * up [T, I]; `gate` one of GATES ("silu", "gelu_tanh")."""

    __slots__ = ("gate", "intermediate", "kernel")

    def __init__(self, intermediate: int, device: torch.device, gate: str = "silu"):
        if gate not in GATES:
            raise ValueError(f"activation {gate!r} is not supported ({', '.join(sorted(GATES))})")
        self.intermediate = intermediate
        self.gate = gate
        self.kernel = device.type == "cpu" and intermediate % 8 == 0 and rows_kernel() is not None

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.kernel and gate_up.dtype == torch.float32:
            return gated_rows(gate_up, self.gate)
        i = self.intermediate
        act = F.silu(gate_up[:, :i]) if self.gate == "silu" else F.gelu(gate_up[:, :i], approximate="tanh")
        return act.mul_(gate_up[:, i:])  # in place: one pass fewer
