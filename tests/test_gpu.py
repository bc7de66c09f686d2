"""On NVIDIA GPUs, the same code path (`--device cuda`, NCCL between ranks) gives the same
greedy tokens as the CPU run of the same checkpoint. Skipped where no GPU is visible."""

from __future__ import annotations

import glob

import httpx
import pytest

from conftest import start_server

pytestmark = pytest.mark.gpu


def _gpus() -> int:
    try:
        import torch
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        return len(glob.glob("/dev/nvidia[0-9]*"))


needs_gpu = pytest.mark.skipif(_gpus() < 1, reason="no NVIDIA GPU visible")
# the tests of two GPUs: scripts/gpu-check --two-gpus runs them (`-m two_gpus`)
two_gpus = [pytest.mark.two_gpus, pytest.mark.skipif(_gpus() < 2, reason="needs two NVIDIA GPUs")]


def needs_two_gpus(test):
    for mark in two_gpus:
        test = mark(test)
    return test


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from devtools.checkpoints import make_checkpoint
    # 6 query heads over 3 KV heads: TP=2 splits the KV groups unevenly (2+1), as on the CPU.
    return make_checkpoint("llama", tmp_path_factory.mktemp("gpu-ckpt"), seed=7, num_attention_heads=6,
                           num_key_value_heads=3, hidden_size=96)


PROMPTS = [[5, 17, 42, 99, 3, 250, 7], [300, 301, 302], list(range(40, 120))]


def greedy_tokens(tmp, checkpoint, args) -> list[list[int]]:
    config = f'[[models]]\nmodel = "{checkpoint}"\nid = "ckpt"\ndtype = "float32"\nmax_model_len = 256\nmax_slots = 4\n'
    server = start_server(tmp, config=config, args=args)
    try:
        out = []
        for prompt in PROMPTS:
            r = httpx.post(f"{server.base}/completions", timeout=120, json={
                "model": "ckpt", "prompt": prompt, "max_tokens": 32, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True})
            assert r.status_code == 200, r.text
            out.append(r.json()["choices"][0]["token_ids"])
        info = httpx.get(f"{server.url}/models", timeout=10).json()["models"][0]
        expect = "cuda" if "cuda" in args else "cpu"
        assert all(d.startswith(expect) for d in info["devices"])
        return out
    finally:
        assert server.stop() == 0
        # every rank said bye when asked: none waited in NCCL's teardown (for graphs an unload left alive)
        assert not [line for line in server.log().splitlines() if "not clean" in line or "did not exit" in line]


def concurrent_greedy(server, prompts: list[list[int]], tokens: int = 24) -> list[list[int]]:
    """Each prompt's greedy continuation, all requests in flight together (one decode batch)."""
    from concurrent.futures import ThreadPoolExecutor

    def one(prompt: list[int]) -> list[int]:
        r = httpx.post(f"{server.base}/completions", timeout=300, json={
            "model": "ckpt", "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def graph_and_eager(tmp, checkpoint, tp: int, pp: int = 1) -> None:
    """The decode graphs give the eager path's greedy tokens, alone and in batches of 3 and 6
    (between the buckets 2/4 and 4/8) and 8 (a bucket's own size)."""
    batches = [[p] for p in PROMPTS] + [PROMPTS, PROMPTS * 2, (PROMPTS * 3)[:8]]
    results = {}
    for graphs in (True, False):
        config = (f'[[models]]\nmodel = "{checkpoint}"\nid = "ckpt"\ndtype = "float32"\nmax_model_len = 256\n'
                  f'max_slots = 8\ncuda_graphs = {str(graphs).lower()}\n')
        server = start_server(tmp, config=config, args=["--device", "cuda", "--tensor-parallel", str(tp),
                                                        "--pipeline-parallel", str(pp)])
        try:
            info = httpx.get(f"{server.url}/models", timeout=10).json()["models"][0]
            assert info["cuda_graphs"] == ([1, 2, 4, 8] if graphs else [])
            # Prompt chunks beside decodes sized by the graphs' times measured at load (pipeline
            # stages run prompts eagerly: the configured size).
            beside = info["chunk_beside_decodes"]
            assert (beside is not None) == (graphs and pp == 1), beside
            assert beside is None or (list(beside) == ["1", "2", "4", "8"] and all(16 <= c <= 256 for c in beside.values()))
            results[graphs] = [concurrent_greedy(server, batch) for batch in batches]
        finally:
            assert server.stop() == 0
    assert results[True] == results[False]
    for batch, outs in zip(batches, results[True]):  # a prompt's tokens do not depend on its batch
        for prompt, out in zip(batch, outs):
            assert out == results[True][PROMPTS.index(prompt)][0]


@pytest.fixture(scope="module")
def llama_checkpoint(tmp_path_factory):
    """Heads of 32 (the Triton kernels take head dims of 16 and more); 6 over 3 KV heads."""
    from devtools.checkpoints import make_checkpoint
    return make_checkpoint("llama", tmp_path_factory.mktemp("gpu-llama"), seed=7, num_attention_heads=6,
                           num_key_value_heads=3, hidden_size=192, head_dim=32)


@pytest.fixture(scope="module")
def qwen3_checkpoint(tmp_path_factory):
    from devtools.checkpoints import make_checkpoint
    return make_checkpoint("qwen3", tmp_path_factory.mktemp("gpu-qwen3"), seed=11, num_attention_heads=4,
                           num_key_value_heads=2, hidden_size=128, head_dim=32)


@needs_gpu
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_decode_graphs_give_the_eager_tokens_on_one_gpu(tmp_path, llama_checkpoint, qwen3_checkpoint, family):
    graph_and_eager(tmp_path, llama_checkpoint if family == "llama" else qwen3_checkpoint, 1)


@needs_gpu
def test_a_full_decode_batch_has_a_prefill_graph_with_room_for_a_prompt_beside_it(tmp_path, qwen3_checkpoint):
    """With 512 slots the prefill graphs go past 512 tokens: a full batch of decodes keeps room for
    a prompt chunk (before, every such step ran eagerly), and steps of more than 512 prompt tokens
    through them give the eager tokens."""
    prompts = [[(7 * i + j) % 250 + 3 for j in range(200)] for i in range(3)]  # one step of 600 tokens
    results = {}
    for graphs in (True, False):
        config = (f'[[models]]\nmodel = "{qwen3_checkpoint}"\nid = "ckpt"\ndtype = "float32"\n'
                  f'max_model_len = 256\nmax_slots = 512\ncuda_graphs = {str(graphs).lower()}\n')
        server = start_server(tmp_path, config=config, args=["--device", "cuda"])
        try:
            beside = httpx.get(f"{server.url}/models", timeout=10).json()["models"][0]["chunk_beside_decodes"]
            assert beside is None if not graphs else beside["512"] >= 16, beside
            results[graphs] = prompts_together(server, prompts, 8)
        finally:
            assert server.stop() == 0
    assert results[True] == results[False]


def prompts_together(server, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """Each prompt's greedy continuation, all of them in one request (admitted together, so their
    prompts make one step)."""
    r = httpx.post(f"{server.base}/completions", timeout=300, json={
        "model": "ckpt", "prompt": prompts, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True})
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    assert len(choices) == len(prompts) and all(len(c["token_ids"]) == tokens for c in choices), choices
    return [c["token_ids"] for c in choices]


@needs_gpu
@pytest.mark.timeout(600)  # 6 models built and run; on a machine with no Triton cache, ~90 s
@pytest.mark.parametrize("model", ["llama-q8_0", "llama-q4", "qwen3-q8_0", "qwen3-q4", "qwen3-Q4_K"])
def test_packed_weights_on_a_gpu_agree_with_their_dequantized_weights(tmp_path, model):
    """The Triton kernels for packed weights against the same model with every weight dequantized
    to bfloat16, both on the GPU, by the issue's bar: teacher-forced top-1 agreement >= 99%,
    greedy continuations identical on >= 90% of prompts (ten prompts: the batched decode rows and
    prefill); then eight decode streams (the int8-activation kernel) against float32. One model
    a test, so that scripts/gpu-check runs them side by side."""
    from test_quant import KQUANT_SIZES, NEW_TOKENS, PROMPTS, config_of

    from neuron.kernels import packed as tk
    from devtools.checkpoints import make_checkpoint, write_random_kquant_gguf
    from devtools.parity import ParityJob, run_parity, top1

    family, scheme = model.split("-")
    if scheme == "Q4_K":
        k = make_checkpoint("qwen3", tmp_path / "qwen3-k", seed=32, **KQUANT_SIZES)
        models = {model: ("gguf", [str(write_random_kquant_gguf(k, "Q4_K", seed=33))], None)}
    else:
        d = make_checkpoint(family, tmp_path / family, seed=31)
        models = {model: ("safetensors", [str(p) for p in sorted(d.glob("*.safetensors"))], scheme)}

    def job(name, fmt, paths, quant, prompts=PROMPTS, dtype="bfloat16", **kw):
        return ParityJob(name, fmt, paths, config_of(fmt, paths), prompts, NEW_TOKENS, dtype=dtype, quant=quant,
                         max_len=128, device="cuda", **kw)

    refs = {r.name: r for r in run_parity([job(n, *m, dense=True, score_greedy=True) for n, m in models.items()])}
    for name, (fmt, paths, quant) in models.items():
        want = refs[name]
        r = run_parity([job(name, fmt, paths, quant, score=[p + g for p, g in zip(PROMPTS, want.greedy)])])[0]
        positions = sum(len(s) for s in want.argmax)
        agree = top1(want, r)
        same = sum(a == b for a, b in zip(want.greedy, r.greedy)) / len(want.greedy)
        print(f"{name}: top-1 {agree:.4f} of {positions}, greedy identical {same:.2f}, bytes {r.weight_bytes}")
        assert agree >= 0.99 and same >= 0.9, name
        assert r.weight_bytes[0] < want.weight_bytes[0] * 0.7  # the weights really are packed (bf16: 2 B)
    # Eight streams decode through the int8-activation kernel (up to GEMV_ROWS rows), measured
    # against the float32 dequantized model, teacher-forced along its greedy path one decode step at
    # a time. On these random models (flat logits) bfloat16 alone already misses the bar
    # there (96-99.6% top-1), so the kernel is held to the bf16 dense model's own agreement: the
    # int8 activations may cost at most 3 points of top-1 more than bfloat16 does.
    few = PROMPTS[:tk.GEMV_ROWS]
    refs = {r.name: r for r in run_parity([job(n, *m, prompts=few, dtype="float32", dense=True)
                                           for n, m in models.items()])}
    worse = []
    for name, (fmt, paths, quant) in models.items():
        want = refs[name].greedy
        forced = {}
        for what, kw in (("packed", dict(quant=quant)), ("bf16 dense", dict(quant=quant, dense=True))):
            r = run_parity([job(name, fmt, paths, prompts=few, forced=want, **kw)])[0]
            hits = sum(a == b for x, y in zip(want, r.forced_argmax) for a, b in zip(x, y))
            forced[what] = hits / sum(map(len, want))
            same = sum(a == b for a, b in zip(want, r.greedy)) / len(want)
            print(f"{name}, {what}, {len(few)} decode streams against float32: top-1 {forced[what]:.4f}, "
                  f"greedy identical {same:.2f}")
        if forced["packed"] < forced["bf16 dense"] - 0.03:
            worse.append(name)
    assert not worse


@needs_gpu
@pytest.mark.timeout(600)
def test_packed_experts_on_a_gpu_agree_with_their_dequantized_weights(tmp_path):
    """A MoE model's experts quantized in situ (q8_0, q4) run stacked through the grouped kernels
    of packed weights (``kernels/moe_packed.py``: a program per pair for the decodes, the grouped
    product for the prompts) against the same model dequantized to float16: teacher-forced top-1
    >= 99%. In float16, not bfloat16, and not greedy identity: a routing decision that flips on an
    ulp sends the rest of a random model's continuation elsewhere. On an H200, q4 top-1 against
    the dequantized model: bfloat16 0.956 here and 0.949 with the experts one by one as before,
    float16 1.0 and 0.994; q8_0 in bfloat16 0.992, greedy identical 0.60."""
    from test_quant import NEW_TOKENS, PROMPTS, config_of

    from devtools.checkpoints import make_checkpoint
    from devtools.parity import ParityJob, run_parity, top1

    d = make_checkpoint("qwen3_moe", tmp_path / "moe", seed=41, hidden_size=128, moe_intermediate_size=64)
    paths = [str(p) for p in sorted(d.glob("*.safetensors"))]
    for quant in ("q8_0", "q4"):
        def job(**kw):
            return ParityJob(f"moe-{quant}", "safetensors", paths, config_of("safetensors", paths), PROMPTS,
                             NEW_TOKENS, dtype="float16", quant=quant, max_len=128, device="cuda", **kw)

        want = run_parity([job(dense=True, score_greedy=True)])[0]
        r = run_parity([job(score=[p + g for p, g in zip(PROMPTS, want.greedy)])])[0]
        agree = top1(want, r)
        same = sum(a == b for a, b in zip(want.greedy, r.greedy)) / len(want.greedy)
        print(f"moe {quant}: top-1 {agree:.4f}, greedy identical {same:.2f}, bytes {r.weight_bytes}")
        assert agree >= 0.99, quant
        assert r.weight_bytes[0] < want.weight_bytes[0] * 0.7


@needs_gpu
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", ["awq", "gptq4-act", "gptq8", "fp8-block128", "fp8-rows", "fp8-in-situ"])
def test_publisher_quantized_checkpoints_on_a_gpu_agree_with_their_dequantized_weights(tmp_path, monkeypatch, name):
    """AWQ, GPTQ (4-bit with desc_act, 8-bit) and FP8 (block and per-row scales; quantized at
    load) checkpoints on the GPU against the same model with their weights dequantized to bfloat16 on the GPU: top-1
    agreement >= 99% teacher-forced, greedy continuations identical on >= 90% of prompts. On a GPU
    with FP8 tensor cores the FP8 products quantize x as well (the checkpoints' dynamic activation
    scheme, as transformers runs them there), which moves the flat logits of these random models
    far more than any kernel error could (~87% top-1 on this model on the CPU, in float32): there
    the served model is held to the agreement with the dequantized model of the same model with
    each FP8 product computed by torch from its definition (``reference_fp8_linear``)."""
    from test_published_quant import FORMATS, write_quantized
    from test_quant import NEW_TOKENS, PROMPTS

    from devtools.checkpoints import make_checkpoint
    from devtools.parity import ParityJob, run_parity, top1
    from neuron.kernels.fp8 import reference_fp8_linear
    from neuron.loader.spec import load_spec
    from neuron.models.fp8 import Fp8Linear

    unpacked = Fp8Linear.__call__

    def w8a8_in_torch(self, x, out_dtype=None):
        if self.kernel is None:
            return unpacked(self, x, out_dtype)
        w8a8_in_torch.calls += 1
        y = reference_fp8_linear(x.reshape(-1, self.k), self.values, self.scale_t, *self.kernel)
        y = y + self.bias if self.bias is not None else y
        return y.to(out_dtype or x.dtype).view(*x.shape[:-1], self.n)

    w8a8_in_torch.calls = 0

    src = make_checkpoint("qwen3", tmp_path / "qwen3", seed=31)
    if name == "fp8-in-situ":  # ``quantize = "fp8"`` on the float checkpoint
        paths, spec = [str(p) for p in sorted(src.glob("*.safetensors"))], load_spec(str(src))
        own = {"quant": "fp8"}
    else:
        d = write_quantized(src, tmp_path / name, *FORMATS[name])
        paths, spec = [str(d / "model.safetensors")], load_spec(str(d))
        own = {"checkpoint_quant": spec.checkpoint_quant}

    def job(**kw):
        return ParityJob(name, "safetensors", paths, spec.config, PROMPTS, NEW_TOKENS, dtype="bfloat16", max_len=128,
                         device="cuda", **own, **kw)

    (dense,) = run_parity([job(dense=True, score_greedy=True)])
    want = dense
    if name.startswith("fp8"):  # on FP8 tensor cores x is quantized too: its reference does the same
        with monkeypatch.context() as m:
            m.setattr(Fp8Linear, "__call__", w8a8_in_torch)
            (want,) = run_parity([job(score_greedy=True)])
        assert w8a8_in_torch.calls > 0, name
    import neuron.kernels.fp8 as fp8_kernels

    products = []
    on_tensor_cores = fp8_kernels.fp8_linear
    with monkeypatch.context() as m:  # counts the served model's products on the FP8 tensor cores
        m.setattr(fp8_kernels, "fp8_linear", lambda *a, **kw: products.append(1) or on_tensor_cores(*a, **kw))
        (r,) = run_parity([job(score=[p + g for p, g in zip(PROMPTS, want.greedy)])])
    assert bool(products) == name.startswith("fp8"), name
    positions = sum(len(s) for s in want.argmax)
    agree = top1(want, r)
    same = sum(a == b for a, b in zip(want.greedy, r.greedy)) / len(want.greedy)
    print(f"{name}: top-1 {agree:.4f} of {positions}, greedy identical {same:.2f}, bytes {r.weight_bytes}")
    if want is not dense:
        # x quantized to e4m3 at every product makes the model chaotic on these flat logits: an ulp
        # of difference upstream flips an activation's rounding (6%) downstream, so no other
        # summation order can agree 99% with the torch definition. There the kernels are held to
        # the definition's own agreement with the dequantized model, less 3 points (as the int8
        # decode activations are in the test above).
        (plain,) = run_parity([job(dense=True, score=[p + g for p, g in zip(PROMPTS, want.greedy)])])
        served, own = top1(r, plain), top1(want, plain)
        print(f"{name}: against the dequantized model, top-1: served {served:.4f}, the torch definition {own:.4f}")
        assert served >= own - 0.03, name
    else:
        assert agree >= 0.99 and same >= 0.9, name
    assert r.weight_bytes[0] < dense.weight_bytes[0] * 0.8, name  # kept packed (bf16 dense: 2 B a weight)


@needs_two_gpus
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["fp8-block128", "fp8-rows"])
def test_publisher_fp8_checkpoints_at_tp2_over_nccl_agree_with_their_dequantized_weights(tmp_path, name):
    """FP8 checkpoints split across two GPUs (each rank its blocks of values and their scales,
    the products on the FP8 tensor cores, the sums over NCCL or peer memory), each rank holding
    half: teacher-forced, the served logits at TP=2 differ from those of the same checkpoint
    dequantized to bfloat16 at TP=1, and from the dequantized model at TP=2, by at most 1.15x
    the served model's difference at TP=1 (RMS over every position and token, against the
    logits' spread); top-1 agrees on >= 75% of positions at both sizes. The reference at TP=1
    matters: the dequantized model at TP=2 reads its scales through the same split, so a wrong
    split of the scales moves it with the served one (0.40 RMS from TP=1 where the bf16 sums'
    order alone moves it 0.011). Not top-1 against top-1: x quantized to e4m3 at every product
    makes these flat logits chaotic (an ulp upstream flips a rounding downstream), so the served
    model at TP=2 agrees on top-1 with itself at TP=1 on only ~88% of positions, and its
    agreement with the dequantized model moves 3-4 points either way from seed to seed while
    the RMS differences stay within 3% of each other (the figures are in docs/gpu.md)."""
    import torch
    from test_published_quant import FORMATS, write_quantized
    from test_quant import NEW_TOKENS, PROMPTS

    from devtools.checkpoints import make_checkpoint
    from devtools.parity import ParityJob, run_parity, scored_rms, top1
    from neuron.loader.spec import load_spec

    d = write_quantized(make_checkpoint("qwen3", tmp_path / "qwen3", seed=31), tmp_path / name, *FORMATS[name])
    spec = load_spec(str(d))

    def job(**kw):
        return ParityJob(name, "safetensors", [str(d / "model.safetensors")], spec.config, PROMPTS, NEW_TOKENS,
                         dtype="bfloat16", max_len=128, device="cuda", checkpoint_quant=spec.checkpoint_quant,
                         keep_scored=True, **kw)

    gen = torch.Generator().manual_seed(41)  # teacher-forced continuations, the same at both sizes
    seqs = [p + torch.randint(0, 509, (NEW_TOKENS,), generator=gen).tolist() for p in PROMPTS]

    agree, err, served, dense = {}, {}, {}, {}
    for world in (1, 2):
        dense[world], served[world] = run_parity([job(dense=True, score=seqs), job(score=seqs)], world=world)
        agree[world], err[world] = top1(dense[world], served[world]), scored_rms(served[world], dense[world])
    across = scored_rms(served[2], dense[1])
    held = {world: r.weight_bytes for world, r in served.items()}
    print(f"{name}: against the dequantized model of its size, top-1 {agree}, RMS difference {err}; served at TP=2 "
          f"against the dequantized model at TP=1 {across:.4f}; bytes per rank {held}; the dequantized model at "
          f"TP=2 against itself at TP=1: top-1 {top1(dense[1], dense[2]):.4f}, "
          f"RMS {scored_rms(dense[2], dense[1]):.4f}")
    assert min(agree.values()) >= 0.75 and max(err[2], across) <= 1.15 * err[1], name
    assert all(abs(b - held[1][0] / 2) < 0.1 * held[1][0] for b in held[2]), held


@needs_two_gpus
def test_decode_graphs_give_the_eager_tokens_at_tp2_over_nccl(tmp_path, qwen3_checkpoint):
    graph_and_eager(tmp_path, qwen3_checkpoint, 2)


@needs_gpu
def test_one_gpu_matches_the_cpu(tmp_path, checkpoint):
    cpu = greedy_tokens(tmp_path, checkpoint, ["--device", "cpu"])
    assert greedy_tokens(tmp_path, checkpoint, ["--device", "cuda"]) == cpu


@needs_two_gpus
def test_two_gpus_over_nccl_match_the_cpu(tmp_path, checkpoint):
    cpu = greedy_tokens(tmp_path, checkpoint, ["--device", "cpu"])
    assert greedy_tokens(tmp_path, checkpoint, ["--device", "cuda", "--tensor-parallel", "2"]) == cpu


@needs_two_gpus
def test_decode_graphs_give_the_eager_tokens_in_two_pipeline_stages(tmp_path, qwen3_checkpoint):
    graph_and_eager(tmp_path, qwen3_checkpoint, 1, pp=2)


@needs_two_gpus
def test_pipeline_stages_on_two_gpus_match_the_cpu(tmp_path, checkpoint):
    """PP=2 over NCCL (a stage a GPU: its residual stream and the sampled tokens sent point to
    point) gives the CPU's greedy tokens, one request at a time and all at once."""
    cpu = greedy_tokens(tmp_path, checkpoint, ["--device", "cpu"])
    args = ["--device", "cuda", "--pipeline-parallel", "2"]
    assert greedy_tokens(tmp_path, checkpoint, args) == cpu
    config = f'[[models]]\nmodel = "{checkpoint}"\nid = "ckpt"\ndtype = "float32"\nmax_model_len = 256\nmax_slots = 8\n'
    server = start_server(tmp_path, config=config, args=args)
    try:
        assert concurrent_greedy(server, PROMPTS * 2, tokens=32) == cpu * 2
    finally:
        assert server.stop() == 0


@needs_two_gpus
def test_killing_a_rank_while_its_peer_waits_in_an_all_reduce_recovers_the_group(tmp_path):
    import os
    import signal
    import threading
    import time

    from conftest import alive
    from devtools.checkpoints import make_checkpoint

    checkpoint = make_checkpoint("llama", tmp_path / "long", seed=7, num_attention_heads=6, num_key_value_heads=3,
                                 hidden_size=96, max_position_embeddings=8192)
    config = (f'[[models]]\nmodel = "{checkpoint}"\nid = "ckpt"\ndtype = "float32"\nmax_model_len = 8192\n'
              f'max_slots = 4\n[timeouts]\nheartbeat_timeout_s = 3.0\n')
    server = start_server(tmp_path, config=config, args=["--device", "cuda", "--tensor-parallel", "2"])
    try:
        old = httpx.get(f"{server.url}/models", timeout=10).json()["models"][0]
        ended: dict = {}

        def stream() -> None:
            body = {"model": "ckpt", "prompt": [5, 6, 7], "max_tokens": 8000, "temperature": 0,
                    "ignore_eos": True, "stream": True}
            with httpx.stream("POST", f"{server.base}/completions", json=body, timeout=120) as r:
                lines = [line for line in r.iter_lines() if line.startswith("data: ")]
            ended.update(at=time.monotonic(), lines=lines)

        reader = threading.Thread(target=stream)
        reader.start()
        time.sleep(2.0)
        # Freeze rank 1 so rank 0 waits inside the next step's sum (over peer memory where the
        # GPUs map each other's, NCCL elsewhere), then kill rank 1.
        os.kill(old["pids"][1], signal.SIGSTOP)
        time.sleep(0.5)
        t_kill = time.monotonic()
        os.kill(old["pids"][1], signal.SIGKILL)
        reader.join(30)
        assert "error" in "".join(ended["lines"]) and ended["lines"][-1] == "data: [DONE]"
        detect_s = ended["at"] - t_kill
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            info = httpx.get(f"{server.url}/models", timeout=10).json()["models"][0]
            if info["status"] == "loaded" and info["epoch"] != old["epoch"]:
                break
            time.sleep(0.2)
        recover_s = time.monotonic() - t_kill
        assert info["status"] == "loaded" and info["recoveries"] == 1
        assert not any(alive(pid) for pid in old["pids"])
        r = httpx.post(f"{server.base}/completions", timeout=60, json={
            "model": "ckpt", "prompt": [5, 6, 7], "max_tokens": 16, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16
        print(f"\npeer killed mid all-reduce: stream ended after {detect_s:.2f}s, "
              f"model loaded again after {recover_s:.2f}s")
    finally:
        assert server.stop() == 0


@needs_gpu
@pytest.mark.timeout(900)
def test_the_hybrid_family_on_one_gpu_gives_transformers_tokens(tmp_path_factory):
    """Float32 on the GPU (the attention through the Triton kernels, the recurrent layers in
    torch): greedy tokens equal to transformers on the CPU, logits within 1e-3."""
    from test_hybrid import FAMILIES, built, job

    from devtools.parity import run_parity

    families = [built(f, tmp_path_factory) for f in sorted(FAMILIES)]
    jobs = [job(f, ckpt) for f, ckpt, _ in families]
    for j in jobs:
        j.device = "cuda"
    for result, (_, _, reference) in zip(run_parity(jobs), families):
        for got, (want, _) in zip(result.logits, reference):
            assert (got.cpu() - want).abs().max() < 1e-3, result.name
        assert result.greedy == [tokens for _, tokens in reference], result.name


@pytest.fixture(scope="module")
def hybrid_checkpoint(tmp_path_factory):
    from test_hybrid import write_hybrid_checkpoint
    return write_hybrid_checkpoint("qwen3_5_text", tmp_path_factory.mktemp("gpu-hybrid"))


@needs_gpu
@pytest.mark.timeout(600)
def test_the_hybrid_family_in_decode_and_prefill_graphs_gives_the_eager_tokens(tmp_path, hybrid_checkpoint):
    """The Gated DeltaNet kernels inside the decode graphs (token after token) and the prefill
    graphs (in chunks), batches between the buckets, against the eager path."""
    graph_and_eager(tmp_path, hybrid_checkpoint, 1)


def compiled_kernels(cache) -> dict[str, str]:
    """The Triton cache's entries (one a kernel compiled, or a launcher built, for a new
    signature) and the names of their files."""
    return {e.name: " ".join(sorted(f.name for f in e.iterdir())) for e in cache.iterdir()} if cache.exists() else {}


@needs_gpu
@pytest.mark.timeout(900)
@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_5_moe_text", "llama-q4"])
def test_prompts_of_any_length_compile_no_kernel_after_the_load(tmp_path, tmp_path_factory, family):
    """Every kernel a step can take is compiled while the model loads: prompts of any length,
    alone, beside decodes and after a cached prefix, compile nothing more (a compile is seconds
    of one user's wait: the first long prompt after a load took 4.1 s, the next 0.2 s, when
    the delta rule's kernels were specialised on the step's count of chunks)."""
    import random

    from test_hybrid import write_hybrid_checkpoint

    if family == "llama-q4":  # packed weights: their products and the prompt path's dequantizing
        from devtools.checkpoints import make_checkpoint
        ckpt = make_checkpoint("llama", tmp_path_factory.mktemp(family), seed=7, num_attention_heads=6,
                               num_key_value_heads=3, hidden_size=192, head_dim=32, max_position_embeddings=4096)
    else:
        ckpt = write_hybrid_checkpoint(family, tmp_path_factory.mktemp(family), max_position_embeddings=4096)
    cache = tmp_path / "triton"
    config = (f'[[models]]\nmodel = "{ckpt}"\nid = "ckpt"\ndtype = "bfloat16"\nmax_model_len = 2048\n'
              'max_slots = 8\n' + ('quantize = "q4"\n' if family == "llama-q4" else ""))
    server = start_server(tmp_path, config=config, args=["--device", "cuda"], env={"TRITON_CACHE_DIR": str(cache)})
    try:
        seen = compiled_kernels(cache)
        assert seen
        rng = random.Random(3)
        prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (1, 7, 16, 17, 63, 64, 65, 130, 255, 513, 1000,
                                                                       1777)]
        batches = [[p] for p in prompts] + [[p + [9] * 40 for p in prompts[-4:]] + prompts[2:6]]
        compiles = []
        for batch in batches:
            concurrent_greedy(server, batch, tokens=3 if len(batch) == 1 else 12)
            now = compiled_kernels(cache)
            compiles += [([len(p) for p in batch], now[k]) for k in now.keys() - seen.keys()]
            seen = now
        assert compiles == []
    finally:
        assert server.stop() == 0


def drafted_greedy(tmp, checkpoint, speculative: str, tp: int = 1) -> tuple[list[list[list[int]]], dict | None]:
    """Each prompt's greedy tokens alone and all together, with ``speculative`` (a TOML table, or
    "" for none), CUDA graphs on; and the drafting counts."""
    config = (f'[[models]]\nmodel = "{checkpoint}"\nid = "ckpt"\ndtype = "float32"\nmax_model_len = 256\n'
              f'max_slots = 8\n' + (f"speculative = {speculative}\n" if speculative else ""))
    server = start_server(tmp, config=config, args=["--device", "cuda", "--tensor-parallel", str(tp)])
    try:
        outs = [concurrent_greedy(server, batch) for batch in [[p] for p in PROMPTS] + [PROMPTS]]
        return outs, httpx.get(f"{server.url}/models", timeout=10).json()["models"][0]["speculative"]
    finally:
        assert server.stop() == 0


@needs_gpu
@pytest.mark.timeout(900)
@pytest.mark.parametrize("family, tp", [("llama", 1), ("hybrid", 1), pytest.param("llama", 2, marks=two_gpus),
                                        pytest.param("hybrid", 2, marks=two_gpus)])
def test_speculative_decoding_in_the_graphs_gives_the_plain_tokens(tmp_path, llama_checkpoint, hybrid_checkpoint,
                                                                   family, tp):
    """Greedy answers with drafts that all hold (a replay of the plain answers), that all fail
    (random), prompt lookup's and (hybrid) the MTP layer's, checked in the decode graphs (dense)
    or the prefill graphs (hybrid), alone and three together, on one GPU and over NCCL: the
    plain run's tokens."""
    import json

    from test_mtp import with_mtp

    checkpoint = llama_checkpoint if family == "llama" else hybrid_checkpoint
    methods = ['"random"', '"ngram"']
    if family == "hybrid":
        checkpoint = with_mtp(checkpoint, tmp_path / "mtp", "qwen3_5_text")
        methods.append('"mtp"')
    plain, _ = drafted_greedy(tmp_path, checkpoint, "", tp)
    record = tmp_path / "replay.jsonl"
    record.write_text("".join(json.dumps({"prompt": p, "output": out[0]}) + "\n" for p, out in zip(PROMPTS, plain)))
    for method in [f'"replay", replay = "{record}"'] + methods:
        got, s = drafted_greedy(tmp_path, checkpoint, f"{{ method = {method}, tokens = 3 }}", tp)
        assert got == plain, method
        if "replay" in method:
            assert s["accepted_tokens"] == s["draft_tokens"] > 24, s


@needs_two_gpus
@pytest.mark.timeout(600)
def test_the_hybrid_family_at_tp2_over_nccl_gives_the_eager_and_the_cpu_tokens(tmp_path, hybrid_checkpoint):
    graph_and_eager(tmp_path, hybrid_checkpoint, 2)
    cpu = greedy_tokens(tmp_path, hybrid_checkpoint, ["--device", "cpu"])
    assert greedy_tokens(tmp_path, hybrid_checkpoint, ["--device", "cuda", "--tensor-parallel", "2"]) == cpu


@needs_gpu
@pytest.mark.timeout(600)
def test_image_chats_on_the_gpu_give_the_cpu_tokens(tmp_path):
    """Qwen3.5 with its vision tower (tests/test_vision_chat.py's checkpoint): an image chat, one
    with an image across prefill chunks, and one resent (its embeddings kept), in float32 on the
    GPU (at TP=2 where two GPUs are there) give the CPU's greedy tokens."""
    from test_vision_chat import CHUNKED, IMAGES, chat, config, picture, write_checkpoint

    def served(server, messages):  # httpx: the GPU hosts have no openai client
        r = httpx.post(f"{server.base}/chat/completions", timeout=300, json={
            "model": "vis", "messages": messages, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True})
        assert r.status_code == 200, r.text
        return r.json()

    ckpt = write_checkpoint(tmp_path / "vision")
    chats = [chat("Look: ", [picture(w, h, 10 * i + j) for j, (w, h) in enumerate(sizes)], " What is it?")
             for i, sizes in enumerate(IMAGES.values())]
    chats += [chat(" ".join(["the quick brown fox"] * 30), [picture(128, 96, 7)], " What?"), chats[0]]
    answers = {}
    for device, tp in [("cpu", 1), ("cuda", 1)] + ([("cuda", 2)] if _gpus() >= 2 else []):
        server = start_server(tmp_path, config=CHUNKED + config(ckpt),
                              args=["--device", device, "--tensor-parallel", str(tp)])
        try:
            answers[device, tp] = [served(server, m)["choices"][0]["token_ids"] for m in chats]
        finally:
            assert server.stop() == 0
    assert all(got == answers["cpu", 1] for got in answers.values()), answers


@needs_gpu
def test_version_and_device_telemetry_on_a_gpu(tmp_path, checkpoint):
    import importlib.util

    config = f'[[models]]\nmodel = "{checkpoint}"\nid = "ckpt"\nmax_model_len = 256\nmax_slots = 4\n'
    server = start_server(tmp_path, config=config, args=["--device", "cuda"])
    try:
        model = httpx.get(f"{server.url}/version", timeout=10).json()["models"]["ckpt"]
        assert model["cuda"] and model["torch"] and model["cpu_isa"] is None
        assert [d.split(":")[0] for d in model["devices"]] == ["cuda"]
        (rank,) = httpx.get(f"{server.url}/health", timeout=10).json()["devices"]["ckpt"]
        assert rank["device"].startswith("cuda") and 0 < rank["memory_used"] <= rank["memory_total"]
        if importlib.util.find_spec("pynvml") is not None:  # NVML reports the rest
            assert 0 <= rank["utilization"] <= 100 and rank["temperature_c"] > 0
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
        assert 'neuron:device_memory_total_bytes{device="cuda' in metrics
    finally:
        assert server.stop() == 0
