"""Devices: the device grammar, what exists, and what a device can do fast (read from the hardware, not guessed)."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import os
import platform
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["DeviceInfo", "available_devices", "is_remote", "local_device_figures", "split_place", "bf16_matmul_native", "compute_dtype", "cpu_name", "device_info", "host_memory", "parse_devices", "release_host_memory", "spendable_bytes", "synchronize", "trim_heap"]


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def bf16_matmul_native(device: torch.device | str = "cpu") -> bool:
    """True when the device multiplies bf16 in hardware.

    CPUs without bf16 units (AVX2-only x86, for one) emulate bf16 GEMM at a small fraction of f32 speed
    (measured on this project's 2-core AVX2 machines: 16 vs 125 GFLOP/s), so the engine upcasts there.
    """
    return _bf16_units(torch.device(device).type)


def compute_dtype(stored: torch.dtype, device: torch.device) -> torch.dtype:
    """f32 and bf16 compute as stored; f16 computes in bf16 on the CPU, whose f16 matmul is a scalar fallback."""
    if stored == torch.float16 and device.type == "cpu":
        return torch.bfloat16
    return stored


@functools.cache
def _bf16_units(device_type: str) -> bool:
    if device_type != "cpu":
        return True
    flags = _cpu_flags()
    if platform.machine() in ("x86_64", "AMD64"):
        return bool(flags & {"avx512_bf16", "amx_bf16"})
    return "bf16" in flags  # where flags cannot be read, upcasting is the safe choice: exact, at worst slower


def available_devices() -> list[str]:
    """Every device a spec may name: cpu, then each CUDA device, then mps."""
    found = ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        found.append("mps")
    return found


def parse_devices(spec: str, remote: list[str] | None = None) -> list[str]:
    """The device grammar -> device names. '' opens none (host only); 'auto' is every accelerator (none if none);
    'cpu' is the CPU as a device; 'cuda' is every CUDA device; 'cuda:0,cuda:1' names them. A rank prefix names another
    host's device (`1:cpu`, `1:cuda:0`, `1:cuda` for all of rank 1's): `remote` lists the cluster's (`Cluster.devices`;
    None: no cluster). `0:` is this host. Unknown names raise."""
    spec = spec.strip()
    if not spec:
        return []
    exists = available_devices()
    accelerators = [d for d in exists if d != "cpu"]
    if spec == "auto":
        return accelerators
    out: list[str] = []
    for part in (p.strip() for p in spec.split(",")):
        rank, local = split_place(part)
        if rank > 0:
            names = _remote_names(spec, rank, local, remote)
        else:
            part = local  # 0:cpu is cpu
            if part == "cuda":
                names = [d for d in exists if d.startswith("cuda:")]
                if not names:
                    raise ValueError(f"-devices {spec}: no CUDA device here (devices: {', '.join(exists)})")
            elif part == "cuda:":
                raise ValueError(f"-devices {spec}: give the CUDA device's number, e.g. cuda:0")
            else:
                names = [part]
                if part not in exists:
                    raise ValueError(f"-devices {spec}: no device {part!r} here (devices: {', '.join(exists)})")
        out += [n for n in names if n not in out]
    return out


def _remote_names(spec: str, rank: int, local: str, remote: list[str] | None) -> list[str]:
    if remote is None:
        raise ValueError(f"-devices {spec}: rank {rank} names another host, and this server is not in a cluster (start it with -cluster and -world)")
    theirs = [d for d in remote if d.startswith(f"{rank}:")]
    if not theirs:
        raise ValueError(f"-devices {spec}: rank {rank} is not in the cluster (devices: {', '.join(remote) or 'none remote'})")
    if local == "cuda":
        names = [d for d in theirs if d.startswith(f"{rank}:cuda:")]
    else:
        names = [f"{rank}:{local}"] if f"{rank}:{local}" in theirs else []
    if not names:
        raise ValueError(f"-devices {spec}: rank {rank} has no device {local!r} (its devices: {', '.join(theirs)})")
    return names


def split_place(place: str) -> tuple[int, str]:
    """`1:cuda:0` -> (1, 'cuda:0'); a place of this host -> (0, place)."""
    head, sep, rest = place.partition(":")
    if sep and head.isdigit():
        return int(head), rest
    return 0, place


def is_remote(place: str) -> bool:
    """A device of another rank (`1:cpu`), which this process reaches through the cluster."""
    return split_place(place)[0] > 0


def local_device_figures() -> list[dict[str, Any]]:
    """Every device of this host with its memory now, as a worker reports them to rank 0."""
    out = []
    for d in available_devices():
        info = device_info(d)
        out.append({"id": info.id, "kind": info.kind, "name": info.name, "total": info.total_bytes, "free": info.free_bytes})
    return out


@dataclass(frozen=True)
class DeviceInfo:
    id: str
    kind: str  # cpu, cuda, mps
    name: str
    total_bytes: int
    free_bytes: int


def host_memory() -> tuple[int, int]:
    """(total, available) bytes of host memory, from the OS."""
    fields: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                fields[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    page = os.sysconf("SC_PAGE_SIZE")
    total = fields.get("MemTotal") or os.sysconf("SC_PHYS_PAGES") * page
    available = fields.get("MemAvailable") or os.sysconf("SC_AVPHYS_PAGES") * page
    return total, available


@functools.cache
def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_info(device: str) -> DeviceInfo:
    """What a device is and its memory now. The CPU as a device has the host's memory."""
    if device == "cpu":
        total, free = host_memory()
        return DeviceInfo("cpu", "cpu", cpu_name(), total, free)
    if device.startswith("cuda:"):
        index = int(device.split(":", 1)[1])
        free, total = torch.cuda.mem_get_info(index)
        return DeviceInfo(device, "cuda", torch.cuda.get_device_name(index), total, free)
    if device == "mps":
        total, free = host_memory()  # unified memory
        return DeviceInfo("mps", "mps", "Apple GPU", total, free)
    raise ValueError(f"no device {device!r} here (devices: {', '.join(available_devices())})")


def own_memory(kind: str) -> bool:
    """Whether a device of this kind (DeviceInfo.kind) has memory of its own, not the host's (a GPU's, not the CPU's
    or Apple's unified memory)."""
    return kind not in ("cpu", "mps")


def quantized_products(kind: str) -> str:
    """How quantized blocks (GGUF's formats, kept quantized) multiply on a device of this kind: the CPU kernels
    (engine/kernels), or elsewhere torch's ops over the weight dequantized to f32 for each product (correct, not fast)."""
    return "the CPU kernels" if kind == "cpu" else "dequantized to f32 for each product (torch ops)"


def synchronize(device: torch.device | str) -> None:
    """Wait for the work queued on `device` to finish, so a clock read after it times the work, not its launch.

    CUDA and MPS queue kernels and return at once; the CPU runs them before returning, so there it does nothing.
    """
    if isinstance(device, str) and is_remote(device):
        return  # another rank's: its answer comes after its work
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()  # mps has one device and no per-device call


def release_host_memory() -> None:
    """Collect unreachable objects (an engine and its model form cycles) and hand freed heap back to the OS.

    glibc keeps freed memory in per-thread arenas; an unloaded model's engine thread leaves hundreds of MB there
    unless trimmed (measured: RSS stayed at the loaded size after unloading SmolLM2 until malloc_trim).
    """
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    trim_heap()


def trim_heap() -> None:
    """glibc's malloc_trim: return freed heap pages to the OS (a no-op elsewhere)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Any:
    """libc's malloc_trim, looked up once (find_library runs ldconfig), or None where there is none (not glibc)."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None


def spendable_bytes(device: str, unspent_budget: int, remote_free: Callable[[str], int] | None = None) -> int:
    """Free memory a device can take blocks into: the driver's figure; the CPU's, less what the host page budget
    may still read in (`Pager.unspent_bytes`: what is already resident is out of the free figure). Another rank's:
    what it last said was free (`remote_free`, the cluster's; it pages nothing)."""
    if is_remote(device):
        if remote_free is None:
            raise ValueError(f"{device} names another host, and this server is not in a cluster")
        return remote_free(device)
    info = device_info(device)
    if info.kind == "cuda":  # what torch's allocator holds freed (a block moved off, say) is this process's to reuse
        return info.free_bytes + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return max(0, info.free_bytes - unspent_budget) if info.kind == "cpu" else info.free_bytes
