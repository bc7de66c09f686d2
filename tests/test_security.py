"""API keys: every protected route refuses a missing or wrong key with 401, in constant time,
and the keys never show up in logs or error messages."""

from __future__ import annotations

import os
import re
import stat
import time

import httpx
import pytest

from conftest import DEFAULT_MODEL, SMALL, start_server

API_KEY = "sk-inference-7c1f0e"
ADMIN_KEY = "sk-admin-93b2aa"

CHAT = {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
INFERENCE_ROUTES = [("POST", "/v1/chat/completions", CHAT),
                    ("POST", "/v1/completions", {"model": DEFAULT_MODEL, "prompt": "Hi", "max_tokens": 2}),
                    ("GET", "/v1/models", None)]
ADMIN_ROUTES = [("GET", "/models", None), ("GET", "/metrics", None),
                ("POST", "/models/load", {"model": "/nonexistent/model"}),
                ("POST", "/models/unload", {"model": "nonexistent"})]


@pytest.fixture(scope="module")
def keyed(server_tmp):
    # The keys come from the environment, which also exercises NEURON_* overrides.
    server = start_server(server_tmp, config=SMALL, env={"NEURON_SERVER__API_KEY": API_KEY,
                                                          "NEURON_SERVER__ADMIN_API_KEY": ADMIN_KEY})
    yield server
    server.stop()


def call(server, method, path, body, key):
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return httpx.request(method, server.url + path, json=body, headers=headers, timeout=60)


@pytest.mark.parametrize("method,path,body", INFERENCE_ROUTES + ADMIN_ROUTES)
@pytest.mark.parametrize("key", [None, "wrong", API_KEY + "x", "Basic " + API_KEY])
def test_a_missing_or_wrong_key_gets_401_on_every_protected_route(keyed, method, path, body, key):
    r = call(keyed, method, path, body, key)
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize("method,path,body", ADMIN_ROUTES)
def test_the_inference_key_does_not_open_admin_routes(keyed, method, path, body):
    assert call(keyed, method, path, body, API_KEY).status_code == 401


def test_the_right_keys_open_their_routes_and_health_stays_open(keyed):
    for method, path, body in INFERENCE_ROUTES:
        assert call(keyed, method, path, body, API_KEY).status_code == 200, path
    assert call(keyed, "GET", "/models", None, ADMIN_KEY).status_code == 200
    assert call(keyed, "GET", "/metrics", None, ADMIN_KEY).status_code == 200
    assert call(keyed, "POST", "/models/load", {"model": "/nonexistent/model"}, ADMIN_KEY).status_code == 404
    assert httpx.get(f"{keyed.url}/health", timeout=10).status_code == 200


def test_keys_never_appear_in_logs(keyed):
    call(keyed, "GET", "/models", None, "wrong")
    log = keyed.log()
    assert API_KEY not in log and ADMIN_KEY not in log


def test_rank_sockets_live_in_a_private_directory(keyed):
    # The rank is forked by the zygote (its command line is the zygote's): the leader logs where
    # its ranks connect.
    endpoint = re.search(r"spawned 1 rank\(s\) of 1 here \(epoch \d+, pids \[\d+\], endpoint (\S+)\)",
                         keyed.log()).group(1)
    assert endpoint.startswith("ipc://")
    directory = os.path.dirname(endpoint[len("ipc://"):])
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700


def test_tcp_rank_endpoints_are_curve_encrypted_and_admit_only_the_leaders_ranks(server_tmp):
    import zmq

    import protocol as p

    # Each rank its own python (not forked), so that its command line and starting environment
    # are its own to read here: how the keys reach a rank is what this looks at.
    server = start_server(server_tmp, config=SMALL + '\n[runtime]\ntransport = "tcp"\n', env={"NEURON_RANK_FORKS": "0"})
    try:
        info = httpx.get(f"{server.url}/models", timeout=10).json()["models"][0]
        cmdline = open(f"/proc/{info['pids'][0]}/cmdline", "rb").read().split(b"\0")
        endpoint = cmdline[cmdline.index(b"--endpoint") + 1].decode()
        assert endpoint.startswith("tcp://127.0.0.1:")
        assert not any(b"CURVE" in arg for arg in cmdline)  # keys travel in the environment only
        start_env = dict(kv.split(b"=", 1) for kv in open(f"/proc/{info['pids'][0]}/environ", "rb").read().split(b"\0") if b"=" in kv)
        server_public = start_env[b"NEURON_CURVE_SERVER_KEY"]
        forged = p.encode(p.StepResult(id=10**9, epoch=info["epoch"], step_id=1, tokens=[0],
                                       timings=p.StepTimings(0.0, 0.0)))
        ctx = zmq.Context()
        intruders = []
        # Without keys; with the right server key but a client key the leader never minted.
        for keys in (None, zmq.curve_keypair()):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.IDENTITY, b"rank-7")  # a real rank-0 holds its own identity
            sock.setsockopt(zmq.LINGER, 0)
            if keys is not None:
                sock.curve_serverkey = server_public
                sock.curve_publickey, sock.curve_secretkey = keys
            sock.connect(endpoint)
            intruders.append(sock)
        time.sleep(1.0)
        for sock in intruders:
            for _ in range(5):
                try:
                    sock.send(forged, zmq.NOBLOCK)
                except zmq.Again:
                    pass
        time.sleep(1.0)
        for sock in intruders:
            sock.close(0)
        ctx.term()
        r = httpx.post(f"{server.base}/chat/completions", json=CHAT | {"max_tokens": 8, "temperature": 0}, timeout=60)
        assert r.status_code == 200
        after = httpx.get(f"{server.url}/models", timeout=10).json()["models"][0]
        # An admitted intruder's frames would reach the leader and be counted as dropped.
        assert after["dropped_frames"] == 0 and after["epoch"] == info["epoch"]
    finally:
        assert server.stop() == 0
