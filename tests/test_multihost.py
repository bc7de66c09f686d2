"""One model across hosts: network namespaces joined by veth pairs stand for the hosts (this
namespace is the head's). TP=2 over two hosts answers as TP=2 on one; a node with another key is
refused and reaches nothing; a cut link fails the group within its deadline and the group
serves again once it is mended; a killed head leaves no rank alive; a node with other files is
named when the load is refused. The settings' precedence and the key file run everywhere."""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from conftest import (DEFAULT_MODEL, ROOT, SMALL, alive, concurrent_greedy_ids, free_port, greedy_ids,
                      rank_processes, start_server)
from devtools import netns

PROMPTS = ["What is the capital of France?", "Write a haiku about rain.", "List three fruits.",
           "Explain gravity in one sentence."]
DEADLINE_S = 3.0
CLUSTER_CONF = SMALL + f"""
[timeouts]
heartbeat_timeout_s = {DEADLINE_S}

[cluster]
join_timeout_s = 90
"""


def greedy(server, prompt: str) -> list[int]:
    return greedy_ids(server, prompt, 24)


def eight_at_once(server) -> list[list[int]]:
    return concurrent_greedy_ids(server, [PROMPTS[i % len(PROMPTS)] for i in range(8)], 24)


# ------------------------------------------------------------------------------------ settings
def test_keygen_writes_private_keys_of_the_head_and_the_nodes_and_never_overwrites(tmp_path):
    key, node_key = tmp_path / "group.key", tmp_path / "group.node.key"
    cmd = [sys.executable, "-m", "neuron.cli", "keygen", str(key)]
    first = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    assert stat.S_IMODE(key.stat().st_mode) == 0o600 and stat.S_IMODE(node_key.stat().st_mode) == 0o600
    text = key.read_text()
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert again.returncode == 1 and "not overwritten" in again.stderr and key.read_text() == text

    from neuron.cluster.keys import GroupKeyError, read_key

    k = read_key(key, head=True)
    assert len({k.server_public, k.server_secret, k.client_public, k.client_secret}) == 4
    # The nodes' file joins the group (the same client pair, the head's public key) but holds no
    # server secret, so no node can pose as the head.
    n = read_key(node_key, head=False)
    assert n.client == k.client and n.server_secret == b"" and k.server_secret.decode() not in node_key.read_text()
    with pytest.raises(GroupKeyError, match="node's group key"):
        read_key(node_key, head=True)
    with pytest.raises(GroupKeyError, match="node's group key"):
        n.server
    bad = tmp_path / "bad.key"
    bad.write_text('server_public = "short"\n')
    bad.chmod(0o600)
    with pytest.raises(GroupKeyError, match="server_public"):
        read_key(bad, head=False)


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660, 0o644])
def test_a_key_file_open_to_others_is_refused_by_the_head_and_the_nodes(tmp_path, mode):
    from neuron.cluster.keys import GroupKeyError, node_key_path, read_key, write_key

    head, node = write_key(tmp_path / "group.key")
    assert node == node_key_path(head)
    for path, is_head in ((head, True), (node, False)):
        path.chmod(mode)
        with pytest.raises(GroupKeyError, match=f"open to others \\(mode {mode:o}\\).*chmod 600"):
            read_key(path, head=is_head)
    if mode != 0o640:
        return
    conf = tmp_path / "n.toml"
    conf.write_text("")
    for rank, path in ((0, head), (1, node)):
        out = subprocess.run([sys.executable, "-m", "neuron.cli", "serve", "--config", str(conf), "--nnodes", "2",
                              "--tensor-parallel", "2", "--node-rank", str(rank), "--master-addr", "127.0.0.1",
                              "--group-key", str(path)], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and "open to others" in out.stderr, out.stderr[-2000:]


def test_cluster_settings_come_from_flags_over_torchrun_variables_over_the_file(tmp_path):
    from neuron.cli import build_parser
    from neuron.config import ConfigError, load_config
    from neuron.serve import apply_flags

    conf = tmp_path / "n.toml"
    conf.write_text('[[models]]\ntensor_parallel = 4\n[cluster]\nnnodes = 2\nmaster_addr = "10.0.0.9"\n'
                    'group_key = "/k"\nmaster_port = 1234\n')
    env = {"NODE_RANK": "1", "MASTER_PORT": "2345"}
    cfg = load_config(conf, env=env)
    assert (cfg.cluster.nnodes, cfg.cluster.node_rank, cfg.cluster.master_addr, cfg.cluster.master_port) == \
        (2, 1, "10.0.0.9", 2345)
    args = build_parser().parse_args(["serve", "--master-addr", "10.0.0.7", "--node-rank", "0"])
    cfg = apply_flags(cfg, args)
    assert (cfg.cluster.node_rank, cfg.cluster.master_addr, cfg.cluster.master_port) == (0, "10.0.0.7", 2345)
    with pytest.raises(ConfigError, match="3 ranks do not split over 2 nodes"):
        load_config(conf, env={"NNODES": "2", "NEURON_MODELS__0__TENSOR_PARALLEL": "3"})
    with pytest.raises(ConfigError, match="group_key"):
        load_config(None, env={"NNODES": "2", "MASTER_ADDR": "10.0.0.1"})
    with pytest.raises(ConfigError, match="node_rank"):
        load_config(None, env={"NNODES": "2", "NODE_RANK": "2"})


def test_the_heads_directory_drops_oversized_and_malformed_frames_and_takes_a_hello(tmp_path):
    """A node's socket (with the key) sending a 2 MiB frame, then garbage, then a hello: the head
    keeps serving its socket and takes only the hello."""
    import asyncio

    import zmq.asyncio

    from neuron.cluster.fingerprint import VERSION
    from neuron.cluster.head import ClusterHead, node_identity
    from neuron.cluster.keys import read_key, write_key
    from neuron.config import ClusterConfig
    from neuron.leader_sockets import CurveGate
    from protocol import cluster as c

    async def run() -> tuple[list[int], list[int], list[int]]:
        key = read_key(write_key(tmp_path / "k")[0], head=True)
        ctx = zmq.asyncio.Context()
        gate = CurveGate(ctx)
        gate.allow(key.client_public)
        port = free_port()
        head = ClusterHead(ClusterConfig(nnodes=2, master_addr="127.0.0.1", master_port=port, group_key="k"),
                           key, ctx, deadline_s=3.0)
        node = ctx.socket(zmq.DEALER)
        node.setsockopt(zmq.IDENTITY, node_identity(1))
        node.curve_serverkey, node.curve_publickey, node.curve_secretkey = key.client
        node.connect(f"tcp://127.0.0.1:{port}")
        try:
            await node.send(b"x" * (2 << 20))
            await asyncio.sleep(0.5)
            after_big = list(head.nodes)
            await node.send(b"\xc1garbage")
            await asyncio.sleep(0.3)
            after_garbage = list(head.nodes)
            await node.send(c.encode(c.NodeHello(node_rank=1, version=VERSION, local_ranks=1)))
            for _ in range(50):
                if head.nodes:
                    break
                await asyncio.sleep(0.1)
            return after_big, after_garbage, list(head.nodes)
        finally:
            node.close(0)
            head.close()
            gate.stop()
            ctx.destroy(0)

    after_big, after_garbage, after_hello = asyncio.run(run())
    assert after_big == [] and after_garbage == [] and after_hello == [1]


# ------------------------------------------------------------------------------------ namespaces
@pytest.fixture(scope="module")
def hosts():
    why = netns.why_not()
    if why is not None:
        pytest.skip(f"multi-host tests need network namespaces: {why}")
    with netns.Hosts(1) as h:
        yield h


@pytest.fixture(scope="module")
def key(tmp_path_factory) -> Path:
    from neuron.cluster.keys import write_key

    return write_key(tmp_path_factory.mktemp("cluster") / "group.key")[0]


class Group:
    """A head here and node 1 in its namespace, serving the default model at TP=2."""

    def __init__(self, tmp: Path, hosts: netns.Hosts, key: Path, config: str = CLUSTER_CONF, tp: int = 2,
                 pp: int = 1) -> None:
        self.tmp, self.hosts, self.key, self.config = tmp, hosts, key, config
        self.layout = ["--tensor-parallel", str(tp), "--pipeline-parallel", str(pp)]
        self.port = free_port()
        self.head = None
        self.node = None

    def flags(self, node_rank: int, key: Path | None = None) -> list[str]:
        from neuron.cluster.keys import node_key_path

        key = key or (self.key if node_rank == 0 else node_key_path(self.key))
        return [*self.layout, "--nnodes", "2", "--node-rank", str(node_rank),
                "--master-addr", self.hosts.head, "--master-port", str(self.port), "--group-key", str(key)]

    def start_node(self, key: Path | None = None, wrap: list[str] = ()) -> subprocess.Popen:
        conf = self.tmp / f"node-{self.port}.toml"
        conf.write_text(self.config)
        log = open(self.tmp / f"node-{self.port}-{time.monotonic_ns()}.log", "wb")
        cmd = [*self.hosts.run_in(1), *wrap, sys.executable, "-m", "neuron.cli", "serve", "--config", str(conf),
               *self.flags(1, key)]
        return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def start(self, healthy: bool = True) -> "Group":
        self.node = self.start_node()
        self.head = start_server(self.tmp, config=self.config, args=self.flags(0), healthy=healthy)
        return self

    def node_ranks(self) -> list[int]:
        return rank_processes(self.node.pid)  # ip netns exec execs; the supervisor is the node

    def health(self) -> dict:
        return httpx.get(f"{self.head.url}/health", timeout=5).json()

    def wait_healthy(self, timeout: float = 120) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                h = self.health()
                if h["status"] == "ok":
                    return h
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise AssertionError(f"not healthy in {timeout}s: {self.health()}\n{self.head.log()[-3000:]}")

    def stop(self) -> None:
        if self.head is not None:
            self.head.stop()
        if self.node is not None and self.node.poll() is None:
            os.killpg(self.node.pid, signal.SIGTERM)
            try:
                self.node.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.node.pid, signal.SIGKILL)
                self.node.wait()


@pytest.fixture(scope="module")
def reference(server_tmp):
    """TP=2 on one host."""
    server = start_server(server_tmp, config=SMALL, args=["--tensor-parallel", "2"])
    try:
        yield [greedy(server, q) for q in PROMPTS]
    finally:
        server.stop()


@pytest.fixture(scope="module")
def group(server_tmp, hosts, key):
    g = Group(server_tmp, hosts, key).start()
    yield g
    g.stop()


def test_tp2_across_two_hosts_answers_as_tp2_on_one_host(group, reference):
    assert [greedy(group.head, q) for q in PROMPTS] == reference
    assert eight_at_once(group.head) == [reference[i % len(PROMPTS)] for i in range(8)]
    h = group.health()
    assert h["cluster"]["nodes"]["1"]["status"] == "ready" and h["cluster"]["missing"] == []
    info = httpx.get(f"{group.head.url}/models", timeout=10).json()["models"][0]
    assert info["tensor_parallel"] == 2 and len(info["shard_bytes"]) == 2
    assert len(group.head.rank_pids()) == 1 and len(group.node_ranks()) == 1


def test_a_node_with_another_key_is_refused_and_reaches_nothing(group, server_tmp):
    from neuron.cluster.keys import write_key

    other = write_key(server_tmp / f"other-{time.monotonic_ns()}.key")[1]
    intruder = group.start_node(key=other)
    assert intruder.wait(30) == 2
    logs = sorted(server_tmp.glob(f"node-{group.port}-*.log"), key=lambda p: p.stat().st_mtime)
    assert "was refused by the head" in logs[-1].read_text()
    # Nothing it sent reached the head or a rank: no frame dropped, node 1 still the one serving.
    assert "dropped a frame" not in group.head.log()
    info = httpx.get(f"{group.head.url}/models", timeout=10).json()["models"][0]
    assert info["dropped_frames"] == 0
    assert group.health()["status"] == "ok"


def test_a_cut_link_fails_the_group_within_its_deadline_and_it_serves_again_when_mended(group, reference):
    group.wait_healthy()
    body = {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "Write a long story about a dragon."}],
            "temperature": 0, "max_tokens": 800, "stream": True, "ignore_eos": True}
    events: list[str] = []
    cut_at = []
    with httpx.stream("POST", f"{group.head.base}/chat/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == 5:
                    group.hosts.cut(1)
                    cut_at.append(time.monotonic())
    ended = time.monotonic()
    try:
        assert events[-1] == "[DONE]"
        assert '"error"' in events[-2] and "heartbeat" in events[-2], events[-3:]
        assert ended - cut_at[0] < DEADLINE_S + 2.0
        h = group.health()
        assert h["status"] != "ok" and h["cluster"]["missing"] == [1] or h["models"][DEFAULT_MODEL] != "loaded"
    finally:
        group.hosts.mend(1)
    group.wait_healthy(120)
    assert greedy(group.head, PROMPTS[0]) == reference[0]


def test_a_killed_head_leaves_no_rank_alive_and_a_new_head_is_joined(group, reference):
    group.wait_healthy()
    ranks = group.node_ranks()
    assert ranks
    os.killpg(group.head.proc.pid, signal.SIGKILL)
    group.head.proc.wait()
    killed = time.monotonic()
    while any(alive(pid) for pid in ranks) and time.monotonic() - killed < DEADLINE_S + 3.0:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in ranks), "a rank outlived its head past the deadline"
    assert group.node.poll() is None, "the node supervisor keeps running for the next head"
    group.head = start_server(group.tmp, config=group.config, args=group.flags(0))
    assert greedy(group.head, PROMPTS[1]) == reference[1]


@pytest.mark.parametrize("tp,pp", [(2, 2)])
def test_pipeline_stages_on_two_hosts_answer_as_one_rank(server_tmp, hosts, key, tp1, tp, pp):
    """A stage a host: TP=2 x PP=2 (a stage's two ranks on each host)
    against TP=1 on one host, one request at a time and 8 at once."""
    reference = [greedy(tp1, q) for q in PROMPTS]
    g = Group(server_tmp, hosts, key, tp=tp, pp=pp).start()
    try:
        assert [greedy(g.head, q) for q in PROMPTS] == reference
        assert eight_at_once(g.head) == [reference[i % len(PROMPTS)] for i in range(8)]
        assert len(g.head.rank_pids()) == tp and len(g.node_ranks()) == tp
    finally:
        g.stop()


def test_a_node_with_other_files_is_named_when_the_load_is_refused(server_tmp, hosts, key):
    from devtools.checkpoints import make_checkpoint

    if shutil.which("unshare") is None:
        pytest.skip("unshare is not installed")
    ours = make_checkpoint("llama", server_tmp / "mh-ours", seed=3)
    theirs = make_checkpoint("llama", server_tmp / "mh-theirs", seed=3, intermediate_size=96)
    config = f'[[models]]\nmodel = "{ours}"\nmax_model_len = 256\nmax_slots = 2\n' \
             f'[timeouts]\nheartbeat_timeout_s = {DEADLINE_S}\nrecovery_attempts = 1\n[cluster]\njoin_timeout_s = 60\n'
    g = Group(server_tmp, hosts, key, config=config)
    # Node 1 sees other files at the same path: its own mount of them.
    g.node = g.start_node(wrap=["unshare", "-m", "sh", "-c", f'mount --bind "{theirs}" "{ours}" && exec "$0" "$@"'])
    try:
        g.head = start_server(server_tmp, config=config, args=g.flags(0), healthy=False)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and "node 1 has other files" not in g.head.log():
            time.sleep(0.1)
        assert "node 1 has other files" in g.head.log(), g.head.log()[-3000:]
    finally:
        g.stop()


def readme_commands() -> list[list[str]]:
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Across hosts\n", 1)[1].split("\n## ", 1)[0]
    return [line.strip().split() for line in section.splitlines()
            if line.startswith("    ") and not line.strip().startswith("#")]


def test_the_readmes_two_host_commands_work_word_for_word(tmp_path):
    """The README's commands as written, each host a namespace with the README's address; the
    head's API answered at its default 127.0.0.1:13131 inside its own namespace."""
    why = netns.why_not()
    if why is not None:
        pytest.skip(f"multi-host tests need network namespaces: {why}")
    venv = ROOT / ".venv"
    if not (venv / "bin" / "neuron").exists():
        pytest.skip("the README's commands run .venv/bin/neuron, which ./scripts/setup makes")
    keygen, head_cmd, node_cmd = readme_commands()
    addr = head_cmd[head_cmd.index("--master-addr") + 1]
    (tmp_path / ".venv").symlink_to(venv)
    assert subprocess.run(keygen, cwd=tmp_path).returncode == 0
    tag = f"{os.getpid() % 100000}r"  # beside the module's hosts, if they are up
    with netns.Hosts(2, tag=tag, prefix=addr.rsplit(".", 1)[0], head_here=False) as hosts:
        assert hosts.head == addr
        procs = []
        try:
            for i, cmd in ((1, head_cmd), (2, node_cmd)):
                log = open(tmp_path / f"host{i}.log", "wb")
                procs.append(subprocess.Popen([*hosts.run_in(i), *cmd], cwd=tmp_path, stdout=log,
                                              stderr=subprocess.STDOUT, start_new_session=True))
            ask = ("import httpx, time, sys\n"
                   "for _ in range(600):\n"
                   "    try:\n"
                   "        if httpx.get('http://127.0.0.1:13131/health', timeout=2).status_code == 200: break\n"
                   "    except httpx.HTTPError: pass\n"
                   "    time.sleep(0.3)\n"
                   "r = httpx.post('http://127.0.0.1:13131/v1/chat/completions', timeout=60, json={'model': "
                   f"'{DEFAULT_MODEL}', 'temperature': 0, 'max_tokens': 12, 'messages': [{{'role': 'user', "
                   "'content': 'What is the capital of France?'}]})\n"
                   "print(r.json()['choices'][0]['message']['content'])\n")
            out = subprocess.run([*hosts.run_in(1), sys.executable, "-c", ask], capture_output=True, text=True,
                                 timeout=300)
            logs = "\n".join((tmp_path / f"host{i}.log").read_text(errors="replace")[-2000:] for i in (1, 2))
            assert "Paris" in out.stdout, out.stderr[-2000:] + logs
        finally:
            for proc in procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGTERM)
            for proc in procs:
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
