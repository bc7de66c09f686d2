"""Speculative decoding with prompt-lookup drafts (``[[models]] speculative``): the drafter and
its adaptation on the leader, the rank's check of a step's drafts (greedy and rejection
sampling), and a real server whose answers are the same with drafts as without."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from conftest import DEFAULT_MODEL, SMALL, chat, start_server

# ------------------------------------------------------------------------------------------------
# the leader's drafter


def test_prompt_lookup_drafts_what_followed_the_latest_longest_match():
    from neuron.engine.speculative import NgramIndex

    tokens = [1, 2, 3, 4, 9, 2, 3, 5, 6, 7, 1, 2, 3]
    # [2, 3] was last followed by 5 (index 7); [1, 2, 3] (longer) by 4: the longest match wins
    assert NgramIndex().propose(tokens, 3) == [4, 9, 2]
    assert NgramIndex().propose(tokens[:-1] + [8, 2, 3], 2) == [5, 6]  # no [8, 2, 3] before: [2, 3]
    assert NgramIndex().propose([1, 2, 3, 4], 3) == []  # nothing repeats
    # before the next token is known: a match needs the last known token earlier, two ahead
    assert not NgramIndex().may_match([1, 2, 3], [4]) and not NgramIndex().may_match([1], [4])
    index = NgramIndex()
    assert index.may_match([4, 1, 2], [4]) and not index.may_match([4, 1, 2], [4, 5])
    assert index.may_match([4, 1, 2], [4, 5, 1])
    index = NgramIndex()  # indexed as the tokens grow: the same answers as built at once
    seq = [5, 6, 7, 5, 6]
    assert index.propose(seq, 4) == [7, 5, 6]
    seq += [7, 8, 5, 6, 7]
    assert index.propose(seq, 4) == [8, 5, 6, 7] == NgramIndex().propose(seq, 4)


def test_drafting_widens_on_success_and_pauses_longer_after_each_failure():
    from neuron.engine.speculative import NO_MATCH_PAUSE, Speculation

    s = Speculation(3)
    repeat = [1, 2, 3, 4] * 4
    assert s.active(0) and s.drafts(repeat, 10, 0) == [1, 2, 3]
    assert s.drafts(repeat, 2, 0) == [1, 2]  # no more than the room left
    clock, resumes = 5, []
    for _ in range(3):  # fail until the width is 0: a pause, doubling each time, to a multiple of it
        while s.active(clock):
            s.checked(s.width, 0, clock)
        resumes.append(s.resume)
        clock = s.resume
    assert resumes == [6, 8, 16] and s.width == 1
    assert not s.active(15) and s.active(16)
    s.checked(1, 1, clock)
    s.checked(2, 2, clock)
    assert s.width == 3 and s.stops == 0  # full acceptance widens again, up to the setting
    s.checked(3, 3, clock)
    assert s.width == 3 and (s.drafted, s.accepted) == (3 + 2 + 1 + 1 + 1 + 1 + 2 + 3, 1 + 2 + 3)
    s.checked(3, 1, clock)
    assert s.width == 2  # a run of one held: two next time
    assert s.drafts([1, 2, 3, 4, 5], 3, 17) == [] and s.resume == 16 + NO_MATCH_PAUSE  # up to the pause,
    assert not s.active(s.resume - 1) and s.active(s.resume)  # to a multiple of it


def test_only_requests_whose_draws_are_per_token_free_draft():
    from neuron.engine.speculative import may_draft
    from protocol import Sampling

    assert may_draft(Sampling(temperature=0.0), False) and may_draft(Sampling(temperature=0.7, top_p=0.9), False)
    assert not may_draft(Sampling(temperature=0.0), True)  # a grammar masks token by token
    for refused in (dict(logprobs=2), dict(seed=1), dict(logit_bias=[(3, 1.0)]), dict(min_tokens=4),
                    dict(repetition_penalty=1.1), dict(frequency_penalty=0.5), dict(presence_penalty=0.5)):
        assert not may_draft(Sampling(**refused), False), refused


def test_speculative_settings_are_checked():
    from neuron.config import ConfigError, load_config

    cfg = load_config(None, env={"NEURON_MODELS__0__SPECULATIVE": "method=ngram,tokens=5"})
    assert (cfg.models[0].speculative.method, cfg.models[0].speculative.tokens) == ("ngram", 5)
    assert load_config(None, env={"NEURON_MODELS__0__SPECULATIVE": "method=mtp"}).models[0].speculative.method == "mtp"
    for bad, words in (("method=ngram,tokens=0", "1..16"),
                       ("method=eagle", "must be \"ngram\""), ("tokens=3,depth=2", "unknown keys: depth")):
        with pytest.raises(ConfigError, match=words):
            load_config(None, env={"NEURON_MODELS__0__SPECULATIVE": bad})


def test_measuring_drafters_replay_a_record_or_guess_at_random(tmp_path):
    from neuron.config import ConfigError, load_config
    from neuron.engine.speculative import GPU_ROWS, MAX_DECODES, DraftError, DraftPolicy, Speculation

    record = tmp_path / "replay.jsonl"
    record.write_text(json.dumps({"prompt": [1, 2, 3], "output": [7, 8, 9, 10]}) + "\n\n")
    policy = DraftPolicy.build("replay", 3, False, 50, 8, str(record))
    assert (policy.decodes, policy.rows) == (MAX_DECODES, MAX_DECODES * 4)
    assert policy.drafter([1, 2]) is None  # a prompt without a record drafts nothing
    s = Speculation(3, policy.drafter([1, 2, 3]))
    assert s.drafts([1, 2, 3, 7], 3, 0) == [8, 9, 10] and s.drafts([1, 2, 3, 7, 8, 9, 10], 3, 0) == []
    s = Speculation(3, policy.drafter([1, 2, 3]))
    assert s.drafts([1, 2, 3, 7, 8], 3, 0) == [9, 10]
    assert s.drafts([1, 2, 3, 7, 8, 5], 3, 0) == [] and s.drafts([1, 2, 3, 7, 8, 5, 10], 3, 0) == []  # off the record
    policy.answered([1, 2, 3], [7, 8, 5])  # the server's own answer is replayed next time
    policy.answered([4], [5])
    assert policy.drafter([1, 2, 3]).answer == [7, 8, 5] and policy.drafter([4]) is None
    guesses = Speculation(2, DraftPolicy.build("random", 2, True, 50, 1).drafter([1]))
    assert all(len(d) == 2 and all(0 <= t < 50 for t in d) for d in (guesses.drafts([1], 5, 0) for _ in range(20)))
    gpu = DraftPolicy.build("ngram", 3, True, 50, 64)
    assert gpu.rows == GPU_ROWS and gpu.decodes > MAX_DECODES
    assert DraftPolicy.build("ngram", 16, True, 50, 2).rows == 2 * 17  # no more rows than the slots' share
    for bad in ("{\"prompt\": [1]}", "{\"prompt\": [1], \"output\": [-2]}", "not json",
                "{\"prompt\": [1], \"output\": [50]}", "{\"prompt\": [true], \"output\": []}", "[" * 100000):
        record.write_text(bad)
        with pytest.raises(DraftError, match="replay file"):
            DraftPolicy.build("replay", 3, False, 50, 8, str(record))
    with pytest.raises(DraftError, match="replay file"):
        DraftPolicy.build("replay", 3, False, 50, 8, str(tmp_path / "missing.jsonl"))
    for bad in ("method=replay", "method=ngram,replay=/tmp/x.jsonl"):
        with pytest.raises(ConfigError, match="is for method \"replay\""):
            load_config(None, env={"NEURON_MODELS__0__SPECULATIVE": bad})


def test_a_step_waits_whole_for_a_drafting_sequence_and_never_for_drafts_that_cannot_come():
    """A drafting sequence's input token must be known: the next step waits for it with the whole
    batch (a step of the others would split the batch); not where the drafts could not be kept
    (a model with recurrent state and no state slot spare), and not while it is paused."""
    import asyncio

    from test_blocks import request

    from neuron.engine.scheduler import DEVICE_TOKEN, Scheduler
    from neuron.engine.speculative import DraftPolicy

    async def main(state_slots: int) -> list:
        s = Scheduler(4, 64, 16, 16, 256, 64, state_slots=state_slots,
                      speculative=DraftPolicy.build("random", 2, False, 50, 4))
        a, b = request(5), request(6)
        s.waiting.extend([a, b])
        s.admit()
        s.schedule()  # both prompts
        return [s.schedule(), s, a, b]

    waited, s, a, b = asyncio.run(main(0))
    assert waited == []  # both wait for their first token
    for r, tok in ((a, 7), (b, 8)):
        r.pending -= 1
        r.output.append(tok)
    plan = s.schedule()
    assert [(x.tokens[0], x.drafts) for x in plan] == [(7, 2), (8, 2)]  # one step, both with drafts
    assert s.schedule() == []  # their drafts are out: nothing to plan until they are checked
    for x in plan:  # the reply: no draft held
        s.drafts_checked(x, 0)
        x.req.pending -= 1
        x.req.output.append(9)
        x.req.spec.pause(s.clock, 64)
    assert [(x.tokens, x.drafts) for x in s.schedule()] == [([9], 0), ([9], 0)]
    assert [x.tokens for x in s.schedule()] == [[DEVICE_TOKEN], [DEVICE_TOKEN]]  # paused: overlapped again
    overlapped, *_ = asyncio.run(main(2))  # both state slots held: no drafts to wait for
    assert [x.tokens for x in overlapped] == [[DEVICE_TOKEN], [DEVICE_TOKEN]]


def test_on_a_gpu_drafts_shrink_as_the_context_grows():
    """A draft's row reads its sequence's K/V once more: a decode carries fewer drafts as its
    context grows, and none once a row would read a quarter of the step's weight bytes."""
    import asyncio

    from test_blocks import request

    from neuron.engine.scheduler import Scheduler
    from neuron.engine.speculative import LONG_CONTEXT_SHARE, DraftPolicy

    policy = DraftPolicy.build("random", 4, True, 50, 4)
    assert policy.room(100_000) == 4  # not set (the CPU): no limit
    policy.context_cost = 1 / 4000  # a token's K/V: 1/4000 of the weights
    share = [min(4, int(LONG_CONTEXT_SHARE * 4000 / n)) for n in (10, 200, 250, 334, 500, 1000, 1001)]
    assert [policy.room(n) for n in (10, 200, 250, 334, 500, 1000, 1001)] == share == [4, 4, 4, 2, 2, 1, 0]

    async def main(prompt: int) -> int:
        s = Scheduler(4, 2048, 256, 16, 4096, 2048, speculative=policy)
        a = request(prompt)
        s.waiting.append(a)
        s.admit()
        s.schedule()
        a.pending -= 1
        a.output.append(7)
        return s.schedule()[0].drafts

    assert [asyncio.run(main(n)) for n in (100, 400, 1200)] == [4, 2, 0]


def test_snapshots_leave_the_drafts_state_slots_free_while_they_can_evict_instead():
    """A model with recurrent state and drafts: the prefix cache's snapshots do not take the
    slots kept for the states after drafts while an older snapshot can go instead; a running
    sequence may take them last."""
    from neuron.engine.blocks import BlockManager
    from neuron.engine.state_cache import StateCache

    cache = StateCache(6, BlockManager(16, 4, b"key"), 4, spare=2)
    running = [cache.allocate(), cache.allocate()]
    kept = []
    for i in range(4):  # more snapshots than the slots beyond the spare ones
        slot = cache.reserve()
        if slot is None:
            break
        assert cache.keep(slot, 4 * (i + 1), f"parent{i}".encode())
        kept.append(slot)
    assert cache.snapshots == 2 and cache.spare == 2  # the third evicted the first, not a spare slot
    drafts = [cache.scratch(), cache.scratch()]
    assert None not in drafts and cache.scratch() is None
    cache.unscratch(drafts)
    assert len({*running, *kept, *drafts}) == 6
    for _ in range(4):  # running sequences: the snapshots' slots first, then the spare ones
        running.append(cache.allocate())
    assert cache.snapshots == 0 and cache.spare == 0


def test_pipeline_stages_refuse_drafts_by_name():
    from neuron.config import ModelEntry, SpeculativeConfig
    from neuron.speculation import speculation_refused

    entry = ModelEntry(speculative=SpeculativeConfig("ngram", 4))
    assert speculation_refused(entry) == ""
    entry.pipeline_parallel = 2
    assert "pipeline stages" in speculation_refused(entry)


# ------------------------------------------------------------------------------------------------
# the rank's check


GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no NVIDIA GPU visible")]
ON_GPU = [pytest.param(("llama", "cuda"), marks=GPU), pytest.param(("qwen3_moe", "cuda"), marks=GPU)]


@pytest.fixture(scope="module", params=[("llama", "cpu"), ("qwen3_moe", "cpu"), *ON_GPU],
                ids=["llama-cpu", "qwen3_moe-cpu", "llama-cuda", "qwen3_moe-cuda"])
def runner(request, tmp_path_factory):
    """A rank's runner of a small random model: on the CPU, and on a GPU where there is one (in
    float32 there, where the same sums in another order rarely flip a greedy token)."""
    from devtools.checkpoints import make_checkpoint
    from devtools.parity import ParityJob, build

    from neuron.loader.model_config import config_from_hf

    family, device = request.param
    # on a GPU, heads the Triton kernels (and so the CUDA graphs) take
    wide = dict(num_attention_heads=4, num_key_value_heads=2, hidden_size=128, head_dim=32) if device == "cuda" else {}
    out = make_checkpoint(family, tmp_path_factory.mktemp(family), seed=5, **wide)
    cfg = config_from_hf(json.loads((out / "config.json").read_text()))
    job = ParityJob(family, "safetensors", [str(p) for p in sorted(out.glob("*.safetensors"))], cfg,
                    [[0], [0]], max_len=64, device=device, draft_rows=16 if device == "cuda" else 0)
    return build(job)[0]


class GraphSpy:
    """Counts the steps with drafts a runner replays in its CUDA graphs."""

    def __init__(self, runner) -> None:
        self.replays = 0
        graphs = runner.step_graphs
        for name in ("replay", "replay_prefill"):
            real = getattr(graphs, name)

            def spy(seqs, *args, real=real, **kwargs):
                self.replays += any(s.drafts for s in seqs)
                return real(seqs, *args, **kwargs)
            setattr(graphs, name, spy)


PROMPT = [5, 17, 33, 2, 9, 41, 7, 7]


def _step(runner, seqs, step_id=0):
    import protocol as p

    return runner.step(p.Step(id=0, epoch=0, step_id=step_id, seqs=seqs)).wait()


def _start(runner, temperature: float = 0.0) -> int:
    """The prompt prefilled in slot 0 as a new sequence: its first draw."""
    import protocol as p

    first = p.StepSeq(slot=0, tokens=PROMPT, start_pos=0, sample=True, blocks=list(range(4)),
                      sampling=p.Sampling(temperature=temperature))
    return _step(runner, [first])[0][0]


def _decode(runner, token: int, at: int, steps: int) -> list[int]:
    """Plain greedy decodes from ``token`` at position ``at``: each step's draw."""
    import protocol as p

    out = []
    for i in range(steps):
        token = _step(runner, [p.StepSeq(slot=0, tokens=[token], start_pos=at + i, sample=True)])[0][0]
        out.append(token)
    return out


def _check(runner, tokens: list[int]) -> tuple[list[int], int]:
    """One step of ``tokens`` after the prompt, all but the first drafts: (accepted, drawn)."""
    import protocol as p

    got, _, _, drafted = _step(runner, [p.StepSeq(slot=0, tokens=tokens, start_pos=len(PROMPT), sample=True,
                                                  drafts=len(tokens) - 1)])
    return drafted[0], got[0]


def test_the_rank_keeps_the_drafts_its_greedy_draws_confirm_and_the_cache_stays_right(runner):
    spy = GraphSpy(runner)
    g0 = _start(runner)
    greedy = _decode(runner, g0, len(PROMPT), 8)
    assert _start(runner) == g0
    assert _check(runner, [g0, *greedy[:4]]) == (greedy[:4], greedy[4])  # every draft right: one more after
    assert _start(runner) == g0
    wrong = (greedy[2] + 1) % runner.vocab
    accepted, drawn = _check(runner, [g0, greedy[0], greedy[1], wrong, greedy[3]])
    assert (accepted, drawn) == (greedy[:2], greedy[2])  # up to the first wrong one, then the model's own
    # the rejected drafts' K/V is overwritten: decoding on gives the plain run's tokens
    assert _decode(runner, drawn, len(PROMPT) + 3, 5) == greedy[3:8]
    assert _start(runner) == g0
    assert _check(runner, [g0, (greedy[0] + 1) % runner.vocab]) == ([], greedy[0])
    assert spy.replays == (3 if runner.cuda else 0) and bool(runner.step_graphs.decode) == runner.cuda


def test_a_step_with_drafts_and_a_prompt_beside_them(runner):
    """Two sequences in one step, one drafting and one a prompt that asks for logprobs: each gets
    what it would alone."""
    import protocol as p

    g0 = _start(runner)
    greedy = _decode(runner, g0, len(PROMPT), 4)
    assert _start(runner) == g0
    mixed = [p.StepSeq(slot=0, tokens=[g0, *greedy[:2]], start_pos=len(PROMPT), sample=True, drafts=2),
             p.StepSeq(slot=1, tokens=PROMPT, start_pos=0, sample=True, blocks=list(range(4, 8)),
                       sampling=p.Sampling(temperature=0.0, logprobs=3))]
    got, logprobs, _, drafted = _step(runner, mixed)
    assert drafted == [greedy[:2], []] and got == [greedy[2], g0]
    assert logprobs[0] == [] and [t for t, _ in logprobs[1]][0] == g0 and len(logprobs[1]) == 3  # the prompt's own


def test_drafts_are_refused_where_they_cannot_be_checked(runner):
    import protocol as p

    from neuron.runner.runner import StepRejected

    _start(runner)
    for seq in (p.StepSeq(slot=0, tokens=[1, 2], start_pos=len(PROMPT), sample=True, drafts=2),
                p.StepSeq(slot=0, tokens=[1, 2], start_pos=len(PROMPT), sample=False, drafts=1),
                p.StepSeq(slot=0, tokens=[1, 2], start_pos=len(PROMPT), sample=True, drafts=-1)):
        with pytest.raises(StepRejected, match="drafts"):
            runner.step(p.Step(id=0, epoch=0, step_id=0, seqs=[seq]))


def test_rejection_sampling_keeps_the_target_distribution():
    """With a draft of one token, the first token out is distributed as the target's first row
    (filtered by top_k, at its temperature), and after an accepted draft the next as its second
    row: drafts change how fast tokens come, never which."""
    from protocol import Sampling

    from neuron.runner.sampler import DeviceSampler

    V, n = 6, 60000
    sampler = DeviceSampler(2, V, torch.device("cpu"))
    sampler.generator.manual_seed(0)
    sampler.start(0, Sampling(temperature=0.8, top_k=4))
    rows = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 1.5], [0.0, 0.3, 2.0, -0.5, 1.0, 0.2]])
    want = []
    for r in rows:
        z = r / 0.8
        z[z < z.topk(4).values[-1]] = float("-inf")
        want.append(torch.softmax(z, -1))
    for draft in (0, 2, 4):  # a likely draft, an unlikely one, one that top_k filters out
        logits = rows.repeat(n, 1)
        tokens, accepted = sampler.verify(logits, [0] * n, [[draft]] * n)
        first = torch.where(accepted == 1, draft, tokens)
        freq = torch.bincount(first, minlength=V).float() / n
        assert (freq - want[0]).abs().max() < 0.012, (draft, freq, want[0])
        second = tokens[accepted == 1]
        if len(second) > 5000:
            freq = torch.bincount(second, minlength=V).float() / len(second)
            assert (freq - want[1]).abs().max() < 0.02, (draft, freq, want[1])
        assert abs(float((accepted == 1).float().mean()) - float(want[0][draft])) < 0.012


# ------------------------------------------------------------------------------------------------
# a real server

TEXT = ("The lighthouse stood on the northern cliff for two hundred years. Every night the keeper climbed the "
        "stairs, trimmed the wick and watched the lamp turn over the dark water. Ships passed far out at sea, and "
        "their crews counted the flashes to know where they were.")
EDIT = "Copy the following text exactly.\n\n" + TEXT


@pytest.fixture(scope="module")
def drafting(server_tmp):
    server = start_server(server_tmp, config=SMALL + 'speculative = { method = "ngram", tokens = 6 }\n')
    yield server
    server.stop()


def _ids(server, content: str, **extra) -> list[int]:
    r = chat(server, content, return_token_ids=True, **extra)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_a_server_answers_the_same_with_drafts_and_counts_them(drafting, tp1):
    for content, tokens in ((EDIT, 80), ("Tell me about lighthouses.", 40)):
        plain, spec = _ids(tp1, content, max_tokens=tokens), _ids(drafting, content, max_tokens=tokens)
        assert spec["token_ids"] == plain["token_ids"] and spec["message"] == plain["message"]
    model = httpx.get(f"{drafting.url}/models").json()["models"][0]
    s = model["speculative"]
    assert s["method"] == "ngram" and s["tokens"] == 6 and s["accepted_tokens"] > 10, s
    assert 0 < s["accepted_tokens"] <= s["draft_tokens"]
    assert httpx.get(f"{tp1.url}/models").json()["models"][0]["speculative"] is None
    metrics = httpx.get(f"{drafting.url}/metrics").text
    line = next(x for x in metrics.splitlines() if x.startswith("neuron:spec_decode_num_accepted_tokens_total"))
    assert float(line.split()[-1]) == s["accepted_tokens"]


def test_replayed_drafts_all_hold_and_random_ones_change_nothing(server_tmp, tp1, tmp_path):
    """The drafters that measure the mechanism (scripts/perf-gpu): a replay of the answer the
    model gave without drafts is accepted whole, random drafts are (almost) all rejected and
    soon paused; the answers are the model's own either way."""
    content = "Tell me about lighthouses."
    plain = _ids(tp1, content, max_tokens=60)["token_ids"]
    prompt = httpx.post(f"{tp1.url}/tokenize", json={"model": DEFAULT_MODEL, "messages": [
        {"role": "user", "content": content}]}).json()["tokens"]
    record = tmp_path / "replay.jsonl"
    record.write_text(json.dumps({"prompt": prompt, "output": plain}) + "\n")
    for method in (f'"replay", replay = "{record}"', '"random"'):
        server = start_server(server_tmp, config=SMALL + f'speculative = {{ method = {method}, tokens = 3 }}\n')
        try:
            assert _ids(server, content, max_tokens=60)["token_ids"] == plain, method
            s = httpx.get(f"{server.url}/models").json()["models"][0]["speculative"]
        finally:
            server.stop()
        if "replay" in method:  # every step but the last few (max_tokens) checks 3 drafts, all held
            assert s["accepted_tokens"] == s["draft_tokens"] >= 3 * 12, s
            assert s["drafts"] <= 60 // 4 + 2, s
        else:  # the width falls to one, then pauses double: few steps draft at all
            assert s["accepted_tokens"] <= 2 and s["drafts"] <= 12, s


def test_image_chats_draft_at_their_m_rope_positions(tmp_path_factory, tmp_path):
    """A Qwen3.5 image chat (M-RoPE: the text after an image resumes past its longer side): the
    transformers answer replayed as drafts is accepted whole, random drafts change nothing; the
    tokens are transformers' either way, and the drafts' rows sit at the positions their tokens
    would."""
    from test_vision_chat import CHUNKED, built, chat as image_chat, config, picture

    ckpt, reference = built("qwen3_5", tmp_path_factory)
    messages = image_chat("Look: ", [picture(48, 40, 3)], " What is it?")
    _, want, _ = reference.answer(messages)
    record = tmp_path / "replay.jsonl"
    record.write_text(json.dumps({"prompt": reference.prompt(messages)[0], "output": want}) + "\n")
    for method in (f'"replay", replay = "{record}"', '"random"'):
        server = start_server(tmp_path, config=CHUNKED + config(ckpt) + f"speculative = {{ method = {method}, tokens = 3 }}\n",
                              args=["--device", "cpu"])
        try:
            r = httpx.post(f"{server.base}/chat/completions", timeout=300, json={
                "model": "vis", "messages": messages, "max_tokens": len(want), "temperature": 0,
                "ignore_eos": True, "return_token_ids": True})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == want, method
            s = httpx.get(f"{server.url}/models").json()["models"][0]["speculative"]
        finally:
            assert server.stop() == 0
        if "replay" in method:
            assert s["accepted_tokens"] == s["draft_tokens"] >= len(want) // 2, s
        else:
            assert s["draft_tokens"] > 0 and s["accepted_tokens"] <= 1, s


def test_stops_and_limits_land_where_they_would_without_drafts(drafting, tp1):
    for extra in (dict(max_tokens=7), dict(max_tokens=60, stop=["wick"]), dict(max_tokens=60, stop=["lamp turn"])):
        plain, spec = _ids(tp1, EDIT, **extra), _ids(drafting, EDIT, **extra)
        assert spec["token_ids"] == plain["token_ids"] and spec["message"] == plain["message"], extra
        assert spec["finish_reason"] == plain["finish_reason"]
    # sampled and streamed: drafts checked by rejection sampling; every chunk arrives in order
    body = {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": EDIT}], "temperature": 0.7,
            "max_tokens": 50, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{drafting.base}/chat/completions", json=body, timeout=120) as r:
        events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    assert events[-1]["usage"]["completion_tokens"] == 50
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    assert text.strip()


def test_two_ranks_check_drafts_as_one_does(server_tmp, tp1):
    """TP=2 (gloo): the drafts' rows go through both ranks' shares, the draws stay rank 0's."""
    server = start_server(server_tmp, config=SMALL + 'speculative = { method = "ngram", tokens = 4 }\n',
                          args=["--tensor-parallel", "2"])
    try:
        for content in (EDIT, "Tell me about lighthouses."):
            assert _ids(server, content, max_tokens=48)["token_ids"] == _ids(tp1, content, max_tokens=48)["token_ids"]
        s = httpx.get(f"{server.url}/models").json()["models"][0]["speculative"]
        assert s["accepted_tokens"] > 10, s
    finally:
        assert server.stop() == 0


def test_a_client_gone_mid_draft_and_a_grammar_beside_drafts(drafting, tp1):
    """A stream dropped while its drafts are out ends there (its slot comes back); a request with a
    grammar decodes token by token on the drafting server and answers as the plain one does."""
    import time

    body = {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": EDIT}], "temperature": 0,
            "max_tokens": 200, "stream": True}
    before = httpx.get(f"{drafting.url}/models").json()["models"][0]["speculative"]["drafts"]
    with httpx.stream("POST", f"{drafting.base}/chat/completions", json=body, timeout=120) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i == 12:
                break
    deadline = time.monotonic() + 30
    while (m := httpx.get(f"{drafting.url}/models").json()["models"][0])["running"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert m["running"] == 0 and m["slots_used"] == 0 and m["speculative"]["drafts"] > before
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "c", "schema": schema, "strict": True}}
    drafts = m["speculative"]["draft_tokens"]
    plain, spec = (_ids(s, "Name a city with a lighthouse.", max_tokens=30, response_format=fmt)
                   for s in (tp1, drafting))
    assert spec["token_ids"] == plain["token_ids"] and json.loads(spec["message"]["content"])["city"]
    assert httpx.get(f"{drafting.url}/models").json()["models"][0]["speculative"]["draft_tokens"] == drafts
    assert _ids(drafting, EDIT, max_tokens=40)["token_ids"] == _ids(tp1, EDIT, max_tokens=40)["token_ids"]



# ------------------------------------------------------------------------------------------------
# the hybrid family: recurrent state after rejected drafts


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    from test_hybrid import built

    return built("qwen3_5_text", tmp_path_factory)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=GPU)])
def test_the_recurrent_state_goes_on_from_the_last_accepted_draft(hybrid, device):
    """The step keeps the state after the input token and after each draft in scratch slots; the
    leader makes the one after the last accepted token the sequence's: decoding on from it gives
    the plain run's tokens, for a rejection mid-way and for every draft accepted."""
    import protocol as p
    from devtools.parity import ParityJob, build

    from neuron.loader.model_config import config_from_hf

    family, ckpt, _ = hybrid
    cfg = config_from_hf(json.loads((ckpt / "config.json").read_text()))
    job = ParityJob(family, "safetensors", [str(x) for x in sorted(ckpt.glob("*.safetensors"))], cfg,
                    [[0]] * 4, max_len=64, device=device, draft_rows=8)
    runner = build(job)[0]
    spy = GraphSpy(runner)
    P = len(PROMPT)

    def start() -> int:
        first = p.StepSeq(slot=0, tokens=PROMPT, start_pos=0, sample=True, blocks=list(range(4)), state=0,
                          sampling=p.Sampling(temperature=0.0))
        return _step(runner, [first])[0][0]

    def decode(token: int, at: int, state: int, steps: int) -> list[int]:
        out = []
        for i in range(steps):
            token = _step(runner, [p.StepSeq(slot=0, tokens=[token], start_pos=at + i, sample=True, state=state)])[0][0]
            out.append(token)
        return out

    def check(tokens: list[int]) -> tuple[list[int], int]:
        k = len(tokens) - 1
        seq = p.StepSeq(slot=0, tokens=tokens, start_pos=P, sample=True, state=0, drafts=k,
                        snapshots=[(P + 1 + j, 1 + j) for j in range(k)])
        got, _, _, drafted = _step(runner, [seq])
        return drafted[0], got[0]

    g0 = start()
    greedy = decode(g0, P, 0, 8)
    assert start() == g0
    wrong = (greedy[2] + 1) % runner.vocab
    accepted, drawn = check([g0, greedy[0], greedy[1], wrong])
    assert (accepted, drawn) == (greedy[:2], greedy[2])
    assert decode(drawn, P + 3, 1 + len(accepted), 5) == greedy[3:8]  # from the state after two drafts
    assert start() == g0
    accepted, drawn = check([g0, *greedy[:3]])
    assert (accepted, drawn) == (greedy[:3], greedy[3])
    assert decode(drawn, P + 4, 0, 4) == greedy[4:8]  # every draft held: the sequence's own slot
    assert spy.replays == (2 if runner.cuda else 0) and bool(runner.step_graphs.prefill) == runner.cuda


@pytest.mark.timeout(600)
@pytest.mark.parametrize("family, tp", [("qwen3_next", 2), ("qwen3_5_moe_text", 1)])
def test_the_hybrid_families_draft_to_the_transformers_tokens(tmp_path_factory, tmp_path, family, tp):
    """Qwen3-Next (sparse and dense MLPs) over gloo at TP=2 and Qwen3.5-MoE at TP=1, with prompt
    lookup and with random drafts (all rejected, the states after them dropped): every answer,
    alone and three at once, is transformers' greedy one."""
    from test_hybrid import PROMPTS as PROMPTS3, built, greedy_completions

    _, ckpt, reference = built(family, tmp_path_factory)
    models = "".join(f'[[models]]\nmodel = "{ckpt}"\nid = "{m}"\ndtype = "float32"\nmax_model_len = 80\n'
                     f'max_slots = 4\ntensor_parallel = {tp}\nspeculative = {{ method = "{m}", tokens = 3 }}\n'
                     for m in ("ngram", "random"))
    server = start_server(tmp_path, config=models + "[engine]\nprefill_chunk = 16\n")
    try:
        for m in ("ngram", "random"):
            def complete(prompts, m=m):
                return greedy_completions(server, m, prompts)

            want = [tokens for _, tokens in reference]
            assert [complete(p)[0] for p in PROMPTS3] == want, m
            assert complete(PROMPTS3) == want, m
        info = {x["id"]: x for x in httpx.get(f"{server.url}/models", timeout=10).json()["models"]}
        assert info["random"]["speculative"]["draft_tokens"] > 0 and info["random"]["state_slots_used"] == 0
    finally:
        assert server.stop() == 0


def test_a_hybrid_server_answers_the_same_with_drafts(hybrid, tmp_path_factory):
    """Random hybrid weights (flat logits: drafts are often rejected), the prefix cache on: the
    state swaps after rejections and the snapshots of finished answers keep the right state."""
    import random

    from test_hybrid_prefix_cache import complete, config

    _, ckpt, _ = hybrid
    tmp = tmp_path_factory.mktemp("hybrid-spec")
    plain = start_server(tmp, config=config(ckpt, True))
    drafting = start_server(tmp, config=config(ckpt, True).replace(
        "[engine]", 'speculative = { method = "ngram", tokens = 3 }\n[engine]'))
    try:
        rng = random.Random(7)
        prompts = []
        while len(prompts) < 2:  # a prompt whose first answer token follows its last one earlier in it:
            base = [rng.randrange(10, 500) for _ in range(16)]  # the first decode has drafts to check
            first = complete(plain, base, 1)[0][0]
            prompt = base[:4] + [base[-1], first] + base[4:]
            if complete(plain, prompt, 1)[0][0] == first:
                prompts.append(prompt)
        for prompt in prompts:
            for again in range(2):  # the second time from the prefix cache's snapshots
                want, _ = complete(plain, prompt, 24)
                got, _ = complete(drafting, prompt, 24)
                assert got == want, again
        s = httpx.get(f"{drafting.url}/models").json()["models"][0]
        assert s["speculative"]["draft_tokens"] > 0 and s["running"] == 0, s
        assert s["state_slots_used"] == 0
    finally:
        plain.stop()
        drafting.stop()
