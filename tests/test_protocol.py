import msgspec
import pytest

import protocol as p


def all_frames():
    s = p.Sampling(temperature=0.7, top_p=0.9, seed=3, logprobs=2)
    cfg = p.ModelConfig(family="llama", vocab_size=10, hidden_size=8, intermediate_size=16, num_layers=1,
                        num_heads=2, num_kv_heads=1, head_dim=4, rms_norm_eps=1e-5, rope_theta=1e4,
                        max_position_embeddings=64, tie_word_embeddings=True)
    return [
        p.Ping(id=1, epoch=2),
        p.InitDist(id=1, epoch=2, backend="gloo", rendezvous="tcp://127.0.0.1:1", world=2, rank=1),
        p.SanityCheck(id=1, epoch=2),
        p.LoadShard(id=1, epoch=2, model="m", format="gguf", paths=["/x"], config=cfg, dtype="float32",
                    max_slots=2, max_len=64),
        p.Step(id=1, epoch=2, step_id=9, seqs=[p.StepSeq(slot=0, tokens=[1, 2], start_pos=0, sampling=s),
                                                p.StepSeq(slot=1, tokens=[5], start_pos=7)]),
        p.Free(id=1, epoch=2, slots=[0, 1]),
        p.Memory(id=1, epoch=2),
        p.Unload(id=1, epoch=2, model="m"),
        p.Shutdown(id=1, epoch=2),
        p.InjectFault(id=1, epoch=2, kind="oom"),
        p.Pong(id=1, epoch=2, rank=0, world=1, device="cpu", pid=5),
        p.InitOk(id=1, epoch=2),
        p.SanityResult(id=1, epoch=2, observed=2.0),
        p.LoadOk(id=1, epoch=2, kv_capacity=10, bytes=100),
        p.StepResult(id=1, epoch=2, step_id=9, tokens=[3, -1], timings=p.StepTimings(1.0, 0.1),
                     logprobs=[[(3, -0.5)], []]),
        p.Freed(id=1, epoch=2),
        p.FaultArmed(id=1, epoch=2, kind="oom"),
        p.MemoryInfo(id=1, epoch=2, free=1, total=2, kv_used=0),
        p.Unloaded(id=1, epoch=2),
        p.Bye(id=1, epoch=2),
        p.Error(id=1, epoch=2, kind="oom", message="x"),
        p.Heartbeat(id=1, epoch=2, rank=1, busy_step=-1),
    ]


@pytest.mark.parametrize("frame", all_frames(), ids=lambda f: type(f).__name__)
def test_every_frame_round_trips_through_the_codec(frame):
    data = p.encode(frame)
    decoded = p.decode_any(data)
    assert decoded == frame
    assert decoded.id == 1 and decoded.epoch == 2


def test_requests_and_replies_decode_only_in_their_direction():
    with pytest.raises(p.FrameError) as err:
        p.decode_request(p.encode(p.Pong(id=4, epoch=1, rank=0, world=1, device="cpu", pid=1)))
    assert err.value.kind == "unknown_op"
    assert err.value.id == 4


def test_an_unknown_op_is_named_and_keeps_its_id():
    with pytest.raises(p.FrameError) as err:
        p.decode_request(msgspec.msgpack.encode(["launch_missiles", 42, 7]))
    assert err.value.kind == "unknown_op"
    assert (err.value.id, err.value.epoch) == (42, 7)
    assert "launch_missiles" in err.value.message


@pytest.mark.parametrize("data", [b"", b"\xc1", b"garbage", msgspec.msgpack.encode({"op": "ping"}),
                                  msgspec.msgpack.encode([1, 2, 3]), msgspec.msgpack.encode(["step", "x", 1]),
                                  msgspec.msgpack.encode(["step", 5, 1, "not-an-int", []])])
def test_malformed_frames_are_bad_requests_not_crashes(data):
    with pytest.raises(p.FrameError) as err:
        p.decode_request(data)
    assert err.value.kind == "bad_request"
    assert err.value.message


def test_a_wrongly_typed_field_names_the_op():
    bad = msgspec.msgpack.encode(["step", 5, 1, 3, [[0, "tokens?", 0, None]]])
    with pytest.raises(p.FrameError) as err:
        p.decode_request(bad)
    assert err.value.kind == "bad_request" and "'step'" in err.value.message and err.value.id == 5
