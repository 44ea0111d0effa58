"""The server's model catalog, its config and the pieces it parses: pure logic and a tiny model, no HTTP."""

from __future__ import annotations

import pytest

from jitllmd.engine.catalog import Catalog
from jitllmd.engine.config import EngineConfig, parse_size
from jitllmd.engine.memory.devices import parse_devices
from jitllmd.serve.server import is_loopback, parse_addr


@pytest.mark.parametrize(("text", "size"), [("8G", 8 << 30), ("512M", 512 << 20), ("1.5g", 3 << 29), ("4096", 4096), ("2GiB", 2 << 30), ("10k", 10240)])
def test_parse_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "lots", "-1G", "8X", "G"])
def test_parse_size_refuses(text):
    with pytest.raises(ValueError, match="size"):
        parse_size(text)


@pytest.mark.parametrize(
    ("addr", "host", "port"), [(":8080", "0.0.0.0", 8080), ("127.0.0.1:0", "127.0.0.1", 0), ("[::1]:9000", "::1", 9000), ("localhost:1", "localhost", 1)]
)
def test_parse_addr(addr, host, port):
    assert parse_addr(addr) == (host, port)


@pytest.mark.parametrize("addr", ["8080", "host:", "host:99999", "host:http"])
def test_parse_addr_refuses(addr):
    with pytest.raises(ValueError, match="HOST:PORT"):
        parse_addr(addr)


def test_loopback():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback("example.com")


def test_device_grammar_on_a_cpu_machine():
    assert parse_devices("") == [] and parse_devices("  ") == []
    assert parse_devices("cpu") == ["cpu"] and parse_devices("cpu,cpu") == ["cpu"]
    assert "cpu" not in parse_devices("auto")  # auto is the accelerators only
    with pytest.raises(ValueError, match=r"no device 'tpu:0' here \(devices: cpu"):
        parse_devices("tpu:0")
    with pytest.raises(ValueError, match="number"):
        parse_devices("cuda:")


@pytest.mark.parametrize(
    ("kw", "field"),
    [({"gpu_layers": -2}, "gpu_layers"), ({"sessions": 0}, "sessions"), ({"max_seq": 0}, "max_seq"), ({"max_batch": -1}, "max_batch"),
     ({"prompt_chunk": -1}, "prompt_chunk"), ({"joint_steps": "x"}, "joint_steps"), ({"host_concurrency": 0}, "host_concurrency"),
     ({"maxmem": 0}, "maxmem")],
)
def test_config_names_the_bad_field(kw, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        EngineConfig(**kw)


def test_catalog_loads_resolves_and_lists(tmp_path, tiny_serve_jlm):
    models = tmp_path / "models"
    models.mkdir()
    (models / "tiny.jlm").write_bytes(tiny_serve_jlm.read_bytes())
    (models / "other.jlm").write_bytes(tiny_serve_jlm.read_bytes())
    (tmp_path / "outside.jlm").write_bytes(b"x")
    (models / "evil.jlm").symlink_to(tmp_path / "outside.jlm")  # listed nowhere: a link out of -models (issue 19)
    (models / "alias.jlm").symlink_to("other.jlm")  # a link that stays inside is a model like any other
    cat = Catalog(models, EngineConfig(max_seq=64), tmp_path / "cache")
    try:
        served = cat.load("tiny.jlm")
        assert served.id.startswith("m-") and "tiny" in served.aliases
        assert cat.get("tiny") is served and cat.get(served.id) is served
        assert [(e.id, e.loaded) for e in cat.entries()] == [(served.id, True), ("alias", False), ("other", False)]
        with pytest.raises(PermissionError, match="outside"):
            cat.resolve("evil.jlm", inside_only=True)
        with pytest.raises(ValueError, match="already loaded"):
            cat.load("other.jlm", id=served.id)
        with pytest.raises(KeyError, match="not loaded"):
            cat.get("other")
        with pytest.raises(PermissionError, match="outside"):
            cat.resolve("../outside.jlm", inside_only=True)
        with pytest.raises(PermissionError, match="outside"):
            cat.resolve(str(tmp_path / "outside.jlm"), inside_only=True)
        assert cat.resolve("../outside.jlm") == (tmp_path / "outside.jlm").resolve()  # the operator's -load may leave -models
        with pytest.raises(FileNotFoundError, match="no such model file"):
            cat.resolve("missing.jlm")
        with pytest.raises(ValueError, match="model id"):
            cat.load("other.jlm", id="bad id")
        cat.unload("tiny")
        assert cat.loaded() == []
    finally:
        cat.stop()


def test_host_and_device_rows(tmp_path, tiny_serve_jlm):
    """A host model runs -host-concurrency requests at once; a device model batches -max-batch rows, at most -sessions;
    a block moved to the host turns the device model into a host one, and back."""
    host = Catalog(tmp_path, EngineConfig(max_seq=64, host_concurrency=3), tmp_path / "cache")
    device = Catalog(tmp_path, EngineConfig(max_seq=64, devices="cpu", sessions=8, max_batch=4), tmp_path / "cache")
    try:
        assert host.load(tiny_serve_jlm, id="h").engine.scheduler.max_batch == 3
        engine = device.load(tiny_serve_jlm, id="d").engine
        assert engine.scheduler.max_batch == 4
        engine.relocate(1, 1, "host").result(timeout=30)
        assert engine.scheduler.max_batch == 1  # -host-concurrency's default
        engine.relocate(1, 1, "cpu").result(timeout=30)
        assert engine.scheduler.max_batch == 4
    finally:
        host.stop()
        device.stop()
