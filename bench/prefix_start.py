"""The prefix cache on a start shorter than a page, served: `jitllmd serve` with `-prefix-cache on` against `off`, the
served section's clients (bench/served.py: SmolLM2's chat template with its default system prompt, 26 tokens every
request starts with, then "Reader k, continue this passage" and ~330 characters of text: ~111 prompt tokens, 128
generated, ignore_eos), each server fresh a round, the order flipping every round.

    python bench/prefix_start.py --kernel avx2+fma --rounds 4
    python bench/prefix_start.py --gguf /path/to/model.gguf --clients 8,16

Each round: one warm-up request, then each client count's requests at once (as the served section does). `off` still
reuses a slot's own tokens (a session that ran an earlier request: its template start), so the two differ by what a
fresh slot finds in the cache. Prints medians of tokens/s and TTFT, the ratio on / off, and the median cached tokens.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from bench import served  # noqa: E402

DEFAULT_GGUF = Path.home() / ".cache" / "jitllmd" / "bench" / "served-models" / "SmolLM2-135M-Instruct.Q8_0-from-Q4_1.gguf"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", type=Path, default=DEFAULT_GGUF, help="the model (default: the served section's SmolLM2 Q8_0, "
                    "which `bench/vs_llamacpp.py --section served` makes)")
    ap.add_argument("--kernel", default=None, help="a kernel variant to force (default: the CPU's best)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--clients", default="8,16")
    ap.add_argument("--tokens", type=int, default=128)
    a = ap.parse_args()
    if not a.gguf.is_file():
        sys.exit(f"no model at {a.gguf}: run `python bench/vs_llamacpp.py --section served --rounds 1` once, or give --gguf")
    clients = [int(c) for c in a.clients.split(",")]
    tps: dict[tuple[str, int], list[float]] = {}
    ttft: dict[tuple[str, int], list[float]] = {}
    cached: dict[tuple[str, int], list[int]] = {}
    for r in range(a.rounds):
        for mode in ("on", "off") if r % 2 == 0 else ("off", "on"):
            port = served.free_port()
            cmd = served.jitllmd_cmd(a.gguf.parent, a.gguf.name, port, a.kernel) + ["-prefix-cache", mode]
            server = served.Server(cmd, f"http://127.0.0.1:{port}", "/healthz")
            try:
                server.wait_healthy()
                with httpx.Client(trust_env=False) as client:
                    served.stream_chat(client, server.url, 0, a.tokens)  # warm up
                k = 1
                for n in clients:
                    streams = served.load(server.url, n, a.tokens, k)
                    k += n
                    wall = max(s.end for s in streams) - min(s.sent for s in streams)
                    tps.setdefault((mode, n), []).append(sum(s.num_tokens for s in streams) / wall)
                    ttft.setdefault((mode, n), []).append(statistics.median(1000 * (s.first - s.sent) for s in streams))
                    cached.setdefault((mode, n), []).extend(s.num_cached_tokens for s in streams)
                    print(f"round {r + 1} {mode:3} {n:2} clients: {tps[(mode, n)][-1]:.1f} tok/s", file=sys.stderr, flush=True)
            finally:
                server.stop()
    print(f"\n`{a.gguf.name}`, kernels {a.kernel or 'the CPU best'}, {a.rounds} rounds, medians; ratio on / off\n")
    print("| clients | tok/s on | tok/s off | ratio | TTFT p50 ms on | off | ratio | cached tokens on / off (median) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n in clients:
        on, off = statistics.median(tps[("on", n)]), statistics.median(tps[("off", n)])
        t_on, t_off = statistics.median(ttft[("on", n)]), statistics.median(ttft[("off", n)])
        c_on, c_off = statistics.median(cached[("on", n)]), statistics.median(cached[("off", n)])
        print(f"| {n} | {on:.1f} | {off:.1f} | {on / off:.2f}x | {t_on:.0f} | {t_off:.0f} | {t_on / t_off:.2f}x | {c_on:.0f} / {c_off:.0f} |")


if __name__ == "__main__":
    main()
