"""Every request field of vLLM's chat and completions protocols either works or is refused with a
400 that names it: the walk below sends each field with a value that would change the output and
checks the change (or the refusal). A field that our schemas do not know would be ignored as
unknown, so the schemas must know every one of them."""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from typing import Any, Callable

import httpx
import msgspec
import pytest

from conftest import DEFAULT_MODEL, TINY
from neuron.server.schemas import ChatRequest, CompletionRequest

# vLLM's ChatCompletionRequest and CompletionRequest (vllm/entrypoints/openai), their fields from
# the guided_* era to structured_outputs and repetition detection.
VLLM_SHARED = [
    "model", "frequency_penalty", "logit_bias", "max_tokens", "n", "presence_penalty", "seed", "stop", "stream",
    "stream_options", "temperature", "top_p", "user", "response_format", "best_of", "use_beam_search", "top_k",
    "min_p", "repetition_penalty", "length_penalty", "stop_token_ids", "include_stop_str_in_output", "ignore_eos",
    "min_tokens", "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens",
    "truncation_side", "prompt_logprobs", "logprob_token_ids", "allowed_token_ids", "bad_words", "guided_json",
    "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend", "guided_whitespace_pattern",
    "structural_tag", "structured_outputs", "priority", "request_id", "logits_processors",
    "return_tokens_as_token_ids", "return_token_ids", "return_token_offsets", "cache_salt", "kv_transfer_params",
    "ec_transfer_params", "vllm_xargs", "repetition_detection", "max_repetition_pattern_size",
    "min_repetition_pattern_size", "repetition_min_count", "thinking_token_budget", "mm_processor_kwargs",
    "media_io_kwargs", "add_special_tokens", "echo", "logprobs",
]
VLLM_CHAT = VLLM_SHARED + [
    "messages", "top_logprobs", "max_completion_tokens", "tools", "tool_choice", "reasoning_effort",
    "include_reasoning", "parallel_tool_calls", "add_generation_prompt", "continue_final_message", "documents",
    "chat_template", "chat_template_kwargs",
]
VLLM_COMPLETIONS = VLLM_SHARED + ["prompt", "suffix", "prompt_embeds"]

QUESTION = "What is the capital of France?"
REPEAT = "Repeat the word dog ten times."
TURN = "<turn>"  # the question, for completions as a whole chat turn: an answer that ends with EOS
CHAT_TURN = f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
PARIS = 7042  # " Paris" in SmolLM2's vocabulary
IM_START = 1  # "<|im_start|>", a special token


@dataclass
class Case:
    """``extra`` sent with the route's baseline body; ``check(out, base)`` on the answer (None:
    must be a 400 naming the field). ``prompt`` replaces the baseline question."""

    field: str
    extra: dict[str, Any]
    check: Callable[[dict, dict], bool] | None = None
    prompt: str = QUESTION
    server: str = "tp1"
    routes: tuple[str, ...] = ("chat", "completions")


def text(out: dict) -> str:
    choice = out["choices"][0]
    return choice["message"]["content"] or "" if "message" in choice else choice["text"]


def usage(out: dict, key: str) -> int:
    return out["usage"][key]


def same_seed_same_text(out: dict, base: dict) -> bool:
    return text(out) == text(out["again"])


def no_ws_but_newlines(out: dict, _: dict) -> bool:
    outside = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text(out))
    return json.loads(text(out)) is not None and not re.search(r"[ \t\r]", outside)


CASES = [
    Case("model", {"model": "no-such-model"}, None),
    Case("frequency_penalty", {"frequency_penalty": 2.0, "max_tokens": 12}, lambda o, b: text(o) != text(b), REPEAT),
    Case("presence_penalty", {"presence_penalty": 2.0, "max_tokens": 12}, lambda o, b: text(o) != text(b), REPEAT),
    Case("repetition_penalty", {"repetition_penalty": 2.0, "max_tokens": 12}, lambda o, b: text(o) != text(b), REPEAT),
    Case("logit_bias", {"logit_bias": {str(PARIS): 100}, "max_tokens": 3}, lambda o, b: text(o) == " Paris" * 3),
    Case("max_tokens", {"max_tokens": 3}, lambda o, b: usage(o, "completion_tokens") == 3),
    Case("n", {"n": 2, "temperature": 1.0, "seed": 1, "max_tokens": 3}, lambda o, b: [c["index"] for c in o["choices"]] == [0, 1]),
    Case("seed", {"seed": 7, "temperature": 1.5, "max_tokens": 4}, same_seed_same_text),
    Case("temperature", {"temperature": 2.0, "seed": 3, "max_tokens": 4}, lambda o, b: text(o) != text(b)),
    Case("top_p", {"top_p": 1e-9, "temperature": 1.0, "seed": 5}, lambda o, b: text(o) == text(b)),
    Case("top_k", {"top_k": 1, "temperature": 1.0, "seed": 5}, lambda o, b: text(o) == text(b)),
    Case("min_p", {"min_p": 1.0, "temperature": 1.0, "seed": 5}, lambda o, b: text(o) == text(b)),
    Case("stop", {"stop": [" Paris"]}, lambda o, b: "Paris" in text(b) and "Paris" not in text(o)),
    Case("stream", {"stream": True}, lambda o, b: o["streamed"] and o["text"] == text(b)),
    Case("stream_options", {"stream": True, "stream_options": {"include_usage": True}},
         lambda o, b: o["usage"]["completion_tokens"] == usage(b, "completion_tokens")),
    Case("user", {"user": "walker-alice"}, lambda o, b: o["log_has_user"]),
    Case("response_format", {"response_format": {"type": "json_object"}, "max_tokens": 16},
         lambda o, b: isinstance(json.loads(text(o)), dict)),
    Case("best_of", {"best_of": 3}, None),
    Case("use_beam_search", {"use_beam_search": True}, None),
    Case("length_penalty", {"length_penalty": 0.5}, None),
    Case("stop_token_ids", {"stop_token_ids": [PARIS]},
         lambda o, b: o["choices"][0]["finish_reason"] == "stop" and "Paris" not in text(o) and "Paris" in text(b)),
    Case("include_stop_str_in_output", {"include_stop_str_in_output": True, "stop": [" Paris"]},
         lambda o, b: text(o).endswith(" Paris")),
    Case("ignore_eos", {"ignore_eos": True, "max_tokens": 12}, lambda o, b: usage(o, "completion_tokens") == 12
         and b["choices"][0]["finish_reason"] == "stop" and usage(b, "completion_tokens") < 12, prompt=TURN),
    Case("min_tokens", {"min_tokens": 10, "max_tokens": 12}, lambda o, b: usage(o, "completion_tokens") >= 10
         and b["choices"][0]["finish_reason"] == "stop" and usage(b, "completion_tokens") < 10, prompt=TURN),
    Case("skip_special_tokens", {"skip_special_tokens": False, "logit_bias": {str(IM_START): 100}, "max_tokens": 2},
         lambda o, b: text(o) == "<|im_start|><|im_start|>"),
    Case("spaces_between_special_tokens",
         {"spaces_between_special_tokens": False, "skip_special_tokens": False, "logit_bias": {str(IM_START): 100},
          "max_tokens": 2}, lambda o, b: text(o) == "<|im_start|><|im_start|>"),
    Case("truncate_prompt_tokens", {"truncate_prompt_tokens": 3}, lambda o, b: usage(o, "prompt_tokens") == 3),
    Case("truncation_side", {"truncate_prompt_tokens": 3, "truncation_side": "right"},
         lambda o, b: usage(o, "prompt_tokens") == 3 and text(o) != o["left"]),
    Case("prompt_logprobs", {"prompt_logprobs": 1}, None),
    Case("logprob_token_ids", {"logprob_token_ids": [1]}, None),
    Case("allowed_token_ids", {"allowed_token_ids": [PARIS, 13], "return_token_ids": True},
         lambda o, b: set(o["choices"][0]["token_ids"]) <= {PARIS, 13}),
    Case("bad_words", {"bad_words": ["Paris"]}, lambda o, b: "Paris" in text(b) and "Paris" not in text(o)),
    Case("guided_json", {"guided_json": {"type": "object", "properties": {"city": {"type": "string"}},
                                         "required": ["city"]}, "max_tokens": 16},
         lambda o, b: "city" in json.loads(text(o))),
    Case("guided_regex", {"guided_regex": "[A-Z][a-z]{1,9} is [A-Z][a-z]{1,9}"},
         lambda o, b: re.fullmatch("[A-Z][a-z]{1,9} is [A-Z][a-z]{1,9}", text(o))),
    Case("guided_choice", {"guided_choice": ["Paris", "London"]}, lambda o, b: text(o) in ("Paris", "London")),
    Case("guided_grammar", {"guided_grammar": 'root ::= "The answer: " [A-Z] [a-z]+'},
         lambda o, b: re.fullmatch("The answer: [A-Z][a-z]+", text(o))),
    Case("guided_decoding_backend", {"guided_decoding_backend": "outlines"}, None),
    Case("guided_whitespace_pattern", {"guided_whitespace_pattern": "\n", "max_tokens": 60, "seed": 2,
                                       "guided_json": {"type": "object", "properties": {"a": {"type": "integer"},
                                                       "b": {"type": "boolean"}}, "required": ["a", "b"]}},
         no_ws_but_newlines, server="tiny"),
    Case("structural_tag", {"structural_tag": '{"structures": []}'}, None),
    Case("structured_outputs", {"structured_outputs": {"choice": ["yes", "no"]}}, lambda o, b: text(o) in ("yes", "no")),
    Case("priority", {"priority": -3}, lambda o, b: o["log_has_priority"] and text(o) == text(b)),
    Case("request_id", {"request_id": "walk-42"}, lambda o, b: o["id"].endswith("-walk-42")),
    Case("logits_processors", {"logits_processors": ["my.module.Processor"]}, None),
    Case("return_tokens_as_token_ids", {"return_tokens_as_token_ids": True, "logprobs": True, "top_logprobs": 1},
         lambda o, b: o["token_strings"][0].startswith("token_id:"), routes=("chat",)),
    Case("return_tokens_as_token_ids", {"return_tokens_as_token_ids": True, "logprobs": 1},
         lambda o, b: o["token_strings"][0].startswith("token_id:"), routes=("completions",)),
    Case("return_token_ids", {"return_token_ids": True}, lambda o, b: len(o["choices"][0]["token_ids"]) ==
         usage(o, "completion_tokens")),
    Case("return_token_offsets", {"return_token_offsets": True}, None),
    # No KV is shared between requests yet: a salt has nothing to separate, and changes nothing.
    Case("cache_salt", {"cache_salt": "s3cr3t-salt"}, lambda o, b: text(o) == text(b)),
    Case("kv_transfer_params", {"kv_transfer_params": {"do_remote_decode": True}}, None),
    Case("ec_transfer_params", {"ec_transfer_params": {"x": 1}}, None),
    Case("vllm_xargs", {"vllm_xargs": {"x": 1}}, None),
    Case("repetition_detection", {"repetition_detection": {"max_pattern_size": 4}}, None),
    Case("max_repetition_pattern_size", {"max_repetition_pattern_size": 4}, None),
    Case("min_repetition_pattern_size", {"min_repetition_pattern_size": 2}, None),
    Case("repetition_min_count", {"repetition_min_count": 3}, None),
    Case("thinking_token_budget", {"thinking_token_budget": 10}, None),
    Case("mm_processor_kwargs", {"mm_processor_kwargs": {"size": 1}}, None),
    Case("media_io_kwargs", {"media_io_kwargs": {"video": {}}}, None),
    Case("add_special_tokens", {"add_special_tokens": False, "logit_bias": {}},
         lambda o, b: usage(o, "prompt_tokens") == usage(b, "prompt_tokens"), routes=("completions",)),
    Case("add_special_tokens", {"add_special_tokens": True}, lambda o, b: usage(o, "prompt_tokens") >=
         usage(b, "prompt_tokens"), routes=("chat",)),
    Case("echo", {"echo": True}, lambda o, b: text(o) == "The capital of France is" + text(b), routes=("completions",)),
    Case("echo", {"echo": True, "messages": [{"role": "user", "content": QUESTION},
                                              {"role": "assistant", "content": "It is"}],
                  "continue_final_message": True, "add_generation_prompt": False},
         lambda o, b: text(o).startswith("It is") and len(text(o)) > 5, routes=("chat",)),
    Case("logprobs", {"logprobs": True, "top_logprobs": 0},
         lambda o, b: len(o["choices"][0]["logprobs"]["content"]) == usage(o, "completion_tokens"), routes=("chat",)),
    Case("logprobs", {"logprobs": 2},
         lambda o, b: all(len(t) == 2 for t in o["choices"][0]["logprobs"]["top_logprobs"]), routes=("completions",)),
    # chat only
    Case("messages", {"messages": [{"role": "user", "content": "What is the capital of Germany?"}]},
         lambda o, b: "Berlin" in text(o) and "Paris" in text(b), routes=("chat",)),
    Case("top_logprobs", {"logprobs": True, "top_logprobs": 3},
         lambda o, b: all(len(e["top_logprobs"]) == 3 for e in o["choices"][0]["logprobs"]["content"]), routes=("chat",)),
    Case("max_completion_tokens", {"max_completion_tokens": 2, "max_tokens": 6},
         lambda o, b: usage(o, "completion_tokens") == 2, routes=("chat",)),
    Case("tools", {"tools": [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}],
                   "max_tokens": 1}, lambda o, b: usage(o, "prompt_tokens") > usage(b, "prompt_tokens") + 30,
         routes=("chat",)),
    Case("tool_choice", {"tools": [{"type": "function", "function": {"name": "lookup"}}], "tool_choice": "none"},
         lambda o, b: usage(o, "prompt_tokens") == usage(b, "prompt_tokens") and text(o) == text(b), routes=("chat",)),
    Case("reasoning_effort", {"reasoning_effort": "low"}, None, routes=("chat",)),
    Case("include_reasoning", {"include_reasoning": False, "guided_regex": "<think>[a-z]{3}</think>ok",
                               "max_tokens": 40},
         lambda o, b: text(o) == "ok" and "reasoning_content" not in o["choices"][0]["message"],
         server="tiny", routes=("chat",)),
    Case("parallel_tool_calls", {"parallel_tool_calls": False, "tool_choice": "required", "max_tokens": 200,
                                 "tools": [{"type": "function", "function": {"name": "f", "parameters": {
                                     "type": "object", "properties": {"x": {"type": "boolean"}}, "required": ["x"],
                                     "additionalProperties": False}}}]},
         lambda o, b: len(o["choices"][0]["message"]["tool_calls"]) == 1, server="tiny", routes=("chat",)),
    Case("add_generation_prompt", {"add_generation_prompt": False, "max_tokens": 1},
         lambda o, b: usage(o, "prompt_tokens") < usage(b, "prompt_tokens"), routes=("chat",)),
    Case("continue_final_message", {"messages": [{"role": "user", "content": QUESTION},
                                                 {"role": "assistant", "content": "The capital of France is"}],
                                    "continue_final_message": True, "add_generation_prompt": False},
         lambda o, b: text(o).startswith(" Paris"), routes=("chat",)),
    Case("documents", {"documents": [{"title": "t", "text": "x"}]}, None, routes=("chat",)),
    Case("chat_template", {"chat_template": "{{ messages[-1]['content'] }}"},
         lambda o, b: usage(o, "prompt_tokens") < 12, routes=("chat",)),
    Case("chat_template_kwargs", {"chat_template": "{{ preface }} {{ messages[-1]['content'] }}",
                                  "chat_template_kwargs": {"preface": "Answer the question below in one word please."}},
         lambda o, b: usage(o, "prompt_tokens") > 12, routes=("chat",)),
    # completions only
    Case("prompt", {"prompt": ["The capital of France is", "The capital of Italy is"], "max_tokens": 3},
         lambda o, b: "Paris" in o["choices"][0]["text"] and "Rome" in o["choices"][1]["text"], routes=("completions",)),
    Case("suffix", {"suffix": " and that is all."}, None, routes=("completions",)),
    Case("prompt_embeds", {"prompt_embeds": "AAAA"}, None, routes=("completions",)),
]


def test_our_schemas_know_every_vllm_field():
    assert set(VLLM_CHAT) <= set(ChatRequest.__struct_fields__)
    assert set(VLLM_COMPLETIONS) <= set(CompletionRequest.__struct_fields__)


@pytest.mark.parametrize("route,fields", [("chat", VLLM_CHAT), ("completions", VLLM_COMPLETIONS)])
def test_the_walk_covers_every_field(route, fields):
    walked = {c.field for c in CASES if route in c.routes}
    assert set(fields) - walked == set()


def baseline(route: str, prompt: str, model: str) -> dict:
    if prompt == TURN:
        prompt = QUESTION if route == "chat" else CHAT_TURN
    if route == "chat":
        return {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 8, "temperature": 0}
    return {"model": model, "prompt": "The capital of France is" if prompt == QUESTION else prompt, "max_tokens": 8,
            "temperature": 0}


def post(server, route: str, body: dict) -> httpx.Response:
    path = "chat/completions" if route == "chat" else "completions"
    if not body.get("stream"):
        return httpx.post(f"{server.base}/{path}", json=body, timeout=300)
    with httpx.stream("POST", f"{server.base}/{path}", json=body, timeout=300) as r:
        r.read()
    return r


def run(server, route: str, body: dict, case: Case, base: dict) -> dict:
    r = post(server, route, body)
    assert r.status_code == 200, r.text
    if body.get("stream"):
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        pieces = [(c["choices"][0].get("delta", {}).get("content") or c["choices"][0].get("text") or "")
                  for c in chunks if c["choices"]]
        usage_chunk = [c["usage"] for c in chunks if c.get("usage")]
        return {"streamed": True, "text": "".join(pieces), "usage": usage_chunk[-1] if usage_chunk else None}
    out = r.json()
    if case.field == "seed":
        out["again"] = post(server, route, body).json()
    if case.field == "user":
        out["log_has_user"] = "user=walker-alice" in server.log()  # the request's start line
    if case.field == "priority":  # it orders a key's waiting requests (test_fair_share); here it is read
        out["log_has_priority"] = "priority=-3" in server.log()
    if case.field == "truncation_side":
        out["left"] = text(post(server, route, {**body, "truncation_side": "left"}).json())
    if case.field == "return_tokens_as_token_ids":
        lp = out["choices"][0]["logprobs"]
        out["token_strings"] = [e["token"] for e in lp["content"]] if route == "chat" else lp["tokens"]
    return out


WALK = [(route, case) for route in ("chat", "completions") for case in CASES if route in case.routes]


@pytest.fixture(scope="module")
def baselines() -> dict:
    return {}


@pytest.mark.parametrize("route,case", WALK, ids=[f"{route}-{case.field}" for route, case in WALK])
def test_the_field_is_honoured_or_refused_by_name(tp1, tiny, baselines, route, case):
    server, model = {"tp1": (tp1, DEFAULT_MODEL), "tiny": (tiny, TINY)}[case.server]
    key = (route, case.server, case.prompt)
    if key not in baselines:
        baselines[key] = post(server, route, baseline(route, case.prompt, model)).json()
    base = baselines[key]
    body = {**baseline(route, case.prompt, model), **case.extra}
    if route == "completions":
        for name in ("messages", "continue_final_message", "add_generation_prompt"):
            body.pop(name, None)
    if case.check is None:
        r = post(server, route, body)
        assert r.status_code == (404 if case.field == "model" else 400), r.text
        assert r.json()["error"]["param"] == case.field
        return
    out = run(server, route, body, case, base)
    assert case.check(out, base), f"{json.dumps(out)[:600]}\nbaseline: {json.dumps(base)[:400]}"


def test_a_malformed_body_names_the_field_too(tp1):
    r = httpx.post(f"{tp1.base}/chat/completions", json={"model": DEFAULT_MODEL, "messages": [], "logit_bias": [1]},
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"
    assert msgspec.json.decode(b'{"model": "m", "prompt": [[1, 2], [3]]}', type=CompletionRequest).prompt == [[1, 2], [3]]


@pytest.mark.parametrize("path, body", [
    ("chat/completions", {"messages": [{"role": "user", "content": QUESTION}]}),
    ("completions", {"prompt": QUESTION}),
    ("responses", {"input": QUESTION, "max_output_tokens": 2, "store": False}),
])
@pytest.mark.parametrize("stream", [False, True])
def test_fields_no_protocol_has_are_answered_and_named_in_a_header_and_the_log(tp1, path, body, stream):
    """A field neither vLLM's nor OpenAI's protocol has (a typo among them) changes nothing, and
    the answer says so: ``x-neuron-ignored`` lists them in the body's order, and the log line."""
    base = {"model": DEFAULT_MODEL, **body, "stream": stream, "temperature": 0}
    if path != "responses":
        base |= {"max_tokens": 2, "ignore_eos": True}
    plain = httpx.post(f"{tp1.base}/{path}", json=base, timeout=60)
    assert plain.status_code == 200, plain.text
    assert "x-neuron-ignored" not in plain.headers
    typo = httpx.post(f"{tp1.base}/{path}", json={**base, "max_token": 50, "frobnicate": {"deep": [1, {"x": 2}]}},
                      timeout=60)
    assert typo.status_code == 200, typo.text
    assert typo.headers["x-neuron-ignored"] == "max_token, frobnicate"
    if not stream:  # the typo had no effect: the same tokens (max_token would have allowed 50)
        tokens = [(out["usage"].get("completion_tokens", out["usage"].get("output_tokens")), answer_text(out))
                  for out in (typo.json(), plain.json())]
        assert tokens[0] == tokens[1] and tokens[0][0] <= 2, tokens
    rid = typo.headers["x-request-id"]
    deadline = time.monotonic() + 10
    while not (lines := [x for x in tp1.log().splitlines() if rid in x and "no effect on" in x]):
        assert time.monotonic() < deadline, f"no log line names the ignored fields of {rid}"
        time.sleep(0.1)
    assert "max_token, frobnicate" in lines[0], lines[0]
    # a name is the client's text: non-ASCII and control characters escaped, many names cut short
    odd = {"na\u00efve\u0004": 1, "\U0001f600": 2, "x" * 100: 0, **{f"k{i}": i for i in range(20)}}
    r = httpx.post(f"{tp1.base}/{path}", json={**base, **odd}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.headers["x-neuron-ignored"] == ("na\\u00efve\\u0004, \\ud83d\\ude00, " + "x" * 64 + ", "
                                             + ", ".join(f"k{i}" for i in range(13)) + ", and 7 more")


def answer_text(out: dict) -> str:
    if "output" in out:  # a response
        return "".join(part["text"] for item in out["output"] if item["type"] == "message" for part in item["content"])
    choice = out["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]
