"""Fuzzing the rank socket: a real ``python -m neuron.rank`` process, driven the way the leader
drives it (a ROUTER bound on a private ipc:// endpoint), fed random and malformed frames.

For every frame: within a deadline the rank answers either ``error{kind, message}`` naming the
frame's id and epoch (where the raw frame still carries them) or the proper reply of that
request; every ~20 frames a ``ping`` must come back as ``pong``; the process never dies. At the
end ``shutdown`` gets ``bye`` and exit code 0.

Frames never sent by the fuzzer (the leader is trusted, and these would block or stop the rank
on purpose): ``shutdown``, ``init_dist`` with world != 1 and a rendezvous a handler could use,
``load_shard`` of an existing file other than the real model, ``load_shard`` of no files with
a config whose embedding table would be large (the rank allocates it before it notices), and
``load_shard`` with more than 4096 heads/layers/experts (plan_shard builds a tuple per query head
before it opens any file: 2**31 heads is minutes of CPU and tens of GiB).

A violation does not stop the run: it is recorded (with the frame), the rank is respawned if it
died, and the test fails at the end with every violation listed, so one run shows them all.
"""

from __future__ import annotations

import hashlib
import math
import os
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, Phase, assume, example, given, seed, settings
from hypothesis import strategies as st

import protocol as p
from protocol.codec import REPLY_OPS, REQUEST_OPS

ROOT = Path(__file__).resolve().parent.parent
SEED = 20261122
EPOCH = 1
# Examples per phase (the seed makes every run send the same frames).
N_WIRE = 1500     # phase B: random bytes, msgpack values, op-shaped arrays, mutated frames
N_STEP = 250      # phase C: step / free / memory frames against a loaded model
PING_EVERY = 20
BYE_TRIALS = 8
MAX_RESPAWNS = 10  # past this many deaths the rest of a run is skipped (counted), to bound the time
REPLY_DEADLINE_S = 15.0
LOAD_DEADLINE_S = 120.0

_raw = msgspec.msgpack.Encoder()
_raw_decoder = msgspec.msgpack.Decoder()

REPLY_FOR: dict[type, type] = {
    p.Ping: p.Pong, p.InitDist: p.InitOk, p.SanityCheck: p.SanityResult, p.LoadShard: p.LoadOk,
    p.Step: p.StepResult, p.Free: p.Freed, p.Memory: p.MemoryInfo, p.Unload: p.Unloaded,
    p.InjectFault: p.FaultArmed,
}


# ---------------------------------------------------------------------------------------------
# The harness: a leader-side ROUTER and one rank process


@dataclass
class Stats:
    frames: int = 0
    pings: int = 0
    respawns: int = 0
    skipped: int = 0
    slowest: list[tuple[float, str]] = field(default_factory=list)
    notes: Counter = field(default_factory=Counter)
    replies: Counter = field(default_factory=Counter)
    error_kinds: Counter = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)
    digest: Any = field(default_factory=hashlib.sha256)  # of every frame sent: same seed, same digest

    def line(self, what: str) -> str:
        return (f"[fuzz-rank] {what}: seed={SEED} digest={self.digest.hexdigest()[:12]} frames={self.frames} "
                f"pings={self.pings} "
                f"respawns={self.respawns} skipped={self.skipped} replies={dict(sorted(self.replies.items()))} "
                f"error_kinds={dict(sorted(self.error_kinds.items()))} violations={len(self.violations)}"
                + (f" notes={dict(self.notes)}" if self.notes else ""))


class ForkedRanks:
    """Ranks forked by neuron's zygote, as a daemon starts its CPU ranks (``neuron/rank_forks.py``),
    from an event loop of their own in a thread; each handed back with Popen's ``poll``, ``wait``
    and ``kill``."""

    def __init__(self) -> None:
        import asyncio
        import threading

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float | None):
        import asyncio

        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def spawn(self, args: list[str]) -> Any:
        from neuron.rank_forks import spawn_rank

        return _Forked(self, self.run(spawn_rank(args, dict(os.environ), "cpu"), 60))

    def close(self) -> None:
        from neuron.rank_forks import warm

        async def release() -> None:
            held = warm()
            if held is not None:
                held[0].release()

        self.run(release(), 10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


class _Forked:
    def __init__(self, forks: ForkedRanks, rank) -> None:
        self.forks, self.rank, self.pid = forks, rank, rank.pid

    @property
    def returncode(self) -> int | None:
        return self.rank.returncode

    def poll(self) -> int | None:
        return self.rank.returncode

    def wait(self, timeout: float | None = None) -> int:
        return self.forks.run(self.rank.wait(), timeout)

    def kill(self) -> None:
        self.forks.loop.call_soon_threadsafe(self.rank.kill)


class Rank:
    def __init__(self, tmp: Path, spawn=None) -> None:
        """``spawn``: how the rank process starts (``ForkedRanks.spawn``); None: ``python -m neuron.rank``."""
        run = tmp / "rt"
        run.mkdir(mode=0o700, parents=True)
        os.chmod(run, 0o700)
        self.endpoint = f"ipc://{run}/rank.sock"
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a respawned rank takes over "rank-0"
        self.sock.bind(self.endpoint)
        self.log_path = tmp / "rank.log"
        self.spawn = spawn
        self.proc: Any = None
        self.replay: list[bytes] = []  # frames that restore a respawned rank's state (a load)
        self._ids = 1_000_000
        self.stats = Stats()

    # -- process
    def start(self) -> None:
        args = ["--endpoint", self.endpoint, "--rank", "0", "--world", "1", "--epoch", str(EPOCH), "--device", "cpu"]
        if self.spawn is not None:
            self.proc = self.spawn(args)
        else:
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen([sys.executable, "-m", "neuron.rank", *args], cwd=ROOT, stdout=log,
                                             stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            reply = self._recv(0.5)
            if isinstance(reply, p.Heartbeat):
                return
            assert self.proc.poll() is None, f"rank exited with {self.proc.returncode} at start:\n{self.log()}"
        raise AssertionError(f"no heartbeat from the rank in 60 s:\n{self.log()}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        if not self.log_path.exists():  # a forked rank writes where the test's output goes
            return "(the rank's output is in the test's captured output)"
        return self.log_path.read_text(errors="replace")[-4000:]

    def respawn(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait()
        self.stats.respawns += 1
        self.start()
        for frame in self.replay:
            self.send(frame)
            got = self.reply(LOAD_DEADLINE_S)
            assert not isinstance(got, (p.Error, type(None))), f"replay after respawn failed: {got!r}"

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.sock.close(0)
        self.ctx.term()

    # -- wire
    def new_id(self) -> int:
        self._ids += 1
        return self._ids

    def send(self, *parts: bytes) -> bool:
        try:
            self.sock.send_multipart([b"rank-0", *parts])
            return True
        except zmq.ZMQError:  # ROUTER_MANDATORY: the rank is not connected
            return False

    def _recv(self, timeout: float):
        if not self.sock.poll(int(timeout * 1000)):
            return None
        ident, *rest = self.sock.recv_multipart()
        assert ident == b"rank-0", ident
        assert len(rest) == 1, f"a reply of {len(rest)} parts"
        try:
            return p.decode_reply(rest[0])
        except p.FrameError as exc:
            return exc

    def reply(self, timeout: float = REPLY_DEADLINE_S):
        """The next frame from the rank that is not a heartbeat, or None at the deadline."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            dead = not self.alive()
            got = self._recv(min(left, 0.5) if not dead else 1.0)  # what a dead rank sent may still be in flight
            if got is None:
                if dead:
                    return None
                continue
            if isinstance(got, p.Heartbeat):
                if got.rank != 0 or got.epoch != EPOCH:
                    self.stats.violations.append(f"odd heartbeat {got!r}")
                continue
            return got
        return None

    def ping(self) -> None:
        i = self.new_id()
        self.stats.pings += 1
        if not self.send(p.encode(p.Ping(id=i, epoch=EPOCH))):
            self._died("ping could not be sent", b"")
            return
        got = self.reply(5.0)
        if not (isinstance(got, p.Pong) and got.id == i and got.epoch == EPOCH and got.rank == 0
                and got.world == 1 and got.pid == self.proc.pid):
            self._died(f"ping {i} answered {got!r}", b"")

    def _died(self, what: str, frame: bytes) -> None:
        state = "alive" if self.alive() else f"DEAD (exit {self.proc.returncode})"
        self.stats.violations.append(f"{what}; rank {state}; frame {_show(frame)}; log tail:\n{self.log()[-1500:]}")
        self.respawn()

    # -- one fuzz frame
    def check(self, frame: bytes, deadline: float = REPLY_DEADLINE_S):
        """Send one frame; verify the answer; record what happened. Returns the reply."""
        expect = expectation(frame)
        self.stats.frames += 1
        self.stats.digest.update(len(frame).to_bytes(8, "little") + frame)
        if not self.send(frame):
            self._died("send failed (rank not connected)", frame)
            return None
        t0 = time.monotonic()
        got = self.reply(deadline)
        took = time.monotonic() - t0
        self.stats.slowest = sorted([*self.stats.slowest, (took, f"{_show(frame)[:160]} -> {got!r}"[:400])],
                                    reverse=True)[:3]
        if got is None:
            self._died("no reply (the rank died)" if not self.alive() else f"no reply in {deadline:.0f}s", frame)
            return None
        if isinstance(got, p.FrameError):
            self.stats.violations.append(f"undecodable reply {got.message} to {_show(frame)}")
            return None
        self.stats.replies[got.__struct_config__.tag] += 1
        if isinstance(got, p.Error):
            self.stats.error_kinds[got.kind] += 1
            if not got.kind or not isinstance(got.message, str):
                self.stats.violations.append(f"error without kind/message {got!r} to {_show(frame)}")
        if (isinstance(got, p.StepResult) and isinstance(expect.msg, p.Step)
                and any(q.start_pos < 0 for q in expect.msg.seqs)):
            self.stats.notes["step with a negative start_pos answered step_result"] += 1
        problem = expect.judge(got)
        if problem:
            self.stats.violations.append(f"{problem}; frame {_show(frame)}")
        if self.stats.frames % PING_EVERY == 0:
            self.ping()
        if not self.alive():
            self._died("rank exited after replying", frame)
        return got


def _show(frame: bytes) -> str:
    if len(frame) <= 120:
        return repr(frame)
    return f"{frame[:100]!r}... ({len(frame)} bytes)"


@dataclass
class Expect:
    msg: p.Request | None = None  # the request the frame decodes to
    kind: str | None = None  # else the error kind a codec error gives
    id: int | None = None  # the id (and epoch) the error must name; None: unrecoverable
    epoch: int | None = None

    def judge(self, got) -> str | None:
        if self.msg is not None:
            want = REPLY_FOR[type(self.msg)]
            if not isinstance(got, (want, p.Error)) or (isinstance(got, p.Error) and want is p.Pong):
                return f"{type(self.msg).__name__} answered by {got!r}"
            if got.id != self.msg.id or got.epoch != self.msg.epoch:
                return f"reply {got!r} names id/epoch {got.id}/{got.epoch}, not {self.msg.id}/{self.msg.epoch}"
            return None
        if not isinstance(got, p.Error):
            return f"undecodable frame answered by {got!r}"
        if got.kind != self.kind:
            return f"error kind {got.kind!r}, expected {self.kind!r} ({got.message[:200]})"
        if self.id is not None and (got.id, got.epoch) != (self.id, self.epoch):
            return f"error names id/epoch {got.id}/{got.epoch}, expected {self.id}/{self.epoch}"
        return None


def expectation(frame: bytes) -> Expect:
    try:
        return Expect(msg=p.decode_request(frame))
    except p.FrameError as exc:
        return Expect(kind=exc.kind, id=exc.id, epoch=exc.epoch)
    except Exception:  # noqa: BLE001
        # RecursionError (deep nesting), UnicodeDecodeError (a str that is not UTF-8): the codec
        # does not turn these into a FrameError. A rank that survives them can only answer
        # bad_request, and cannot know the id.
        return Expect(kind="bad_request")


def unsafe(frame: bytes) -> bool:
    """Frames that would stop or block the rank by design, or make it allocate a lot."""
    try:
        msg = p.decode_request(frame)
    except Exception:  # noqa: BLE001
        return False
    if isinstance(msg, p.Shutdown):
        return True
    if isinstance(msg, p.InitDist):
        return msg.world != 1 and ":" in msg.rendezvous
    if isinstance(msg, p.LoadShard):
        c = msg.config
        # plan_shard builds a tuple with one entry per query head before any file is opened:
        # 2**31 heads is minutes of CPU and tens of GiB (see the report; the leader is trusted).
        if max(abs(c.num_heads), abs(c.num_kv_heads), abs(c.num_experts), abs(c.num_layers)) > 4096:
            return True
        if any(os.path.exists(x) for x in msg.paths if isinstance(x, str)):
            return True
        if msg.format != "gguf" and not msg.paths and c.vocab_size * c.hidden_size > 2**22:
            return True
    return False


# ---------------------------------------------------------------------------------------------
# Strategies

def weighted(*items: tuple[int, st.SearchStrategy]) -> st.SearchStrategy:
    """one_of with weights (repeating a strategy inside one_of does not weight it)."""
    return st.sampled_from([s for w, s in items for _ in range(w)]).flatmap(lambda s: s)


EDGE_INTS = [0, 1, -1, 2**31 - 1, -(2**31), 2**32, 2**53 + 1, 2**63 - 1, -(2**63), 2**63, 2**64 - 1]
EDGE_FLOATS = [0.0, -0.0, 1e308, -1e308, 5e-324, math.inf, -math.inf, math.nan]
# (a str with a lone surrogate cannot be encoded: invalid UTF-8 goes in as raw msgpack bytes below)
EDGE_TEXT = ["", "\x00", "\u202e\u200fRTL", "\ufeff", "😀" * 8, "e\u0301", "ping", "shutdown",
             "../../etc/passwd", "%s%n", "\n" * 64]
TINY_CONFIG = p.ModelConfig(family="llama", vocab_size=16, hidden_size=8, intermediate_size=16, num_layers=1,
                            num_heads=2, num_kv_heads=1, head_dim=4, rms_norm_eps=1e-5, rope_theta=1e4,
                            max_position_embeddings=64, tie_word_embeddings=True)

ints = st.one_of(st.integers(-(2**63), 2**64 - 1), st.sampled_from(EDGE_INTS), st.integers(-5, 70))
floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(EDGE_FLOATS))
texts = st.one_of(st.text(max_size=24), st.sampled_from(EDGE_TEXT),
                  st.builds(lambda ch, n: ch * n, st.sampled_from(["a", "😀", "\x00"]), st.sampled_from([4096, 100_000])))
scalars = st.one_of(st.none(), st.booleans(), ints, floats, texts, st.binary(max_size=32))
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=6),
                            st.dictionaries(st.one_of(st.text(max_size=10), st.integers(-(2**63), 2**64 - 1)),
                                            inner, max_size=5)),
    max_leaves=24,
)


def nested(depth: int, leaf=0) -> bytes:
    """A msgpack array nested ``depth`` deep (built as bytes: Python would recurse too)."""
    return b"\x91" * depth + _raw.encode(leaf)


SAFE_OPS = sorted(REQUEST_OPS - {"shutdown"})
frame_ids = st.one_of(st.integers(0, 2**20), ints)

random_bytes = st.binary(max_size=512)
random_msgpack = values.map(_raw.encode)
op_arrays = st.builds(lambda op, fields: _raw.encode([op, *fields]),
                      st.sampled_from(SAFE_OPS), st.lists(values, max_size=8))
op_arrays_with_ids = st.builds(lambda op, i, e, fields: _raw.encode([op, i, e, *fields]),
                               st.sampled_from(SAFE_OPS), frame_ids, frame_ids, st.lists(values, max_size=6))
unknown_ops = st.builds(
    lambda op, i, e, fields: _raw.encode([op, i, e, *fields]),
    st.one_of(st.sampled_from(sorted(REPLY_OPS)), texts.filter(lambda s: s not in REQUEST_OPS),
              st.sampled_from(["PING", "ping ", "Step", "shutdown\x00"])),
    frame_ids, frame_ids, st.lists(values, max_size=4))
nested_arrays = st.builds(lambda d, op, i: nested(d, [op, i, EPOCH]),
                          st.integers(1, 400), st.sampled_from(SAFE_OPS), frame_ids)
nested_fields = st.builds(lambda op, i, d: b"\x94" + _raw.encode(op) + _raw.encode(i) + _raw.encode(EPOCH)
                          + nested(d), st.sampled_from(SAFE_OPS), frame_ids, st.integers(1, 400))
long_strings = st.builds(lambda op, i, n, ch: _raw.encode([op, i, EPOCH, ch * n]),
                         st.sampled_from(["unload", "inject_fault", "memory", "init_dist"]), frame_ids,
                         st.integers(10_000, 2_000_000), st.sampled_from(["a", "é", "😀", "\x00"]))


def sampling(sane: bool) -> st.SearchStrategy:
    if sane:
        return st.builds(p.Sampling, temperature=st.floats(0, 2), top_p=st.floats(0.05, 1), top_k=st.integers(0, 50),
                         min_p=st.floats(0, 0.5), seed=st.one_of(st.none(), st.integers(0, 2**63 - 1)),
                         repetition_penalty=st.floats(0.5, 2), frequency_penalty=st.floats(-2, 2),
                         presence_penalty=st.floats(-2, 2), prompt_len=st.integers(0, 8), logprobs=st.integers(0, 21))
    return st.builds(p.Sampling, temperature=floats, top_p=floats, top_k=ints, min_p=floats,
                     seed=st.one_of(st.none(), ints), frequency_penalty=floats, presence_penalty=floats,
                     repetition_penalty=floats, prompt_len=ints, logprobs=st.one_of(st.integers(-2, 30), ints))


def step_seq(max_len: int, vocab: int, slots: int) -> st.SearchStrategy:
    # Sane: a slot's whole table (16-token blocks, 4 per slot: the test loads 64-token contexts)
    # with a new sequence, or a continuation with the decode input on the device.
    sane = st.builds(
        lambda slot, tokens, start, sample, sampling: p.StepSeq(
            slot=slot, tokens=tokens, start_pos=start, sample=sample, sampling=sampling,
            blocks=list(range(4 * slot, 4 * slot + 4)) if sampling is not None else [], block_start=0),
        st.integers(0, slots - 1), st.lists(st.integers(0, vocab - 1), min_size=1, max_size=12),
        st.integers(0, max_len - 13), st.booleans(), st.one_of(st.none(), sampling(True)),
    )
    decode = st.builds(
        lambda slot, start: p.StepSeq(slot=slot, tokens=[-1], start_pos=start, sample=True),
        st.integers(0, slots - 1), st.integers(1, max_len - 1))
    wild = st.builds(
        p.StepSeq,
        slot=st.one_of(st.integers(-3, slots + 2), ints),
        tokens=st.lists(st.one_of(st.integers(-3, vocab + 3), ints), max_size=16),
        start_pos=st.one_of(st.integers(-20, max_len + 3), ints),
        sample=st.booleans(),
        blocks=st.lists(st.one_of(st.integers(-2, 4 * slots + 2), ints), max_size=6),
        block_start=st.one_of(st.integers(-2, 6), ints),
        sampling=st.one_of(st.none(), sampling(False), sampling(True)),
        allowed=st.one_of(st.none(), st.binary(max_size=64)),
    )
    return weighted((2, sane), (1, decode), (1, wild))


def step_frames(max_len: int, vocab: int, slots: int) -> st.SearchStrategy:
    steps = st.builds(lambda i, sid, seqs: p.encode(p.Step(id=i, epoch=EPOCH, step_id=sid, seqs=seqs)),
                      frame_ids, ints, st.lists(step_seq(max_len, vocab, slots), max_size=4))
    frees = st.builds(lambda i, slots_: p.encode(p.Free(id=i, epoch=EPOCH, slots=slots_)),
                      frame_ids, st.lists(ints, max_size=8))
    memory = st.builds(lambda i: p.encode(p.Memory(id=i, epoch=EPOCH)), frame_ids)
    return weighted((6, steps), (1, frees), (1, memory))


def nonsense_requests() -> st.SearchStrategy:
    """Well-formed requests a rank without a model must refuse (or answer) properly."""
    cfgs = st.builds(
        lambda v, h, heads, kv, layers: msgspec.structs.replace(
            TINY_CONFIG, vocab_size=v, hidden_size=h, num_heads=heads, num_kv_heads=kv, num_layers=layers),
        st.one_of(st.integers(-4, 64), ints), st.one_of(st.integers(-4, 64), ints),
        st.one_of(st.integers(-2, 8), ints), st.one_of(st.integers(-2, 8), ints), st.integers(-1, 4))
    loads = st.builds(
        lambda i, model, fmt, paths, cfg, dtype, slots, ml, quant: p.encode(p.LoadShard(
            id=i, epoch=EPOCH, model=model, format=fmt, paths=paths, config=cfg, dtype=dtype, max_slots=slots,
            max_len=ml, quant=quant)),
        frame_ids, texts, st.sampled_from(["safetensors", "gguf", "", "onnx"]),
        st.lists(st.sampled_from(["/nonexistent/model.safetensors", "/nonexistent/m.gguf", "", "\x00",
                                  "relative/missing.bin"]), max_size=3),
        cfgs, st.sampled_from(["float32", "bfloat16", "float16", "int8", "", "float64", "torch.float32"]),
        st.one_of(st.integers(-2, 8), ints), st.one_of(st.integers(-2, 128), ints), st.one_of(st.none(), texts))
    return weighted((1, loads), (3, st.one_of(
        st.builds(lambda i: p.encode(p.SanityCheck(id=i, epoch=EPOCH)), frame_ids),
        st.builds(lambda i: p.encode(p.Memory(id=i, epoch=EPOCH)), frame_ids),
        st.builds(lambda i, m: p.encode(p.Unload(id=i, epoch=EPOCH, model=m)), frame_ids, texts),
        st.builds(lambda i, k: p.encode(p.InjectFault(id=i, epoch=EPOCH, kind=k)), frame_ids,
                  st.one_of(st.just("oom"), texts)),
        st.builds(lambda i, s: p.encode(p.Free(id=i, epoch=EPOCH, slots=s)), frame_ids, st.lists(ints, max_size=8)),
        st.builds(lambda i, sid, seqs: p.encode(p.Step(id=i, epoch=EPOCH, step_id=sid, seqs=seqs)),
                  frame_ids, ints, st.lists(step_seq(64, 100, 4), max_size=3)),
        st.builds(lambda i, backend, rdv, world, rank, t: p.encode(p.InitDist(
            id=i, epoch=EPOCH, backend=backend, rendezvous=rdv, world=world, rank=rank, timeout_s=t)),
            frame_ids, st.sampled_from(["gloo", "nccl", "mpi", "nope", ""]),
            st.one_of(st.just("tcp://127.0.0.1:1"), texts), st.one_of(st.just(1), ints), ints, floats),
    )))


TEMPLATES: list[p.Frame] = [
    p.Ping(id=7, epoch=EPOCH),
    p.InitDist(id=7, epoch=EPOCH, backend="gloo", rendezvous="none", world=1, rank=0),
    p.SanityCheck(id=7, epoch=EPOCH),
    p.LoadShard(id=7, epoch=EPOCH, model="m", format="safetensors", paths=["/nonexistent/x.safetensors"],
                config=TINY_CONFIG, dtype="float32", max_slots=2, max_len=64),
    p.Step(id=7, epoch=EPOCH, step_id=3, seqs=[p.StepSeq(slot=0, tokens=[1, 2], start_pos=0, sample=True,
                                                         blocks=[0], sampling=p.Sampling(temperature=0.0))]),
    p.Free(id=7, epoch=EPOCH, slots=[0, 1]),
    p.Memory(id=7, epoch=EPOCH),
    p.Unload(id=7, epoch=EPOCH, model="m"),
    p.InjectFault(id=7, epoch=EPOCH, kind="oom"),
]


@st.composite
def mutated_frames(draw) -> bytes:
    """A real request frame with one element replaced, dropped, added, or reached into."""
    arr = _raw_decoder.decode(p.encode(draw(st.sampled_from(TEMPLATES))))
    action = draw(st.sampled_from(["replace", "replace", "truncate", "extend", "deep"]))
    if action == "replace":
        arr[draw(st.integers(1, len(arr) - 1))] = draw(values)
    elif action == "truncate":
        arr = arr[: draw(st.integers(1, len(arr) - 1))]
    elif action == "extend":
        arr += draw(st.lists(values, min_size=1, max_size=3))
    else:
        target = arr
        for _ in range(draw(st.integers(1, 3))):
            holders = [(k, v) for k, v in (target.items() if isinstance(target, dict) else enumerate(target))
                       if isinstance(v, (list, dict)) and v and not (target is arr and k == 0)]
            if not holders:
                break
            key, target = draw(st.sampled_from(holders))
        keys = list(target.keys()) if isinstance(target, dict) else list(range(1 if target is arr else 0, len(target)))
        if keys:
            target[draw(st.sampled_from(keys))] = draw(values)
    return _raw.encode(arr)


wire_frames = weighted((1, random_bytes), (1, random_msgpack), (1, op_arrays), (2, op_arrays_with_ids),
                       (1, unknown_ops), (1, nested_arrays), (1, nested_fields), (1, long_strings),
                       (3, mutated_frames()), (2, nonsense_requests()))

FUZZ_SETTINGS = dict(database=None, deadline=None, phases=[Phase.explicit, Phase.generate],
                     suppress_health_check=list(HealthCheck), print_blob=False)


# ---------------------------------------------------------------------------------------------
# The tests


@pytest.fixture
def rank(tmp_path):
    r = Rank(tmp_path)
    r.start()
    yield r
    r.close()


def _finish(rank: Rank, what: str) -> None:
    """Shutdown must be answered with bye and exit 0; then report and fail on any violation."""
    i = rank.new_id()
    assert rank.send(p.encode(p.Shutdown(id=i, epoch=EPOCH))), "rank not connected at shutdown"
    bye = rank.reply(30.0)
    code = rank.proc.wait(30)
    print("\n" + rank.stats.line(what))
    for took, what_ in rank.stats.slowest:
        print(f"[fuzz-rank] slow frame {took:.2f}s: {what_}")
    for v in rank.stats.violations:
        print(f"[fuzz-rank] VIOLATION: {v}")
    assert isinstance(bye, p.Bye) and bye.id == i, (
        f"shutdown {i} answered {bye!r}; the rank exited {code}; log tail:\n{rank.log()[-1500:]}")
    assert code == 0, f"rank exited {code} after shutdown:\n{rank.log()}"
    assert not rank.stats.violations, (
        f"{len(rank.stats.violations)} violation(s); first: {rank.stats.violations[0][:3000]}")


def test_rank_init_dist_world_1_and_nonsense_before_load(rank):
    """init_dist at world 1, and requests that make no sense on a rank with no model."""
    def call(frame: p.Frame, want: type, kind: str | None = None) -> None:
        got = rank.check(p.encode(frame))
        assert isinstance(got, want), f"{frame!r} -> {got!r}"
        assert got.id == frame.id and got.epoch == frame.epoch
        if kind is not None:
            assert got.kind == kind, f"{frame!r} -> {got!r}"

    call(p.InitDist(id=1, epoch=EPOCH, backend="gloo", rendezvous="tcp://127.0.0.1:1", world=1, rank=0), p.InitOk)
    call(p.Step(id=2, epoch=EPOCH, step_id=1, seqs=[p.StepSeq(slot=0, tokens=[1], start_pos=0)]), p.Error,
         "model_not_loaded")
    call(p.Step(id=3, epoch=EPOCH, step_id=2, seqs=[]), p.Error, "model_not_loaded")
    call(p.Free(id=4, epoch=EPOCH, slots=[-1, 0, 2**63 - 1, -(2**63), 10**9]), p.Freed)
    call(p.Memory(id=5, epoch=EPOCH), p.MemoryInfo)
    call(p.Unload(id=6, epoch=EPOCH, model="no-such-model"), p.Unloaded)
    call(p.LoadShard(id=7, epoch=EPOCH, model="m", format="safetensors", paths=["/nonexistent/a.safetensors"],
                     config=TINY_CONFIG, dtype="float32", max_slots=2, max_len=64), p.Error, "failed")
    call(p.LoadShard(id=8, epoch=EPOCH, model="m", format="gguf", paths=["/nonexistent/a.gguf"],
                     config=TINY_CONFIG, dtype="float32", max_slots=2, max_len=64), p.Error, "failed")
    call(p.LoadShard(id=9, epoch=EPOCH, model="m", format="gguf", paths=[], config=TINY_CONFIG,
                     dtype="float32", max_slots=2, max_len=64), p.Error, "failed")
    call(p.LoadShard(id=10, epoch=EPOCH, model="m", format="safetensors", paths=["/nonexistent/a.safetensors"],
                     config=TINY_CONFIG, dtype="float128", max_slots=2, max_len=64), p.Error, "bad_request")
    call(p.SanityCheck(id=11, epoch=EPOCH), p.SanityResult)
    call(p.InjectFault(id=12, epoch=EPOCH, kind="oom"), p.Error, "bad_request")
    call(p.Step(id=13, epoch=EPOCH, step_id=3, seqs=[p.StepSeq(slot=0, tokens=[1], start_pos=0)]), p.Error,
         "model_not_loaded")  # the armed-fault refusal left nothing armed
    # a multipart message: the DEALER takes each part as its own frame
    a, b = rank.new_id(), rank.new_id()
    assert rank.send(p.encode(p.Ping(id=a, epoch=EPOCH)), p.encode(p.Ping(id=b, epoch=EPOCH)))
    got = {rank.reply(5.0).id, rank.reply(5.0).id}
    assert got == {a, b}, got
    _finish(rank, "init_dist + nonsense")


def test_fuzz_rank_wire(rank):
    """Random bytes, msgpack values, op-shaped arrays, unknown ops, mutated real frames, huge
    ints, long strings, nesting; and well-formed nonsense (load of missing files, bad dtypes,
    steps with no model, weird frees, init_dist that cannot rendezvous)."""
    t0 = time.monotonic()

    @seed(SEED)
    @settings(max_examples=N_WIRE, **FUZZ_SETTINGS)
    @given(frame=wire_frames)
    @example(frame=b"")
    @example(frame=b"\xc1")  # never-used msgpack byte
    @example(frame=b"\x93\xa4ping\x01")  # truncated
    @example(frame=_raw.encode(["ping", 2**64 - 1, -(2**63)]))
    @example(frame=_raw.encode(["step", 2**64 - 1, 2**64 - 1, 2**64 - 1, [[2**64 - 1, [2**64 - 1], -1, None]]]))
    @example(frame=_raw.encode(["shutdown", "not-an-id"]))  # a broken shutdown is only an error
    @example(frame=_raw.encode(["load_shard", 5, EPOCH, {"config": None}]))
    # A str that is not UTF-8 (here a CESU-style lone surrogate): msgspec raises UnicodeDecodeError.
    @example(frame=b"\x94\xa6unload\x05\x01\xa3a\xed\xa0")
    @example(frame=nested(200, ["ping", 3, EPOCH]))
    @example(frame=b"\x94\xa4ping\x05\x01" + nested(300))
    # Deep nesting: msgspec raises RecursionError (not DecodeError) past ~1000 levels.
    @example(frame=b"\x94\xa4step\x09\x01" + nested(5_000))
    def fuzz(frame: bytes) -> None:
        assume(not unsafe(frame))
        if rank.stats.respawns >= MAX_RESPAWNS:
            rank.stats.skipped += 1
            return
        rank.check(frame)

    fuzz()
    print(f"\n[fuzz-rank] wire phase took {time.monotonic() - t0:.1f}s")
    _finish(rank, "wire")


def test_fuzz_rank_steps_with_a_model(rank):
    """With the real model loaded (small KV cache): steps with wild slots, positions, token ids
    and sampling parameters, frees and memory in between; afterwards a greedy step still gives
    the token it gave before the fuzz."""
    from neuron.loader.spec import load_spec

    spec = load_spec("SmolLM2-135M-Instruct")
    slots, max_len = 4, 64
    load = p.LoadShard(id=rank.new_id(), epoch=EPOCH, model="fuzz", format=spec.files.format,
                       paths=[str(x) for x in spec.files.paths], config=spec.config, dtype="float32",
                       max_slots=slots, max_len=max_len)
    t0 = time.monotonic()
    ok = rank.check(p.encode(load), LOAD_DEADLINE_S)
    assert isinstance(ok, p.LoadOk), f"load failed: {ok!r}"
    rank.replay.append(p.encode(load))
    print(f"\n[fuzz-rank] model loaded in {time.monotonic() - t0:.1f}s")

    def greedy() -> int:
        frame = p.Step(id=rank.new_id(), epoch=EPOCH, step_id=1, seqs=[p.StepSeq(
            slot=0, tokens=[1, 9690, 28, 216, 5248], start_pos=0, sample=True, blocks=[0, 1, 2, 3],
            sampling=p.Sampling(temperature=0.0))])
        got = rank.check(p.encode(frame))
        assert isinstance(got, p.StepResult), got
        return got.tokens[0]

    before = greedy()
    vocab = spec.config.vocab_size
    t0 = time.monotonic()

    @seed(SEED)
    @settings(max_examples=N_STEP, **FUZZ_SETTINGS)
    @given(frame=step_frames(max_len, vocab, slots))
    @example(frame=p.encode(p.Step(id=1, epoch=EPOCH, step_id=1, seqs=[])))
    @example(frame=p.encode(p.Step(id=2, epoch=EPOCH, step_id=1, seqs=[p.StepSeq(slot=0, tokens=[], start_pos=0)])))
    @example(frame=p.encode(p.Step(id=3, epoch=EPOCH, step_id=1, seqs=[
        p.StepSeq(slot=0, tokens=[2**63 - 1], start_pos=0, sample=True, blocks=[0],
                  sampling=p.Sampling(temperature=1.0))])))
    @example(frame=p.encode(p.Step(id=4, epoch=EPOCH, step_id=1, seqs=[
        p.StepSeq(slot=1, tokens=[5, 6], start_pos=-1, sample=True, blocks=[4], sampling=p.Sampling(temperature=0.0))])))
    @example(frame=p.encode(p.Step(id=5, epoch=EPOCH, step_id=1, seqs=[
        p.StepSeq(slot=0, tokens=[5], start_pos=0, sample=True, blocks=[0], sampling=p.Sampling(temperature=math.nan)),
        p.StepSeq(slot=0, tokens=[5], start_pos=0, sample=True, blocks=[0], sampling=p.Sampling(logprobs=2**63 - 1))])))
    @example(frame=p.encode(p.Step(id=6, epoch=EPOCH, step_id=1, seqs=[
        p.StepSeq(slot=2, tokens=[5, 6, 7], start_pos=3, sample=True, blocks=[8, 9],
                  sampling=p.Sampling(temperature=1e-300, repetition_penalty=1e-300, seed=2**64 - 1))])))
    @example(frame=p.encode(p.Step(id=7, epoch=EPOCH, step_id=1, seqs=[
        p.StepSeq(slot=1, tokens=[-1], start_pos=9, sample=True, blocks=[10**9], block_start=1)])))
    @example(frame=p.encode(p.Step(id=8, epoch=EPOCH, step_id=1, seqs=[
        p.StepSeq(slot=3, tokens=[5, 6], start_pos=0, sample=True, blocks=[12], allowed=b"\x01\x02",
                  sampling=p.Sampling(temperature=0.5, logit_bias=[(10**9, 1.0)]))])))
    def fuzz(frame: bytes) -> None:
        if rank.stats.respawns >= MAX_RESPAWNS:
            rank.stats.skipped += 1
            return
        rank.check(frame)

    fuzz()
    after = greedy()
    print(f"[fuzz-rank] step phase took {time.monotonic() - t0:.1f}s; greedy token {before} -> {after}")
    if after != before:
        rank.stats.violations.append(f"greedy token changed after the fuzz: {before} -> {after}")
    _finish(rank, "steps")


def test_rank_survives_deeply_nested_frame(rank):
    """Reproducer (failed at 931d1c4, fixed in a86cb5e): a msgpack array nested 100k deep.
    msgspec raises RecursionError, which protocol.codec._decode did not catch, so it escaped
    RankProcess._on_frame and ended the rank's run loop: the rank exited 1 instead of answering
    error{bad_request}."""
    frame = nested(100_000)
    assert rank.send(frame)
    got = rank.reply(10.0)
    alive = rank.alive()
    assert alive, (f"the rank died on a {len(frame)}-byte frame of nested arrays "
                   f"(exit {rank.proc.returncode}); log tail:\n{rank.log()[-1200:]}")
    assert isinstance(got, p.Error) and got.kind == "bad_request", got
    _finish(rank, "deep nesting")


def test_rank_survives_invalid_utf8(rank):
    """Reproducer (failed at 931d1c4, fixed in a86cb5e): an ``unload`` whose model name is a
    msgpack str of invalid UTF-8. msgspec raises UnicodeDecodeError, which protocol.codec._decode
    did not catch (only DecodeError and ValidationError), so it escaped RankProcess._on_frame and
    ended the run loop: the rank exited 1 instead of answering error{bad_request}. Random bytes
    hit this too (a fixstr header followed by non-UTF-8)."""
    frame = b"\x94\xa6unload\x05\x01\xa2\xff\xfe"  # ["unload", 5, 1, <str b"\xff\xfe">]
    assert rank.send(frame)
    got = rank.reply(10.0)
    assert rank.alive(), (f"the rank died on {frame!r} (exit {rank.proc.returncode}); "
                          f"log tail:\n{rank.log()[-1200:]}")
    assert isinstance(got, p.Error) and got.kind == "bad_request", got
    _finish(rank, "invalid utf-8")


def test_rank_shutdown_delivers_bye(tmp_path):
    """``shutdown`` must be answered with ``bye`` before the rank exits 0. RankProcess.main calls
    os._exit as soon as the loop ends; before 7be5ce6 the DEALER (LINGER 0) was never closed, and
    7be5ce6's sock.close(linger=1000) alone does not wait (only Context.term() does), so the
    queued Bye could be dropped before ZeroMQ's I/O thread wrote it (fixed by the ctx.term() in
    a86cb5e). It shows on a busy machine: two busy-loop children load both cores while a rank
    is started and shut down up to BYE_TRIALS times. Probabilistic: a regression fails most runs,
    not all. The ranks are forked from the zygote, as a daemon's CPU ranks are (a fresh python
    each would spend most of the test importing torch)."""
    forks = ForkedRanks()
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    lost = []
    try:
        for trial in range(BYE_TRIALS):
            r = Rank(tmp_path / f"t{trial}", forks.spawn)
            try:
                r.start()
                i = r.new_id()
                assert r.send(p.encode(p.Shutdown(id=i, epoch=EPOCH)))
                bye = r.reply(20.0)
                code = r.proc.wait(20)
                assert code == 0, f"rank exited {code} after shutdown"
                if not (isinstance(bye, p.Bye) and bye.id == i):
                    lost.append(trial)
                    break
            finally:
                r.close()
    finally:
        for b in busy:
            b.kill()
            b.wait()
        forks.close()
    print(f"\n[fuzz-rank] bye under load: trials={trial + 1} lost={lost}")
    assert not lost, f"the rank exited 0 without its bye (trial {lost[0]} of {BYE_TRIALS})"
