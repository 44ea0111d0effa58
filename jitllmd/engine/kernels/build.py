"""Building the kernels: the same C sources compiled per CPU feature set (`variants`) with the system's C compiler,
once per machine, and loaded with ctypes, each entry point's signature declared. The best variant this CPU runs is
used unless `use_variant` forces one. `configure` says where builds are kept; `describe` names the variant in use, or
why there is none.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

__all__ = ["configure", "describe", "rows_kernel", "use_variant", "variant", "variants"]

log = logging.getLogger("jitllmd.kernels")

_SOURCES = [Path(__file__).with_name(n) for n in ("rows.c", "panels.c", "quant.c", "layer.c", "attend_bf16.c", "sample.c", "pool.c")]
_HEADERS = [Path(__file__).with_name(n) for n in ("simd.h", "pool.h")]  # included by the sources: part of a build's identity
_FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-mprfchw", "-pthread", "-shared", "-fPIC", "-std=gnu11", "-lm"]  # prefetchw: a NOP where absent
_BASE_CPU = ("avx2", "fma", "f16c")  # what _FLAGS need
_AVX512 = ("avx512f", "avx512bw", "avx512vl", "avx512dq")
# variant -> (flags added to _FLAGS, /proc/cpuinfo flags it needs beyond _BASE_CPU); worst first, the best runnable is used
_VARIANTS: dict[str, tuple[list[str], tuple[str, ...]]] = {
    "avx2+fma": ([], ()),
    # AVX-VNNI: dpbusd on 256-bit vectors without AVX-512 (Intel's client cores since Alder Lake; Zen 5 has it too)
    "avx2+vnni": (["-mavxvnni"], ("avx_vnni",)),
    "avx512+vnni": (["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni"], (*_AVX512, "avx512_vnni")),
    # and bf16 units: a quantized model's prompt chunks multiply in bf16 (quant.c's bf16_rows), with vdpbf16ps or AMX
    "avx512+bf16": (["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mavx512bf16"], (*_AVX512, "avx512_vnni", "avx512_bf16")),
    "avx512+amx": (["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mavx512bf16", "-mamx-tile", "-mamx-bf16"],
                   (*_AVX512, "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16")),
}
_cache_dir: Path | None = None  # set by configure(); None: ~/.cache/jitllmd/kernels (the engine reads no environment)
_forced: str | None = None  # set by use_variant(); None: the best of variants()


def configure(cache_dir: Path) -> None:
    """Keep kernel builds in `cache_dir` (default ~/.cache/jitllmd/kernels; the CLI passes its cache's kernels/).
    Call before first use; a later call makes the next use load from there (a library loaded before stays mapped)."""
    global _cache_dir
    _cache_dir = Path(cache_dir)
    _load.cache_clear()


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def variants() -> list[str]:
    """The kernel variants this CPU can run, best last (empty where none: not x86-64, or no AVX2, FMA and F16C)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return []
    flags = _cpu_flags()
    return [name for name, (_, needs) in _VARIANTS.items() if flags.issuperset((*_BASE_CPU, *needs))]


def use_variant(name: str | None) -> None:
    """Run the kernels built as `name` (one of `variants()`), or the best again (None): for tests and benchmarks. The
    next call loads it; a library loaded before stays mapped for whoever holds it."""
    global _forced
    if name is not None and name not in variants():
        raise ValueError(f"kernel variant {name!r} does not run on this CPU (it runs {variants()})")
    _forced = name
    _load.cache_clear()


def _slug(variant: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", variant)


def _build(cache: Path, compiler: str, variant: str) -> Path:
    """The shared library for these sources and the variant's flags, compiled once into `cache` (atomically); older
    builds of the same variant are removed (a process that loaded one keeps its mapping), other variants' kept."""
    flags = [*_FLAGS, *_VARIANTS[variant][0]]
    key = hashlib.sha256(b"".join(src.read_bytes() for src in [*_SOURCES, *_HEADERS]) + " ".join(flags).encode()).hexdigest()[:12]
    slug = _slug(variant)
    out = cache / f"kernels-{slug}-{key}.so"
    if out.exists():
        return out
    cache.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".kernels-", suffix=".so", dir=cache)
    os.close(fd)
    try:
        subprocess.run([compiler, *flags, *map(str, _SOURCES), "-o", tmp], check=True, capture_output=True, text=True, timeout=120)
        os.replace(tmp, out)
    finally:
        Path(tmp).unlink(missing_ok=True)
    # this variant's older builds; for avx2+fma also those named before variants were (kernels-<hash>.so, rows-*.so)
    same = re.compile(rf"kernels-{re.escape(slug)}-[0-9a-f]{{12}}\.so" + (r"|kernels-[0-9a-f]{12}\.so|rows-.*\.so" if variant == "avx2+fma" else ""))
    for old in cache.iterdir():
        if old != out and same.fullmatch(old.name):
            old.unlink(missing_ok=True)
    return out


def _failure(exc: Exception) -> str:
    """A failed build or load in one line: the compiler's first error where it said one."""
    if isinstance(exc, subprocess.CalledProcessError) and exc.stderr:
        lines = exc.stderr.splitlines()
        return next((line for line in lines if "error" in line), lines[0]).strip()
    return str(exc)


@functools.cache
def _load() -> tuple[ctypes.CDLL | None, str]:
    """The compiled kernels and the variant's description, or None and why torch's ops run instead."""
    machine = platform.machine()
    if machine not in ("x86_64", "AMD64"):
        return None, f"torch ops (not x86-64: {machine})"
    missing = sorted(set(_BASE_CPU) - _cpu_flags())
    if missing:
        return None, f"torch ops (CPU lacks {' and '.join(m.upper() for m in missing)})"
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None, "torch ops (no C compiler: neither cc nor gcc on PATH)"
    cache = _cache_dir or Path.home() / ".cache" / "jitllmd" / "kernels"
    why = ""
    for variant in [_forced] if _forced else variants()[::-1]:  # the best that builds (a compiler may lack a variant's flags)
        try:
            path = _build(cache, compiler, variant)
            lib = ctypes.CDLL(str(path))  # its loops run on pool.c's threads
        except (OSError, subprocess.SubprocessError) as exc:
            why = _failure(exc)
            log.warning("kernel variant %s unavailable: %s", variant, why)
            continue
        _declare(lib)
        return lib, f"{variant} ({path.name})"
    log.warning("compiled kernels unavailable, using torch's ops: %s", why)
    return None, f"torch ops (build failed: {why})"


def rows_kernel() -> ctypes.CDLL | None:
    """The compiled kernels (rows.c, panels.c, quant.c), or None where they cannot run here."""
    return _load()[0]


def variant() -> str | None:
    """The kernel variant in use (one of `variants()`), or None where torch's ops run instead. Builds them if need be."""
    lib, text = _load()
    return None if lib is None else text.split(" ", 1)[0]


def describe() -> str:
    """The kernels in use, e.g. 'avx512+vnni (kernels-avx512-vnni-<hash>.so)', or 'torch ops (<why not>)'. Builds them
    if need be."""
    return _load()[1]


def _declare(lib: ctypes.CDLL) -> None:
    """Each entry point's C signature, so ctypes passes 64-bit ints and pointers as the sources take them."""
    for fn in (lib.rows_f32, lib.rows_bf16):
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
        fn.restype = None
    lib.top_k.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
    lib.top_k.restype = ctypes.c_int64
    lib.attend_rows.argtypes = [ctypes.c_void_p] * 9 + [ctypes.c_int64] * 4 + [ctypes.c_float, ctypes.c_int, ctypes.c_int]
    lib.attend_rows.restype = ctypes.c_int
    lib.rms_norm_rows.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_float, ctypes.c_int]
    lib.rms_norm_rows.restype = None
    lib.rms_norm_add_rows.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2 + [ctypes.c_float, ctypes.c_int]
    lib.rms_norm_add_rows.restype = None
    lib.rms_norm_heads.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_float, ctypes.c_int]
    lib.rms_norm_heads.restype = None
    lib.gated_rows.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_int] * 2
    lib.gated_rows.restype = None
    lib.rope_rows.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
    lib.rope_rows.restype = None
    lib.attend_chunk.argtypes = [ctypes.c_void_p, ctypes.c_int64, *[ctypes.c_void_p] * 3, *[ctypes.c_int64] * 4, ctypes.c_void_p, *[ctypes.c_int64] * 3,
                                 ctypes.c_float, ctypes.c_int, ctypes.c_int]
    lib.attend_chunk.restype = ctypes.c_int
    lib.attend_chunk_bf16.argtypes = lib.attend_chunk.argtypes
    lib.attend_chunk_bf16.restype = ctypes.c_int
    lib.pack_panels.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
    lib.pack_panels.restype = None
    lib.panel_linear.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int, ctypes.c_void_p, ctypes.c_float, ctypes.c_int]
    lib.panel_linear.restype = ctypes.c_int
    lib.quant_rows.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 4 + [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_float,
                                                                           ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    lib.quant_rows.restype = ctypes.c_int
    lib.gemm_rows.argtypes = lib.quant_rows.argtypes
    lib.gemm_rows.restype = ctypes.c_int
    lib.dequant_rows.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_int] * 3
    lib.dequant_rows.restype = ctypes.c_int
    lib.bf16_round.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_float, ctypes.c_int]
    lib.bf16_round.restype = ctypes.c_int
    lib.bf16_rows.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, *[ctypes.c_void_p] * 5, ctypes.c_int64, ctypes.c_void_p,
                              ctypes.c_int64, ctypes.c_int]
    lib.bf16_rows.restype = ctypes.c_int
    lib.bf16_rows_kind.argtypes = []
    lib.bf16_rows_kind.restype = ctypes.c_int
    lib.pool_test_sum.argtypes = [ctypes.c_int64, ctypes.c_int, ctypes.c_int64, ctypes.c_void_p]  # pool.c's, for tests
    lib.pool_test_sum.restype = ctypes.c_int64
    lib.pool_test_nested.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p]
    lib.pool_test_nested.restype = ctypes.c_int64
    lib.pool_test_runs.argtypes = [ctypes.c_int64, ctypes.c_int, ctypes.c_void_p]
    lib.pool_test_runs.restype = ctypes.c_int64
    lib.pool_test_workers.argtypes = []
    lib.pool_test_workers.restype = ctypes.c_int
    lib.decode_stack.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                 ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    lib.decode_stack.restype = ctypes.c_int
