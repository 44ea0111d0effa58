"""The compiled few-row kernels against torch's own ops: projections (f32 and bf16 weights) and decode attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from jitllmd.engine.kernels import MAX_ROWS, attend_rows, rms_norm_rows, rows_kernel, rows_linear

pytestmark = pytest.mark.skipif(rows_kernel() is None, reason="no C compiler or no AVX2/FMA here: the engine runs torch's ops")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_linear_matches_torch(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(200, 64, generator=g).to(dtype)
    for rows in (1, 3, 8, 9, MAX_ROWS):
        x = torch.randn(rows, 64, generator=g)
        ours = rows_linear(x, w)
        assert ours.dtype == torch.float32 and ours.shape == (rows, 200)
        torch.testing.assert_close(ours, F.linear(x, w.float()), rtol=1e-5, atol=1e-5)


def test_a_rows_result_does_not_depend_on_its_step() -> None:
    """Each (row, output) is summed in one order whatever the rows beside it: joint and lone steps agree exactly."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(96, 128, generator=g)
    x = torch.randn(MAX_ROWS, 128, generator=g)
    together = rows_linear(x, w)
    for r in (0, 7, 8, MAX_ROWS - 1):
        assert torch.equal(rows_linear(x[r : r + 1], w)[0], together[r])


def test_attend_rows_matches_sdpa_and_writes_the_new_position() -> None:
    g = torch.Generator().manual_seed(2)
    H, Hkv, D, cap = 6, 2, 16, 40
    keys = [torch.randn(Hkv, cap, D, generator=g) for _ in range(3)]
    values = [torch.randn(Hkv, cap, D, generator=g) for _ in range(3)]
    lengths, starts = [12, 40, 1], [0, 25, 0]  # the second row as under a sliding window
    q, k, v = torch.randn(3, H, D, generator=g), torch.randn(3, Hkv, D, generator=g), torch.randn(3, Hkv, D, generator=g)
    out = attend_rows(q, k, v, keys, values, lengths, starts)
    for r in range(3):
        at = lengths[r] - 1
        assert torch.equal(keys[r][:, at], k[r]) and torch.equal(values[r][:, at], v[r])
        kk = keys[r][:, starts[r] : lengths[r]].repeat_interleave(H // Hkv, 0)
        vv = values[r][:, starts[r] : lengths[r]].repeat_interleave(H // Hkv, 0)
        ref = F.scaled_dot_product_attention(q[r][:, None, :][None], kk[None], vv[None])[0, :, 0, :].reshape(-1)
        torch.testing.assert_close(out[r], ref, rtol=1e-5, atol=1e-5)


def test_rms_norm_rows_matches_torch() -> None:
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(MAX_ROWS, 72, generator=g), torch.randn(72, generator=g)
    torch.testing.assert_close(rms_norm_rows(x, w, 1e-5), F.rms_norm(x, (72,), w, 1e-5), rtol=1e-5, atol=1e-6)
