"""The disk tier of a rank's prefix cache: below the host tier, a file per KV block of the rank's
own share, named by the block's chain hash, so that a restarted daemon serving the same model
finds its warm prefixes again.

A model's files live in ``<disk_dir>/<model>/rank<r>/``, beside an ``IDENTITY`` file naming what
the K/V was computed with (the weights' files, sizes and times, dtype, quantization, the parallel
layout, block size and this layout's version; the leader builds it). A directory of another
identity is emptied at open, never read; so is a file whose own header names another identity,
or whose length or checksum (SHA-256 of its bytes) is wrong: skipped, deleted, and logged, never
served. ``disk_dir`` is created private (0700) and refused where group or others may write.

Writes and reads run on threads of their own, so a step never waits for the disk: ``write``
queues a host slot's bytes (the caller leaves them be until the write is done; a full queue
drops it), ``fetch`` queues a read into a host slot, and ``drain`` hands the device thread what has been written, fetched or has failed
since. A write that finds the tier at its size first deletes the least recently used files; one
that the disk refuses (full) is dropped with one log line, and serving goes on."""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import stat
import struct
import threading
from collections import OrderedDict, deque
from concurrent.futures import Future
from pathlib import Path

import numpy as np

log = logging.getLogger("neuron.runner")

LAYOUT = 2  # bump when a block's bytes change meaning (slot layout, dtype handling, checksum)
MAGIC = b"NKVB"
HEADER = struct.Struct("<4sI16s32sQ")  # magic, layout, identity, SHA-256 of the payload, payload bytes
QUEUE = 64  # writes (or reads) waiting at most
READERS = max(1, min(8, (os.cpu_count() or 1) // 2))  # threads reading (and checking) blocks side by side


class DiskTierRefused(Exception):
    """The disk tier cannot be used as configured (its directory's permissions)."""


def private_dir(path: Path) -> Path:
    """``path`` made (0700) if it is missing; refused if group or others may write to it."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if not stat.S_ISDIR(st.st_mode):
        raise DiskTierRefused(f"disk_dir {str(path)!r} is not a directory")
    if st.st_mode & 0o022:
        raise DiskTierRefused(f"disk_dir {str(path)!r} is writable by its group or others "
                              f"(mode {stat.S_IMODE(st.st_mode):o}): chmod go-w it, or name a private one")
    return path


def identity_digest(identity: str) -> bytes:
    return hashlib.blake2b(f"{LAYOUT}|{identity}".encode(), digest_size=16).digest()


class DiskKvStore:
    def __init__(self, root: Path, model: str, identity: str, rank: int, block_bytes: int, capacity: int) -> None:
        self.block_bytes, self.capacity = block_bytes, capacity
        self.identity = identity_digest(identity)
        base = private_dir(root)
        self.dir = base / _safe(model) / f"rank{rank}"
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.files: OrderedDict[bytes, int] = OrderedDict()  # hash -> bytes on disk, least recently used first
        self.used = 0  # bytes of them
        self.lock = threading.Lock()
        self.done: deque[tuple[str, bytes, bool]] = deque()  # ("write" | "fetch" | "evict", hash, ok)
        self.dropped = 0  # writes the full queue (or the disk) turned away
        self._open()
        self._writes: queue.Queue = queue.Queue(QUEUE)
        self._reads: queue.Queue = queue.Queue(QUEUE)
        self._threads = [threading.Thread(target=self._loop, args=(q, f), name=f"disk-tier-{f.__name__}",
                                          daemon=True)
                         for q, f in ((self._writes, self._write), *((self._reads, self._fetch),) * READERS)]
        for t in self._threads:
            t.start()

    def _open(self) -> None:
        """Keep the files of this identity whose length is right, oldest first; delete the rest."""
        mark = self.dir / "IDENTITY"
        if not mark.exists() or mark.read_text().strip() != self.identity.hex():
            for f in self.dir.iterdir():
                if f.name != "IDENTITY":
                    _remove(f)
            mark.write_text(self.identity.hex() + "\n")
        found = []
        for f in self.dir.iterdir():
            if f.name == "IDENTITY":
                continue
            h = _hash_of(f.name)
            size = f.stat().st_size if h is not None else -1
            if size != HEADER.size + self.block_bytes:
                log.warning("disk tier: %s is not a whole block file of this model, deleted", f)
                _remove(f)
                continue
            found.append((f.stat().st_mtime_ns, h, size))
        for _, h, size in sorted(found):
            self.files[h] = size
            self.used += size
        self._evict(0)

    @property
    def file_bytes(self) -> int:
        return HEADER.size + self.block_bytes

    def hashes(self) -> list[bytes]:
        with self.lock:
            return list(self.files)

    def write(self, h: bytes, data: np.ndarray, ready=None) -> Future | None:
        """Queue ``data`` (a block's bytes, uint8, read by the writer thread once ``ready``, a
        CUDA event of the copy that fills it, is done: the caller leaves it unchanged until the
        future is done) to be written as ``h``; None if the queue is full (the block is dropped,
        and reported lost)."""
        done: Future = Future()
        try:
            self._writes.put_nowait((h, data.reshape(-1), done, ready))
            return done
        except queue.Full:
            self.dropped += 1
            self.done.append(("write", h, False))
            return None

    def fetch(self, h: bytes, into: np.ndarray) -> Future:
        """Queue a read of ``h`` into ``into`` (uint8, the block's bytes: a host slot); the
        future's result says whether ``into`` holds the block."""
        done: Future = Future()
        self._reads.put((h, into, done))
        return done

    def drop(self, hashes: list[bytes]) -> None:
        """Delete these blocks' files (after the writes queued before)."""
        if hashes:
            self._writes.put((None, hashes))

    def drain(self) -> list[tuple[str, bytes, bool]]:
        out = []
        while self.done:
            out.append(self.done.popleft())
        return out

    def close(self) -> None:
        for q in (self._writes, *(self._reads,) * READERS):
            q.put(None)
        for t in self._threads:
            t.join(5)

    # ----------------------------------------------------------------------------- threads
    def _loop(self, q: queue.Queue, work) -> None:
        while (item := q.get()) is not None:
            try:
                work(*item)
            except Exception:  # a bug here must not kill the thread: the step goes on without the disk
                log.exception("disk tier: %s of a block failed", work.__name__)
                if item[0] is not None:
                    self.done.append((work.__name__.strip("_"), item[0], False))
                if len(item) >= 3 and not item[2].done():
                    item[2].set_result(False)

    def _write(self, h: bytes | None, data, done: Future | None = None, ready=None) -> None:
        try:
            if ready is not None:
                ready.synchronize()
            self._write_one(h, data)
        finally:
            if done is not None and not done.done():
                done.set_result(None)

    def _write_one(self, h: bytes | None, data) -> None:
        if h is None:  # data: hashes to delete
            for gone in data:
                with self.lock:
                    size = self.files.pop(gone, None)
                    self.used -= size or 0
                if size is not None:
                    _remove(self.dir / _name(gone))
            return
        if data.nbytes != self.block_bytes:
            raise ValueError(f"a block of {data.nbytes} bytes, not {self.block_bytes}")
        with self.lock:
            known = h in self.files
        if known or HEADER.size + data.nbytes > self.capacity:
            self.done.append(("write", h, known))
            return
        self._evict(HEADER.size + data.nbytes)
        path = self.dir / _name(h)
        tmp = path.with_suffix(".tmp")
        header = HEADER.pack(MAGIC, LAYOUT, self.identity, _digest(data), data.nbytes)
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(memoryview(data))
            os.replace(tmp, path)
        except OSError as exc:
            _remove(tmp)
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                log.warning("disk tier: a block could not be written (%s); %d dropped so far", exc, self.dropped)
            self.done.append(("write", h, False))
            return
        with self.lock:
            self.files[h] = HEADER.size + data.nbytes
            self.used += HEADER.size + data.nbytes
        self.done.append(("write", h, True))

    def _fetch(self, h: bytes, into: np.ndarray, done: Future) -> None:
        path = self.dir / _name(h)
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except OSError as exc:
            log.warning("disk tier: %s could not be read (%s)", path, exc)
            self._lose(h, path, done)
            return
        why = self._check(raw)
        if why:
            log.warning("disk tier: %s %s: deleted, not served", path, why)
            self._lose(h, path, done)
            return
        into.reshape(-1)[:] = np.frombuffer(raw, dtype=np.uint8, offset=HEADER.size)
        with self.lock:
            if h in self.files:
                self.files.move_to_end(h)
        self.done.append(("fetch", h, True))
        done.set_result(True)

    def _check(self, raw: bytes) -> str | None:
        if len(raw) != HEADER.size + self.block_bytes:
            return f"holds {len(raw)} bytes, not {HEADER.size + self.block_bytes}"
        magic, layout, identity, digest, n = HEADER.unpack_from(raw)
        if magic != MAGIC or layout != LAYOUT or n != self.block_bytes:
            return "is not a block file of this layout"
        if identity != self.identity:
            return "belongs to another model"
        if _digest(memoryview(raw)[HEADER.size:]) != digest:
            return "fails its checksum"
        return None

    def _lose(self, h: bytes, path: Path, done: Future) -> None:
        _remove(path)
        with self.lock:
            self.used -= self.files.pop(h, 0)
        self.done.append(("fetch", h, False))
        done.set_result(False)

    def _evict(self, room: int) -> None:
        """Delete the least recently used files until ``room`` more bytes fit."""
        while True:
            with self.lock:
                if not self.files or self.used + room <= self.capacity:
                    return
                h, size = self.files.popitem(last=False)
                self.used -= size
            _remove(self.dir / _name(h))
            self.done.append(("evict", h, True))


def _digest(payload) -> bytes:
    """The payload's checksum: SHA-256, which a CPU with SHA instructions computes about twice as
    fast as BLAKE2b (the reads' bottleneck)."""
    return hashlib.sha256(payload).digest()


def _name(h: bytes) -> str:
    return h.hex() + ".kv"


def _hash_of(name: str) -> bytes | None:
    if not name.endswith(".kv"):
        return None
    try:
        return bytes.fromhex(name[:-3])
    except ValueError:
        return None


def _safe(model: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in model) or "model"


def _remove(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass
