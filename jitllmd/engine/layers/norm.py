"""RMSNorm as Hugging Face computes it (in f32, cast back, then scaled), through the row kernel where it applies."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels import rows_kernel
from ..kernels.ops import rms_norm_add_rows, rms_norm_heads, rms_norm_rows

__all__ = ["RMSNorm"]


class RMSNorm:
    """x -> RMSNorm(x) * weight over the last dimension. The weight is kept in `dtype`; f32 inputs of a CPU norm
    whose width the kernel vectorises take one kernel call (torch's fused norm cost ~45 us per call at decode)."""

    __slots__ = ("eps", "kernel", "weight")

    def __init__(self, weight: torch.Tensor, eps: float, dtype: torch.dtype):
        self.weight = weight.to(dtype)  # [hidden]
        self.eps = eps
        self.kernel = (
            dtype == torch.float32 and weight.device.type == "cpu" and weight.shape[-1] % 8 == 0 and rows_kernel() is not None
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            if self.kernel and x.dim() == 2:
                return rms_norm_rows(x, self.weight, self.eps)  # a step's few rows or a prompt's
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype) * self.weight

    def heads_(self, x: torch.Tensor) -> torch.Tensor:
        """Each head of x [T, heads, D] normed in place (a view into a qkv product's rows: q/k norms); x."""
        if self.kernel and x.dtype == torch.float32 and x.stride(2) == 1 and x.stride(1) == x.shape[2]:
            rms_norm_heads(x, self.weight, self.eps)
            return x
        return x.copy_(self(x))

    def add_to(self, residual: torch.Tensor, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """residual + RMSNorm(x) * weight, x [T, D] a sublayer's output (written over where the kernel runs, or into
        `out`, f32 [T, D] contiguous, where given: else a new tensor is returned)."""
        if self.kernel and x.dtype == residual.dtype == torch.float32 and x.dim() == 2 and x.is_contiguous() and residual.is_contiguous():
            return rms_norm_add_rows(x, self.weight, self.eps, residual, out)
        return residual + self(x.to(residual.dtype))
