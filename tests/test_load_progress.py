"""A load reports its progress: the weight bytes a rank has read so far reach the leader in
heartbeats and show in GET /models while the model loads."""

from __future__ import annotations

import protocol as p
from neuron.loader.spec import load_spec
from neuron.rank.worker import DeviceWorker


def test_a_rank_counts_every_weight_byte_it_reads(tmp_path, one_torch_thread):
    from devtools.checkpoints import make_checkpoint

    path = make_checkpoint("qwen3", tmp_path / "ckpt", seed=5)
    spec = load_spec(str(path))
    worker = DeviceWorker(0, 1, "cpu")
    assert worker.loaded_bytes == 0
    ok = worker.handle(p.LoadShard(id=1, epoch=1, model="m", format="safetensors",
                                   paths=[str(x) for x in spec.files.paths], config=spec.config, dtype="float32",
                                   max_slots=2, max_len=64))
    assert isinstance(ok, p.LoadOk), ok
    assert worker.loaded_bytes == ok.bytes  # every float32 weight read once, nothing more


def test_heartbeats_carry_the_progress_to_the_leader():
    beat = p.decode_reply(p.encode(p.Heartbeat(id=0, epoch=3, rank=1, busy_step=-1, loaded_bytes=12345)))
    assert isinstance(beat, p.Heartbeat) and beat.loaded_bytes == 12345
