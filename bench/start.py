"""Start to healthy: `llama-server` against `jitllmd serve` on the same GGUF, each timed from its spawn until its health
endpoint answers 200 (llama-server's /health, jitllmd's /healthz), the two interleaved round by round, medians.

    python bench/start.py                                   # SmolLM2 Q4_1 and Qwen2.5-Coder-1.5B Q4_K_M, 5 rounds
    python bench/start.py --models qwen2.5-coder-1.5b --rounds 7
    python bench/start.py --no-peer                         # jitllmd alone (no llama.cpp build on this machine)

Both serve as bench/served.py starts them (16 sessions of 1024 positions, 2 threads for llama-server, jitllmd at its
defaults with -devices cpu). jitllmd loads the GGUF's .jlm, converted once into the bench's models directory by a
first start that is not timed; its kernels are built by then too. The llama.cpp peer comes from
../shared/tools/build-llamacpp (vs_llamacpp.llama_bin: built there once per machine where it is not yet). What a jitllmd start spends, by phase, is in
its own log: run `jitllmd serve -load X -devices cpu` and read the lines it prints.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.served import Server, ServerFailed, free_port, jitllmd_cmd, llama_server_cmd  # noqa: E402
from bench.vs_llamacpp import cache, llama_bin  # noqa: E402


def models() -> dict[str, Path | None]:
    from bench.convert import qwen_1_5b
    from jitllmd.embedded import default_gguf

    return {"smollm2-135m-q4_1": default_gguf(), "qwen2.5-coder-1.5b": qwen_1_5b()}


def start_once(engine: str, gguf: Path, models_dir: Path, bin_dir: Path | None, threads: int) -> float:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    if engine == "llama-server":
        assert bin_dir is not None
        server = Server(llama_server_cmd(bin_dir, gguf, port, threads), url, "/health")
    else:
        server = Server(jitllmd_cmd(models_dir, gguf.name, port), url, "/healthz")
    try:
        return server.wait_healthy()
    finally:
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=None, help=f"comma-separated, of: {', '.join(models())} (default: both)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-peer", action="store_true", help="jitllmd alone")
    args = ap.parse_args()
    found = models()
    names = args.models.split(",") if args.models else list(found)
    bin_dir = None if args.no_peer else llama_bin()  # built once per machine (~10-15 min) where it is not yet
    engines = ["llama-server", "jitllmd"] if bin_dir is not None else ["jitllmd"]

    rows = []
    for name in names:
        gguf = found.get(name)
        if gguf is None:
            print(f"{name}: not installed (see DESIGN.md's models), skipped", file=sys.stderr)
            continue
        models_dir = cache() / "start-models"
        models_dir.mkdir(exist_ok=True)
        link = models_dir / gguf.name
        if not link.exists():
            link.unlink(missing_ok=True)
            link.symlink_to(gguf.resolve())
        first = start_once("jitllmd", gguf, models_dir, bin_dir, args.threads)  # converts once, builds the kernels
        print(f"{name}: jitllmd's first start (converts unless done before) {first:.2f}s", file=sys.stderr)
        got: dict[str, list[float]] = {e: [] for e in engines}
        for r in range(args.rounds):
            for engine in engines if r % 2 == 0 else engines[::-1]:
                try:
                    got[engine].append(start_once(engine, gguf, models_dir, bin_dir, args.threads))
                except ServerFailed as exc:
                    sys.exit(f"{name}: {engine}: {exc}")
            print(f"{name} round {r + 1}: " + ", ".join(f"{e} {got[e][-1]:.2f}s" for e in engines), file=sys.stderr)
        rows.append((name, {e: statistics.median(v) for e, v in got.items()}))
    print(f"\nstart to healthy, seconds (medians of {args.rounds} interleaved starts, spawn to 200)\n")
    if bin_dir is not None:
        print("| model | llama-server | jitllmd | jitllmd / llama-server |\n|---|---:|---:|---:|")
        for name, m in rows:
            print(f"| {name} | {m['llama-server']:.2f} | {m['jitllmd']:.2f} | {m['jitllmd'] / m['llama-server']:.2f}x |")
    else:
        print("| model | jitllmd |\n|---|---:|")
        for name, m in rows:
            print(f"| {name} | {m['jitllmd']:.2f} |")


if __name__ == "__main__":
    main()
