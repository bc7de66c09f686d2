"""Claude Code unchanged: the requests the real CLI sends (tests/fixtures/claude_code, recorded
from 2.1.332) replayed against a real server, each answered 200 in the stream Anthropic's SDK
reads; model aliases; the access log; context edits; ``max_tokens`` past the context; fields of
no effect named in ``x-neuron-ignored``; the base URL answering. The CLI itself runs in
scripts/try-claude-code."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from conftest import access_line, start_server

FIXTURES = Path(__file__).parent / "fixtures" / "claude_code"
KEY = "cc-test-key"
CONTEXT = 65536  # Claude Code's prompt is 20-30k tokens with its tools


@pytest.fixture(scope="module")
def cc(tmp_path_factory):
    """A tiny random qwen3 (a template that renders tools) answering to Claude's model names."""
    from chat_templates import HERMES_TOOLS, use_template
    from devtools.checkpoints import make_checkpoint

    tmp = tmp_path_factory.mktemp("cc")
    # two layers of two heads: a 30k-token prompt's attention takes seconds on two cores, not minutes
    model_dir = make_checkpoint("qwen3", tmp / "tiny-cc", seed=5, max_position_embeddings=CONTEXT,
                                num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)
    use_template(model_dir, HERMES_TOOLS)
    server = start_server(tmp, config=f'[[models]]\nmodel = "{model_dir}"\nid = "tiny-cc"\n'
                                      f'aliases = ["claude-sonnet-4-5", "claude-*"]\nmax_model_len = {CONTEXT}\n'
                                      f'max_slots = 2\n[engine]\nprefill_chunk = 1024\n'
                                      f'[server]\napi_key = "{KEY}"\n')
    yield server
    server.stop()


def post(server, body: dict, headers: dict | None = None, path: str = "/v1/messages") -> httpx.Response:
    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01", **(headers or {})}
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=300)


def events(r: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]


@pytest.mark.parametrize("name", sorted(p.stem for p in FIXTURES.glob("*.json")))
def test_the_requests_claude_code_sends_are_answered(cc, name):
    rec = json.loads((FIXTURES / f"{name}.json").read_text())
    # As recorded, but for max_tokens (128,000: a random model would write to the context's end;
    # test_max_tokens_past_the_context_runs_to_its_end covers that)
    body = {**rec["body"], "max_tokens": 16}
    r = post(cc, body, rec["headers"], f"{rec['path']}?{rec['query']}" if rec["query"] else rec["path"])
    assert r.status_code == 200, r.text[:2000]
    assert r.headers["content-type"].startswith("text/event-stream")
    evs = events(r)
    kinds = [e["type"] for e in evs]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds, kinds
    assert evs[0]["message"]["model"] == body["model"]  # the name asked for: an alias of tiny-cc
    last = next(e for e in evs if e["type"] == "message_delta")
    assert last["delta"]["stop_reason"] in ("end_turn", "tool_use", "model_context_window_exceeded", "max_tokens")
    if body.get("context_management"):
        assert last["context_management"] == {"applied_edits": []}  # keep: "all", nothing to clear
    # this model thinks (its template has the markers): thinking and effort take effect
    ignored = set(filter(None, (r.headers.get("x-neuron-ignored") or "").split(", ")))
    assert ignored == ({"safeguards"} if body.get("safeguards") else set()), ignored
    # the SDK's own model of the message reads what the stream built
    from anthropic.types import Message

    message = dict(evs[0]["message"])
    blocks = {}
    for e in evs:
        if e["type"] == "content_block_start":
            blocks[e["index"]] = dict(e["content_block"])
        elif e["type"] == "content_block_delta" and e["delta"]["type"] == "text_delta":
            blocks[e["index"]]["text"] += e["delta"]["text"]
    message.update(content=[blocks[i] for i in sorted(blocks)], stop_reason=last["delta"]["stop_reason"])
    Message.model_validate(message)


def test_the_base_url_answers(cc):
    for path in ("/", "/api/hello"):  # the second: Claude Code's probe
        assert httpx.get(f"{cc.url}{path}", timeout=10).status_code == 200
        assert httpx.head(f"{cc.url}{path}", timeout=10).status_code == 200


def test_aliases_exact_and_glob_answer_with_the_name_asked(cc):
    for name in ("claude-sonnet-4-5", "claude-haiku-4-5-20251001", "tiny-cc"):
        r = post(cc, {"model": name, "max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code == 200 and r.json()["model"] == name, r.text
    r = post(cc, {"model": "gpt-4o", "max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 404
    chat = httpx.post(f"{cc.url}/v1/chat/completions", headers={"authorization": f"Bearer {KEY}"}, timeout=60,
                      json={"model": "claude-opus-4-8", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]})
    assert chat.status_code == 200 and chat.json()["model"] == "claude-opus-4-8"
    listed = httpx.get(f"{cc.url}/v1/models", headers={"authorization": f"Bearer {KEY}"}, timeout=10).json()["data"]
    assert {(m["id"], m.get("root")) for m in listed} == {("tiny-cc", None), ("claude-sonnet-4-5", "tiny-cc")}
    clash = httpx.post(f"{cc.url}/models/load", headers={"authorization": f"Bearer {KEY}"}, timeout=60,
                       json={"model": "SmolLM2-135M-Instruct", "aliases": ["claude-opus-4-8"]})
    assert clash.status_code == 409 and clash.json()["error"]["code"] == "model_name_taken", clash.text


def test_the_access_log_has_a_line_for_each_request_and_why_it_failed(cc):
    rid = "access-log-probe"
    ok = post(cc, {"model": "tiny-cc", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]},
              {"x-request-id": rid + "-200"})
    bad = post(cc, {"model": "tiny-cc", "max_tokens": 0, "messages": [{"role": "user", "content": "Hi"}]},
               {"x-request-id": rid + "-400"})
    missing = post(cc, {"model": "nope", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]},
                   {"x-request-id": rid + "-404"})
    anon = httpx.post(f"{cc.url}/v1/messages", json={"model": "tiny-cc", "max_tokens": 2, "messages": []},
                      headers={"x-request-id": rid + "-401"}, timeout=30)
    assert (ok.status_code, bad.status_code, missing.status_code, anon.status_code) == (200, 400, 404, 401)
    lines = {status: access_line(cc, f"{rid}-{status}") for status in ("200", "400", "404", "401")}
    assert "POST /v1/messages 200" in lines["200"] and "error=" not in lines["200"]
    assert "max_tokens" in lines["400"] and "'nope'" in lines["404"] and "error=" in lines["401"]


def test_context_edits_clear_old_thinking_and_tool_results(cc):
    call = {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"file_path": "a.txt"}}
    messages = [
        {"role": "user", "content": "Read a.txt"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "I should read it. " * 20,
                                           "signature": "x"}, call]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "alpha " * 300}]},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "Now b.", "signature": "x"},
                                          {**call, "id": "toolu_2", "input": {"file_path": "b.txt"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_2", "content": "beta"}]},
    ]
    tools = [{"name": "Read", "description": "Read a file",
              "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}}}}]
    base = {"model": "tiny-cc", "max_tokens": 2, "messages": messages, "tools": tools}
    count = post(cc, {k: v for k, v in base.items() if k != "max_tokens"}, path="/v1/messages/count_tokens")
    edits = [{"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 1}},
             {"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": 100},
              "keep": {"type": "tool_uses", "value": 1}, "clear_tool_inputs": True}]
    r = post(cc, {**base, "context_management": {"edits": edits}})
    assert r.status_code == 200, r.text
    applied = r.json()["context_management"]["applied_edits"]
    assert [e["type"] for e in applied] == ["clear_thinking_20251015", "clear_tool_uses_20250919"]
    assert applied[0]["cleared_thinking_turns"] == 1 and applied[0]["cleared_input_tokens"] > 20
    assert applied[1]["cleared_tool_uses"] == 1 and applied[1]["cleared_input_tokens"] > 200
    edited = post(cc, {k: v for k, v in base.items() if k != "max_tokens"} | {"context_management": {"edits": edits}},
                  path="/v1/messages/count_tokens")
    assert edited.json()["input_tokens"] < count.json()["input_tokens"] - 200
    excluded = [{**edits[1], "exclude_tools": ["Read"]}]
    r = post(cc, {**base, "context_management": {"edits": excluded}})
    assert r.json()["context_management"]["applied_edits"] == []
    at_least = [{**edits[1], "clear_at_least": {"type": "input_tokens", "value": 100000}}]
    assert post(cc, {**base, "context_management": {"edits": at_least}}).json()["context_management"] == \
        {"applied_edits": []}


def test_max_tokens_past_the_context_runs_to_its_end(tmp_path):
    """Anthropic's rule: the room that is left; at the context's end, model_context_window_exceeded;
    a prompt with no room is 'prompt is too long'."""
    from devtools.checkpoints import make_checkpoint

    model_dir = make_checkpoint("qwen3", tmp_path / "short", seed=5, max_position_embeddings=256)
    server = start_server(tmp_path, config=f'[[models]]\nmodel = "{model_dir}"\nid = "short"\nmax_model_len = 128\n'
                                           'max_slots = 2\n')
    try:
        words = " ".join(["the cat sat on the mat"] * 12)
        count = httpx.post(f"{server.url}/v1/messages/count_tokens", timeout=30,
                           json={"model": "short", "messages": [{"role": "user", "content": words}]}).json()
        room = 128 - count["input_tokens"]
        assert 0 < room < 100, count
        r = httpx.post(f"{server.url}/v1/messages", timeout=120, json={
            "model": "short", "max_tokens": 32000, "messages": [{"role": "user", "content": words}],
            "stop_sequences": []})
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["usage"]["output_tokens"] <= room
        assert out["stop_reason"] in ("model_context_window_exceeded", "end_turn")
        if out["stop_reason"] == "model_context_window_exceeded":
            assert out["usage"]["output_tokens"] == room
        small = httpx.post(f"{server.url}/v1/messages", timeout=120, json={
            "model": "short", "max_tokens": 1, "messages": [{"role": "user", "content": words}]}).json()
        assert small["stop_reason"] in ("max_tokens", "end_turn")  # its own max_tokens, not the context's end
        long = httpx.post(f"{server.url}/v1/messages", timeout=30, json={
            "model": "short", "max_tokens": 10, "messages": [{"role": "user", "content": words * 3}]})
        assert long.status_code == 400
        err = long.json()["error"]
        assert err["type"] == "invalid_request_error" and err["message"].startswith("messages: prompt is too long: ")
        assert err["message"].endswith("tokens > 127 maximum")
    finally:
        server.stop()
