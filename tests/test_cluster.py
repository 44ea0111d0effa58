"""A model's blocks on other ranks (engine/cluster/link.py, remote.py, worker.py): rank 0 in this process, two
`jitllmd worker` processes on loopback (gloo), tiny random models. Greedy tokens equal a single process's: for one
request, for batched rows, across moves of blocks between ranks mid-conversation, for a quantized model and for a
sliding-window one past its window."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from jitllmd.engine.cluster.link import Cluster, RankError, cluster_address
from jitllmd.engine.cluster.remote import RemoteModel
from jitllmd.engine.engine import Engine
from jitllmd.engine.memory.devices import is_remote, parse_devices
from jitllmd.engine.memory.placement import HOST, plan_places
from jitllmd.engine.request import Delta, Done, Failed, Generation
from jitllmd.engine.sampler import SamplingParams

from .conftest import write_tiny_llama
from .test_client_verbs import free_port

GREEDY = SamplingParams(temperature=0)
PROMPTS = [[5, 6, 7, 8, 9], [12, 11, 10], [30, 31, 32, 33, 34, 35, 36], [40]]


def start_worker(models: Path, url: str, rank: int, timeout: float = 60.0) -> subprocess.Popen[str]:
    """`jitllmd worker` as rank `rank`; its log goes to worker-RANK-PORT.log beside -models."""
    from .serving import _die_with_parent

    cmd = [sys.executable, "-m", "jitllmd", "worker", "-models", str(models), "-cluster", url, "-rank", str(rank), "-cluster-timeout", str(timeout)]
    with open(models.parent / f"worker-{rank}-{url.rsplit(':', 1)[1]}.log", "a") as log:
        return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, text=True, preexec_fn=_die_with_parent)


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory) -> Path:
    """tiny.jlm (a 4-layer llama), tiny-q8_0.jlm (the same, Q8_0) and gemma.jlm (a 4-layer Gemma 3 with a window of 8)."""
    from jitllmd.engine.convert import convert

    from .conftest import fixed_tokenizer_json, write_tiny_hf

    root = tmp_path_factory.mktemp("cluster")
    hf, _ = write_tiny_llama(root / "hf", max_position_embeddings=512, num_hidden_layers=4)
    d = root / "models"
    d.mkdir()
    convert(hf, d / "tiny.jlm", "f32")
    convert(hf, d / "tiny-q8_0.jlm", "q8_0")
    gemma, _ = write_tiny_hf(root / "gemma", "gemma3", max_position_embeddings=512, sliding_window=8, num_hidden_layers=4,
                             layer_types=["sliding_attention", "full_attention"] * 2, tie_word_embeddings=True)
    (gemma / "tokenizer.json").write_text(fixed_tokenizer_json())
    convert(gemma, d / "gemma.jlm", "f32")
    return d


@pytest.fixture(scope="module")
def cluster(models_dir: Path):
    """Rank 0 here; ranks 1 and 2 are `jitllmd worker` processes."""
    url = f"tcp://127.0.0.1:{free_port()}"
    workers = [start_worker(models_dir, url, r) for r in (1, 2)]
    c = Cluster(url, 3, timeout=60.0, join_timeout=120.0)
    yield c
    c.close()
    for w in workers:
        try:
            w.wait(30)  # each stops once rank 0 lets its link go
        except subprocess.TimeoutExpired:
            w.kill()
            w.wait()


def generate(engine: Engine, prompt: list[int], n: int = 24, **kw) -> list[int]:
    out: list[int] = []
    for ev in engine.generate(Generation(prompt, GREEDY, max_tokens=n, ignore_eos=True, **kw)):
        if isinstance(ev, Failed):
            raise AssertionError(ev.message)
        if isinstance(ev, Delta):
            out += ev.token_ids
    return out


def load(models_dir: Path, name: str, cluster: Cluster | None = None, rows: int = 1) -> Engine:
    devices = ["cpu", "1:cpu", "2:cpu"] if cluster is not None else ["cpu"]
    return Engine.load(models_dir / name, devices=devices, max_seq=256, sessions=rows, max_batch=rows, host_rows=rows, split_rows=rows,
                       cluster=cluster, shared=(name, None))


def conversation(engine: Engine, moves: list[tuple[int, int, str]] | None = None) -> list[list[int]]:
    """Four turns of one named session (24 tokens each); before turns 2..4 the blocks move as `moves` says."""
    session = engine.new_session()
    out = [generate(engine, PROMPTS[0], session=session)]
    for i, prompt in enumerate(PROMPTS[1:]):
        if moves is not None:
            first, last, to = moves[i]
            engine.relocate(first, last, to, session).result()
        out.append(generate(engine, prompt, session=session))
    return out


@pytest.fixture(scope="module")
def reference(models_dir: Path) -> dict[str, dict]:
    """A single process's answers (every block on its cpu device)."""
    out: dict[str, dict] = {}
    for name in ("tiny.jlm", "tiny-q8_0.jlm", "gemma.jlm"):
        engine = load(models_dir, name)
        try:
            out[name] = {"one": [generate(engine, p) for p in PROMPTS], "turns": conversation(engine), "long": generate(engine, PROMPTS[2], 60)}
        finally:
            engine.stop()
    return out


# -- the device grammar and the plan ---------------------------------------------------------------------------------


def test_rank_prefix_in_the_device_grammar() -> None:
    remote = ["1:cpu", "1:cuda:0", "1:cuda:1", "2:cpu"]
    assert parse_devices("cpu,1:cpu,2:cpu", remote) == ["cpu", "1:cpu", "2:cpu"]
    assert parse_devices("0:cpu,1:cuda", remote) == ["cpu", "1:cuda:0", "1:cuda:1"]
    assert is_remote("1:cuda:0") and not is_remote("cuda:0") and not is_remote("cpu")
    with pytest.raises(ValueError, match="not in a cluster"):
        parse_devices("cpu,1:cpu")
    with pytest.raises(ValueError, match=r"rank 3 is not in the cluster \(devices: 1:cpu"):
        parse_devices("3:cpu", remote)
    with pytest.raises(ValueError, match="rank 2 has no device 'cuda:0'"):
        parse_devices("2:cuda:0", remote)


def test_cluster_addresses() -> None:
    assert cluster_address("tcp://hostA:29500").port == 29500
    with pytest.raises(ValueError, match="tcp://HOST:PORT"):
        cluster_address("http://hostA")
    env = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    a = cluster_address("env://", env)
    assert (a.host, a.port, a.agent_store) == ("10.0.0.1", 29400, True)
    with pytest.raises(ValueError, match="MASTER_ADDR and MASTER_PORT"):
        cluster_address("env://", {"MASTER_ADDR": "10.0.0.1"})


def test_plan_keeps_embed_and_head_on_rank_0() -> None:
    blocks, kv = [10] * 6, [0, 1, 1, 1, 1, 0]
    ends = frozenset({0, 5})
    # room for the head and two layers here, the rest on rank 1: pipeline order, embed on the host
    assert plan_places(blocks, kv, [("cpu", 33), ("1:cpu", 100)], -1, ends) == [HOST, "1:cpu", "1:cpu", "cpu", "cpu", "cpu"]
    # another rank first: the head stays here (on the host), the layers go there
    assert plan_places(blocks, kv, [("1:cpu", 100)], -1, ends) == [HOST, "1:cpu", "1:cpu", "1:cpu", "1:cpu", HOST]


def test_a_rank_that_never_joins_is_named() -> None:
    url = f"tcp://127.0.0.1:{free_port()}"
    with pytest.raises(ValueError, match=r"rank 1 did not join within 1 s of -join-timeout \(start `jitllmd worker -cluster tcp://127\.0\.0\.1:\d+ -rank 1`"):
        Cluster(url, 2, timeout=1.0, join_timeout=1.0)


# -- tokens across ranks ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["tiny.jlm", "tiny-q8_0.jlm", "gemma.jlm"])
def test_greedy_tokens_across_three_processes(models_dir: Path, cluster: Cluster, reference: dict, name: str) -> None:
    engine = load(models_dir, name, cluster)
    try:
        engine.relocate(1, 1, "1:cpu").result()  # layer 0 on rank 1, layers 1-2 on rank 2, layer 3 here
        engine.relocate(2, 3, "2:cpu").result()
        assert engine.loaded.placement.places == ["cpu", "1:cpu", "2:cpu", "2:cpu", "cpu", "cpu"]
        assert [generate(engine, p) for p in PROMPTS] == reference[name]["one"]
        assert generate(engine, PROMPTS[2], 60) == reference[name]["long"]  # past gemma's window of 8
        engine.relocate(1, 4, "1:cpu").result()  # the last layer there too: its tokens keep only the sampled one's row
        assert [generate(engine, p) for p in PROMPTS] == reference[name]["one"]
    finally:
        engine.stop()


def test_batched_rows_cross_each_seam_as_one_tensor(models_dir: Path, cluster: Cluster, reference: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    rows_per_call: list[int] = []
    run = RemoteModel.run

    def counted(self, first, last, x, positions, rows, keep):  # noqa: ANN001
        rows_per_call.append(len(rows))
        assert x.shape[0] == sum(r.num_tokens for r in rows)
        return run(self, first, last, x, positions, rows, keep)

    monkeypatch.setattr(RemoteModel, "run", counted)
    engine = load(models_dir, "tiny.jlm", cluster, rows=4)
    try:
        engine.relocate(2, 3, "1:cpu").result()
        results: dict[int, list[int]] = {}
        gate = threading.Barrier(len(PROMPTS))

        def one(i: int) -> None:
            gate.wait()
            results[i] = generate(engine, PROMPTS[i])

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [results[i] for i in range(len(PROMPTS))] == reference["tiny.jlm"]["one"]
        assert max(rows_per_call) > 1  # rows of one step went over together
    finally:
        engine.stop()


@pytest.mark.parametrize("name", ["tiny.jlm", "gemma.jlm"])
def test_moves_between_ranks_mid_conversation(models_dir: Path, cluster: Cluster, reference: dict, name: str) -> None:
    engine = load(models_dir, name, cluster)
    try:
        moves = [(2, 3, "1:cpu"), (1, 3, "2:cpu"), (1, 4, "cpu")]  # out to rank 1, across to rank 2, home again
        assert conversation(engine, moves) == reference[name]["turns"]
        assert engine.loaded.placement.places == ["cpu"] * 6
        assert engine.loaded.placement.remotes  # rank 1 and 2 were opened...
    finally:
        engine.stop()


def test_a_session_kv_left_behind_is_let_go(models_dir: Path, cluster: Cluster) -> None:
    """Ephemeral sessions' KV on a rank goes when rank 0's goes (with the next call there)."""
    engine = load(models_dir, "tiny.jlm", cluster)
    try:
        engine.relocate(2, 3, "1:cpu").result()
        remote = engine.loaded.placement.remotes[1]
        session = engine.new_session()
        generate(engine, PROMPTS[0], session=session)
        key = session.kv.key
        assert key in remote._known
        engine.sessions.close(session.id)
        del session
        import gc

        gc.collect()
        generate(engine, PROMPTS[1])
        assert key not in remote._known
    finally:
        engine.stop()


def test_embed_and_head_stay_on_rank_0(models_dir: Path, cluster: Cluster) -> None:
    engine = load(models_dir, "tiny.jlm", cluster)
    try:
        with pytest.raises(ValueError, match="include head .5., which stays on this host"):
            engine.relocate(3, 5, "1:cpu").result()
        with pytest.raises(ValueError, match="include embed"):
            engine.relocate(0, 2, "1:cpu").result()
        assert engine.loaded.placement.places == ["cpu"] * 6
    finally:
        engine.stop()


def test_a_rank_without_the_file_refuses_the_move(tmp_path: Path, models_dir: Path) -> None:
    """Rank 1 started on an empty -models: the move fails with its message, and the model serves on as it was."""
    url = f"tcp://127.0.0.1:{free_port()}"
    empty = tmp_path / "empty"
    empty.mkdir()
    worker = start_worker(empty, url, 1)
    c = Cluster(url, 2, timeout=60.0, join_timeout=120.0)
    engine = Engine.load(models_dir / "tiny.jlm", devices=["cpu", "1:cpu"], max_seq=256, cluster=c, shared=("tiny.jlm", None))
    try:
        with pytest.raises(ValueError, match=r"rank 1: tiny\.jlm: no such model file in .*empty \(each rank needs its own copy"):
            engine.relocate(2, 3, "1:cpu").result()
        assert engine.loaded.placement.places == ["cpu"] * 6
        assert len(generate(engine, PROMPTS[0])) == 24
    finally:
        engine.stop()
        c.close()
        worker.wait(30)


def test_a_dead_rank_fails_its_rows_and_rejoins(models_dir: Path) -> None:
    """Killed mid-generation: the request fails as unavailable (no hang), later ones fail at once; a restarted rank
    joins again and a model loaded again uses it."""
    url = f"tcp://127.0.0.1:{free_port()}"
    worker = start_worker(models_dir, url, 1)
    c = Cluster(url, 2, timeout=10.0, join_timeout=120.0)
    engine = Engine.load(models_dir / "tiny.jlm", devices=["cpu", "1:cpu"], max_seq=512, cluster=c, shared=("tiny.jlm", None))
    again = None
    try:
        engine.relocate(2, 3, "1:cpu").result()
        events = engine.generate(Generation(PROMPTS[0], GREEDY, max_tokens=400, ignore_eos=True))
        first = next(events)
        assert isinstance(first, Delta)
        worker.kill()
        worker.wait()
        rest = list(events)
        assert isinstance(rest[-1], Failed) and rest[-1].unavailable
        assert "rank 1" in rest[-1].message and "unreachable" in rest[-1].message
        after = list(engine.generate(Generation(PROMPTS[1], GREEDY, max_tokens=4)))
        assert isinstance(after[-1], Failed) and after[-1].unavailable
        with pytest.raises(RankError):
            c.link(1)
        engine.stop()  # the model lets go of its blocks there: the rank is gone, nothing waits on it

        worker = start_worker(models_dir, url, 1)
        old = c.links[1]
        deadline = 120
        import time

        t0 = time.monotonic()
        while c.links[1] is old and time.monotonic() - t0 < deadline:
            time.sleep(0.2)
        assert c.links[1] is not old and c.link(1).generation == 2
        again = Engine.load(models_dir / "tiny.jlm", devices=["cpu", "1:cpu"], max_seq=512, cluster=c, shared=("tiny.jlm", None))
        again.relocate(2, 3, "1:cpu").result()
        done = list(again.generate(Generation(PROMPTS[0], GREEDY, max_tokens=8, ignore_eos=True)))
        assert isinstance(done[-1], Done)
    finally:
        engine.stop()
        if again is not None:
            again.stop()
        c.close()
        worker.wait(30)


def test_kv_of_a_layer_comes_back_exactly(models_dir: Path, cluster: Cluster) -> None:
    """A session's K/V of the moved layers, out to rank 1 and back, bit for bit."""
    engine = load(models_dir, "tiny.jlm", cluster)
    try:
        session = engine.new_session()
        generate(engine, PROMPTS[2], session=session)
        before = [(k.clone(), v.clone()) for k, v in (session.kv.filled(i) for i in range(4))]
        engine.relocate(2, 3, "1:cpu", session).result()
        assert session.kv.devices[1] == torch.device("meta") and session.kv.devices[2] == torch.device("meta")
        engine.relocate(2, 3, "cpu", session).result()
        after = [session.kv.filled(i) for i in range(4)]
        for (k0, v0), (k1, v1) in zip(before, after):
            assert torch.equal(k0, k1) and torch.equal(v0, v1)
    finally:
        engine.stop()


_ECHO = """
import sys
from datetime import timedelta
import torch.distributed as dist
from jitllmd.engine.cluster.link import Channel
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), None, False, timedelta(seconds=60), wait_for_workers=False, multi_tenant=True)
channel = Channel(dist.ProcessGroupGloo(dist.PrefixStore("t/", store), 1, 2, timedelta(seconds=60)), 0)
while True:
    doc, tensors = channel.recv()
    channel.send(doc, tensors)
    if doc.get("op") == "stop":
        break
"""


def test_channel_carries_any_dtype_and_long_messages() -> None:
    """The wire format over a real gloo pair with an echoing process: a message shorter than the inbox in one piece, a
    longer one (a KV move) in two; every dtype the engine sends, bit for bit."""
    from datetime import timedelta

    import torch.distributed as dist

    from jitllmd.engine.cluster.link import Channel

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, None, True, timedelta(seconds=60), wait_for_workers=False, multi_tenant=True)
    echo = subprocess.Popen([sys.executable, "-c", _ECHO, str(port)])
    try:
        a = Channel(dist.ProcessGroupGloo(dist.PrefixStore("t/", store), 0, 2, timedelta(seconds=60)), 1)
        tensors = [torch.randn(3, 5), torch.randn(2, 7).bfloat16(), torch.randn(4).half(), torch.arange(9), torch.randn(2, Channel.INBOX // 4 + 3)]
        for sent in (tensors[:4], tensors, []):  # one piece, past the inbox, none
            a.send({"op": "x", "n": len(sent)}, sent)
            doc, got = a.recv()
            assert doc == {"op": "x", "n": len(sent)} and len(got) == len(sent)
            assert all(g.dtype == s.dtype and torch.equal(g, s) for g, s in zip(got, sent))
        a.send({"op": "stop"})
        a.recv()
    finally:
        assert echo.wait(60) == 0


def test_a_gguf_is_converted_by_each_rank(tmp_path: Path) -> None:
    """rank 0 loads a .gguf (converted into its -models/.cache); rank 1 has only the .gguf in its own -models, and
    converts it there when it is asked for layers: the two conversions agree (the fingerprint), and so do the tokens."""
    from jitllmd.engine.catalog import Catalog
    from jitllmd.engine.config import EngineConfig

    from .conftest import write_tiny_gguf

    hf, model = write_tiny_llama(tmp_path / "hf", max_position_embeddings=512, num_hidden_layers=4)
    mine, theirs = tmp_path / "models", tmp_path / "theirs"
    mine.mkdir()
    theirs.mkdir()
    write_tiny_gguf(mine / "tiny.gguf", hf, model, q8_0=True)
    (theirs / "tiny.gguf").write_bytes((mine / "tiny.gguf").read_bytes())
    url = f"tcp://127.0.0.1:{free_port()}"
    worker = start_worker(theirs, url, 1)
    c = Cluster(url, 2, timeout=60.0, join_timeout=120.0)
    catalog = Catalog(mine, EngineConfig(devices="cpu,1:cpu", max_seq=256), mine / ".cache", c)
    try:
        engine = catalog.load("tiny.gguf", id="tiny").engine
        want = generate(engine, PROMPTS[0])
        engine.relocate(1, 4, "1:cpu").result()
        assert generate(engine, PROMPTS[0]) == want
        assert list((theirs / ".cache").glob("tiny-*.jlm"))  # rank 1's own conversion
    finally:
        catalog.stop()
        c.close()
        worker.wait(30)
