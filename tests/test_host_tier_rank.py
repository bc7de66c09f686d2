"""The rank's host tier (``runner/host_tier.py``): blocks moved into host slots and back hold
exactly their K/V (and their moves are timed), in every layer, over runs of consecutive slots and moves of more blocks than a
chunk; an offload and a restore in one move read before they write; a move out of range is
refused before anything moves. On a GPU, with pinned slots, the copies are queued behind the
device's work and before the next, so blocks a kernel is still writing and blocks the next kernel
reads are moved right."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from neuron.runner.attention import PagedKvCache  # noqa: E402
from neuron.runner.host_tier import CHUNK, HostKvTier, host_tier  # noqa: E402
from neuron.runner.inputs import StepRejected  # noqa: E402
from neuron.runner.state import StatePool  # noqa: E402
from neuron.models.interface import RecurrentState  # noqa: E402

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no NVIDIA GPU visible")


def filled(device: str, blocks: int = 200, dtype=torch.float32) -> PagedKvCache:
    kv = PagedKvCache(3, blocks, 4, 2, 8, torch.device(device), dtype)
    kv.k.copy_(torch.randn(kv.k.shape, dtype=torch.float32).to(dtype))
    kv.v.copy_(torch.randn(kv.v.shape, dtype=torch.float32).to(dtype))
    return kv


def round_trip(device: str, dtype=torch.float32) -> None:
    kv = filled(device, blocks=300, dtype=dtype)
    tier = HostKvTier(kv, 180, pinned=device == "cuda")
    assert tier.store.is_pinned() == (device == "cuda")  # page-locked in place, not by torch's allocator
    k0, v0 = kv.k.clone(), kv.v.clone()
    blocks = list(range(5, 5 + CHUNK + 40))  # more than a chunk
    slots = list(range(100, 100 + 30)) + list(range(0, CHUNK + 10))  # two runs, out of order
    out = tier.move(list(zip(blocks, slots)), [])
    kv.k.zero_()
    kv.v.zero_()
    back = list(range(150, 150 + len(blocks)))[::-1]  # into other blocks, reversed
    into = tier.move([], list(zip(slots, back)))
    if device == "cuda":
        torch.cuda.synchronize()
    assert out.ms()[0] > 0 and into.ms()[1] > 0  # each move's device time, for the tier's bandwidth
    for b, to in zip(blocks, back):
        assert torch.equal(kv.k[:, to], k0[:, b]) and torch.equal(kv.v[:, to], v0[:, b])
    untouched = [b for b in range(kv.blocks) if b not in back]
    assert not kv.k[:, untouched].any()
    tier.close()
    assert not tier.store.is_pinned()  # unlocked when the rank unloads


def test_blocks_moved_into_host_slots_and_back_hold_their_k_and_v():
    round_trip("cpu")


def test_an_offload_and_a_restore_of_one_block_in_one_move_read_before_they_write():
    kv = filled("cpu", blocks=8)
    tier = HostKvTier(kv, 4, pinned=False)
    k2, k5 = kv.k[:, 2].clone(), kv.k[:, 5].clone()
    tier.move([(5, 0)], [])
    tier.move([(2, 1)], [(0, 2)])  # block 2 leaves for slot 1 and takes block 5's K/V from slot 0
    assert torch.equal(kv.k[:, 2], k5)
    tier.move([], [(1, 3)])
    assert torch.equal(kv.k[:, 3], k2)


@pytest.mark.parametrize("offload, restore", [([(8, 0)], []), ([(0, 4)], []), ([], [(4, 0)]), ([], [(0, -1)])])
def test_a_move_out_of_range_is_refused_before_anything_moves(offload, restore):
    kv = filled("cpu", blocks=8)
    tier = HostKvTier(kv, 4, pinned=False)
    before = kv.k.clone()
    with pytest.raises(StepRejected):
        tier.move([(1, 0), *offload], [(0, 2), *restore])
    assert torch.equal(kv.k, before)


def pool(slots: int, recurrent: bool = True, device: str = "cpu") -> StatePool:
    """State slots of two layers whose tensors are of two dtypes, so a slot's bytes cross buffers."""
    specs = [RecurrentState(((20, 10), (10, 13)), (None, torch.bfloat16)), RecurrentState(((12, 20),))] if recurrent else []
    states = StatePool(specs, slots, torch.device(device))
    for b in states.buffers.values():
        b.copy_(torch.randn(b.shape).to(b.dtype))
    return states


def test_the_tier_takes_as_many_blocks_as_its_bytes_hold_and_two_snapshots_at_least():
    kv = filled("cpu", blocks=8)
    k0, v0 = kv.k.clone(), kv.v.clone()
    per_block = 2 * 3 * 4 * 2 * 8 * 4
    assert host_tier(kv, 10 * per_block + per_block - 1, pool(0, False), 0).slots == 10
    assert torch.equal(kv.k, k0) and torch.equal(kv.v, v0)  # its first moves (the ops' first use) change nothing
    assert host_tier(kv, per_block - 1, pool(0, False), 0) is None
    states = pool(4)
    assert states.slot_bytes == (200 + 240) * 4 + 130 * 2  # more than one block: two pieces
    tier = host_tier(kv, 10 * per_block, states, 0)
    assert tier.slots == 10 and tier.pieces == 2
    assert host_tier(kv, 3 * per_block, states, 0) is None  # less than two snapshots


def test_a_host_tier_the_host_cannot_hold_fails_the_load_by_its_setting_s_name():
    kv = filled("cpu", blocks=8)
    with pytest.raises(torch.OutOfMemoryError, match=r"the host tier needs .* GiB and this host has .* available: lower \[cache\] host_gb"):
        host_tier(kv, 1 << 52, pool(0, False), 0)


def state_round_trip(device: str) -> None:
    kv = filled(device, blocks=8)
    states = pool(4, device=device)
    tier = HostKvTier(kv, 6, pinned=device == "cuda", states=states)
    assert tier.pieces == 2
    before = {d: b.clone() for d, b in states.buffers.items()}
    k0 = kv.k.clone()
    tier.move([(3, 4)], [], [(1, 1, 0), (1, 0, 5), (2, 0, 2), (2, 1, 3)])  # two snapshots and a block
    for b in states.buffers.values():
        b.zero_()
    tier.move([], [(4, 0)], [], [(5, 3, 0)])  # the first piece of slot 1's into slot 3, with a block
    assert torch.equal(kv.k[:, 0], k0[:, 3])
    tier.move([], [], [], [(0, 3, 1), (3, 0, 1), (2, 0, 0)])  # its other piece a step later; slot 2's into 0
    for d, b in states.buffers.items():
        assert torch.equal(b[3], before[d][1]) and torch.equal(b[0], before[d][2])
        assert not b[1].any() and not b[2].any()


def test_state_pieces_moved_out_and_back_in_any_order_and_steps_hold_the_state():
    state_round_trip("cpu")


@pytest.mark.gpu
@needs_gpu
def test_on_a_gpu_state_pieces_round_trip_through_pinned_slots_exactly():
    state_round_trip("cuda")


@pytest.mark.parametrize("state_offload, state_restore", [([(4, 0, 0)], []), ([(0, 0, 6)], []), ([], [(0, 4, 1)]),
                                                          ([(0, -1, 0)], [])])
def test_a_state_move_out_of_range_is_refused_before_anything_moves(state_offload, state_restore):
    kv = filled("cpu", blocks=8)
    states = pool(4)
    tier = HostKvTier(kv, 6, pinned=False, states=states)
    tier.store.zero_()  # its slots as allocated may hold NaN, which no comparison finds equal
    with pytest.raises(StepRejected, match="state slot"):
        tier.move([(1, 0)], [], state_offload, state_restore)
    assert not tier.store.any()


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_on_a_gpu_pinned_slots_round_trip_exactly(dtype):
    round_trip("cuda", dtype)


@pytest.mark.gpu
@needs_gpu
def test_on_a_gpu_moves_are_ordered_with_the_device_s_work():
    kv = filled("cuda", blocks=64, dtype=torch.bfloat16)
    tier = HostKvTier(kv, 64, pinned=True)
    a = torch.randn(4096, 4096, device="cuda")
    for _ in range(3):  # queue long work that writes block 3 last, then move it without waiting
        a = a @ a / 64
    kv.k[:, 3] = 7
    kv.v[:, 3] = 9
    tier.move([(3, 10)], [])
    kv.k[:, 3] = 0  # the next kernel overwrites the block: the offload has read it before
    tier.move([], [(10, 20)])
    got = kv.k[:, 20].float()  # read by the next kernel after the restore
    torch.cuda.synchronize()
    assert torch.all(got == 7) and torch.all(kv.v[:, 20] == 9) and torch.all(kv.k[:, 3] == 0)


@pytest.mark.gpu
@needs_gpu
def test_on_a_gpu_tiers_dropped_without_close_unlock_their_slots():
    """A new tier's mapping may take a dropped one's addresses: those must be unlocked by then."""
    import gc

    kv = filled("cuda", blocks=8)
    for _ in range(4):
        tier = HostKvTier(kv, 4, pinned=True)
        assert tier.store.is_pinned()
        del tier
        gc.collect()
    torch.cuda.synchronize()


def disk_round_trip(device: str, tmp_path, dtype=torch.float32) -> None:
    """Blocks offloaded, written to disk by the next step (the device's copies not awaited), the
    slots and blocks then overwritten, read back from disk into other slots and restored into other
    blocks: exactly their K/V. A restore from a slot whose read has not landed waits for it."""
    import protocol as p
    from neuron.runner.disk_tier import DiskKvStore

    kv = filled(device, blocks=64, dtype=dtype)
    tier = HostKvTier(kv, 40, pinned=device == "cuda")
    tier.disk = DiskKvStore(tmp_path / "kv", "m", "id", 0, tier.block_bytes, 1 << 30)
    k0, v0 = kv.k.clone(), kv.v.clone()
    blocks, slots = list(range(3, 13)), list(range(20, 30))
    hashes = [bytes([i]) * 16 for i in range(10)]
    tier.step_moves(p.Step(id=1, epoch=0, step_id=1, seqs=[], offload=list(zip(blocks, slots))))
    tier.step_moves(p.Step(id=2, epoch=0, step_id=2, seqs=[], spill=list(zip(slots, hashes))))
    kv.k.zero_()
    kv.v.zero_()
    tier.step_moves(p.Step(id=3, epoch=0, step_id=3, seqs=[], offload=[(40, s) for s in slots]))  # waits for the writes
    back, into = list(range(0, 10)), list(range(50, 60))
    tier.step_moves(p.Step(id=4, epoch=0, step_id=4, seqs=[], fetch=list(zip(hashes, back))))
    tier.step_moves(p.Step(id=5, epoch=0, step_id=5, seqs=[], restore=list(zip(back, into))))  # waits for the reads
    if device == "cuda":
        torch.cuda.synchronize()
    for b, to in zip(blocks, into):
        assert torch.equal(kv.k[:, to], k0[:, b]) and torch.equal(kv.v[:, to], v0[:, b])
    fetched, lost = tier.disk_news()
    assert sorted(fetched) == sorted(hashes) and lost == []
    tier.disk.close()


def test_blocks_written_to_disk_and_read_back_through_host_slots_hold_their_k_and_v(tmp_path):
    disk_round_trip("cpu", tmp_path)


def test_a_wait_for_the_disk_s_news_returns_once_every_read_under_way_is_done(tmp_path):
    """A step with nothing else to do waits for all the reads under way, not for the first, so a
    prefix read in from disk comes back in one step's news."""
    import protocol as p
    from neuron.runner.disk_tier import DiskKvStore

    kv = filled("cpu", blocks=64)
    tier = HostKvTier(kv, 60, pinned=False)
    tier.disk = DiskKvStore(tmp_path / "kv", "m", "id", 0, tier.block_bytes, 1 << 30)
    hashes = [bytes([i]) * 16 for i in range(48)]
    tier.step_moves(p.Step(id=1, epoch=0, step_id=1, seqs=[], offload=[(i, i) for i in range(48)]))
    tier.step_moves(p.Step(id=2, epoch=0, step_id=2, seqs=[], spill=list(zip(range(48), hashes))))
    tier.step_moves(p.Step(id=3, epoch=0, step_id=3, seqs=[], offload=[(60, s) for s in range(48)]))  # writes done
    assert tier.disk_news() == ([], [])
    tier.step_moves(p.Step(id=4, epoch=0, step_id=4, seqs=[], fetch=list(zip(hashes, range(48)))))
    tier.wait_for_disk(30.0)
    fetched, lost = tier.disk_news()
    assert sorted(fetched) == sorted(hashes) and lost == []
    tier.disk.close()


@pytest.mark.gpu
@needs_gpu
def test_on_a_gpu_blocks_written_to_disk_from_pinned_slots_come_back_exactly(tmp_path):
    disk_round_trip("cuda", tmp_path, torch.bfloat16)
