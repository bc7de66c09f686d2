"""Quantized weights kept packed (issue 8, CPU): GGUF blocks decoded without loss, the CPU kernel
against a float reference, in-situ quantization, block-aligned tensor-parallel splits, and whole
models — the default SmolLM2 GGUF and random llama/qwen3/qwen3_moe checkpoints in every packed
type and both in-situ schemes — against the float32 model of the same (dequantized) weights, at
TP=1 and TP=2: teacher-forced top-1 agreement, greedy continuations, resident bytes per rank."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from neuron.loader.gguf_file import GgufFile
from neuron.loader.resolve import default_model_path
from neuron.loader.spec import load_spec
from neuron.models.packed_linear import PackedLinear
from neuron.models.quant import GROUP, decode_blocks, quantize
from neuron.models.sharding import ShardingError, check_plan, plan_shard
from devtools.checkpoints import make_checkpoint, random_quant_blocks, write_random_kquant_gguf
from devtools.parity import ParityJob, run_parity, top1

pytestmark = pytest.mark.usefixtures("one_torch_thread", "float32_activations")

EXACT_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "Q3_K", "Q2_K")
BITS = {"Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "Q8_0": 8, "Q5_0": 5, "Q5_1": 5, "Q5_K": 5, "Q6_K": 6, "Q3_K": 3, "Q2_K": 2}


def raw_tensor(name: str, shape: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    qtype = gguf.GGMLQuantizationType[name]
    if name.endswith("_K"):
        return random_quant_blocks(name, shape, rng)
    return gguf.quants.quantize((rng.standard_normal(shape) * 0.1).astype(np.float32), qtype)


# ---------------------------------------------------------------------------- blocks and kernel


@pytest.mark.parametrize("name", EXACT_TYPES)
def test_gguf_blocks_decode_to_exactly_what_gguf_py_dequantizes(name):
    raw = raw_tensor(name, (48, 512), np.random.default_rng(1))
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[name])
    q = decode_blocks(raw, gguf.GGMLQuantizationType[name])
    assert q.bits == BITS[name] and q.group == (16 if name in ("Q6_K", "Q3_K", "Q2_K") else 32)
    if name in ("Q6_K", "Q3_K", "Q2_K"):  # float32 products in another order than gguf-py's
        assert np.allclose(q.dequantize(), want, rtol=1e-6, atol=1e-9)
    else:
        assert np.array_equal(q.dequantize(), want)
    assert np.isfinite(want).all() and want.std() > 0


@pytest.mark.parametrize(("name", "shape"), [(t, (80, 512)) for t in ("Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q3_K")]
                         + [("Q4_1", (83, 544)), ("Q8_0", (83, 544))])  # a short last chunk; rows not in fours
@pytest.mark.parametrize("rows", (1, 3, 4, 7, 9))
def test_the_cpu_kernel_computes_what_the_dequantized_float32_weight_computes(name, shape, rows):
    raw = raw_tensor(name, shape, np.random.default_rng(3))
    q = decode_blocks(raw, gguf.GGMLQuantizationType[name])
    lin = PackedLinear(q, None)
    N, K = shape
    held = lin.rows(torch.arange(N))  # the weight the layer holds, dequantized
    file = torch.from_numpy(q.dequantize())
    assert torch.equal(held, file)  # K-quants too: their scales are kept as the file builds them
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows))
    want = x @ held.t()
    got = lin(x)
    assert got.dtype == torch.float32 and got.shape == (rows, N)
    assert float((got - want).abs().max()) <= 2e-6 * float(want.abs().max())
    ids = torch.tensor([0, 17, N - 1, 17])
    assert torch.equal(lin.rows(ids), held[ids])


def test_the_cpu_kernel_lets_the_other_threads_run_while_it_computes():
    """A rank's socket loop (heartbeats, pings) shares the process with the device thread, so a
    kernel must not hold the GIL while it computes: here a thread that sleeps 1 ms at a time
    never waits for a call of the kernel to end before it wakes. The call
    is made about 0.4 s long where the machine allows: on two cores the kernel's threads can keep
    the sleeper off both for tens of ms (one run saw a 68 ms gap in a 217 ms call)."""
    import threading
    import time

    q = quantize(torch.randn(2048, 2048, generator=torch.Generator().manual_seed(6)), "q4")
    lin = PackedLinear(q, None)
    rows, took = 16, 0.0
    while took < 0.4 and rows <= 16384:  # a call long enough to see, on any machine
        rows *= 2
        x = torch.randn(rows, 2048)
        t0 = time.perf_counter()
        lin(x)
        took = time.perf_counter() - t0
    done = threading.Event()
    worker = threading.Thread(target=lambda: (lin(x), done.set()))
    worker.start()
    gaps, last = [], time.perf_counter()
    while not done.is_set():
        time.sleep(0.001)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    worker.join()
    # A call of 20 ms or more (a 32768-row call takes longer on any CPU): 20 sleeps of 1 ms fit in it.
    assert took >= 0.02 and len(gaps) > 10 and max(gaps) < took / 4, (took, max(gaps), len(gaps))


def test_bfloat16_activations_go_through_the_float32_kernel():
    q = decode_blocks(raw_tensor("Q4_1", (64, 256), np.random.default_rng(4)), gguf.GGMLQuantizationType.Q4_1)
    lin = PackedLinear(q, torch.ones(64, dtype=torch.bfloat16), torch.bfloat16)
    x = torch.randn(2, 256).bfloat16()
    got = lin(x)
    want = x.float() @ torch.from_numpy(q.dequantize()).t() + 1
    assert got.dtype == torch.bfloat16 and torch.allclose(got.float(), want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize(("scheme", "bits"), [("q8_0", 8), ("q4", 4)])
def test_in_situ_quantization_rounds_each_weight_to_its_groups_grid(scheme, bits):
    w = torch.randn(32, 256, generator=torch.Generator().manual_seed(5)) * 0.05
    q = quantize(w, scheme)
    assert q.bits == bits and q.source == f"{scheme} (in situ)"
    g = w.view(32, -1, GROUP)
    step = (g.abs().amax(-1) / 127) if scheme == "q8_0" else (g.amax(-1) - g.amin(-1)) / 15
    err = (torch.from_numpy(q.dequantize()) - w).abs().view(32, -1, GROUP).amax(-1)
    assert (err <= 0.5 * step * 1.01 + 1e-6).all() and float(err.max()) > 0
    assert np.array_equal(q.s, q.s.astype(np.float16).astype(np.float32))  # the scales the kernel stores


def test_a_quant_weight_held_as_tensors_packs_and_fuses_as_its_numpy_form_does():
    """A rank's GPU keeps its in-situ integers as tensors: fused with a file's Q6_K part (scales per
    16, numpy) and packed, the matrix computes and dequantizes as the all-numpy one does."""
    from neuron.models.quant import QuantWeight, concat_rows

    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(7)) * 0.05
    q = quantize(w, "q8_0")
    held = QuantWeight(*(torch.from_numpy(a) for a in (q.u, q.s, q.m)), q.bits, q.source)
    k6 = decode_blocks(raw_tensor("Q6_K", (32, 256), np.random.default_rng(8)), gguf.GGMLQuantizationType.Q6_K)
    want, got = concat_rows([q, k6]), concat_rows([held, k6])
    assert torch.is_tensor(got.u) and got.group == 16
    assert np.array_equal(want.dequantize(), got.dequantize())
    x = torch.randn(3, 256)
    assert torch.equal(PackedLinear(want, None)(x), PackedLinear(got, None)(x))


# ---------------------------------------------------------------------------- tensor-parallel splits


def test_packed_weights_split_the_mlp_on_whole_groups_and_cover_it_exactly():
    cfg = load_spec(str(default_model_path())).config  # intermediate 1536 = 48 groups
    for world in (2, 3):
        parts = [p.mlp for p in check_plan(cfg, world, GROUP)]
        assert parts[0].start == 0 and parts[-1].stop == cfg.intermediate_size
        assert all(a.stop == b.start for a, b in zip(parts, parts[1:]))
        assert all(p.start % GROUP == 0 for p in parts)
        assert max(map(len, parts)) - min(map(len, parts)) <= GROUP
    # unpacked weights keep the element-even split
    assert [len(p.mlp) for p in check_plan(cfg, 3)] == [512, 512, 512]


def test_a_head_split_that_cuts_a_quant_group_is_refused_with_the_reason(tmp_path):
    import msgspec

    cfg = load_spec(str(default_model_path())).config  # 9 heads of 64, 3 KV heads
    odd = msgspec.structs.replace(cfg, num_heads=12, num_kv_heads=12, head_dim=8, hidden_size=96)
    assert len(check_plan(odd, 3)) == 3  # 4 heads of 8 = 32 columns each: fine
    with pytest.raises(ShardingError, match="cut the packed weights' 32-element quant groups"):
        check_plan(odd, 2, GROUP)  # 6 heads of 8 = 48 columns: cut
    assert plan_shard(odd, 2, 0).q_heads == range(0, 6)  # unpacked, the same split is fine


# ---------------------------------------------------------------------------- whole models

N_PROMPTS = 10
NEW_TOKENS = 32
_gen = torch.Generator().manual_seed(808)
PROMPTS = [torch.randint(0, 509, (n,), generator=_gen).tolist() for n in (3, 5, 8, 12, 17, 23, 30, 41, 9, 60)]
KQUANT_SIZES = dict(hidden_size=256, intermediate_size=512, head_dim=32, num_hidden_layers=2)
SMOL_TEXTS = [
    "The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a village by the sea,",
    "<|im_start|>user\nWhat is 2+2? Answer briefly.<|im_end|>\n<|im_start|>assistant\n", "The quick brown fox",
    "import numpy as np\n", "Water boils at", "SELECT * FROM users WHERE", "Dear Sir or Madam,", "1, 2, 3, 4, 5,",
]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, tuple[str, list[str], str | None, Path | None]]:
    """name -> (format, paths, in-situ scheme, GGUF file whose bytes bound the memory)."""
    root = tmp_path_factory.mktemp("quant")
    out: dict[str, tuple[str, list[str], str | None, Path | None]] = {}
    for family in ("llama", "qwen3", "qwen3_moe"):
        d = make_checkpoint(family, root / family, seed=31, gguf_types="Q8_0,Q4_0,Q4_1")
        for t in ("Q8_0", "Q4_0", "Q4_1"):
            out[f"{family}-{t}"] = ("gguf", [str(d / f"model-{t}.gguf")], None, d / f"model-{t}.gguf")
        for scheme in ("q8_0", "q4"):
            out[f"{family}-{scheme}-in-situ"] = ("safetensors", [str(p) for p in sorted(d.glob("*.safetensors"))],
                                                 scheme, None)
        sizes = dict(KQUANT_SIZES, moe_intermediate_size=256) if family == "qwen3_moe" else KQUANT_SIZES
        k = make_checkpoint(family, root / f"{family}-k", seed=32, **sizes)
        for t in ("Q4_K", "Q5_K", "Q6_K"):
            path = write_random_kquant_gguf(k, t, seed=33)
            out[f"{family}-{t}"] = ("gguf", [str(path)], None, path)
    smol = default_model_path()
    out["smollm2"] = ("gguf", [str(smol)], None, smol)
    return out


def prompts_for(name: str) -> list[list[int]]:
    if name != "smollm2":
        return PROMPTS
    tk = load_spec(str(default_model_path())).tokenizer.tokenizer
    return [tk.encode(text, add_special_tokens=False).ids for text in SMOL_TEXTS]


def config_of(fmt: str, paths: list[str]):
    return load_spec(paths[0] if fmt == "gguf" else str(Path(paths[0]).parent)).config


@pytest.fixture(scope="module")
def runs(models):
    """The float32 reference (every weight dequantized, dense) at TP=1, its greedy continuations,
    then the packed models at TP=1 and TP=2 scored on those sequences."""
    refs = [ParityJob(name, fmt, paths, config_of(fmt, paths), prompts_for(name), NEW_TOKENS, quant=quant,
                      dense=True, score_greedy=True, max_len=128)
            for name, (fmt, paths, quant, _) in models.items()]
    ref = {r.name: r for r in run_parity(refs)}
    jobs = [ParityJob(job.name, job.fmt, job.paths, job.config, job.prompts, NEW_TOKENS, quant=job.quant,
                      score=[p + g for p, g in zip(job.prompts, ref[job.name].greedy)], max_len=128)
            for job in refs]
    return ref, {world: {r.name: r for r in run_parity(jobs, world)} for world in (1, 2)}


NAMES = [f"{f}-{t}" for f in ("llama", "qwen3", "qwen3_moe")
         for t in ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "q8_0-in-situ", "q4-in-situ")] + ["smollm2"]


@pytest.mark.parametrize("world", (1, 2))
@pytest.mark.parametrize("name", NAMES)
def test_packed_models_agree_with_their_float32_dequantized_reference(runs, name, world):
    ref, packed = runs
    r, want = packed[world][name], ref[name]
    positions = sum(len(s) for s in want.argmax)
    agree = top1(want, r)
    same = sum(a == b for a, b in zip(want.greedy, r.greedy)) / len(want.greedy)
    diff = max(float((a - b).abs().max()) for a, b in zip(want.logits, r.logits))
    print(f"{name} TP={world}: top-1 {agree:.4f} of {positions} positions, greedy identical {same:.2f}, "
          f"max |logit diff| {diff:.2e}, bytes {r.weight_bytes} (dense {want.weight_bytes})")
    assert agree >= 0.99
    assert same >= 0.9
    assert len({tuple(g) for g in want.greedy}) > 1  # the continuations depend on the prompt
    assert r.weight_bytes[0] < want.weight_bytes[0] / 2  # and the weights really are packed


def file_share_bytes(path: Path, world: int, rank: int) -> float:
    """The bytes of the GGUF file that rank ``rank`` of ``world`` holds: its rows or columns of
    each split tensor, every replicated tensor whole."""
    spec = load_spec(str(path))
    cfg, plan = spec.config, plan_shard(spec.config, world, rank, GROUP)
    hd = cfg.head_dim
    share = {"token_embd": len(range(plan.vocab.start, min(plan.vocab.stop, cfg.vocab_size))) / cfg.vocab_size,
             "attn_q": len(plan.q_heads) / cfg.num_heads, "attn_k": len(plan.kv_heads) / cfg.num_kv_heads,
             "attn_v": len(plan.kv_heads) / cfg.num_kv_heads, "attn_output": len(plan.q_heads) * hd / (cfg.num_heads * hd),
             "ffn_gate": len(plan.mlp) / max(cfg.intermediate_size, 1), "ffn_up": len(plan.mlp) / max(cfg.intermediate_size, 1),
             "ffn_down": len(plan.mlp) / max(cfg.intermediate_size, 1)}
    share["output"] = share["token_embd"]
    for kind in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
        share[kind] = len(plan.experts) / max(cfg.num_experts, 1)
    total = 0.0
    for name, t in GgufFile(path).tensors.items():
        kind = name.split(".")[-2]
        total += t.data.nbytes * share.get(kind, 1.0)
    return total


MEMORY = [f"{f}-{t}" for f in ("llama", "qwen3") for t in ("Q8_0", "Q4_0", "Q4_1", "Q4_K")] + ["smollm2"]


@pytest.mark.parametrize("world", (1, 2))
@pytest.mark.parametrize("name", MEMORY)
def test_each_rank_holds_at_most_1_15_times_its_share_of_the_file(runs, models, name, world):
    _, packed = runs
    path = models[name][3]
    for rank, held in enumerate(packed[world][name].weight_bytes):
        share = file_share_bytes(path, world, rank)
        print(f"{name} TP={world} rank {rank}: {held} bytes resident, {share:.0f} bytes of the file, "
              f"{held / share:.3f}x")
        assert held <= 1.15 * share


def test_in_situ_q4_scales_are_exact_in_the_cpu_and_the_gpu_forms():
    """s and m are float16s (the CPU kernel's), s and m + 8 s bfloat16s (the GPU's tensor-core
    int4 kernel's), so both compute the very weight ``dequantize`` gives; the error stays within
    about half a step, also for groups far from 0 and for tiny ones."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(64, 256, generator=g) * 0.02
    w[:8] += 0.5
    w[8:16] -= 3
    w[16:24] *= 1e-3
    w[24] = 0
    q = quantize(w, "q4")
    s, m = torch.from_numpy(q.s), torch.from_numpy(q.m)
    for t, dtype in ((s, torch.float16), (m, torch.float16), (s, torch.bfloat16), (m + 8 * s, torch.bfloat16)):
        assert torch.equal(t.to(dtype).float(), t)
    x = w.view(64, -1, GROUP)
    step = ((x.amax(-1) - x.amin(-1)) / 15).clamp(min=1e-12)
    err = (torch.from_numpy(q.dequantize()) - w).abs().view(64, -1, GROUP).amax(-1) / step
    assert float(err[24:].max()) <= 0.51 and float(err[:8].max()) <= 0.6 and float(err.max()) <= 1.8


def test_forced_decode_steps_give_the_greedy_tokens_back(tmp_path):
    """``ParityJob.forced`` (teacher forcing one decode step at a time, as the GPU test scores the
    decode kernel) fed a model's own greedy continuations draws them again, step for step."""
    from devtools.checkpoints import make_checkpoint

    d = make_checkpoint("qwen3", tmp_path / "m", seed=41)
    paths = [str(p) for p in sorted(d.glob("*.safetensors"))]

    def job(**kw):
        return ParityJob("m", "safetensors", paths, config_of("safetensors", paths), PROMPTS[:4], 12, quant="q4",
                         **kw)

    greedy = run_parity([job()])[0].greedy
    forced = run_parity([job(forced=greedy)])[0]
    assert forced.forced_argmax == greedy and len(greedy[0]) == 12
