"""Kept quantized parts are the file's own pages (engine/memory/pager.py's BlockReader.keep): a block kept on the cpu device
or resident on the host maps its quantized parts from the .jlm, populated at load, and answers as read parts do;
float parts, and parts whose tensors are not one run of the file, are read; a block that leaves, or a model that is
closed, unmaps them."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from jitllmd.engine.engine import Engine
from jitllmd.engine.loader import load_model
from jitllmd.engine.memory.pager import BlockReader
from jitllmd.engine.request import Delta, Generation
from jitllmd.engine.sampler import SamplingParams


def _file_ranges(path: Path) -> list[tuple[int, int]]:
    """The address ranges of this process mapped from `path`."""
    out = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == str(path.resolve()):
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            out.append((lo, hi))
    return out


def _mapped(t: torch.Tensor, ranges: list[tuple[int, int]]) -> bool:
    return any(lo <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= hi for lo, hi in ranges)


def _greedy(loaded, n: int = 12) -> list[int]:
    e = Engine(loaded).start()
    try:
        events = list(e.generate(Generation([1, 5, 9, 13, 2, 7], SamplingParams(temperature=0), max_tokens=n)))
    finally:
        e.stop()
    return [i for ev in events if isinstance(ev, Delta) for i in ev.token_ids]


def _parts(loaded, name: str) -> dict[str, torch.Tensor]:
    placement = loaded.placement
    return placement._held_parts[name] if name in placement._held_parts else placement.pager._parts[name]


@pytest.mark.parametrize("devices", [["cpu"], []], ids=["cpu-device", "host-resident"])
def test_quantized_parts_are_the_files_pages(tiny_serve_q8_jlm: Path, devices: list[str]) -> None:
    loaded = load_model(tiny_serve_q8_jlm, devices=devices, max_seq=64)
    try:
        ranges = _file_ranges(tiny_serve_q8_jlm)
        parts = _parts(loaded, "blocks.0")
        quantized = {p for p, t in parts.items() if t.dtype == torch.uint8}
        assert {"o", "down", "gate_up"} <= quantized  # one tensor, or two end to end in the file (gate, up)
        for p, t in parts.items():
            one_run = p in ("o", "down", "gate_up")
            assert _mapped(t, ranges) == (p in quantized and one_run), p  # floats are read; qkv's q, k, v lie apart
        mapped = _greedy(loaded)
        del parts, t
    finally:
        loaded.close()
    del loaded
    gc.collect()
    assert _file_ranges(tiny_serve_q8_jlm) == []  # closed and let go of: unmapped
    read = load_model(tiny_serve_q8_jlm, devices=devices, max_seq=64)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(BlockReader, "_populate", False)  # a kernel without MADV_POPULATE_READ: every part read
            reread = load_model(tiny_serve_q8_jlm, devices=devices, max_seq=64)
        try:
            assert not any(_mapped(t, _file_ranges(tiny_serve_q8_jlm)) for t in _parts(reread, "blocks.0").values())
            assert _greedy(reread) == mapped
        finally:
            reread.close()
        assert _greedy(read) == mapped
    finally:
        read.close()


def test_a_block_that_leaves_the_cpu_unmaps(tiny_serve_q8_jlm: Path) -> None:
    loaded = load_model(tiny_serve_q8_jlm, devices=["cpu"], max_seq=64, page_budget=None)
    try:
        before = _greedy(loaded)
        down = _parts(loaded, "blocks.1")["down"]
        at = (down.data_ptr(), down.data_ptr() + down.numel())
        assert _mapped(down, _file_ranges(tiny_serve_q8_jlm))
        del down
        last = len(loaded.placement.names) - 1
        loaded.placement.move(1, last, "host", [])
        loaded.placement.pager.set_budget(loaded.placement.pager.largest_layer()[1])  # one layer resident: the rest paged
        gc.collect()
        assert not any(lo <= at[0] and at[1] <= hi for lo, hi in _file_ranges(tiny_serve_q8_jlm))
        assert _greedy(loaded) == before  # paged blocks are read into buffers, resident ones mapped again
        loaded.placement.pager.set_budget(None)
        loaded.placement.move(1, last, "cpu", [])
        assert _mapped(_parts(loaded, "blocks.1")["down"], _file_ranges(tiny_serve_q8_jlm))
        assert _greedy(loaded) == before
    finally:
        loaded.close()
