"""Unloading a model frees it at once: no reference cycle keeps a rank's model, its KV cache and
recurrent state, or its CUDA graphs alive until Python's garbage collector happens to run. On a
GPU that memory would stay taken after an unload (the next model finds less), and NCCL's teardown
waits for the graphs that captured its collectives, so a rank's exit would hang."""

from __future__ import annotations

import gc
import weakref

import pytest

import protocol as p
from neuron.loader.spec import load_spec
from neuron.rank.worker import DeviceWorker


def _checkpoint(kind: str, out):
    if kind in ("qwen3", "qwen3_moe"):
        from devtools.checkpoints import make_checkpoint
        return make_checkpoint(kind, out, seed=3)
    if kind == "qwen3_next":
        from test_hybrid import write_hybrid_checkpoint
        return write_hybrid_checkpoint(kind, out, seed=3)
    from test_vision_chat import write_checkpoint  # qwen3_5 with its vision tower
    return write_checkpoint(out, seed=3)


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe", "qwen3_next", "qwen3_5"])
def test_an_unloaded_model_is_freed_without_the_garbage_collector(tmp_path, kind, one_torch_thread):
    spec = load_spec(str(_checkpoint(kind, tmp_path / kind)))
    worker = DeviceWorker(0, 1, "cpu")
    ok = worker.handle(p.LoadShard(id=1, epoch=1, model="m", format="safetensors",
                                   paths=[str(x) for x in spec.files.paths], config=spec.config, dtype="float32",
                                   max_slots=2, max_len=64))
    assert isinstance(ok, p.LoadOk), ok
    runner = worker.runner
    held = {"runner": runner, "model": worker.model, "kv": runner.kv, "states": runner.states,
            "graphs": runner.step_graphs}
    refs = {name: weakref.ref(obj) for name, obj in held.items()}
    del runner, held
    gc.collect()
    gc.disable()  # what unloading frees, it must free by itself
    try:
        assert isinstance(worker.handle(p.Unload(id=2, epoch=1, model="m")), p.Unloaded)
        alive = [name for name, ref in refs.items() if ref() is not None]
    finally:
        gc.enable()
    assert not alive, f"still alive after the unload: {alive}"
