"""A rank's disk tier (``runner/disk_tier.py``): blocks written by its thread are read back
byte for byte, also by a store opened again after a restart; a corrupted, truncated or foreign
file is skipped, deleted and logged, never served; another identity's directory is emptied; the
tier holds its size by deleting the least recently used files (and a size smaller than a block
keeps nothing, and breaks nothing); disk_dir is made private and refused when others may write."""

from __future__ import annotations

import logging
import os
import time

import numpy as np
import pytest

from neuron.runner.disk_tier import HEADER, DiskKvStore, DiskTierRefused

BLOCK = 4096


def block(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, BLOCK, dtype=np.uint8)


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def settle(store: DiskKvStore, n: int, timeout: float = 10) -> list:
    """The next ``n`` results the store's threads report."""
    got: list = []
    deadline = time.monotonic() + timeout
    while len(got) < n:
        got += store.drain()
        assert time.monotonic() < deadline, got
        time.sleep(0.005)
    return got


def opened(tmp_path, identity="model-a", capacity=64 * (BLOCK + HEADER.size)) -> DiskKvStore:
    return DiskKvStore(tmp_path / "disk", "m", identity, 0, BLOCK, capacity)


def test_blocks_written_are_fetched_back_byte_for_byte_also_after_a_restart(tmp_path):
    store = opened(tmp_path)
    for i in range(5):
        assert store.write(h(i), block(i))
    assert sorted(settle(store, 5)) == sorted(("write", h(i), True) for i in range(5))
    out = np.zeros(BLOCK, dtype=np.uint8)
    assert store.fetch(h(3), out).result(10)
    assert settle(store, 1) == [("fetch", h(3), True)] and np.array_equal(out, block(3))
    store.close()
    again = opened(tmp_path)
    assert sorted(again.hashes()) == sorted(h(i) for i in range(5))
    assert again.fetch(h(1), out).result(10)
    assert settle(again, 1) == [("fetch", h(1), True)] and np.array_equal(out, block(1))
    again.close()
    assert oct(os.stat(tmp_path / "disk").st_mode & 0o777) == "0o700"


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign"])
def test_a_damaged_or_foreign_file_is_never_served(tmp_path, damage, caplog):
    store = opened(tmp_path)
    store.write(h(1), block(1))
    settle(store, 1)
    path = store.dir / (h(1).hex() + ".kv")
    raw = bytearray(path.read_bytes())
    if damage == "flip":
        raw[-7] ^= 0xFF
    elif damage == "truncate":
        raw = raw[:-100]
    else:  # a file of another identity's store copied in
        other = opened(tmp_path / "other", identity="model-b")
        other.write(h(1), block(1))
        settle(other, 1)
        raw = bytearray((other.dir / path.name).read_bytes())
        other.close()
    path.write_bytes(bytes(raw))
    out = np.full(BLOCK, 7, dtype=np.uint8)
    with caplog.at_level(logging.WARNING, logger="neuron.runner"):
        assert store.fetch(h(1), out).result(10) is False
        assert settle(store, 1) == [("fetch", h(1), False)]
    assert (out == 7).all() and not path.exists() and h(1) not in store.hashes()
    assert any("deleted, not served" in r.message for r in caplog.records)
    store.close()


def test_a_truncated_file_is_dropped_when_the_store_opens(tmp_path):
    store = opened(tmp_path)
    store.write(h(1), block(1))
    store.write(h(2), block(2))
    settle(store, 2)
    store.close()
    path = store.dir / (h(2).hex() + ".kv")
    path.write_bytes(path.read_bytes()[:50])
    (store.dir / "junk.kv.tmp").write_bytes(b"x")
    again = opened(tmp_path)
    assert again.hashes() == [h(1)] and not path.exists() and not (store.dir / "junk.kv.tmp").exists()
    again.close()


def test_another_identity_empties_the_directory_and_reads_nothing(tmp_path):
    store = opened(tmp_path)
    store.write(h(1), block(1))
    settle(store, 1)
    store.close()
    other = opened(tmp_path, identity="model-a with other weights")
    assert other.hashes() == [] and [f.name for f in other.dir.iterdir()] == ["IDENTITY"]
    other.close()


def test_the_tier_keeps_its_size_by_deleting_the_least_recently_used(tmp_path):
    per = BLOCK + HEADER.size
    store = opened(tmp_path, capacity=3 * per)
    for i in range(3):
        store.write(h(i), block(i))
        settle(store, 1)
    out = np.zeros(BLOCK, dtype=np.uint8)
    store.fetch(h(0), out)  # 0 used again: 1 is now the least recently used
    settle(store, 1)
    store.write(h(3), block(3))
    got = settle(store, 2)
    assert ("evict", h(1), True) in got and ("write", h(3), True) in got
    assert sorted(store.hashes()) == sorted([h(0), h(2), h(3)]) and store.used == 3 * per
    assert len(list(store.dir.glob("*.kv"))) == 3
    store.close()


def test_dropped_blocks_leave_the_disk_after_the_writes_queued_before(tmp_path):
    store = opened(tmp_path)
    for i in range(3):
        store.write(h(i), block(i))
    store.drop([h(0), h(2), h(9)])  # 9: never written
    settle(store, 3)
    deadline = time.monotonic() + 10
    while len(store.hashes()) > 1 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert store.hashes() == [h(1)] and store.used == BLOCK + HEADER.size
    assert [f.name for f in store.dir.glob("*.kv")] == [h(1).hex() + ".kv"]
    store.close()


def test_a_tier_smaller_than_a_block_keeps_nothing(tmp_path):
    store = opened(tmp_path, capacity=BLOCK)
    store.write(h(1), block(1))
    assert settle(store, 1) == [("write", h(1), False)] and store.hashes() == []
    store.close()


def test_a_disk_dir_others_may_write_is_refused(tmp_path):
    d = tmp_path / "shared"
    d.mkdir()
    os.chmod(d, 0o777)
    with pytest.raises(DiskTierRefused, match="writable by its group or others"):
        DiskKvStore(d, "m", "x", 0, BLOCK, 1 << 20)
