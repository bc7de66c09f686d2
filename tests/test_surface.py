"""The operator's HTTP surface on a live server: /tokenize and /detokenize, /openapi.json against
the bodies the tests send, x-request-id on every answer and in the log lines, and CORS (on for
one origin in the ops server, off by default in tp1)."""

from __future__ import annotations

import httpx
import jsonschema
import openai
import pytest

from conftest import DEFAULT_MODEL, OPS_ADMIN_KEY, OPS_API_KEY, json_log, ops_headers
from neuron.server.request_id import MAX_LEN, sanitise

CONVERSATION = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "What is the capital of France?"}]


def post(server, path: str, body, *, admin: bool = False, headers: dict | None = None) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers={**ops_headers(admin), **(headers or {})}, timeout=120)


# ------------------------------------------------------------------------------------- tokenize
def test_tokenize_counts_a_conversation_exactly_as_its_chat_completion_counts_the_prompt(ops):
    r = post(ops, "/tokenize", {"model": DEFAULT_MODEL, "messages": CONVERSATION})
    assert r.status_code == 200, r.text
    tok = r.json()
    assert set(tok) == {"count", "max_model_len", "tokens"}
    assert tok["count"] == len(tok["tokens"]) > 10 and tok["max_model_len"] == 1024
    client = openai.OpenAI(base_url=ops.base, api_key=OPS_API_KEY, max_retries=0, timeout=120)
    out = client.chat.completions.create(model=DEFAULT_MODEL, messages=CONVERSATION, max_tokens=2)
    assert out.usage.prompt_tokens == tok["count"]
    bare = post(ops, "/tokenize", {"model": DEFAULT_MODEL, "messages": CONVERSATION,
                                   "add_generation_prompt": False}).json()
    assert bare["tokens"] == tok["tokens"][:bare["count"]] and bare["count"] < tok["count"]


def test_tokenize_a_prompt_with_token_strings_and_detokenize_it_back(ops):
    text = "The capital of France is"
    tok = post(ops, "/tokenize", {"prompt": text, "return_token_strs": True}).json()  # model: the only one
    assert len(tok["token_strs"]) == tok["count"] == len(tok["tokens"])
    assert "".join(tok["token_strs"]).replace("Ġ", " ") == text
    client = openai.OpenAI(base_url=ops.base, api_key=OPS_API_KEY, max_retries=0, timeout=120)
    out = client.completions.create(model=DEFAULT_MODEL, prompt=text, max_tokens=1)
    assert out.usage.prompt_tokens == tok["count"]
    back = post(ops, "/detokenize", {"model": DEFAULT_MODEL, "tokens": tok["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": text}


@pytest.mark.parametrize("path,body,status,param", [
    ("/tokenize", {"model": DEFAULT_MODEL, "prompt": "a", "messages": CONVERSATION}, 400, "prompt"),
    ("/tokenize", {"model": DEFAULT_MODEL}, 400, "prompt"),
    ("/tokenize", {"model": DEFAULT_MODEL, "messages": []}, 400, "messages"),
    ("/tokenize", {"model": DEFAULT_MODEL, "messages": CONVERSATION, "continue_final_message": True}, 400,
     "continue_final_message"),
    ("/tokenize", {"model": "no-such-model", "prompt": "a"}, 404, "model"),
    ("/detokenize", {"model": DEFAULT_MODEL, "tokens": [1, 10**9]}, 400, "tokens"),
    ("/detokenize", {"model": DEFAULT_MODEL, "tokens": "abc"}, 400, "tokens"),
])
def test_tokenize_and_detokenize_refusals_name_the_field(ops, path, body, status, param):
    r = post(ops, path, body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


def test_tokenize_needs_the_inference_key_when_one_is_set(ops):
    r = httpx.post(f"{ops.url}/tokenize", json={"prompt": "a"}, timeout=10)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


# ------------------------------------------------------------------------------------- openapi
# Bodies other tests send, and bodies of the same kinds, for every route that takes one.
SENT = {
    "/v1/chat/completions": [
        {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
        {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "Hi"}], "temperature": 0, "stream": True,
         "stream_options": {"include_usage": True}, "logprobs": True, "top_logprobs": 3, "seed": 1234,
         "stop": ["Paris"], "ignore_eos": True, "return_token_ids": True, "max_completion_tokens": 4},
        {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]},
                                             {"role": "assistant", "content": None}],
         "chat_template_kwargs": {"enable_thinking": False}, "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1},
    ],
    "/v1/completions": [
        {"model": DEFAULT_MODEL, "prompt": "Hi", "max_tokens": 2},
        {"model": DEFAULT_MODEL, "prompt": [1, 2, 3], "temperature": 0, "max_tokens": 32, "ignore_eos": True,
         "return_token_ids": True, "logprobs": 2},
    ],
    "/tokenize": [{"model": DEFAULT_MODEL, "messages": CONVERSATION}, {"prompt": "a", "return_token_strs": True},
                  {"model": DEFAULT_MODEL, "messages": CONVERSATION, "add_generation_prompt": False,
                   "add_special_tokens": True, "chat_template_kwargs": {}}],
    "/detokenize": [{"model": DEFAULT_MODEL, "tokens": [1, 2]}],
    "/v1/messages": [{"model": DEFAULT_MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}],
                      "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
                      "thinking": {"type": "disabled"}, "stream": True, "metadata": {"user_id": "u"}}],
    "/v1/messages/count_tokens": [{"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "Hi"}]}],
    "/models/load": [{"model": "/nonexistent/model"},
                     {"model": DEFAULT_MODEL, "tensor_parallel": 2, "max_model_len": 128, "max_slots": 2},
                     {"model": "tiny-llama", "id": "x", "dtype": "float32", "device": "cpu", "devices": [0]}],
    "/models/unload": [{"model": DEFAULT_MODEL}],
    "/debug/fault": [{"model": DEFAULT_MODEL, "rank": 0, "kind": "oom"}],
}
# Bodies the server refuses for their shape, with a 400 before anything runs.
MALFORMED = {
    "/v1/chat/completions": [{"messages": [{"role": "user", "content": "Hi"}]},
                             {"model": DEFAULT_MODEL, "messages": "Hi"},
                             {"model": DEFAULT_MODEL, "messages": [], "max_tokens": "5"}],
    "/v1/completions": [{"model": 7, "prompt": "Hi"}, {"model": DEFAULT_MODEL, "prompt": {"a": 1}}],
    "/tokenize": [{"prompt": 5}],
    "/detokenize": [{"tokens": ["a"]}],
    "/v1/messages": [{"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "Hi"}]},
                     {"model": DEFAULT_MODEL, "max_tokens": 4, "messages": [], "max_token": 4}],
    "/models/load": [{"model": DEFAULT_MODEL, "tensor_parallell": 2}, {"model": DEFAULT_MODEL, "devices": "0"}],
    "/models/unload": [{}],
}


@pytest.fixture(scope="module")
def spec(ops) -> dict:
    r = httpx.get(f"{ops.url}/openapi.json", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    return r.json()


def body_validator(spec: dict, path: str) -> jsonschema.Validator:
    schema = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    return jsonschema.Draft202012Validator({**schema, "components": spec["components"]})


def test_openapi_documents_exactly_the_routes_the_app_serves(ops, spec):
    import asyncio

    from starlette.routing import Route

    from neuron.config import Config
    from neuron.server.app import create_app

    app = create_app(Config(models=[]))
    try:
        served = {(m.lower(), r.path) for r in app.routes if isinstance(r, Route) for m in r.methods if m != "HEAD"}
    finally:
        asyncio.run(app.state.neuron.engine_client.shutdown())
    documented = {(m, p) for p, item in spec["paths"].items() for m in item}
    assert documented == served
    assert {"/tokenize", "/detokenize", "/openapi.json", "/v1/chat/completions", "/models/load"} <= set(spec["paths"])
    for method, path in documented:  # and the live server answers each, not its router's 404 / 405
        r = httpx.request(method, ops.url + path, json={} if method == "post" else None,
                          headers=ops_headers(admin=True), timeout=30)
        assert r.status_code != 405 and not (r.status_code == 404 and r.json()["error"]["message"] == "Not Found"), \
            (method, path, r.text)
    assert spec["openapi"].startswith("3.1")
    assert spec["paths"]["/models/load"]["post"]["security"] == [{"admin": []}]
    assert spec["paths"]["/v1/models"]["get"]["security"] == [{"api": []}, {"api_key": []}]
    assert "security" not in spec["paths"]["/health"]["get"]


def test_openapi_accepts_the_bodies_the_tests_send(spec):
    for path, bodies in SENT.items():
        validator = body_validator(spec, path)
        for body in bodies:
            errors = [e.message for e in validator.iter_errors(body)]
            assert errors == [], (path, body, errors)


def test_openapi_refuses_what_the_server_refuses_for_its_shape(ops, spec):
    for path, bodies in MALFORMED.items():
        validator = body_validator(spec, path)
        for body in bodies:
            assert not validator.is_valid(body), (path, body)
            r = post(ops, path, body, admin=path.startswith("/models"))
            assert r.status_code == 400, (path, body, r.text)


# --------------------------------------------------------------------------------- x-request-id
def test_the_request_id_is_echoed_on_answers_and_errors_of_every_kind(ops):
    rid = {"x-request-id": "client-7f3a.b:9"}
    chat = {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    answers = [
        post(ops, "/v1/chat/completions", chat, headers=rid),  # 200
        post(ops, "/v1/chat/completions", chat | {"temperature": "hot"}, headers=rid),  # 400
        httpx.post(f"{ops.url}/v1/chat/completions", json=chat, headers=rid, timeout=30),  # 401
        httpx.get(f"{ops.url}/nowhere", headers=rid, timeout=10),  # 404
        httpx.get(f"{ops.url}/v1/chat/completions", headers=rid, timeout=10),  # 405
        post(ops, "/v1/chat/completions", chat | {"model": "absent"}, headers=rid),  # 404 model_not_found
        httpx.get(f"{ops.url}/health", headers=rid, timeout=10),
        httpx.get(f"{ops.url}/openapi.json", headers=rid, timeout=10),
    ]
    assert [r.status_code for r in answers] == [200, 400, 401, 404, 405, 404, 200, 200]
    assert all(r.headers["x-request-id"] == "client-7f3a.b:9" for r in answers)
    with httpx.stream("POST", f"{ops.base}/chat/completions", json=chat | {"stream": True},
                      headers={**ops_headers(), **rid}, timeout=60) as r:
        assert r.headers["x-request-id"] == "client-7f3a.b:9"
        assert [line for line in r.iter_lines() if line][-1] == "data: [DONE]"


def test_a_request_id_is_made_when_absent_and_sanitised_and_bounded_when_given(ops):
    made = [httpx.get(f"{ops.url}/health", timeout=10).headers["x-request-id"] for _ in range(2)]
    assert made[0] != made[1] and all(len(m) == 32 and int(m, 16) >= 0 for m in made)
    dirty = httpx.get(f"{ops.url}/health", headers={"x-request-id": 'a b"<c>\\d;e' + "x" * 300}, timeout=10)
    assert dirty.headers["x-request-id"] == ("abcde" + "x" * 300)[:MAX_LEN]
    assert sanitise("\x00\x01 ") != "" and sanitise("ok-1") == "ok-1"


def test_the_request_id_names_the_request_in_its_start_and_finish_log_lines(ops):
    rid = "trace-me-42"
    chat = {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
            "ignore_eos": True}
    usage = post(ops, "/v1/chat/completions", chat, headers={"x-request-id": rid}).json()["usage"]
    lines = [line for line in json_log(ops) if line.get("request_id") == rid and line["logger"] == "neuron.request"]
    start, finish = lines
    assert start["msg"] == "request started" and finish["msg"] == "request finished"
    assert start["model"] == finish["model"] == DEFAULT_MODEL
    assert start["prompt_tokens"] == finish["prompt_tokens"] == usage["prompt_tokens"]
    assert finish["completion_tokens"] == 3 and finish["finish_reason"] == "length"
    assert 0 <= finish["queue_s"] <= finish["ttft_s"] <= finish["duration_s"]
    # The process that served HTTP: the leader, or an API process beside an engine core
    assert all(line["level"] == "info" and (line["process"] == "leader" or line["process"].startswith("api-"))
               for line in lines)


# ------------------------------------------------------------------------------------------ CORS
PREFLIGHT = {"Origin": "http://app.example", "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}


def test_a_browser_preflight_from_the_configured_origin_is_allowed(ops):
    r = httpx.options(f"{ops.base}/chat/completions", headers=PREFLIGHT, timeout=10)
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "http://app.example"
    assert "POST" in r.headers["access-control-allow-methods"]
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    real = httpx.get(f"{ops.base}/models", headers={"Origin": "http://app.example", **ops_headers()}, timeout=10)
    assert real.headers["access-control-allow-origin"] == "http://app.example"
    assert "x-request-id" in real.headers["access-control-expose-headers"].lower()


def test_a_preflight_from_another_origin_gets_no_cors_headers(ops):
    r = httpx.options(f"{ops.base}/chat/completions", headers=PREFLIGHT | {"Origin": "http://evil.example"},
                      timeout=10)
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers


def test_cors_is_off_by_default_and_a_preflight_is_refused_without_cors_headers(tp1):
    r = httpx.options(f"{tp1.base}/chat/completions", headers=PREFLIGHT, timeout=10)
    assert r.status_code == 405
    assert not [h for h in r.headers if h.lower().startswith("access-control-")]
    real = httpx.get(f"{tp1.base}/models", headers={"Origin": "http://app.example"}, timeout=10)
    assert real.status_code == 200 and "access-control-allow-origin" not in real.headers


def test_the_admin_key_is_not_in_the_json_logs(ops):
    log = ops.log()
    assert OPS_API_KEY not in log and OPS_ADMIN_KEY not in log
