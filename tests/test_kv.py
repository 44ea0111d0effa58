"""Session KV storage: a CPU layer's storage is whole from the first reservation (never regrown by copying), the
positions reserved are what it reports, and moves carry the filled positions."""

from __future__ import annotations

import pytest
import torch

from jitllmd.engine.kv import RoomError, SessionKV


@torch.inference_mode()  # as a forward writes it
def _fill(kv: SessionKV, start: int, n: int) -> None:
    for i in range(kv.num_layers):
        for t in range(start, start + n):
            kv.k[i][:, t] = t + 1000 * i
            kv.v[i][:, t] = -(t + 1000 * i)
    kv.length = start + n


def test_cpu_storage_is_whole_once_and_keeps_its_positions() -> None:
    kv = SessionKV(num_layers=3, num_kv_heads=2, head_dim=8, capacity=3000, dtype=torch.float32)
    kv.reserve(10)
    assert kv.nbytes() == 256 * kv.bytes_per_position()  # positions reserved: at least a growth step
    assert all(k.shape == (2, 3000, 8) for k in kv.k)  # the whole capacity, unwritten pages unmapped
    addresses = [k.data_ptr() for k in kv.k]
    _fill(kv, 0, 10)
    for total in (300, 700, 2999, 3000):
        kv.reserve(total)
        assert [k.data_ptr() for k in kv.k] == addresses  # no copy to grow
    assert kv.nbytes() == 3000 * kv.bytes_per_position()
    assert kv.k[2][0, 9, 0].item() == 2009 and kv.v[1][1, 4, 3].item() == -1004
    with pytest.raises(RoomError):
        kv.reserve(3001)


def test_moves_carry_the_filled_positions() -> None:
    kv = SessionKV(num_layers=2, num_kv_heads=1, head_dim=4, capacity=600, dtype=torch.float32)
    kv.reserve(20)
    _fill(kv, 0, 20)
    kv.move(1, torch.device("meta"))  # another device: storage for the positions reserved, not the capacity
    assert kv.k[1].shape == (1, 256, 4) and kv.devices[1].type == "meta"
    kv.reserve(300)  # it grows by doubling there (and the CPU layer stays as it is)
    assert kv.k[1].shape == (1, 512, 4) and kv.k[0].shape == (1, 600, 4)
    back = SessionKV(num_layers=1, num_kv_heads=1, head_dim=4, capacity=600, dtype=torch.float32)
    back.reserve(20)
    _fill(back, 0, 20)
    back.move(0, torch.device("cpu"))  # same place: nothing to do
    assert back.k[0][0, 19, 0].item() == 19


def test_a_window_layer_keeps_about_its_window() -> None:
    """Layer 0 slides (window 100), layer 1 keeps everything: 1000 positions written a few at a time leave layer 0
    with storage of its window and growth step, the positions a next query sees still there (moved to the front),
    and the arithmetic (`bytes_at`, `nbytes`) counting that."""
    kv = SessionKV(num_layers=2, num_kv_heads=1, head_dim=4, capacity=4000, dtype=torch.float32, windows=[100, None])
    for start in range(0, 1000, 5):
        kv.reserve(start + 5)
        with torch.inference_mode():  # as a forward writes it
            for i in range(2):
                for t in range(start, start + 5):
                    kv.k[i][:, kv.slot(i, t)] = t
                    kv.v[i][:, kv.slot(i, t)] = -t
        kv.length = start + 5
    off = kv.offsets[0]
    assert 0 < off <= 1000 - 100 and off % 64 == 0 and kv.offsets[1] == 0
    assert kv.k[0].shape[1] == 100 + 64 + 64 + 256 and kv.k[1].shape[1] == 4000
    seen = kv.k[0][0, kv.slot(0, 1000 - 100) : kv.slot(0, 1000), 0]
    assert torch.equal(seen, torch.arange(900, 1000, dtype=torch.float32))  # what a query at 1000 attends
    assert kv.layer_nbytes(0) == 484 * 32 and kv.layer_nbytes(1) == kv._allocated * 32
    assert kv.bytes_at(1000) == (100 + 1000) * 32 and kv.bytes_at(50) == 100 * 32
    assert kv.reusable(1000) == 1000 and kv.reusable(off + 98) == 0
    kv.move(0, torch.device("meta"))  # the window layer's storage goes as it is
    assert kv.k[0].shape == (1, 484, 4)
    kv.truncate(0)
    assert kv.offsets == [0, 0]


def test_a_window_longer_than_the_session_is_no_window() -> None:
    kv = SessionKV(num_layers=1, num_kv_heads=1, head_dim=4, capacity=64, dtype=torch.float32, windows=[512])
    assert kv.windows == [None]
    kv.reserve(10)
    assert kv.k[0].shape[1] == 64


def test_storage_made_inside_a_forward_takes_copies_moves_and_slides_outside_one() -> None:
    """A forward runs under torch.inference_mode, so KV storage it reserves is an inference tensor; the engine then
    forks a prompt's KV into it (n > 1), moves it (place -move) and slides a window outside any forward: each must
    still work (a RuntimeError about inference tensors answered n > 1 chats 500 after a Connect call)."""
    src = SessionKV(num_layers=2, num_kv_heads=1, head_dim=4, capacity=600, dtype=torch.float32, windows=[70, None])
    dst = SessionKV(num_layers=2, num_kv_heads=1, head_dim=4, capacity=600, dtype=torch.float32, windows=[70, None])
    with torch.inference_mode():
        for kv in (src, dst):  # both ran a forward before
            kv.reserve(40)
            for i in range(2):
                kv.k[i][:, :40] = torch.randn(1, 40, 4)
                kv.v[i][:, :40] = torch.randn(1, 40, 4)
            kv.length = 40
    dst.copy_from(src, 30)
    assert dst.length == 30 and all(torch.equal(dst.k[i][:, :30], src.k[i][:, :30]) for i in range(2))
    dst.reserve(600)  # the window layer slides its positions in place
    dst.move(1, torch.device("cpu"))
    dst.move(0, torch.device("meta"))
    dst.move(0, torch.device("cpu"), filled=src.filled(0))
