"""Several hosts as one server, through torch.distributed: rank 0 (the server) holds a TCPStore at the -cluster
address; each other rank (`jitllmd worker`) joins it and gets a gloo pair group with rank 0, over which rank 0 sends
it commands (open a model, hold blocks, run them on a hidden state, carry KV) and it answers each in turn.

A pair group per worker, not one world group: a worker that dies takes only its own link down, and a restarted one
joins again (a new generation of its rank) while the server and the other ranks go on. Every wait has a timeout: a
rank that stops answering fails the call that waits on it (RankError) and its link stays down until it rejoins.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from ..memory.devices import local_device_figures, split_place

__all__ = ["Channel", "Cluster", "ClusterAddress", "Link", "RankError", "RemoteError", "cluster_address", "join_store"]

log = logging.getLogger("jitllmd.cluster")
_PREFIX = "jitllmd"
_POLL_S = 0.2  # how often rank 0 looks for a rank that (re)joins
_PING_S = 2.0  # how often an idle link is asked for its devices' memory (and so found dead)
_ALIGN = 16  # each tensor of a message starts at a multiple of this many bytes (any dtype's view of it is aligned)
FOREVER = timedelta(days=3650)  # a worker waits this long for rank 0's next command (rank 0 going away ends it at once)


class RankError(RuntimeError):
    """A rank died or stopped answering: what waited on it fails (a 503 to clients), never hangs."""


class RemoteError(ValueError):
    """A rank answered, with an error: the command was wrong for it (a model file it lacks, say)."""


@dataclass(frozen=True)
class ClusterAddress:
    host: str
    port: int
    agent_store: bool = False  # torchrun's agent hosts the store: every rank, rank 0 too, connects to it


def cluster_address(url: str, env: Mapping[str, str] | None = None) -> ClusterAddress:
    """`tcp://HOST:PORT` (as torch.distributed's init_method), or `env://`: torch's MASTER_ADDR and MASTER_PORT in
    `env` (the process environment the command hands in, as torchrun sets it). ValueError says what is wrong."""
    if url == "env://":
        env = env or {}
        host, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
        if not host or not port or not port.isdigit():
            raise ValueError("-cluster env:// needs MASTER_ADDR and MASTER_PORT in the environment (torchrun sets them)")
        return ClusterAddress(host, int(port), env.get("TORCHELASTIC_USE_AGENT_STORE") == "True")
    parsed = urlparse(url)
    if parsed.scheme != "tcp" or not parsed.hostname or parsed.port is None:
        raise ValueError(f"-cluster {url}: give tcp://HOST:PORT (rank 0's address) or env:// (torchrun's MASTER_ADDR and MASTER_PORT)")
    return ClusterAddress(parsed.hostname, parsed.port)


def join_store(address: ClusterAddress, *, master: bool, timeout: float) -> dist.TCPStore:
    """The cluster's TCPStore: served by rank 0 (unless torchrun's agent serves it), joined by the others, which retry
    until `timeout` while rank 0 is not up yet."""
    hosting = master and not address.agent_store
    what = f"cannot listen on {address.host}:{address.port}" if hosting else f"cannot reach rank 0's store at {address.host}:{address.port} within {timeout:g} s"
    try:
        sock = _listen(address.host, address.port) if hosting else None
    except OSError as exc:
        raise ValueError(f"-cluster: {what}: {exc.strerror or exc}") from None
    try:
        store = dist.TCPStore(address.host, address.port, None, hosting, timedelta(seconds=timeout), wait_for_workers=False, multi_tenant=True,
                              master_listen_fd=sock.fileno() if sock is not None else None)
    except (RuntimeError, dist.DistError) as exc:
        if sock is not None:
            sock.close()
        raise ValueError(f"-cluster: {what}: {_first_line(exc)}") from None
    if sock is not None:
        sock.detach()  # the store owns the descriptor now, and closes it with itself
    return store


def _listen(host: str, port: int) -> socket.socket:
    """A socket listening on host:port only: the store's own socket, however its host is given, listens on every
    interface, and the -cluster address may be a loopback or private one that was meant to stay so."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, sockaddr = min(infos, key=lambda info: info[0] != socket.AF_INET)  # IPv4 where the name has both
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6 and sockaddr[0] == "::":
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # every interface, IPv4 too, as the store's own
        sock.bind(sockaddr)
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    return sock


# -- the wire: one message each way per command where it fits the receiver's buffer ---------------------------------


class Channel:
    """One side of a pair group, to `peer`: a message is a JSON document and tensors, sent as one byte buffer
    ([total bytes, JSON bytes], the JSON, each tensor's bytes at a multiple of _ALIGN). The receiver posts one buffer of
    `INBOX` bytes (gloo takes a shorter message into a longer buffer); a longer message sends its rest after it."""

    INBOX = 1 << 20

    def __init__(self, pg: Any, peer: int):
        self.pg = pg
        self.peer = peer
        self._inbox = torch.empty(self.INBOX, dtype=torch.uint8)

    def send(self, doc: dict[str, Any], tensors: list[torch.Tensor] = (), timeout: timedelta | None = None) -> None:  # type: ignore[assignment]
        """One message: `doc` and `tensors` (any dtype, any device: sent from host memory)."""
        flat = [t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8) for t in tensors]
        specs, offset = [], 0
        for t, f in zip(tensors, flat):
            specs.append([str(t.dtype).removeprefix("torch."), list(t.shape), offset])
            offset += _aligned(f.numel())
        head = json.dumps({**doc, "tensors": specs}, separators=(",", ":")).encode()
        lead = _aligned(12 + len(head))
        total = lead + offset
        buf = torch.empty(total, dtype=torch.uint8)
        view = buf.numpy()
        view[:12] = memoryview(struct.pack("<QI", total, len(head)))
        view[12 : 12 + len(head)] = memoryview(head)
        at = lead
        for f in flat:
            buf[at : at + f.numel()] = f
            at += _aligned(f.numel())
        _wait(self.pg.send([buf[: self.INBOX]], self.peer, 0), timeout)
        if total > self.INBOX:
            _wait(self.pg.send([buf[self.INBOX :]], self.peer, 1), timeout)

    def recv(self, timeout: timedelta | None = None) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """The next message: its JSON document and its tensors (on the CPU, their own memory)."""
        _wait(self.pg.recv([self._inbox], self.peer, 0), timeout)
        total, n = struct.unpack("<QI", self._inbox[:12].numpy().tobytes())
        payload = self._inbox
        if total > self.INBOX:
            rest = torch.empty(total - self.INBOX, dtype=torch.uint8)
            _wait(self.pg.recv([rest], self.peer, 1), timeout)
            payload = torch.cat([self._inbox, rest])
        doc = json.loads(payload[12 : 12 + n].numpy().tobytes())
        lead = _aligned(12 + n)
        out = []
        for dtype_name, shape, offset in doc.pop("tensors"):
            dtype = getattr(torch, dtype_name)
            nbytes = torch.Size(shape).numel() * dtype.itemsize
            out.append(payload[lead + offset : lead + offset + nbytes].view(dtype).view(shape).clone())  # the inbox is reused
        return doc, out


def _aligned(n: int) -> int:
    return n + (-n % _ALIGN)


def _wait(work: Any, timeout: timedelta | None) -> None:
    if timeout is None:
        work.wait()
    else:
        work.wait(timeout)


def _first_line(exc: BaseException) -> str:
    """An error of gloo or the store in one line: its message without gloo's source location and advice."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = text.split("] ", 1)[-1] if text.startswith("[") else text  # gloo's "[file:line] message"
    return text.split(". This is typically", 1)[0]


# -- rank 0's side ----------------------------------------------------------------------------------------------------


class Link:
    """Rank 0's pair group with one worker: one call at a time (a command and its answer); any failure ends it."""

    def __init__(self, rank: int, generation: int, pg: Any, hello: dict[str, Any], timeout: float):
        self.rank = rank
        self.generation = generation
        self.pg = pg
        self.channel = Channel(pg, 1)
        self.host = str(hello.get("host", "?"))
        self.pid = int(hello.get("pid", 0))
        self.devices: list[dict[str, Any]] = list(hello.get("devices", []))  # what the worker has: id, kind, name, total, free
        self.timeout = timeout
        self.error: str | None = None
        self.lock = threading.Lock()

    @property
    def alive(self) -> bool:
        return self.error is None

    def call(self, op: str, doc: dict[str, Any] | None = None, tensors: list[torch.Tensor] = (), timeout: float | None = None) -> tuple[dict[str, Any], list[torch.Tensor]]:  # type: ignore[assignment]
        """Send a command, wait for its answer (at most `timeout` s, default the cluster's). RankError if the rank is
        gone or does not answer in time (the link is then down); RemoteError if it answered with an error."""
        wait = timedelta(seconds=timeout if timeout is not None else self.timeout)
        with self.lock:
            if self.error is not None:
                raise RankError(f"rank {self.rank} ({self.host}) is unreachable: {self.error}")
            try:
                self.channel.send({"op": op, **(doc or {})}, list(tensors), wait)
                answer, out = self.channel.recv(wait)
            except (RuntimeError, dist.DistError) as exc:
                self.error = _first_line(exc)
                log.warning("rank %d (%s) is unreachable: %s", self.rank, self.host, self.error)
                raise RankError(f"rank {self.rank} ({self.host}) is unreachable: {self.error}") from None
        if "error" in answer:
            raise RemoteError(f"rank {self.rank}: {answer['error']}")
        return answer, out

    def ping(self) -> None:
        """Refresh the devices' memory figures, unless a call is under way (which says the rank answers)."""
        if not self.alive or not self.lock.acquire(blocking=False):
            return
        self.lock.release()
        try:
            answer, _ = self.call("info", timeout=min(self.timeout, 10.0))
            self.devices = answer["devices"]
        except (RankError, RemoteError):
            pass

    def close(self, why: str = "closed") -> None:
        """End the link: a live worker is told to stop (a worker whose rank rejoined, or that is gone, is not)."""
        if self.alive:
            try:
                self.call("bye", timeout=min(self.timeout, 5.0))
            except (RankError, RemoteError):
                pass
        self.error = self.error or why
        try:
            self.pg.abort()
        except Exception:  # already broken: nothing more to let go of
            pass


class Cluster:
    """Rank 0's view of the cluster: the store, and a link to each worker rank that joined (kept up to date: a rank
    that comes back replaces its old link)."""

    def __init__(self, url: str, world: int, timeout: float = 30.0, join_timeout: float = 60.0, env: Mapping[str, str] | None = None):
        if world < 2:
            raise ValueError(f"-world {world}: a cluster has rank 0 and at least one worker (give 2 or more)")
        if timeout <= 0 or join_timeout <= 0:
            raise ValueError("-cluster-timeout and -join-timeout must be positive numbers of seconds")
        self.url = url
        self.world = world
        self.timeout = timeout
        self.address = cluster_address(url, env)
        self.store = join_store(self.address, master=True, timeout=join_timeout)
        self.store.set(f"{_PREFIX}/world", str(world))
        self.links: dict[int, Link] = {}
        self._changed = threading.Condition()
        self._closed = False
        self._threads = [threading.Thread(target=self._accept, name="cluster-accept", daemon=True),
                         threading.Thread(target=self._watch, name="cluster-ping", daemon=True)]
        for t in self._threads:
            t.start()
        self._wait_for_all(join_timeout)

    def _wait_for_all(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._changed:
            while len(self.links) < self.world - 1:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [str(r) for r in range(1, self.world) if r not in self.links]
                    self.close()
                    ranks = "rank " + missing[0] if len(missing) == 1 else "ranks " + ", ".join(missing)
                    raise ValueError(f"-cluster {self.url}: {ranks} did not join within {timeout:g} s of -join-timeout (start `jitllmd worker -cluster {self.url} "
                                     f"-rank {missing[0]}` on its host, with the same -models)")
                self._changed.wait(min(left, 0.5))

    def _accept(self) -> None:
        """Wait for ranks to join (again): a worker takes the next generation of its rank, says hello, and both sides
        build their pair group under that generation's prefix. One thread for every rank: the store's client is one
        connection, and a wait on it holds it."""
        seen = dict.fromkeys(range(1, self.world), 0)
        while not self._closed:
            joined = False
            for rank in seen:
                try:
                    generation = int(self.store.add(f"{_PREFIX}/{rank}/gen", 0))
                except (RuntimeError, dist.DistError):
                    return  # the store is gone: the server is stopping
                if generation > seen[rank]:
                    seen[rank] = generation
                    self._join(rank, generation)
                    joined = True
            if not joined:
                time.sleep(_POLL_S)

    def _join(self, rank: int, generation: int) -> None:
        try:
            self.store.wait([f"{_PREFIX}/{rank}/hello/{generation}"], timedelta(seconds=min(self.timeout, 10.0)))  # set just after gen
            hello = json.loads(self.store.get(f"{_PREFIX}/{rank}/hello/{generation}"))
            prefixed = dist.PrefixStore(f"{_PREFIX}/{rank}/{generation}/", self.store)
            pg = dist.ProcessGroupGloo(prefixed, 0, 2, timedelta(seconds=self.timeout))
        except (RuntimeError, dist.DistError, ValueError) as exc:
            log.warning("rank %d (generation %d) did not finish joining: %s", rank, generation, _first_line(exc))
            return
        link = Link(rank, generation, pg, hello, self.timeout)
        with self._changed:
            old = self.links.get(rank)
            self.links[rank] = link
            self._changed.notify_all()
        if old is not None:
            old.error = old.error or "it joined again as a new process: load the model again to use it"
            old.close()
        log.info("rank %d joined from %s (pid %d): %s", rank, link.host, link.pid, ", ".join(f"{rank}:{d['id']}" for d in link.devices))

    def _watch(self) -> None:
        while not self._closed:
            time.sleep(_PING_S)
            for link in list(self.links.values()):
                link.ping()

    def link(self, rank: int) -> Link:
        """The current link to `rank` (RankError if it never joined or is down)."""
        link = self.links.get(rank)
        if link is None:
            raise RankError(f"rank {rank} has not joined the cluster")
        if not link.alive:
            raise RankError(f"rank {rank} ({link.host}) is unreachable: {link.error}")
        return link

    def devices(self) -> list[str]:
        """Every remote device a spec may name: `R:ID` for each device of each rank that joined, live or not."""
        return [f"{r}:{d['id']}" for r, link in sorted(self.links.items()) for d in link.devices]

    def free_bytes(self, place: str) -> int:
        """What a remote device `R:ID` last said was free."""
        return int(self.device(place)[1]["free"])

    def device(self, place: str) -> tuple[Link, dict[str, Any]]:
        """The link and the last known figures of a remote device `R:ID`."""
        rank, local = split_place(place)
        link = self.links.get(rank)
        if link is None:
            raise RankError(f"rank {rank} has not joined the cluster")
        for d in link.devices:
            if d["id"] == local:
                return link, d
        raise ValueError(f"rank {rank} has no device {local!r} (it has {', '.join(d['id'] for d in link.devices)})")

    def close(self) -> None:
        """Let every link go (the workers see rank 0 leave and stop)."""
        self._closed = True
        for link in list(self.links.values()):
            link.close()


def hello_info(devices: list[dict[str, Any]]) -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid(), "devices": devices}


def worker_link(url: str, rank: int, timeout: float, env: Mapping[str, str] | None = None) -> tuple[Any, int, dist.TCPStore]:
    """A worker's side of joining: the store (rank 0's, retried until `timeout`), the world it announced (the rank must
    be in it), a new generation of this rank, hello, and the pair group with rank 0. -> (pair group, generation, store)."""
    address = cluster_address(url, env)
    store = join_store(address, master=False, timeout=timeout)
    try:
        store.wait([f"{_PREFIX}/world"], timedelta(seconds=timeout))
        world = int(store.get(f"{_PREFIX}/world"))
    except (RuntimeError, dist.DistError) as exc:
        raise ValueError(f"-cluster {url}: rank 0 did not announce the cluster within {timeout:g} s: {_first_line(exc)}") from None
    if not 1 <= rank < world:
        raise ValueError(f"-rank {rank}: the cluster at {url} has ranks 1..{world - 1} for workers (rank 0 is the server; -world {world})")
    generation = int(store.add(f"{_PREFIX}/{rank}/gen", 1))
    store.set(f"{_PREFIX}/{rank}/hello/{generation}", json.dumps(hello_info(local_device_figures())))
    try:
        pg = dist.ProcessGroupGloo(dist.PrefixStore(f"{_PREFIX}/{rank}/{generation}/", store), 1, 2, timedelta(seconds=timeout))
    except (RuntimeError, dist.DistError) as exc:
        raise ValueError(f"-cluster {url}: rank 0 did not take rank {rank} within {timeout:g} s: {_first_line(exc)}") from None
    return pg, generation, store
