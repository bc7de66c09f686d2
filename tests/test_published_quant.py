"""Checkpoints their publisher quantized, AWQ (GEMM), GPTQ (v1) and FP8 (block scales as Qwen's
releases, per-row scales as compressed-tensors'), read in their own layout and kept packed
(neuron/loader/published.py). Each checkpoint is written here from a random float
checkpoint, the way AutoAWQ and AutoGPTQ pack theirs; its reference is transformers' float model
holding the dequantized weights. Served greedy tokens equal that reference at TP=1, 2 and 3, the
unpacking matches the formats' definitions worked by hand, and /models names the format."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import start_server
from devtools.checkpoints import make_checkpoint
from devtools.parity import ParityJob, run_parity
from devtools.shapes import pack_words as pack
from neuron.loader.published import unpack_along_columns, unpack_along_rows, unpack_awq
from neuron.loader.spec import load_spec

pytestmark = pytest.mark.usefixtures("float32_activations")  # the references are float

NEW_TOKENS = 24
_gen = torch.Generator().manual_seed(303)
PROMPTS = [torch.randint(0, 509, (n,), generator=_gen).tolist() for n in (4, 11, 29)]
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# name: (method, bits, group_size, sym) or, for FP8: ("fp8", weight_block_size, scale dtype, config style)
FORMATS = {"awq": ("awq", 4, 64, False), "gptq4": ("gptq", 4, 64, False), "gptq8": ("gptq", 8, -1, True),
           "gptq4-act": ("gptq", 4, 64, "act"),
           "fp8-block32": ("fp8", [32, 32], torch.bfloat16, "fp8"),
           "fp8-block128": ("fp8", [128, 128], torch.float16, "fp8"),
           "fp8-rows": ("fp8", None, torch.float32, "compressed-tensors"),
           "fp8-tensor": ("fp8", None, torch.float32, "fp8")}


# ------------------------------------------------------------------------- the layouts, by hand


def test_awq_words_hold_their_columns_in_autoawqs_order():
    # AutoAWQ packs column 8j + (0, 2, 4, 6, 1, 3, 5, 7)[i] into bits 4i of word j: nibbles
    # 0..7 of 0x76543210 are the values 0..7, so columns 0..7 read 0, 4, 1, 5, 2, 6, 3, 7.
    words = torch.tensor([[0x76543210, 0x0000000F]], dtype=torch.int32)
    assert unpack_awq(words).tolist() == [[0, 4, 1, 5, 2, 6, 3, 7, 15, 0, 0, 0, 0, 0, 0, 0]]
    assert unpack_awq(torch.tensor([[-1]], dtype=torch.int32)).tolist() == [[15] * 8]  # the sign bit is a value bit


def test_gptq_words_hold_their_values_lowest_bits_first():
    words = torch.tensor([[0x76543210, 0x000000FF]], dtype=torch.int32)
    assert unpack_along_rows(words, 4).T.tolist() == [[0, 1, 2, 3, 4, 5, 6, 7], [15, 15, 0, 0, 0, 0, 0, 0]]
    assert unpack_along_columns(words, 8).tolist() == [[0x10, 0x32, 0x54, 0x76, 0xFF, 0, 0, 0]]


# ------------------------------------------------------------------------- writing checkpoints


def quantize(w: torch.Tensor, bits: int, group: int, sym: bool, g_idx: torch.Tensor | None = None):
    """w [N, K] -> q [K, N], zero points [G, N] (the true ones), float16 scales [G, N], and the
    dequantized weight [N, K]; column k in group ``g_idx[k]`` (default: k // group)."""
    N, K = w.shape
    g_idx = torch.arange(K) // (K if group == -1 else group) if g_idx is None else g_idx.long()
    G, top = int(g_idx.max()) + 1, 2 ** bits - 1
    s, z = torch.empty(N, G), torch.empty(N, G)
    for i in range(G):
        x = w[:, g_idx == i]
        if sym:
            s[:, i] = (x.abs().amax(1) / (2 ** (bits - 1) - 1)).half().float()
            z[:, i] = 2 ** (bits - 1)
        else:
            lo, hi = x.amin(1), x.amax(1)
            s[:, i] = ((hi - lo) / top).half().float()
            z[:, i] = torch.round(-lo / s[:, i]).clamp(1, top)  # >= 1: GPTQ v1 stores z - 1
    scale, zero = s[:, g_idx], z[:, g_idx]
    q = torch.clamp(torch.round(w / scale) + zero, 0, top)
    return (q.T.to(torch.int32).contiguous(), z.T.to(torch.int32).contiguous(), s.T.half().contiguous(),
            (q - zero) * scale)


def act_order(K: int, group: int, seed: int) -> torch.Tensor:
    """GPTQ's desc_act g_idx: the columns quantized in a shuffled order P, the i-th of them in group
    i // group. P moves whole runs of 32 columns (shuffled inside), as a tensor-parallel share needs."""
    gen = torch.Generator().manual_seed(seed)
    runs = torch.randperm(K // 32, generator=gen)
    order = torch.cat([r * 32 + torch.randperm(32, generator=gen) for r in runs])
    g_idx = torch.empty(K, dtype=torch.int32)
    g_idx[order] = (torch.arange(K) // group).to(torch.int32)
    return g_idx


def fp8_quantize(w: torch.Tensor, block: list[int] | None, scale_dtype: torch.dtype, per_row: bool):
    """float8 e4m3 values, their scales (stored as ``scale_dtype``), the dequantized weight."""
    N, K = w.shape
    if block:
        bn, bk = block
        rows, cols = -(-N // bn), -(-K // bk)
        padded = torch.zeros(rows * bn, cols * bk).index_put_((torch.arange(N)[:, None], torch.arange(K)), w)
        amax = padded.abs().reshape(rows, bn, cols, bk).amax((1, 3))
    else:
        amax = w.abs().amax(1, keepdim=True) if per_row else w.abs().amax().reshape(1)
    scale = (amax / 448).to(scale_dtype)
    full = scale.float()
    if block:
        full = full.repeat_interleave(block[0], 0)[:N].repeat_interleave(block[1], 1)[:, :K]
    values = (w / full).to(torch.float8_e4m3fn)
    return values, scale, values.float() * full


def write_quantized(src: Path, out: Path, method: str, bits, group, sym) -> Path:
    """``out``: src's checkpoint with its projections packed the way ``method`` packs them;
    ``out``-float: the same model with the dequantized weights, in float32 (the reference)."""
    ref = out.with_name(out.name + "-float")
    for d in (out, ref):
        shutil.copytree(src, d)
        for f in d.glob("*.safetensors"):
            f.unlink()
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors |= load_file(f)
    packed, floats = {}, {}
    for name, w in tensors.items():
        base = name.removesuffix(".weight")
        if not name.endswith(".weight") or base.split(".")[-1] not in LINEARS:
            packed[name] = floats[name] = w
            continue
        if method == "fp8":
            block, scale_dtype, style = bits, group, sym
            values, scale, floats[name] = fp8_quantize(w.float(), block, scale_dtype, style == "compressed-tensors")
            packed[name] = values
            packed[name + ("_scale_inv" if block else "_scale")] = scale
            continue
        g_idx = act_order(w.shape[1], group, len(packed)) if sym == "act" else None
        q, z, s, deq = quantize(w.float(), bits, group, sym is True, g_idx)
        floats[name] = deq
        packed[base + ".scales"] = s
        if method == "awq":
            order = (0, 2, 4, 6, 1, 3, 5, 7)
            packed[base + ".qweight"] = pack(q, bits, 1, order)
            packed[base + ".qzeros"] = pack(z, bits, 1, order)
        else:
            packed[base + ".qweight"] = pack(q, bits, 0)
            packed[base + ".qzeros"] = pack(z - 1, bits, 1)
            g = q.shape[0] if group == -1 else group
            packed[base + ".g_idx"] = g_idx if g_idx is not None else torch.arange(q.shape[0], dtype=torch.int32) // g
    save_file(packed, out / "model.safetensors", metadata={"format": "pt"})
    save_file(floats, ref / "model.safetensors", metadata={"format": "pt"})
    for d in (out, ref):
        index = d / "model.safetensors.index.json"
        if index.exists():
            index.unlink()
    config = json.loads((out / "config.json").read_text())
    if method == "fp8" and sym == "compressed-tensors":
        quant = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
                 "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                     "num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True},
                     "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}}}
    elif method == "fp8":
        quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
        quant |= {"weight_block_size": bits} if bits else {}
    else:
        quant = {"quant_method": method, "bits": bits, "group_size": group}
        quant |= {"version": "gemm", "zero_point": True} if method == "awq" else \
            {"sym": sym is True, "desc_act": sym == "act"}
    (out / "config.json").write_text(json.dumps(config | {"quantization_config": quant}))
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("published")
    src = make_checkpoint("qwen3", tmp / "qwen3", seed=17)
    return {name: write_quantized(src, tmp / name, *fmt) for name, fmt in FORMATS.items()}


def hf_greedy(checkpoint: Path) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    model.eval().generation_config.eos_token_id = None
    out = []
    with torch.no_grad():
        for p in PROMPTS:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW_TOKENS)
            out.append(gen[0, len(p):].tolist())
    return out


@pytest.fixture(scope="module")
def references(checkpoints) -> dict[str, list[list[int]]]:
    return {name: hf_greedy(d.with_name(d.name + "-float")) for name, d in checkpoints.items()}


# ------------------------------------------------------------------------- served and split


def test_the_unpacked_weights_are_the_published_dequantization(checkpoints):
    from neuron.loader.published import PublishedSource
    from neuron.loader.safetensors_source import SafetensorsSource

    for name, d in checkpoints.items():
        spec = load_spec(str(d))
        src = PublishedSource(SafetensorsSource([str(d / "model.safetensors")]), spec.checkpoint_quant)
        want = load_file(d.with_name(d.name + "-float") / "model.safetensors")
        for linear in ("model.layers.1.self_attn.o_proj.weight", "model.layers.0.mlp.gate_proj.weight"):
            assert torch.equal(src.get(linear), want[linear]), (name, linear)
            rows, cols = range(16, 48), range(32, 64)  # a share of either kind, inside a 64-column group
            assert torch.equal(src.get(linear, dim=0, part=rows), want[linear][16:48]), (name, linear)
            assert torch.equal(src.get(linear, dim=1, part=cols), want[linear][:, 32:64]), (name, linear)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_greedy_tokens_equal_transformers_on_the_dequantized_weights(checkpoints, references, world):
    jobs = []
    for name, d in checkpoints.items():
        spec = load_spec(str(d))
        jobs.append(ParityJob(name, "safetensors", [str(d / "model.safetensors")], spec.config, PROMPTS, NEW_TOKENS,
                              checkpoint_quant=spec.checkpoint_quant))
    for job, result in zip(jobs, run_parity(jobs, world=world)):
        assert result.greedy == references[job.name], (job.name, world)
        dense = (Path(job.paths[0]).parent.with_name(job.name + "-float") / "model.safetensors").stat().st_size
        assert sum(result.weight_bytes) < 0.6 * dense, (job.name, result.weight_bytes)  # kept packed


def test_the_server_serves_them_packed_and_names_the_format(tmp_path, checkpoints, references):
    tps = {"awq": 2, "gptq8": 1, "fp8-block128": 3}  # (every format at every TP size: in process)
    config = "".join(f'[[models]]\nmodel = "{checkpoints[n]}"\nid = "{n}"\nmax_model_len = 128\nmax_slots = 2\n'
                     f'tensor_parallel = {tp}\n' for n, tp in tps.items())
    server = start_server(tmp_path, config=config)
    try:
        models = {m["id"]: m for m in httpx.get(f"{server.url}/models", timeout=10).json()["models"]}
        for name, tp in tps.items():
            m = models[name]
            method, bits, group, _ = FORMATS[name]
            assert m["status"] == "loaded" and m["tensor_parallel"] == tp
            if method == "fp8":
                scales = f"blocks of {bits[0]}x{bits[1]}" if bits else "scales per tensor or row"
                assert m["weight_format"].startswith(f"fp8:{scales} (safetensors:"), m["weight_format"]
                assert "f8_e4m3" in m["weight_format"]
                assert f"fp8 e4m3, {scales if bits else 'per row'} x" in m["packing"], m["packing"]
            else:
                groups = "per row" if group == -1 else f"groups of {group}"
                assert m["weight_format"] == f"{method}:int{bits} {groups} (safetensors:i32+f16+f32)", m["weight_format"]
                assert f"int{bits} from {method.upper()} int{bits} g{group}" in m["packing"], m["packing"]
            for i, prompt in enumerate(PROMPTS):
                body = {"model": name, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0,
                        "ignore_eos": True, "return_token_ids": True}
                r = httpx.post(f"{server.base}/completions", json=body, timeout=120)
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["token_ids"] == references[name][i], (name, i)
    finally:
        assert server.stop() == 0


def test_a_desc_act_share_that_cuts_a_32_column_run_is_refused_naming_it():
    """Columns of a group scattered in runs of 16: the whole matrix reads (sorted by group), a
    share of half its columns cannot keep one scale per 32 columns and says so."""
    from neuron.errors import LoadError
    from neuron.loader.published import PublishedSource
    from neuron.loader.prequantized import checkpoint_quant

    K, N, group = 128, 16, 64
    gen = torch.Generator().manual_seed(5)
    order = torch.cat([r * 16 + torch.arange(16) for r in torch.randperm(K // 16, generator=gen)])
    g_idx = torch.empty(K, dtype=torch.int32)
    g_idx[order] = (torch.arange(K) // group).to(torch.int32)
    w = torch.randn(N, K, generator=gen)
    q, z, s, deq = quantize(w, 4, group, False, g_idx)
    tensors = {"x.qweight": pack(q, 4, 0), "x.qzeros": pack(z - 1, 4, 1), "x.scales": s, "x.g_idx": g_idx}

    class Tensors:
        def has(self, name):
            return name in tensors

        def get(self, name, *, dim=None, part=None):
            t = tensors[name]
            return t if part is None else t.narrow(dim or 0, part.start, len(part))

    quant = checkpoint_quant({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": group,
                                                      "desc_act": True, "sym": False}}, {})
    src = PublishedSource(Tensors(), quant)
    assert torch.equal(src.get("x.weight"), deq)
    with pytest.raises(LoadError, match="desc_act groups do not fall on whole 32-column runs"):
        src.get_quant("x.weight", dim=1, part=range(0, 64))


def test_in_situ_fp8_keeps_one_byte_a_weight_and_equals_its_dequantized_model(checkpoints):
    """``quantize = "fp8"`` on a float checkpoint: the same greedy tokens at TP=1, 2 and 3 as the
    float model of its dequantized weights (a scale per row and 128 columns where they divide the
    matrix, else 64 or 32; a rank quantizes the groups its share cuts whole, so every split reads
    the same values), in about a quarter of the float32 bytes."""
    src = checkpoints["awq"].with_name("qwen3")
    paths = [str(p) for p in sorted(src.glob("*.safetensors"))]
    cfg = load_spec(str(src)).config
    (ref,) = run_parity([ParityJob("ref", "safetensors", paths, cfg, PROMPTS, NEW_TOKENS, quant="fp8", dense=True)])
    dense = sum(Path(p).stat().st_size for p in paths)
    for world in (1, 2, 3):
        (got,) = run_parity([ParityJob("fp8", "safetensors", paths, cfg, PROMPTS, NEW_TOKENS, quant="fp8")], world=world)
        assert got.greedy == ref.greedy, world
        assert sum(got.weight_bytes) < 0.45 * dense, got.weight_bytes


def test_in_situ_fp8_shares_cut_inside_a_column_group_hold_the_whole_matrix_s_values(tmp_path):
    """A rank's share of columns that starts or ends inside a group of 128: the group is quantized
    whole, so the shares' values and scales are the whole matrix's; a share of whole groups keeps
    the 128-column scales the FP8 tensor cores take, and a matrix whose columns 128 does not
    divide takes 64, else 32."""
    from neuron.loader.insitu import QuantizingSource, fp8_columns
    from neuron.loader.safetensors_source import SafetensorsSource

    g = torch.Generator().manual_seed(5)
    w = torch.randn(48, 384, generator=g) * torch.logspace(-3, 1, 384)[None, :]
    save_file({"layer.weight": w.to(torch.bfloat16)}, tmp_path / "w.safetensors")
    src = QuantizingSource(SafetensorsSource([str(tmp_path / "w.safetensors")]), "fp8")
    whole = src.get_fp8("layer.weight")
    assert whole.scale.shape == (48, 3) and torch.equal(whole.col_block, torch.arange(384) // 128)
    for cuts in ([0, 160, 384], [0, 96, 200, 384], [0, 128, 256, 384]):
        shares = [src.get_fp8("layer.weight", dim=1, part=range(a, b)) for a, b in zip(cuts, cuts[1:])]
        assert torch.equal(torch.cat([s.dequantize() for s in shares], 1), whole.dequantize()), cuts
        for (a, b), s in zip(zip(cuts, cuts[1:]), shares):
            assert s.values.shape == (48, b - a) and int(s.col_block[0]) == 0
            assert torch.equal(s.scale, whole.scale[:, a // 128:(b - 1) // 128 + 1])
    assert [fp8_columns(k) for k in (4096, 192, 96, 12288)] == [128, 64, 32, 128]


@pytest.mark.parametrize("world", [1, 2])
def test_a_hybrid_fp8_checkpoint_equals_transformers_on_its_dequantized_weights(tmp_path, world):
    """Qwen3.5 (Gated DeltaNet layers: in_proj_qkv, _z, _b, _a as one fused projection) with every
    projection FP8 in blocks of 32 x 32, split over uneven linear-attention heads at TP=2."""
    from test_hybrid import job, write_hybrid_checkpoint

    src = write_hybrid_checkpoint("qwen3_5_text", tmp_path / "float", seed=3)
    ref = tmp_path / "dequantized"
    out = tmp_path / "fp8"
    shutil.copytree(src, ref)
    shutil.copytree(src, out)
    (path,) = sorted(src.glob("*.safetensors"))
    packed, floats = {}, {}
    for name, w in load_file(path).items():
        if name.endswith("_proj.weight") and ".layers." in name and w.ndim == 2:
            packed[name], packed[name + "_scale_inv"], floats[name] = fp8_quantize(w.float(), [32, 32], torch.bfloat16,
                                                                                   False)
        else:
            packed[name] = floats[name] = w
    save_file(packed, out / path.name, metadata={"format": "pt"})
    save_file(floats, ref / path.name, metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32]}
    (out / "config.json").write_text(json.dumps(config))
    spec = load_spec(str(out))
    base = job("qwen3_5_text", out)
    fp8 = ParityJob("fp8", "safetensors", base.paths, spec.config, base.prompts, base.new_tokens,
                    checkpoint_quant=spec.checkpoint_quant)
    (got,) = run_parity([fp8], world=world)
    # The reference is transformers' forward over the prompt and the tokens served, each served
    # token its argmax there: its generate() drifts from its own forward for this checkpoint (at
    # position 64 of the 40-token prompt, by a margin of 0.43, where neuron agrees with the forward).
    import transformers

    model = transformers.Qwen3_5ForCausalLM.from_pretrained(ref, dtype=torch.float32).eval()
    for prompt, greedy, last in zip(base.prompts, got.greedy, got.logits):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + greedy])).logits[0]
        assert torch.allclose(last, logits[len(prompt) - 1], atol=1e-4, rtol=0)
        assert logits[len(prompt) - 1:-1].argmax(-1).tolist() == greedy, prompt
    dense = path.stat().st_size
    assert sum(got.weight_bytes) < 0.7 * dense  # the projections at a byte a weight, the rest float32


@pytest.mark.parametrize("fmt", ["fp8-block32", "gptq8", "in-situ fp8"])
def test_sparse_experts_of_a_quantized_checkpoint_stay_packed(tmp_path, fmt):
    """qwen3_moe with every expert's projections FP8 (or GPTQ, or quantized to fp8 at load): each
    expert kept in its format, greedy tokens equal transformers on the dequantized weights (in
    situ: the dequantized model) at TP=1 and 2 (experts split between the ranks)."""
    src = make_checkpoint("qwen3_moe", tmp_path / "moe", seed=23)
    if fmt == "in-situ fp8":
        paths = [str(p) for p in sorted(src.glob("*.safetensors"))]
        cfg = load_spec(str(src)).config
        (ref,) = run_parity([ParityJob("ref", "safetensors", paths, cfg, PROMPTS, NEW_TOKENS, quant="fp8", dense=True)])
        want, job = ref.greedy, ParityJob(fmt, "safetensors", paths, cfg, PROMPTS, NEW_TOKENS, quant="fp8")
        dense = sum(Path(p).stat().st_size for p in paths)
    else:
        d = write_quantized(src, tmp_path / fmt, *FORMATS[fmt])
        want = hf_greedy(d.with_name(d.name + "-float"))
        spec = load_spec(str(d))
        job = ParityJob(fmt, "safetensors", [str(d / "model.safetensors")], spec.config, PROMPTS, NEW_TOKENS,
                        checkpoint_quant=spec.checkpoint_quant)
        dense = (d.with_name(d.name + "-float") / "model.safetensors").stat().st_size
    for world in (1, 2):
        (got,) = run_parity([job], world=world)
        assert got.greedy == want, world
        assert sum(got.weight_bytes) < 0.6 * dense, got.weight_bytes  # experts too: most of the weights


def test_a_broken_quantized_checkpoint_fails_its_load_naming_the_tensor_and_leaves_no_rank(tmp_path, checkpoints):
    """An FP8 checkpoint whose block scales do not fit its weight (a careless conversion): the
    ranks' load fails with the tensor and shapes named, the daemon exits 1 with that message,
    and no rank process outlives it."""
    import os
    import signal
    import time

    d = tmp_path / "broken"
    shutil.copytree(checkpoints["fp8-block32"], d)
    tensors = load_file(d / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.weight_scale_inv"
    tensors[name] = tensors[name][:, :1].contiguous()
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    server = start_server(tmp_path, args=["--model", str(d), "--tensor-parallel", "2"], healthy=False)
    try:
        assert server.proc.wait(120) == 1
    finally:
        if server.proc.poll() is None:
            server.stop()
    assert f"{name}: (2, 1) scales for a 64x128 weight in 32x32 blocks" in server.log(), server.log()[-3000:]
    def session(pid: int) -> int:  # the daemon starts its own session; its live ranks are in it
        try:
            state, *fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            return -1 if state == "Z" else int(fields[2])  # (an exited process not yet reaped holds nothing)
        except (OSError, ValueError, IndexError):
            return -1

    time.sleep(1)
    leftovers = [pid for pid in map(int, filter(str.isdigit, os.listdir("/proc"))) if session(pid) == server.proc.pid]
    seen = {pid: open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode() for pid in leftovers}
    for pid in leftovers:
        os.kill(pid, signal.SIGKILL)
    assert not leftovers, seen


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_the_benchmarks_4bit_writer_is_read_back_within_a_step(tmp_path, method):
    """``devtools.shapes.int4_checkpoint`` (what ``scripts/perf-gpu --quantize awq,gptq`` serves)
    writes checkpoints that neuron's reader of the published layouts unpacks to the source
    weights: GPTQ's symmetric ones within half a step, AWQ's within one (its zero point is rounded,
    so the top of a group may clamp a step short, as AutoAWQ's own do)."""
    from devtools.shapes import int4_checkpoint, make_shaped_checkpoint
    from neuron.loader.published import PublishedSource
    from neuron.loader.safetensors_source import SafetensorsSource
    from neuron.loader.spec import load_spec

    src = make_shaped_checkpoint("qwen3-tiny", tmp_path / "src", dtype="float32", layers=2)
    out = int4_checkpoint(src, tmp_path / method, method, group=32)
    spec = load_spec(str(out))
    assert spec.checkpoint_quant is not None and spec.checkpoint_quant.method == method
    packed = PublishedSource(SafetensorsSource(spec.files.paths), spec.checkpoint_quant)
    floats = SafetensorsSource(load_spec(str(src)).files.paths)
    name = "model.layers.1.mlp.down_proj.weight"
    w, deq = floats.get(name), packed.get(name)
    groups = w.reshape(w.shape[0], -1, 32)
    step, share = ((groups.amax(2) - groups.amin(2)) / 15, 1.0) if method == "awq" else (groups.abs().amax(2) / 7, 0.5)
    err = (deq.float() - w).abs().reshape(w.shape[0], -1, 32).amax(2)
    assert (err <= step * (share + 1e-3) + 1e-7).all()
    assert err.mean() < step.mean() * 0.5
    assert packed.get("model.embed_tokens.weight").equal(floats.get("model.embed_tokens.weight"))
