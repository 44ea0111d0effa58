"""`jitllmd worker`: another host's rank of a cluster: holds the blocks rank 0 (`jitllmd serve -cluster`) places on
this host's devices, read from this host's own copy of each model, and those blocks' KV; no HTTP."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Annotated

import typer

from ..console import err_console, fail

__all__ = ["quiet_c10d", "run_worker", "worker"]


def worker(
    models: Annotated[Path | None, typer.Option("-models", "--models", help="Model directory: the same files at the same paths as rank 0's -models (a .gguf rank 0 converted is converted here too, into -models/.cache).", show_default=False)] = None,
    cluster: Annotated[str | None, typer.Option("-cluster", "--cluster", metavar="URL", show_default=False, help="Rank 0's -cluster address, tcp://HOST:PORT, or env:// (torch's MASTER_ADDR and MASTER_PORT). Default: env:// under torchrun.")] = None,
    rank: Annotated[int | None, typer.Option("-rank", "--rank", metavar="N", show_default=False, help="This host's rank, 1..N-1 of rank 0's -world N; its devices are named N:cpu, N:cuda:0. Default: RANK under torchrun.")] = None,
    cluster_timeout: Annotated[float, typer.Option("-cluster-timeout", "--cluster-timeout", metavar="SECONDS", help="How long to wait for rank 0 to take an answer.")] = 60.0,
    join_timeout: Annotated[float, typer.Option("-join-timeout", "--join-timeout", metavar="SECONDS", help="How long to keep trying to reach rank 0 at start-up (it may come up after this worker).")] = 300.0,
) -> None:
    """Join a cluster as a worker rank: rank 0 places blocks on this host's devices and runs them here.

    A restarted worker joins again under the same rank; models that had blocks here must then be loaded again.
    It stops when rank 0 goes away.
    """
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if cluster is None:
        if "MASTER_ADDR" not in os.environ:
            raise fail("give -cluster tcp://HOST:PORT, rank 0's -cluster address")
        cluster = "env://"
    if rank is None:
        env_rank = os.environ.get("RANK", "")
        if not env_rank.isdigit():
            raise fail("give -rank N, this host's rank (1..N-1 of rank 0's -world N)")
        rank = int(env_rank)
    run_worker(models, cluster, rank, cluster_timeout, join_timeout)


def quiet_c10d() -> None:
    """torch.distributed's C++ side logs every retry of a connection, with a stack trace, on stderr; the cluster's own
    messages say what failed. Before torch is imported; TORCH_CPP_LOG_LEVEL, if given, wins."""
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")


def run_worker(models: Path | None, cluster: str, rank: int, timeout: float, join_timeout: float = 300.0) -> None:
    """Join `cluster` as `rank` and answer rank 0 until it goes away (on a thread: Ctrl-C stops the wait at once)."""
    if rank < 1:
        raise fail(f"-rank {rank}: rank 0 is the server (`jitllmd serve -cluster`); a worker is rank 1 or more")
    if timeout <= 0 or join_timeout <= 0:
        raise fail("-cluster-timeout and -join-timeout must be positive numbers of seconds")
    if models is not None and not models.is_dir():
        raise fail(f"-models {models}: not a directory")
    quiet_c10d()
    from ..embedded import cache_dir
    from ..engine import kernels
    from ..engine.cluster.link import worker_link
    from ..engine.cluster.worker import Worker

    kernels.configure(cache_dir() / "kernels")
    models_dir = models if models is not None else Path.cwd()
    err_console.print(f"rank {rank}: joining {cluster}", style="dim")
    try:
        pg, generation, _store = worker_link(cluster, rank, join_timeout, os.environ)
    except ValueError as exc:
        raise fail(str(exc)) from None
    err_console.print(f"rank {rank}: joined (generation {generation}); serving rank 0's blocks from {models_dir}", style="dim")
    w = Worker(models_dir, models_dir / ".cache", timeout)
    box: dict[str, str] = {}
    t = threading.Thread(target=lambda: box.setdefault("why", w.serve(pg)), name=f"worker-{rank}", daemon=True)
    t.start()
    try:
        while t.is_alive():
            t.join(0.5)
    except KeyboardInterrupt:
        err_console.print(f"rank {rank}: stopped", style="dim")
        raise typer.Exit(130) from None
    err_console.print(f"rank {rank}: rank 0 went away ({box.get('why', '?')}); {w.commands} commands answered; stopping", style="dim")
