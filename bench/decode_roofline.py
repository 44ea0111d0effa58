"""Batch-1 decode against this machine's read bandwidth: how far jitllmd and llama.cpp each are from the most a
memory-bound step could give, on the same GGUF file, and so the most jitllmd / llama.cpp a decode could reach here.

    python bench/decode_roofline.py                                          # SmolLM2 Q8_0 and Qwen2.5-Coder-1.5B, 3 rounds
    LLAMACPP_ISA=avx2 python bench/decode_roofline.py --kernel avx2+fma      # the AVX2 kind (an AVX2-only llama.cpp build)

Each round, interleaved: the read peak (a C loop streaming a 1 GiB buffer, 4 independent 256-bit loads and adds per
iteration on each of the threads, nothing written: the best of three passes), then jitllmd's decode (bench/vs_llamacpp.py's
worker: 128 single-token forwards at depth 0 on the converted file, its median of 3) and llama-bench's `-n 128`. The
bytes a step reads are the weights a token's forward touches (`LoadedModel.decode_bytes`: every projection and the
head, one row of the embedding table) — the same file's blocks for both engines. The table shows medians over
rounds: tok/s, the bytes they read a second, that as a share of the peak, and the roofline's tok/s (peak / bytes a
token). The last column is the most jitllmd / llama.cpp can be here at one row: the roofline over llama.cpp's figure.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.vs_llamacpp import MODELS, Failed, Quiet, Settings, llama_bin, llama_decode, run_jitllmd  # noqa: E402

READ_C = r"""
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
int main(int argc, char **argv) {
    const int threads = atoi(argv[1]);
    const size_t bytes = (size_t)1 << 30, per = bytes / threads;
    uint8_t *buf = aligned_alloc(64, bytes);
    if (!buf) return 1;
    memset(buf, 1, bytes); /* every page mapped before the clock starts */
    double best = 0.0;
    long long sink = 0;
    for (int pass = 0; pass < 4; pass++) {
        const double t0 = omp_get_wtime();
#pragma omp parallel num_threads(threads) reduction(+ : sink)
        {
            const __m256i *p = (const __m256i *)(buf + per * omp_get_thread_num());
            __m256i a = _mm256_setzero_si256(), b = a, c = a, d = a;
            for (size_t i = 0; i < per / 32; i += 4) {
                a = _mm256_add_epi64(a, _mm256_load_si256(p + i));
                b = _mm256_add_epi64(b, _mm256_load_si256(p + i + 1));
                c = _mm256_add_epi64(c, _mm256_load_si256(p + i + 2));
                d = _mm256_add_epi64(d, _mm256_load_si256(p + i + 3));
            }
            const __m256i s = _mm256_add_epi64(_mm256_add_epi64(a, b), _mm256_add_epi64(c, d));
            sink += _mm256_extract_epi64(s, 0) + _mm256_extract_epi64(s, 3);
        }
        const double gbs = (double)per * threads / (omp_get_wtime() - t0) / 1e9;
        if (pass > 0 && gbs > best) best = gbs; /* the first pass warms the TLB */
    }
    printf("%f %lld\n", best, sink & 1);
    free(buf);
    return 0;
}
"""


def read_peak_tool(out: Path) -> Path:
    """The read loop, compiled with the system's cc."""
    if shutil.which("cc") is None:
        sys.exit("needs a C compiler (cc) for the read-bandwidth loop")
    src, exe = out / "read.c", out / "read"
    src.write_text(READ_C)
    subprocess.run(["cc", "-O2", "-mavx2", "-fopenmp", str(src), "-o", str(exe)], check=True, capture_output=True)
    return exe


def read_peak(exe: Path, threads: int) -> float:
    return float(subprocess.run([str(exe), str(threads)], check=True, capture_output=True, text=True).stdout.split()[0])


def decode_bytes(jlm: Path) -> int:
    """The bytes one token's forward reads (mapped, not read: loading is lazy)."""
    from jitllmd.engine.loader import load_model

    loaded = load_model(jlm, max_seq=64)
    try:
        return loaded.decode_bytes()
    finally:
        loaded.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2-q8_0,qwen-1.5b-q4_k_m", help=f"comma-separated, of: {', '.join(MODELS)}")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kernel", default=None, help="jitllmd's kernel variant forced, e.g. avx2+fma (the AVX2 kind against LLAMACPP_ISA=avx2)")
    ap.add_argument("--idle-wait", type=float, default=5.0, help="seconds to wait for other processes to leave the cores before each measurement")
    a = ap.parse_args()
    for m in a.models.split(","):
        if m not in MODELS:
            ap.error(f"--models: unknown {m!r}; known: {', '.join(MODELS)}")
    st = Settings(threads=a.threads, decode=128, depths=(0,), kernel=a.kernel)
    bin_dir = llama_bin()
    quiet = Quiet(a.idle_wait)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        exe = read_peak_tool(Path(tmp))
        for model in a.models.split(","):
            label, make = MODELS[model]
            gguf = make()
            jlm = Path(run_jitllmd("convert", gguf, st)["jlm"])
            nbytes = decode_bytes(jlm)
            got: dict[str, list[float]] = {"peak": [], "jitllmd": [], "llama.cpp": []}
            for r in range(a.rounds):
                engines = [("jitllmd", lambda j=jlm: run_jitllmd("decode", j, st)), ("llama.cpp", lambda g=gguf: llama_decode(bin_dir, g, st))]
                for name, fn in [("peak", None), *(engines if r % 2 == 0 else engines[::-1])]:
                    quiet.start()
                    try:
                        value = read_peak(exe, a.threads) if fn is None else fn()["decode_tps_d0"]
                    except Failed as exc:
                        print(f"{model} round {r + 1} {name}: {exc}", file=sys.stderr)
                        continue
                    others = quiet.finish()
                    got[name].append(value)
                    print(f"{model} round {r + 1} {name:9s} {value:8.1f}, other processes {others:.2f} cores", file=sys.stderr, flush=True)
            rows.append((label, nbytes, {k: statistics.median(v) if v else float("nan") for k, v in got.items()}))
    kind = f"jitllmd kernels {a.kernel} forced" if a.kernel else "jitllmd's own kernels"
    print(f"\nBatch-1 decode at depth 0, {a.threads} threads, {kind}, medians of {a.rounds} interleaved rounds\n")
    print("| model | MB a token | read peak GB/s | engine | tok/s | GB/s | of peak | roofline tok/s | most jitllmd / llama.cpp here |")
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|")
    for label, nbytes, med in rows:
        roof = med["peak"] * 1e9 / nbytes
        for engine in ("jitllmd", "llama.cpp"):
            tps = med[engine]
            gbs = tps * nbytes / 1e9
            most = f"{roof / med['llama.cpp']:.2f}x (now {med['jitllmd'] / med['llama.cpp']:.2f}x)" if engine == "jitllmd" else ""
            print(f"| {label} | {nbytes / 1e6:.0f} | {med['peak']:.1f} | {engine} | {tps:.1f} | {gbs:.1f} | {100 * gbs / med['peak']:.0f}% | {roof:.1f} | {most} |")


if __name__ == "__main__":
    main()
