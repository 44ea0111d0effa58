"""Devices: what a torch device can do fast, read from the hardware rather than guessed."""

from __future__ import annotations

import functools
import platform

__all__ = ["bf16_matmul_native"]


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@functools.cache
def bf16_matmul_native(device_type: str = "cpu") -> bool:
    """True when the device multiplies bf16 in hardware.

    CPUs without bf16 units (AVX2-only x86, for one) emulate bf16 GEMM at a small fraction of f32 speed
    (measured on this project's 2-core AVX2 machines: 16 vs 125 GFLOP/s), so the engine upcasts there.
    """
    if device_type != "cpu":
        return True
    flags = _cpu_flags()
    if platform.machine() in ("x86_64", "AMD64"):
        return bool(flags & {"avx512_bf16", "amx_bf16"})
    return "bf16" in flags  # where flags cannot be read, upcasting is the safe choice: exact, at worst slower
