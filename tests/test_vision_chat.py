"""Images in chat on a small random Qwen3.5 checkpoint (transformers' own classes, its vision
tower, a real processor config saved beside it), served by neuron on the CPU and compared with
transformers given the same prompt, pixels and grids: the first token's log-probabilities and 16
greedy tokens, at TP=1 and 2, with one and two images, and with a prompt longer than one prefill
chunk whose image straddles a chunk boundary; the errors an image can get; an image resent in a
multi-turn chat encoded once, its prefix served from the cache."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from conftest import start_server
from test_hybrid import randomized
from devtools.fixture_tokenizer import BOS_TOKEN, EOS_TOKEN, build_tokenizer, write_tokenizer

VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")
MARKER = "".join(VISION_TOKENS)
VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=8,
              temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=64)
TEXT = dict(vocab_size=520, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=16, linear_value_head_dim=16, max_position_embeddings=2048)
PROCESSOR = {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": 8, "temporal_patch_size": 2,
             "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
             "size": {"shortest_edge": 16 * 16 * 4, "longest_edge": 16 * 16 * 48}}
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
NEW = 16


def write_checkpoint(out: Path, seed: int = 0, family: str = "qwen3_5") -> Path:
    import transformers
    from tokenizers import AddedToken

    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in VISION_TOKENS])
    ids = {f"{name}_token_id": tokenizer.token_to_id(t)
           for name, t in zip(("vision_start", "image", "vision_end"), VISION_TOKENS)}
    text = TEXT | dict(bos_token_id=tokenizer.token_to_id(BOS_TOKEN), eos_token_id=tokenizer.token_to_id(EOS_TOKEN))
    moe = family == "qwen3_5_moe"
    config = (transformers.Qwen3_5MoeConfig if moe else transformers.Qwen3_5Config)(
        text_config=text | (MOE if moe else {}), vision_config=VISION, **ids)
    torch.manual_seed(seed)
    model = randomized((transformers.Qwen3_5MoeForConditionalGeneration if moe
                        else transformers.Qwen3_5ForConditionalGeneration)(config).float().eval(), seed)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    write_tokenizer(out, tokenizer, json.loads((out / "config.json").read_text())["text_config"])
    tk_config = json.loads((out / "tokenizer_config.json").read_text())
    for t in VISION_TOKENS:  # transformers' tokenizer keeps only the added tokens listed here
        tk_config["added_tokens_decoder"][str(tokenizer.token_to_id(t))] = {
            "content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}
    (out / "tokenizer_config.json").write_text(json.dumps(tk_config))
    (out / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    return out


def picture(width: int, height: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def bomb() -> bytes:
    """A 177 KB PNG that decodes to 168 MB (one colour)."""
    buf = io.BytesIO()
    Image.new("RGB", (8000, 7000), (10, 20, 30)).save(buf, format="PNG")
    return buf.getvalue()


def uri(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def chat(text_before: str, images: list[bytes], text_after: str) -> list[dict]:
    parts = [{"type": "text", "text": text_before}]
    parts += [{"type": "image_url", "image_url": {"url": uri(d)}} for d in images]
    return [{"role": "user", "content": parts + [{"type": "text", "text": text_after}]}]


class Reference:
    """transformers on the same prompt: its processor's pixels and grids, the model's logits and
    greedy tokens."""

    def __init__(self, ckpt: Path) -> None:
        import transformers
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        self.ckpt = ckpt
        architecture = json.loads((ckpt / "config.json").read_text())["architectures"][0]
        self.model = getattr(transformers, architecture).from_pretrained(ckpt, dtype=torch.float32).eval()
        self.processor = Qwen2VLImageProcessorPil(**{k: v for k, v in PROCESSOR.items() if k != "image_processor_type"})
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(ckpt)
        self.pad = self.tokenizer.convert_tokens_to_ids("<|image_pad|>")

    def prompt(self, messages: list[dict]) -> tuple[list[int], dict]:
        images = [base64.b64decode(p["image_url"]["url"].split(",", 1)[1])
                  for m in messages for p in m["content"] if p["type"] == "image_url"]
        flat = [{"role": m["role"], "content": "".join(p.get("text") or MARKER for p in m["content"])}
                for m in messages]
        ids = self.tokenizer.apply_chat_template(flat, add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        if not images:
            return list(ids), {}
        inputs = self.processor([Image.open(io.BytesIO(d)) for d in images], return_tensors="pt")
        counts = iter((inputs["image_grid_thw"].prod(-1) // 4).tolist())
        out = []
        for t in ids:
            out += [t] * next(counts) if t == self.pad else [t]
        return out, {"pixel_values": inputs["pixel_values"], "image_grid_thw": inputs["image_grid_thw"],
                     "mm_token_type_ids": torch.tensor([[int(t == self.pad) for t in out]])}

    def answer(self, messages: list[dict]) -> tuple[torch.Tensor, list[int], int]:
        ids, extra = self.prompt(messages)
        x = torch.tensor([ids])
        with torch.no_grad():
            logits = self.model(input_ids=x, **extra).logits[0, -1]
            out = self.model.generate(input_ids=x, **extra, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                                      pad_token_id=0)
        return torch.log_softmax(logits.double(), -1), out[0, len(ids):].tolist(), len(ids)


_BUILT: dict[str, tuple[Path, Reference]] = {}


def built(family: str, tmp_path_factory) -> tuple[Path, Reference]:
    if family not in _BUILT:
        ckpt = write_checkpoint(tmp_path_factory.mktemp(f"{family}-vision"), family=family)
        _BUILT[family] = ckpt, Reference(ckpt)
    return _BUILT[family]


@pytest.fixture(scope="module")
def vision_model(tmp_path_factory):
    return built("qwen3_5", tmp_path_factory)


def config(ckpt: Path, **extra) -> str:
    settings = {"max_model_len": 2048, "max_slots": 4, "dtype": "float32"} | extra
    lines = "".join(f"{k} = {json.dumps(v)}\n" for k, v in settings.items())
    return f'[[models]]\nmodel = "{ckpt}"\nid = "vis"\n{lines}'


def served(server, messages: list[dict], max_tokens: int = NEW) -> dict:
    """The answer of the official client, as a dict (``token_ids`` is neuron's extension)."""
    import openai

    client = openai.OpenAI(base_url=server.base, api_key="none", timeout=300)
    out = client.chat.completions.create(model="vis", messages=messages, max_tokens=max_tokens, temperature=0,
                                         logprobs=True, top_logprobs=20,
                                         extra_body={"ignore_eos": True, "return_token_ids": True,
                                                     "return_tokens_as_token_ids": True})
    return out.model_dump()


def check_against(reference: Reference, got: dict, messages: list[dict]) -> None:
    want_lp, want_tokens, prompt_len = reference.answer(messages)
    choice = got["choices"][0]
    assert got["usage"]["prompt_tokens"] == prompt_len
    assert choice["token_ids"] == want_tokens
    first = choice["logprobs"]["content"][0]["top_logprobs"]
    assert len(first) == 20
    for t in first:  # the first token's 20 most likely, by id
        assert abs(t["logprob"] - float(want_lp[int(t["token"].removeprefix("token_id:"))])) < 1e-4, t


def long_chat(reference: Reference, seed: int) -> list[dict]:
    """A prompt of several 64-token prefill chunks whose 48-token image straddles one's edge."""
    for n in range(4, 12):
        words = " ".join(["the quick brown fox jumps over the lazy dog"] * n)
        messages = chat(words + " and then: ", [picture(128, 96, seed)], " What is it? " + words)
        at = reference.prompt(messages)[0].index(reference.pad)
        if 16 < at % 64 < 64 - 16:
            return messages
    raise AssertionError("no prompt puts the image across a chunk edge")


IMAGES = {"one": [(48, 40)], "two": [(64, 30), (24, 56)]}
CHUNKED = "[engine]\nprefill_chunk = 64\n"  # prompts longer than a chunk, images across chunk edges


@pytest.mark.parametrize("family, tp", [("qwen3_5", 1), ("qwen3_5", 2), ("qwen3_5_moe", 1), ("qwen3_5_moe", 2)])
def test_image_chats_give_transformers_logprobs_and_tokens(tmp_path_factory, tmp_path, family, tp):
    ckpt, reference = built(family, tmp_path_factory)
    server = start_server(tmp_path, config=CHUNKED + config(ckpt),
                          args=["--device", "cpu", "--tensor-parallel", str(tp)])
    try:
        for i, (name, sizes) in enumerate(IMAGES.items()):
            messages = chat("Look: ", [picture(w, h, 10 * i + j) for j, (w, h) in enumerate(sizes)], " What is it?")
            check_against(reference, served(server, messages), messages)
        messages = long_chat(reference, 7)
        assert len(reference.prompt(messages)[0]) > 3 * 64
        check_against(reference, served(server, messages), messages)
        models = httpx.get(f"{server.url}/models", timeout=10).json()["models"][0]
        assert "vision" in models["capabilities"] and models["image_encodes"] == 4, models
    finally:
        assert server.stop() == 0


def metric(server, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def test_a_chat_that_resends_its_image_encodes_it_once_and_reuses_its_prefix(vision_model, tmp_path):
    """Four turns, each resending the whole conversation with its image: the tower runs once (the
    metric), each turn after the first finds the previous turn's prompt in the prefix cache less
    one block (its answer comes back as text, which a random model's tokens do not survive), and
    the answers equal those with the cache off."""
    ckpt, reference = vision_model
    answers = {}
    for caching in (True, False):
        server = start_server(tmp_path, config=CHUNKED + config(ckpt, prefix_caching=caching),
                              args=["--device", "cpu"])
        try:
            messages = chat("Here is a picture: ", [picture(80, 64, 3)], " Describe it.")
            before, got = 0, []
            for turn in range(4):
                out = served(server, messages, max_tokens=12)
                cached = (out["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                if caching and turn:
                    assert cached >= before - 16, (turn, cached, before)
                before = out["usage"]["prompt_tokens"]
                got.append(out["choices"][0]["token_ids"])
                messages = messages + [{"role": "assistant", "content": out["choices"][0]["message"]["content"]},
                                       {"role": "user", "content": f"And turn {turn + 2}?"}]
            assert metric(server, "neuron:image_encodes_total") == 1
            if caching:  # another image in the same place is another prompt to the cache
                other = chat("Here is a picture: ", [picture(80, 64, 4)], " Describe it.")
                out = served(server, other)
                assert out["usage"]["prompt_tokens_details"]["cached_tokens"] <= reference.prompt(other)[0].index(
                    reference.pad)
                check_against(reference, out, other)
            else:  # the ranks kept its embeddings: the later turns used them
                assert metric(server, "neuron:image_embedding_reuses_total") == 3
            answers[caching] = got
        finally:
            assert server.stop() == 0
    assert answers[True] == answers[False]


def test_what_an_image_cannot_be_is_a_4xx_naming_it_and_the_server_stays_healthy(vision_model, tmp_path):
    import openai

    ckpt, reference = vision_model
    server = start_server(tmp_path, config=config(ckpt) + "[debug]\nfault_injection = true\n", args=["--device", "cpu"])
    client = openai.OpenAI(base_url=server.base, api_key="none")
    png = picture(32, 32, 1)
    cases = [
        (chat("a", [], "b")[:0] + [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}], "invalid_image", "not fetched"),
        (chat("a", [png[: len(png) // 2]], "b"), "invalid_image", "truncated or corrupt"),
        (chat("a", [b"not an image"], "b"), "invalid_image", "not a PNG"),
        (chat("a", [picture(20000, 1, 2)], "b"), "invalid_image", "larger than 16384 on a side"),
        (chat("a", [bomb()], "b"), "invalid_image", "has more than 50000000 pixels"),
        (chat("a", [png] * 17, "b"), "too_many_images", "at most 16 images"),
        (chat("a <|image_pad|>", [png], "b"), "invalid_request", "2 image tokens for 1 images"),
        ([{"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": uri(png)}}]}],
         "invalid_request", "only user messages may hold images"),
    ]
    try:
        for messages, code, words in cases:
            with pytest.raises(openai.BadRequestError) as err:
                client.chat.completions.create(model="vis", messages=messages, max_tokens=2)
            assert err.value.body["code"] == code and words in err.value.body["message"], err.value.body
        r = httpx.post(f"{server.base}/chat/completions", timeout=60, json={
            "model": "vis", "messages": chat("a", [png], "b"), "max_tokens": 2, "truncate_prompt_tokens": 8})
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", r.text
        # The Responses API takes input_image parts too, and answers what chat answers.
        r = httpx.post(f"{server.base}/responses", timeout=60, json={
            "model": "vis", "max_output_tokens": 4, "temperature": 0, "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "Look: "},
                                             {"type": "input_image", "image_url": uri(png)},
                                             {"type": "input_text", "text": " What is it?"}]}]})
        assert r.status_code == 200, r.text
        want = served(server, chat("Look: ", [png], " What is it?"), max_tokens=4)["usage"]["prompt_tokens"]
        assert r.json()["usage"]["input_tokens"] == want
        # So does the Messages API, its image a base64 block (and inside a tool's result, the same image).
        block = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": base64.b64encode(png).decode()}}
        r = httpx.post(f"{server.url}/v1/messages", timeout=60, json={
            "model": "vis", "max_tokens": 4, "temperature": 0, "messages": [
                {"role": "user", "content": [{"type": "text", "text": "Look: "}, block,
                                             {"type": "text", "text": " What is it?"}]}]})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["input_tokens"] + r.json()["usage"]["cache_read_input_tokens"] == want
        r = httpx.post(f"{server.url}/v1/messages", timeout=60, json={
            "model": "vis", "max_tokens": 2, "messages": [
                {"role": "user", "content": "Show me."},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "shot", "input": {}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [block]}]}]})
        assert r.status_code == 200, r.text
        ok = client.chat.completions.create(model="vis", messages=chat("Look: ", [png], "?"), max_tokens=4)
        assert ok.usage.completion_tokens == 4
        # A step that fails on the rank (here out of memory before the tower ran): what it was to
        # keep is unknown, so the same image sent again is encoded again, and answers.
        fresh = chat("Again: ", [picture(40, 24, 9)], "?")
        armed = httpx.post(f"{server.url}/debug/fault", json={"model": "vis", "rank": 0, "kind": "oom"})
        assert armed.status_code == 200, armed.text
        with pytest.raises(openai.APIStatusError) as err:
            client.with_options(max_retries=0).chat.completions.create(model="vis", messages=fresh, max_tokens=4)
        assert err.value.body["code"] == "insufficient_memory", err.value.body
        check_against(reference, served(server, fresh), fresh)
    finally:
        assert server.stop() == 0


def test_image_chats_at_once_through_preemption_and_evictions_equal_one_at_a_time(vision_model, tmp_path):
    """Eight image chats at once (six images, two of them twice) for four slots, a KV cache for
    about two, 16-token prompt chunks and room for the embeddings of about two images: sequences
    are preempted and recomputed, embeddings dropped and encoded again, and every answer is the one
    it gets alone."""
    import concurrent.futures

    ckpt, reference = vision_model
    chats = [chat(f"Picture {i}: ", [picture(48 + 16 * (i % 3), 40, i % 6)], " What is it?") for i in range(8)]
    settings = dict(max_model_len=96, max_slots=4, block_size=8, kv_cache_tokens=96)
    engine = "[engine]\nprefill_chunk = 16\nmax_queue_wait_s = 600\nimage_embedding_cache_mb = 0.006\n"
    server = start_server(tmp_path, config=engine + config(ckpt, **settings), args=["--device", "cpu"])
    try:
        alone = [served(server, m)["choices"][0]["token_ids"] for m in chats]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            together = list(pool.map(lambda m: served(server, m)["choices"][0]["token_ids"], chats))
        assert together == alone
        info = httpx.get(f"{server.url}/models", timeout=10).json()["models"][0]
        assert info["preemptions"] > 0 and info["image_encodes"] > 6, info
    finally:
        assert server.stop() == 0
