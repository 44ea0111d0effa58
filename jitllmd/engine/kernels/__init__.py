"""Compiled CPU kernels: C sources built once per machine with the system's C compiler, loaded with ctypes.

rows.c: few-row projections, decode attention, RMSNorm. panels.c: f32 projections over weights rewritten once into
column panels, for any number of rows (a prompt's GEMMs and a step's GEMVs). quant.c: projections over GGUF-quantized
rows kept in ggml's block layout, and their dequantization. layer.c: a quantized decoder layer's decode step in one
call. attend_bf16.c: a prompt chunk's attention on AMX tiles. pool.c: the threads their loops run on. Where they
cannot be built (no compiler, not x86 with AVX2, FMA and F16C, a failed build), `rows_kernel` is None and the engine
runs torch's own ops: the kernels make steps faster, never different in what they compute, but for one rounding a
CPU's bf16 units bring: on the variants built for them (`avx512+bf16`, `avx512+amx`) a quantized model's prompt chunks
multiply in bf16 (`ops.bf16_runs`), as a bf16 model's do, and where AMX runs, attend in bf16 too
(`ops.attend_chunk(bf16=True)`).

build.py builds and loads them, per CPU feature set (its public calls are re-exported here: `configure`, `describe`,
`rows_kernel`, `use_variant`, `variant`, `variants`); ops.py holds the typed calls, imported from `kernels.ops`.
"""

from __future__ import annotations

from .build import configure, describe, rows_kernel, use_variant, variant, variants

__all__ = ["configure", "describe", "rows_kernel", "use_variant", "variant", "variants"]
