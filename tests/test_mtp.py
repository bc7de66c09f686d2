"""Speculative decoding with the checkpoint's own multi-token-prediction layer (``method = "mtp"``).

The hybrid family's small random checkpoints (transformers' classes) get an MTP layer as the
hub's Qwen3.5 and Qwen3-Next checkpoints ship it (``mtp.*``, ``mtp_num_hidden_layers = 1``).
transformers does not run it, so the reference is the published architecture built from its
parts: ``fc`` over the zero-centred norms of the next token's embedding and the model's final
hidden state, then a one-layer full-attention model of the family's own transformers class run
on those rows (``inputs_embeds``) at their positions, its final norm being ``mtp.norm``, and the
model's LM head. The rank's proposals and its MTP logits must match it, prompt in one step or
in chunks, after drafts kept and rejected; and a server drafting with it answers transformers'
greedy tokens at TP=1 and over gloo at TP=2."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest
import torch

from conftest import start_server

FIRST_TEXT = {"qwen3_5_text": "Qwen3_5TextConfig", "qwen3_5_moe_text": "Qwen3_5MoeTextConfig",
              "qwen3_next": "Qwen3NextConfig"}
PROMPT = [5, 17, 33, 2, 9, 41, 7, 7, 12, 3]
K = 3


class Reference:
    """The checkpoint's model and its MTP layer in transformers' classes (see the module doc)."""

    def __init__(self, ckpt: Path, family: str) -> None:
        import transformers
        from safetensors.torch import load_file
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

        raw = json.loads((ckpt / "config.json").read_text())
        self.main = getattr(transformers, raw["architectures"][0]).from_pretrained(ckpt, dtype=torch.float32).eval()
        text = raw.get("text_config", raw)
        one = {k: v for k, v in text.items() if k not in ("layer_types", "architectures", "model_type")}
        one |= dict(num_hidden_layers=1, layer_types=["full_attention"], mlp_only_layers=[])
        self.layer = getattr(transformers, FIRST_TEXT[family])(**one)
        model_class = transformers.AutoModelForCausalLM.from_config(self.layer).model.__class__
        self.mtp = model_class(self.layer).eval()
        tensors = load_file(ckpt / "model.safetensors")
        own = {k.removeprefix("mtp."): v for k, v in tensors.items() if k.startswith("mtp.")}
        got = self.mtp.load_state_dict({k: v for k, v in own.items() if k.startswith(("layers.", "norm."))},
                                       strict=False)
        assert got.missing_keys == ["embed_tokens.weight"] and not got.unexpected_keys, got  # the model's is used
        self.fc = own["fc.weight"]
        self.norms = []
        for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden"):
            norm = Qwen3_5RMSNorm(text["hidden_size"], eps=text["rms_norm_eps"])
            norm.weight.data.copy_(own[f"{name}.weight"])
            self.norms.append(norm)

    @torch.no_grad()
    def run(self, tokens: list[int], k: int) -> tuple[int, list[int], torch.Tensor]:
        """After ``tokens``: the model's greedy next token, the MTP layer's ``k`` chained guesses
        after it, and the layer's logits for the first."""
        body = self.main.model.language_model if hasattr(self.main.model, "language_model") else self.main.model
        h = body(torch.tensor([tokens])).last_hidden_state[0]
        nxt = int(self.main.lm_head(h[-1]).argmax())
        embed = self.main.get_input_embeddings()
        seq, hidden, guesses, first = list(tokens[1:]) + [nxt], h, [], None
        for _ in range(k):
            e = self.norms[0](embed(torch.tensor(seq)))
            x = torch.cat([e, self.norms[1](hidden)], dim=-1) @ self.fc.T
            out = self.mtp(inputs_embeds=x[None], position_ids=torch.arange(len(seq))[None]).last_hidden_state[0]
            logits = self.main.lm_head(out[-1])
            first = logits if first is None else first
            guesses.append(int(logits.argmax()))
            seq.append(guesses[-1])
            hidden = torch.cat([hidden, out[-1:]])
        return nxt, guesses, first


def with_mtp(src: Path, out: Path, family: str, seed: int = 3) -> Path:
    """A copy of the checkpoint ``src`` with a random MTP layer of the hub's layout."""
    import transformers
    from safetensors.torch import load_file, save_file

    from test_hybrid import randomized

    shutil.copytree(src, out)
    raw = json.loads((out / "config.json").read_text())
    text = raw.get("text_config", raw)
    one = {k: v for k, v in text.items() if k not in ("layer_types", "architectures", "model_type")}
    one |= dict(num_hidden_layers=1, layer_types=["full_attention"], mlp_only_layers=[])
    layer_cfg = getattr(transformers, FIRST_TEXT[family])(**one)
    model = randomized(transformers.AutoModelForCausalLM.from_config(layer_cfg).model.to(torch.float32), seed)
    tensors = load_file(out / "model.safetensors")
    for name, value in model.state_dict().items():
        if name.startswith(("layers.0.", "norm.")):
            tensors[f"mtp.{name}"] = value.contiguous()
    gen = torch.Generator().manual_seed(seed)
    H = text["hidden_size"]
    tensors["mtp.fc.weight"] = torch.randn(H, 2 * H, generator=gen) * 0.1
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden"):
        tensors[f"mtp.{name}.weight"] = torch.randn(H, generator=gen) * 0.1
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    text["mtp_num_hidden_layers"] = 1
    (out / "config.json").write_text(json.dumps(raw))
    return out


_BUILT: dict[str, tuple[Path, Reference]] = {}


def built(family: str, tmp_path_factory) -> tuple[Path, Reference]:
    from test_hybrid import built as plain

    if family not in _BUILT:
        _, ckpt, _ = plain(family, tmp_path_factory)
        out = with_mtp(ckpt, tmp_path_factory.mktemp(f"{family}-mtp") / "m", family)
        _BUILT[family] = out, Reference(out, family)
    return _BUILT[family]


def _runner(ckpt: Path, family: str, device: str = "cpu"):
    from devtools.parity import ParityJob, build

    from neuron.loader.model_config import config_from_hf

    cfg = config_from_hf(json.loads((ckpt / "config.json").read_text()))
    job = ParityJob(family, "safetensors", [str(x) for x in sorted(ckpt.glob("*.safetensors"))], cfg,
                    [[0]] * 4, max_len=64, draft_rows=8, mtp=True, device=device)
    return build(job)[0]


def _step(runner, seqs):
    import protocol as p

    pending = runner.step(p.Step(id=0, epoch=0, step_id=0, seqs=seqs))
    tokens, _, _, drafted = pending.wait()
    return tokens, drafted, pending.proposals


ON_GPU = [pytest.param("qwen3_5_text", "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no NVIDIA GPU visible")])]


@pytest.mark.parametrize("family, device", [(f, "cpu") for f in sorted(FIRST_TEXT)] + ON_GPU)
def test_the_mtp_layer_proposes_what_the_published_architecture_does(family, device, tmp_path_factory):
    """Its logits and guesses after a prompt in one step and in two chunks, after a decode whose
    drafts were partly kept, and after a plain decode (on a GPU: prompt steps and drafts in the
    prefill graphs, the plain decode in a decode graph, whose hidden states it takes)."""
    import protocol as p

    ckpt, ref = built(family, tmp_path_factory)
    runner = _runner(ckpt, family, device)
    logits = []
    real = runner.model.mtp_forward

    def spy(*args):
        out = real(*args)
        logits.append(out[1])
        return out
    runner.model.mtp_forward = spy
    start = dict(slot=0, blocks=list(range(4)), state=0, sampling=p.Sampling(temperature=0.0))
    nxt, guesses, first = ref.run(PROMPT, K)
    # the prompt in one step
    tokens, _, proposals = _step(runner, [p.StepSeq(tokens=PROMPT, start_pos=0, sample=True, propose=K, **start)])
    assert (tokens[0], proposals[0]) == (nxt, guesses)
    got = logits[0][0].cpu()
    assert torch.allclose(got, first, atol=1e-4 if device == "cpu" else 1e-3, rtol=0), (got - first).abs().max()
    # in two chunks: the first's last hidden state waits for the second's first token
    _step(runner, [p.StepSeq(tokens=PROMPT[:6], start_pos=0, propose=K, **start)])
    tokens, _, proposals = _step(runner, [p.StepSeq(slot=0, tokens=PROMPT[6:], start_pos=6, sample=True, state=0,
                                                    propose=K)])
    assert (tokens[0], proposals[0]) == (nxt, guesses)
    # a decode with drafts: the model's own tokens kept up to a wrong one, proposals after the draw
    seq = PROMPT + [nxt]
    greedy = []
    for _ in range(3):
        greedy.append(ref.run(seq + greedy, 0)[0])
    wrong = (greedy[1] + 1) % runner.vocab
    P = len(PROMPT)
    tokens, drafted, proposals = _step(runner, [p.StepSeq(
        slot=0, tokens=[nxt, greedy[0], wrong], start_pos=P, sample=True, state=0, drafts=2, propose=K,
        snapshots=[(P + 1, 1), (P + 2, 2)])])
    assert (drafted[0], tokens[0]) == ([greedy[0]], greedy[1])
    want = ref.run(seq + greedy[:1], K)
    assert (want[0], proposals[0]) == (greedy[1], want[1])
    # a plain decode, from the state after the kept draft
    tokens, _, proposals = _step(runner, [p.StepSeq(slot=0, tokens=[greedy[1]], start_pos=P + 2, sample=True,
                                                    state=2, propose=K)])
    assert (tokens[0], proposals[0]) == (greedy[2], ref.run(seq + greedy[:2], K)[1])
    if device == "cuda":
        assert runner.step_graphs.decode and runner.step_graphs.hidden_out


def test_the_leader_asks_for_proposals_drafts_them_and_holds_blocks_for_the_guesses():
    """A prompt's chunks ask the layer to run (the last for guesses too), with blocks held for
    the guessing rows; the next step drafts what came back for the tokens as they are; after a
    rejection the sequence pauses, asks again on its pause's last step (still overlapped) and
    drafts on the step that ends it."""
    import asyncio

    from test_blocks import request

    from neuron.engine.scheduler import DEVICE_TOKEN, Scheduler
    from neuron.engine.speculative import DraftPolicy

    async def main():
        s = Scheduler(4, 128, 32, 16, 256, 16, speculative=DraftPolicy.build("mtp", 3, False, 50, 4))
        a = request(24)
        s.waiting.append(a)
        s.admit()
        return s, a, s.schedule(), s.schedule()

    s, a, first, last = asyncio.run(main())
    assert [(len(x.tokens), x.sample, x.propose) for x in first + last] == [(16, False, 3), (8, True, 3)]
    assert len(a.blocks) * 16 >= 24 + 3 - 1  # the guesses' rows after the draw have blocks
    assert s.schedule() == []  # its guesses come with the token: the next step waits for them
    a.pending -= 1
    a.output.append(7)
    a.spec.index.offer(25, [11, 12, 13])
    plan = s.schedule()
    assert [(x.tokens, x.drafts, x.propose) for x in plan] == [([7, 11, 12, 13], 3, 3)]
    s.drafts_checked(plan[0], 0)
    a.pending -= 1
    a.output.append(9)
    a.spec.pause(s.clock, 4)
    asked = []
    for _ in range(4):
        x, = s.schedule()
        asked.append((x.tokens[0] == DEVICE_TOKEN, x.drafts, x.propose))
        if x.propose:
            break
    assert len(asked) > 2 and asked[-1] == (True, 0, 2) and all(p == (True, 0, 0) for p in asked[1:-1])
    for _ in range(len(asked)):
        a.pending -= 1
        a.output.append(9)
    a.spec.index.offer(len(a.prompt) + len(a.output), [21])
    x, = s.schedule()
    assert (x.tokens, x.drafts) == ([9, 21], 1)


def test_mtp_is_refused_by_name_where_the_checkpoint_has_no_mtp_layer(tmp_path_factory, tmp_path):
    from test_hybrid import built as plain

    from neuron.config import ModelEntry, SpeculativeConfig
    from neuron.loader.spec import load_spec
    from neuron.speculation import speculation_refused

    entry = ModelEntry(speculative=SpeculativeConfig(method="mtp", tokens=2))
    _, ckpt, _ = plain("qwen3_next", tmp_path_factory)
    assert "needs a checkpoint with MTP layers" in speculation_refused(entry, load_spec(str(ckpt)))
    ckpt, _ = built("qwen3_next", tmp_path_factory)
    assert speculation_refused(entry, load_spec(str(ckpt))) == ""
    d = Path(shutil.copytree(ckpt, tmp_path / "m"))
    raw = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(raw | {"mtp_num_hidden_layers": 2}))
    assert "takes one MTP layer, and this checkpoint has 2" in speculation_refused(entry, load_spec(str(d)))
    from safetensors.torch import load_file, save_file
    tensors = {k: v for k, v in load_file(d / "model.safetensors").items() if k != "mtp.fc.weight"}
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps(raw))
    assert "lacks mtp.fc.weight" in speculation_refused(entry, load_spec(str(d)))
    llama = load_spec(str(make_llama(tmp_path / "llama")))
    assert "the llama family has none" in speculation_refused(entry, llama)


def make_llama(out: Path) -> Path:
    from devtools.checkpoints import make_checkpoint

    return make_checkpoint("llama", out, seed=1)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("family, tp", [("qwen3_5_text", 1), ("qwen3_next", 2)])
def test_a_server_drafting_with_the_mtp_layer_answers_the_transformers_tokens(tmp_path_factory, tmp_path,
                                                                                family, tp):
    """Alone, three at once, and eight for four slots in a KV cache too small for them all
    (preemptions; the guesses' blocks come from the same few), in prompt chunks: transformers'
    greedy tokens; the layer's drafts are counted."""
    from test_hybrid import PROMPTS, built as plain, greedy_completions

    _, _, reference = plain(family, tmp_path_factory)
    ckpt, _ = built(family, tmp_path_factory)
    config = (f'[[models]]\nmodel = "{ckpt}"\nid = "m"\ndtype = "float32"\nmax_model_len = 80\nmax_slots = 4\n'
              f'block_size = 8\nkv_cache_tokens = 160\ntensor_parallel = {tp}\n'
              f'speculative = {{ method = "mtp", tokens = {K} }}\n[engine]\nprefill_chunk = 16\nmax_queue_wait_s = 600\n')
    server = start_server(tmp_path, config=config)
    try:
        def complete(prompts):
            return greedy_completions(server, "m", prompts)

        want = [tokens for _, tokens in reference]
        assert [complete(x)[0] for x in PROMPTS] == want
        assert complete(PROMPTS) == want
        assert complete((PROMPTS * 3)[:8]) == (want * 3)[:8]
        info = httpx.get(f"{server.url}/models", timeout=10).json()["models"][0]
        assert info["speculative"]["draft_tokens"] > 0 and info["state_slots_used"] == 0 and info["preemptions"], info
    finally:
        assert server.stop() == 0
