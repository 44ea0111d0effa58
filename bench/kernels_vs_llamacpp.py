"""A decode row's product, kernel against kernel: jitllmd's quant_rows at one x row against llama.cpp's own
ggml_vec_dot_<format>_q8_<K|0> over the same weight bytes, one thread, in one process, interleaved round by round.

    LLAMACPP_ISA=avx2 python bench/kernels_vs_llamacpp.py --kernel avx2+fma     # the AVX2 kind on any x86 machine
    python bench/kernels_vs_llamacpp.py --rounds 15 --formats q4_k,q6_k

llama.cpp's side is its libggml-cpu as ../shared/tools/build-llamacpp built it, called through a few lines of C (built
here, once, into ~/.cache/jitllmd/bench) that loop its vec_dot over the weight's rows, with x quantized first as
llama.cpp's matmul does (quantize_row_q8_K for the K-formats, _q8_0 for the 32-formats); jitllmd's side is one
quant_rows call (x quantized per 32 inputs inside it). Both read the same random blocks (valid f16 scales), shaped as
Qwen2.5-Coder-1.5B's projections: 8960 x 1536 (gate, up: six superblocks a row) and 1536 x 8960 (down), a few MB: the
cache holds them, so this times the instructions, not the memory. The table: each side's median ns per block (a
K-format's 256-value superblock, a 32-format's block) and llama.cpp's time over jitllmd's (above 1: jitllmd quicker),
and the largest difference of the two outputs relative to their largest value (the x roundings differ: per 256 inputs
there, per 32 here).
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# format -> (ggml type, block bytes, values a block, llama.cpp's vec_dot, x's quantizer, x block bytes, where f16 scales go)
FORMATS = {
    "q4_0": (2, 18, 32, "ggml_vec_dot_q4_0_q8_0", "quantize_row_q8_0", 34, (0,)),
    "q5_0": (6, 22, 32, "ggml_vec_dot_q5_0_q8_0", "quantize_row_q8_0", 34, (0,)),
    "q8_0": (8, 34, 32, "ggml_vec_dot_q8_0_q8_0", "quantize_row_q8_0", 34, (0,)),
    "q4_k": (12, 144, 256, "ggml_vec_dot_q4_K_q8_K", "quantize_row_q8_K", 292, (0, 2)),
    "q5_k": (13, 176, 256, "ggml_vec_dot_q5_K_q8_K", "quantize_row_q8_K", 292, (0, 2)),
    "q6_k": (14, 210, 256, "ggml_vec_dot_q6_K_q8_K", "quantize_row_q8_K", 292, (208,)),
}
SHAPES = ((8960, 1536), (1536, 8960))

SHIM = r"""
#include <stddef.h>
#include <stdint.h>
typedef void (*vec_dot_t)(int, float *, size_t, const void *, size_t, const void *, size_t, int);
/* y[o] = W[o] . x for the n rows of W (row_bytes apart), x already quantized as vec_dot takes it */
void rows_dot(vec_dot_t dot, int k, int n, const uint8_t *w, size_t row_bytes, const void *x, float *y) {
    for (int o = 0; o < n; o++) dot(k, y + o, 0, w + (size_t)o * row_bytes, 0, x, 0, 1);
}
"""


def shim(bin_dir: Path) -> ctypes.CDLL:
    """The C loop, built once per llama.cpp build (it links that build's libggml-cpu)."""
    key = hashlib.sha256(f"{bin_dir}\n{SHIM}".encode()).hexdigest()[:12]
    out = Path.home() / ".cache" / "jitllmd" / "bench" / f"vec_dot_shim-{key}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        src = out.with_suffix(".c")
        src.write_text(SHIM)
        subprocess.run(["cc", "-O2", "-shared", "-fPIC", str(src), "-o", str(out)], check=True)
    return ctypes.CDLL(str(out))


def weight_shapes(text: str) -> list[tuple[int, int]]:
    """An argparse type: comma-separated N x K weights (outputs x inputs, K a multiple of 256), e.g. 1024x1536,128x8960."""
    try:
        shapes = [(int(n), int(k)) for n, k in (s.lower().split("x") for s in text.split(","))]
    except ValueError:
        raise argparse.ArgumentTypeError(f"N x K pairs, e.g. 1024x1536, not {text!r}") from None
    if any(n < 1 or k < 256 or k % 256 for n, k in shapes):
        raise argparse.ArgumentTypeError("N >= 1 and K a multiple of 256")
    return shapes


def random_blocks(fmt: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """n rows of k values as random blocks of `fmt` whose f16 scales are 0.01 (Q6_K's int8 scales within +-63)."""
    _, size, per, _, _, _, scales = FORMATS[fmt]
    w = rng.integers(0, 256, size=(n, k // per, size), dtype=np.uint8)
    f = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    for at in scales:
        w[:, :, at : at + 2] = f
    if fmt == "q6_k":
        w[:, :, 192:208] &= 0x3F
    return np.ascontiguousarray(w.reshape(n, -1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernel", default=None, help="jitllmd's kernel variant forced, e.g. avx2+fma (default: the best this CPU runs)")
    ap.add_argument("--formats", default=",".join(FORMATS), help=f"comma-separated, of: {', '.join(FORMATS)}")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--calls", type=int, default=5, help="calls a round times, each side")
    ap.add_argument("--shapes", type=weight_shapes, default=list(SHAPES),
                    help="comma-separated N x K weights (outputs x inputs, K a multiple of 256), e.g. 1024x1536,128x8960: a few hundred KB "
                         f"stay in L2 (default: {','.join(f'{n}x{k}' for n, k in SHAPES)})")
    a = ap.parse_args()
    formats = a.formats.split(",")
    for f in formats:
        if f not in FORMATS:
            ap.error(f"unknown format {f!r}: one of {', '.join(FORMATS)}")

    import torch

    from jitllmd.engine import kernels

    if a.kernel:
        kernels.use_variant(a.kernel)
    from jitllmd.engine.kernels import ops

    torch.set_num_threads(1)
    from bench.vs_llamacpp import llama_bin

    bin_dir = llama_bin()
    ctypes.CDLL(str(bin_dir / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
    cpu = ctypes.CDLL(str(bin_dir / "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
    cpu.ggml_cpu_init()
    loop = shim(bin_dir)
    flags = sorted({w for line in open("/proc/cpuinfo") if line.startswith("flags") for w in line.split() if w.startswith(("avx512", "amx"))})
    print(f"jitllmd kernels: {kernels.describe()}; llama.cpp: {bin_dir}; one thread; CPU flags: {' '.join(flags) or 'no avx512/amx'}")
    print(f"medians of {a.rounds} rounds of {a.calls} calls each side, interleaved\n")
    print("| format | weight | llama.cpp ns/block | jitllmd ns/block | llama.cpp / jitllmd | output rel. diff |")
    print("|---|---|---:|---:|---:|---:|")
    rng = np.random.default_rng(0)
    for fmt in formats:
        for n, k in a.shapes:
            t, o, diff = compare(fmt, n, k, cpu, loop, ops.quant_rows, rng, a.rounds, a.calls)
            blocks = n * k // FORMATS[fmt][2]
            print(f"| {fmt.upper()} | {n} x {k} | {t / blocks * 1e9:.2f} | {o / blocks * 1e9:.2f} | {t / o:.2f}x | {diff:.1e} |", flush=True)


def compare(fmt: str, n: int, k: int, cpu: ctypes.CDLL, loop: ctypes.CDLL, quant_rows, rng: np.random.Generator, rounds: int,
            calls: int) -> tuple[float, float, float]:
    """-> (llama.cpp's seconds a call, jitllmd's, the outputs' largest difference over their largest value)"""
    import torch

    from jitllmd.engine.layers.formats import BY_GGML, to_lanes

    qtype, _, per, dot_name, quant_name, xbytes, _ = FORMATS[fmt]
    dot = ctypes.cast(getattr(cpu, dot_name), ctypes.c_void_p)
    quantize = getattr(cpu, quant_name)
    w = random_blocks(fmt, n, k, rng)  # ggml's order, as llama.cpp reads them
    held = BY_GGML[qtype]
    wt = to_lanes(torch.from_numpy(w).reshape(-1, held.nbytes), held).reshape(w.shape)  # the engine's (lane order for K-formats)
    x = torch.randn(1, k)
    xq = (ctypes.c_uint8 * (k // per * xbytes + 64))()
    y = np.zeros(n, np.float32)
    xp, wp, yp = x.numpy().ctypes.data_as(ctypes.c_void_p), w.ctypes.data_as(ctypes.c_void_p), y.ctypes.data_as(ctypes.c_void_p)

    def theirs() -> None:
        quantize(xp, xq, ctypes.c_int64(k))
        loop.rows_dot(dot, k, n, wp, ctypes.c_size_t(w.shape[1]), xq, yp)

    def ours() -> None:
        quant_rows(x, wt, qtype, n)

    theirs()
    diff = float(np.abs(y - quant_rows(x, wt, qtype, n).numpy()[0]).max() / max(1e-30, np.abs(y).max()))
    times: dict[str, list[float]] = {"theirs": [], "ours": []}
    for r in range(rounds):
        for name, fn in (("theirs", theirs), ("ours", ours)) if r % 2 == 0 else (("ours", ours), ("theirs", theirs)):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter() - t0) / calls)
    return statistics.median(times["theirs"]), statistics.median(times["ours"]), diff

if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
