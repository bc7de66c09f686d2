"""Chat templates are programs, and whoever writes one (a request, when the operator allows it, or
a model's files) must not be able to hang the daemon, eat its memory or stop it from stopping.
Each attack of the report that found it, against a real server: a 4xx within 10 s, other users
served within a stated bound meanwhile, /health honest, memory back, SIGTERM on time."""

from __future__ import annotations

import shutil
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from conftest import DEFAULT_MODEL, OPS_ADMIN_KEY, OPS_API_KEY, ops_headers, start_server

LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
HUGE = "{% set s = 'x' * 300000000 %}{{ s }}"
DOUBLING = ("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"
            "{{ ns.s }}")
OTHERS_WITHIN_S = 8.0  # an honest request's answer while looping templates run (it takes ~0.3 s alone)
HEADERS = {"Authorization": f"Bearer {OPS_API_KEY}"}
ADMIN = {"Authorization": f"Bearer {OPS_ADMIN_KEY}"}


def _config(root: Path, extra: str = "", render_s: float = 1.0) -> str:
    return f"""
[[models]]
model = "{DEFAULT_MODEL}"
max_model_len = 1024
max_slots = 4

[server]
api_key = "{OPS_API_KEY}"
admin_api_key = "{OPS_ADMIN_KEY}"
model_roots = ["{root}"]
allow_request_chat_template = true

[templates]
render_timeout_s = {render_s}
render_memory_bytes = 536870912
{extra}
"""


@pytest.fixture(scope="module")
def root(tmp_path_factory, tiny_checkpoint) -> Path:
    root = tmp_path_factory.mktemp("template-root")
    for name, template in (("loops", LOOP), ("loops-on-spin", "{% if messages[-1]['content'] == 'spin' %}" + LOOP
                                             + "{% endif %}{{ messages[-1]['content'] }}")):
        shutil.copytree(tiny_checkpoint, root / name)
        (root / name / "chat_template.jinja").write_text(template)
    return root


@pytest.fixture(scope="module")
def server(server_tmp, root):
    s = start_server(server_tmp, config=_config(root))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def patient(server_tmp, root):
    """Templates may render for 30 s: a template that grows its memory meets the memory limit
    first, however busy the machine (at 1 s a busy 2-core machine met the time limit first)."""
    s = start_server(server_tmp, config=_config(root, render_s=30.0))
    yield s
    s.stop()


def chat(server, content: str, template: str | None = None, model: str = DEFAULT_MODEL,
         timeout: float = 60) -> tuple[httpx.Response, float]:
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 2, "temperature": 0}
    if template is not None:
        body["chat_template"] = template
    t0 = time.monotonic()
    r = httpx.post(f"{server.base}/chat/completions", json=body, headers=HEADERS, timeout=timeout)
    return r, time.monotonic() - t0


def rss_mb(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            total += int(next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                              if line.startswith("VmRSS:")).split()[1])
        except (OSError, StopIteration):
            pass
    return total / 1024


def leader_side(server) -> list[int]:
    """The leader and its worker processes (not its ranks)."""
    from conftest import children_of

    ranks = set(server.rank_pids())
    return [server.proc.pid, *(p for p in children_of(server.proc.pid) if p not in ranks)]


def test_a_request_template_is_refused_by_name_unless_the_operator_allows_it(ops):
    body = {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
            "chat_template": "{{ messages[0]['content'] }}"}
    r = httpx.post(f"{ops.base}/chat/completions", json=body, headers=ops_headers(), timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "chat_template" and "allow_request_chat_template" in err["message"]


def test_looping_request_templates_are_stopped_and_never_hold_up_other_users(server):
    with ThreadPoolExecutor(7) as pool:
        loops = [pool.submit(chat, server, "hi", LOOP) for _ in range(7)]
        time.sleep(0.5)  # the loops are rendering
        honest = []
        for content in ("What is the capital of France?", "Name a colour."):
            honest.append(chat(server, content))
            t0 = time.monotonic()
            tk = httpx.post(f"{server.url}/tokenize", headers=HEADERS, timeout=60,
                            json={"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": content}]})
            honest.append((tk, time.monotonic() - t0))
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
        stopped = [f.result() for f in loops]
    for r, took in honest:
        assert r.status_code == 200 and took < OTHERS_WITHIN_S, (r.status_code, took, r.text[:200])
    for r, took in stopped:
        assert r.status_code == 400 and took < 10, (r.status_code, took, r.text[:300])
        err = r.json()["error"]
        assert err["param"] == "chat_template" and "took over 1s to render" in err["message"]
    assert chat(server, "Hello")[0].status_code == 200
    assert "Traceback" not in server.log()


@pytest.mark.parametrize("template,words", [(HUGE, "made a value of 300000000"), (DOUBLING, "memory")])
def test_a_template_asking_for_gigabytes_is_a_400_and_leaves_the_memory_as_it_was(patient, template, words):
    server = patient
    chat(server, "warm up")
    before = rss_mb(leader_side(server))
    r, took = chat(server, "hi", template)
    assert r.status_code == 400 and took < 10, (took, r.text[:300])
    assert words in r.json()["error"]["message"], r.text
    time.sleep(0.5)  # a worker left large is replaced as its job ends
    assert rss_mb(leader_side(server)) < before + 100, (before, rss_mb(leader_side(server)))


def test_a_model_whose_own_template_loops_is_refused_at_load(server, root):
    t0 = time.monotonic()
    r = httpx.post(f"{server.url}/models/load", headers=ADMIN, json={"model": str(root / "loops")}, timeout=60)
    assert r.status_code == 422 and time.monotonic() - t0 < 10, r.text
    assert r.json()["error"]["code"] == "invalid_model_config" and "chat template took over" in r.text


def test_a_model_template_that_loops_on_one_input_costs_that_request_only(server, root):
    from conftest import children_of

    r = httpx.post(f"{server.url}/models/load", headers=ADMIN, timeout=120,
                   json={"model": str(root / "loops-on-spin"), "id": "spinner"})
    assert r.status_code == 200, r.text
    try:
        spun, took = chat(server, "spin", model="spinner")
        assert spun.status_code == 400 and took < 10, spun.text
        assert "the model's chat template took over" in spun.json()["error"]["message"]
        assert chat(server, "fine", model="spinner")[0].status_code == 200
        assert chat(server, "Hello")[0].status_code == 200
    finally:
        httpx.post(f"{server.url}/models/unload", headers=ADMIN, json={"model": "spinner"}, timeout=120)
    # Nothing keeps burning a core: the leader's workers are idle once the loop was stopped.
    workers = [p for p in children_of(server.proc.pid) if p not in server.rank_pids()]

    def cpu(pids):
        total = 0
        for pid in pids:
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                total += int(fields[11]) + int(fields[12])
            except (OSError, IndexError):
                pass
        return total

    first = cpu(workers)
    time.sleep(1.0)
    assert cpu(workers) - first < 20, "a worker kept spinning"  # clock ticks (1/100 s) in one second


def test_sigterm_during_a_looping_render_exits_within_the_drain_deadline(server_tmp, root):
    config = _config(root).replace("render_timeout_s = 1.0", "render_timeout_s = 60.0").replace(
        "allow_request_chat_template = true", "allow_request_chat_template = true\ndrain_timeout_s = 3.0")
    s = start_server(server_tmp, config=config)
    try:
        looping = threading.Thread(target=lambda: chat(s, "hi", LOOP, timeout=120), daemon=True)
        looping.start()
        time.sleep(1.0)
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        code = s.proc.wait(30)
        took = time.monotonic() - t0
        assert code == 0 and took < 3.0 + 5.0, (code, took, s.log()[-2000:])
    finally:
        s.stop()
