"""The prefix cache on a start shorter than a page, served: `jitllmd serve` with `-prefix-cache on` against `off`, the
served section's clients (bench/served.py: SmolLM2's chat template with its default system prompt, 26 tokens every
request starts with, then "Reader k, continue this passage" and ~330 characters of text: ~111 prompt tokens, 128
generated, ignore_eos), each server fresh a round, the order flipping every round.

    python bench/prefix_start.py --kernel avx2+fma --rounds 4
    python bench/prefix_start.py --gguf /path/to/model.gguf --clients 8,16

Each round is the served section's (bench/served.py serve_round): one warm-up request, then each client count's
requests at once. `off` still
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
    clients = tuple(int(c) for c in a.clients.split(","))
    got: dict[tuple[str, str], list[float]] = {}  # (mode, serve_round's key) -> a value a round
    for r in range(a.rounds):
        for mode in ("on", "off") if r % 2 == 0 else ("off", "on"):
            port = served.free_port()
            cmd = served.jitllmd_cmd(a.gguf.parent, a.gguf.name, port, a.kernel) + ["-prefix-cache", mode]
            server = served.Server(cmd, f"http://127.0.0.1:{port}", "/healthz")
            try:
                res = served.serve_round(server, clients, a.tokens)
            finally:
                server.stop()
            for key, value in res.items():
                if isinstance(value, str):
                    sys.exit(f"-prefix-cache {mode}, round {r + 1}: {key}: {value}")
                got.setdefault((mode, key), []).append(value)
            print(f"round {r + 1} {mode:3}: " + ", ".join(f"{n} clients {res[f'tps_{n}']:.1f} tok/s" for n in clients), file=sys.stderr, flush=True)
    med = {k: statistics.median(v) for k, v in got.items()}
    print(f"\n`{a.gguf.name}`, kernels {a.kernel or 'the CPU best'}, {a.rounds} rounds, medians; ratio on / off\n")
    print("| clients | tok/s on | tok/s off | ratio | TTFT p50 ms on | off | ratio | cached tokens on / off (median) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n in clients:
        on, off = med[("on", f"tps_{n}")], med[("off", f"tps_{n}")]
        t_on, t_off = med[("on", f"ttft_ms_{n}")], med[("off", f"ttft_ms_{n}")]
        print(f"| {n} | {on:.1f} | {off:.1f} | {on / off:.2f}x | {t_on:.0f} | {t_off:.0f} | {t_on / t_off:.2f}x | "
              f"{med[('on', f'cached_{n}')]:.0f} / {med[('off', f'cached_{n}')]:.0f} |")

if __name__ == "__main__":
    main()
