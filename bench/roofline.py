"""How close an f32 prompt comes to this CPU's FMA peak: jitllmd's and transformers' 512-token SmolLM2 forward
against the floating-point work it must do.

    python bench/roofline.py              # 5 interleaved rounds
    python bench/roofline.py --rounds 9

The peak: a register-only loop (12 independent 8-wide FMA chains per thread, no loads or stores), compiled with the
system's cc and run on as many threads as torch uses; the best of three runs. Then, in this process and on this
thread (one OpenMP team), interleaved round by round: one prompt forward of each engine on the same f32 weights, the
panel GEMM and MKL's sgemm (`F.linear`) on the forward's four projection shapes, and one layer's prompt attention.
FLOPs are counted from the config (a multiply-add is two): jitllmd's last block runs attention and the MLP for the
one token whose logits are asked for, transformers' for all of them. The table shows medians; the last lines say what
the ratio against transformers would be if jitllmd's whole forward ran at the peak, and what share of the peak a
given ratio needs.
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.decode import prepare, prompt_ids  # noqa: E402

PEAK_C = r"""
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
int main(int argc, char **argv) {
    const int threads = atoi(argv[1]);
    const long iters = 100000000L;
    const double t0 = omp_get_wtime();
#pragma omp parallel num_threads(threads)
    {
        long n = iters;
        __asm__ volatile(
            "vxorps %%ymm0,%%ymm0,%%ymm0\n vmovaps %%ymm0,%%ymm1\n vmovaps %%ymm0,%%ymm2\n vmovaps %%ymm0,%%ymm3\n"
            "vmovaps %%ymm0,%%ymm4\n vmovaps %%ymm0,%%ymm5\n vmovaps %%ymm0,%%ymm6\n vmovaps %%ymm0,%%ymm7\n"
            "vmovaps %%ymm0,%%ymm8\n vmovaps %%ymm0,%%ymm9\n vmovaps %%ymm0,%%ymm10\n vmovaps %%ymm0,%%ymm11\n"
            "1:\n"
            "vfmadd231ps %%ymm14,%%ymm15,%%ymm0\n vfmadd231ps %%ymm14,%%ymm15,%%ymm1\n vfmadd231ps %%ymm14,%%ymm15,%%ymm2\n"
            "vfmadd231ps %%ymm14,%%ymm15,%%ymm3\n vfmadd231ps %%ymm14,%%ymm15,%%ymm4\n vfmadd231ps %%ymm14,%%ymm15,%%ymm5\n"
            "vfmadd231ps %%ymm14,%%ymm15,%%ymm6\n vfmadd231ps %%ymm14,%%ymm15,%%ymm7\n vfmadd231ps %%ymm14,%%ymm15,%%ymm8\n"
            "vfmadd231ps %%ymm14,%%ymm15,%%ymm9\n vfmadd231ps %%ymm14,%%ymm15,%%ymm10\n vfmadd231ps %%ymm14,%%ymm15,%%ymm11\n"
            "dec %0\n jnz 1b\n"
            : "+r"(n)::"xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "cc");
    }
    printf("%f\n", threads * iters * 12.0 * 16 / (omp_get_wtime() - t0) / 1e9);
    return 0;
}
"""


def fma_peak(threads: int) -> float:
    """GFLOP/s of `threads` threads doing nothing but independent FMAs: the best of three runs."""
    if shutil.which("cc") is None:
        sys.exit("needs a C compiler (cc) for the FMA peak loop")
    with tempfile.TemporaryDirectory() as d:
        src, exe = Path(d) / "peak.c", Path(d) / "peak"
        src.write_text(PEAK_C)
        subprocess.run(["cc", "-O2", "-fopenmp", str(src), "-o", str(exe)], check=True, capture_output=True)
        return max(float(subprocess.run([str(exe), str(threads)], check=True, capture_output=True, text=True).stdout) for _ in range(3))


def forward_flops(cfg, T: int, trim_last: bool) -> float:
    """A T-token prompt forward's FLOPs: projections, attention (causal), the head for the last token."""
    h, i, H, Hkv, D, V = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size
    qkv = (H + 2 * Hkv) * D
    rest = H * D * h + 2 * h * i + i * h  # o, gate_up, down, per token
    attn_full = 4 * H * D * T * (T + 1) / 2  # scores and p x V over the keys each query sees
    layer = 2 * T * (h * qkv + rest) + attn_full
    last = 2 * T * h * qkv + 2 * rest + 4 * H * D * T if trim_last else layer
    return (cfg.num_layers - 1) * layer + last + 2 * h * V


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=512)
    a = ap.parse_args()
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    from jitllmd.engine.kernels.ops import attend_chunk, pack_panels, panel_linear
    from jitllmd.engine.kv import RowSpan
    from jitllmd.engine.loader import load_model

    threads = torch.get_num_threads()
    peak = fma_peak(threads)
    paths = prepare()
    T = a.prompt
    ours = load_model(paths["f32"], max_seq=T + 16)
    cfg = ours.model.cfg
    ids = prompt_ids(ours.tokenizer.encode, T)
    tok = AutoTokenizer.from_pretrained(paths["hf"])
    ref = AutoModelForCausalLM.from_pretrained(paths["hf"], dtype=torch.float32).eval()
    ref_ids = torch.tensor([prompt_ids(lambda t: tok.encode(t, add_special_tokens=False), T)])

    def ours_forward() -> None:
        ours.runner.forward(torch.tensor(ids), torch.arange(T), [RowSpan(0, T, ours.new_kv())], torch.tensor([T - 1]))

    def ref_forward() -> None:
        ref(ref_ids, past_key_values=DynamicCache(), use_cache=True, logits_to_keep=1)

    g = torch.Generator().manual_seed(0)
    qkv_out = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    shapes = {"qkv": (qkv_out, cfg.hidden_size), "o": (cfg.hidden_size, cfg.num_heads * cfg.head_dim),
              "gate_up": (2 * cfg.intermediate_size, cfg.hidden_size), "down": (cfg.hidden_size, cfg.intermediate_size)}
    plain = {k: torch.randn(n, kk, generator=g) * 0.05 for k, (n, kk) in shapes.items()}
    packed = {k: pack_panels(w.clone()) for k, w in plain.items()}
    xs = {k: torch.randn(T, kk, generator=g) for k, (n, kk) in shapes.items()}
    q = torch.randn(T, cfg.num_heads, cfg.head_dim, generator=g)
    kc = torch.randn(cfg.num_kv_heads, T, cfg.head_dim, generator=g)
    vc = torch.randn(cfg.num_kv_heads, T, cfg.head_dim, generator=g)

    jobs: dict[str, tuple[float, Callable[[], object]]] = {  # name -> (FLOPs, call)
        "jitllmd forward": (forward_flops(cfg, T, True), ours_forward),
        "transformers forward": (forward_flops(cfg, T, False), ref_forward),
        "attend_chunk, one layer": (4 * cfg.num_heads * cfg.head_dim * T * (T + 1) / 2, lambda: attend_chunk(q, kc, vc, 0, 0, None)),
    }
    for k, (n, kk) in shapes.items():
        jobs[f"panel GEMM {k} {T}x{kk}->{n}"] = (2 * T * n * kk, lambda k=k: panel_linear(xs[k], packed[k]))
        jobs[f"MKL F.linear {k} {T}x{kk}->{n}"] = (2 * T * n * kk, lambda k=k: F.linear(xs[k], plain[k]))
    times: dict[str, list[float]] = {name: [] for name in jobs}
    with torch.inference_mode():
        for _, fn in jobs.values():  # warm up
            fn()
        for _ in range(a.rounds):
            for name in random.sample(list(jobs), len(jobs)):
                fn = jobs[name][1]
                reps = 1 if "forward" in name else 10
                t0 = time.perf_counter()
                for _ in range(reps):
                    fn()
                times[name].append((time.perf_counter() - t0) / reps)

    print(f"\nSmolLM2-135M-Instruct f32, {T}-token prompt, {threads} threads, median of {a.rounds} interleaved rounds")
    print("| what | ms | GFLOP | GFLOP/s | of FMA peak |\n|---|---:|---:|---:|---:|")
    print(f"| FMA peak (registers only, {threads} threads) | | | {peak:.0f} | 100% |")
    med = {name: statistics.median(t) for name, t in times.items()}
    for name, (flops, _) in jobs.items():
        rate = flops / med[name] / 1e9
        print(f"| {name} | {med[name] * 1000:.1f} | {flops / 1e9:.2f} | {rate:.0f} | {100 * rate / peak:.0f}% |")
    ours_flops = jobs["jitllmd forward"][0]
    floor = ours_flops / (peak * 1e9)
    ratio = med["transformers forward"] / med["jitllmd forward"]
    print(f"\njitllmd's forward at the FMA peak would take {floor * 1000:.0f} ms. Prompt ratio against transformers: "
          f"{ratio:.2f}x now, {med['transformers forward'] / floor:.2f}x at the peak.")
    for want in (1.5, 1.4):
        need = ours_flops / (med["transformers forward"] / want) / 1e9
        print(f"{want}x needs jitllmd's whole forward at {need:.0f} GFLOP/s, {100 * need / peak:.0f}% of the FMA peak.")


if __name__ == "__main__":
    main()
