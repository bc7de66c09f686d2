"""Shared test fixtures: real `neuron serve` processes on loopback ports."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

# Under pytest-xdist (the README's -n 2) each worker, and the servers and ranks it starts, takes its
# share of the cores: OpenMP threads that spin on cores another worker's rank uses slow both down.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    share = (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, share)))  # read when torch loads, after this


def _plain_http(call):
    """httpx's one-shot functions (``httpx.get``, ``httpx.post``, ...) build a client each, and a
    client loads certifi's CA bundle into a new SSL context: 24.5 ms of CPU a call here, for
    servers that all speak plain HTTP on loopback (py-spy put 5.6% of four server test files'
    CPU there). Without ``verify`` given, the tests' calls verify nothing: no TLS is spoken."""
    def one_shot(*args, **kwargs):
        kwargs.setdefault("verify", False)
        return call(*args, **kwargs)
    return one_shot


for _name in ("request", "get", "post", "put", "patch", "delete", "head", "options", "stream"):
    setattr(httpx, _name, _plain_http(getattr(httpx, _name)))

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = "SmolLM2-135M-Instruct"


def run_kernel_check(code: str, *args: str, interpret: bool) -> object:
    """The JSON that ``code`` prints last, run in a process of its own (the kernels compiled, or
    by Triton's interpreter: a process imports Triton one way only) with ``args`` as its argv."""
    import json

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_processes(parent: int) -> list[int]:
    """The rank processes ``parent`` started: forked by its zygote (``neuron/rank_forks.py``),
    or its own ``python -m neuron.rank`` children where it could not fork them."""
    out = []
    for pid in children_of(parent):
        argv = cmdline(pid).split(b"\0")
        if b"neuron.rank.zygote" in argv:
            out += children_of(pid)
        elif b"neuron.rank" in argv:
            out.append(pid)
    return out


def children_of(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    log_path: Path

    @property
    def base(self) -> str:
        return f"{self.url}/v1"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def rank_pids(self) -> list[int]:
        """The leader's rank processes (not its grammar-compiling workers)."""
        return rank_processes(self.proc.pid)

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def api_pids(server) -> dict[int, int]:
    """index -> pid of the core's API processes."""
    out = {}
    for pid in children_of(server.proc.pid):
        argv = cmdline(pid).split(b"\0")
        if b"neuron.server.api_process" in argv:
            out[int(argv[argv.index(b"--index") + 1])] = pid
    return out


STARTED: list[subprocess.Popen] = []  # every server this run started, killed at its end if still up


def pytest_configure(config) -> None:
    """A run ended by SIGTERM (a ``timeout`` around it) stops as if interrupted, so its servers'
    fixtures stop them; the session's end then kills any left. Each server runs in a session of
    its own, where a killed rank would be restarted by its leader, holding its GPU memory."""
    def interrupted(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, interrupted)


def pytest_runtest_logreport(report) -> None:
    """With NEURON_TEST_SHOW_FAILURES set (scripts/gpu-check sets it), a failure's report is
    printed the moment it arrives, so a run cut off by its time limit still shows why tests failed."""
    if report.failed and os.environ.get("NEURON_TEST_SHOW_FAILURES"):
        print(f"\n---- FAILURE {report.nodeid} ({report.when})\n{report.longreprtext}\n----", flush=True)


def pytest_unconfigure(config) -> None:
    for proc in STARTED:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def own_kv_cache(config: str) -> str:
    """``config`` with a KV cache of each model's own sequences (``max_slots`` x ``max_model_len``)
    where it sets none: on a GPU shared by tests side by side (scripts/gpu-check --jobs), a cache
    sized from the free memory would take what the others need."""
    import tomllib

    from neuron.config import ModelEntry

    entries = tomllib.loads(config).get("models", [])
    parts = config.split("[[models]]\n")
    if len(parts) != len(entries) + 1:
        return config
    for i, entry in enumerate(entries):
        if "kv_cache_tokens" not in entry:
            slots = entry.get("max_slots", ModelEntry.max_slots)
            length = entry.get("max_model_len", ModelEntry.max_model_len) or 4096
            parts[i + 1] = f"kv_cache_tokens = {slots * length}\n" + parts[i + 1]
    return "[[models]]\n".join(parts)


def start_server(tmp: Path, *, config: str = "", args: list[str] = (), env: dict | None = None,
                 wait: float = 180, healthy: bool = True) -> Server:
    port = free_port()
    conf = tmp / f"neuron-{port}.toml"
    conf.write_text(own_kv_cache(config) if os.environ.get("NEURON_TEST_KV_TOKENS") else config)
    log_path = tmp / f"server-{port}.log"
    cmd = [sys.executable, "-m", "neuron.cli", "serve", "--config", str(conf), "--port", str(port), *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=open(log_path, "wb"), stderr=subprocess.STDOUT,
                            env={**os.environ, **(env or {})}, start_new_session=True)
    STARTED.append(proc)
    server = Server(proc, f"http://127.0.0.1:{port}", log_path)
    if not healthy:
        return server
    if os.environ.get("NEURON_TEST_KV_TOKENS"):  # servers side by side (gpu-check --jobs): loads share the cores
        wait *= 2
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{server.log()[-4000:]}")
        try:
            if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    server.stop()
    raise RuntimeError(f"server not healthy after {wait}s:\n{server.log()[-4000:]}")


SMALL = """
[[models]]
model = "SmolLM2-135M-Instruct"
max_model_len = 1024
max_slots = 8
"""


@pytest.fixture(scope="session")
def server_tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("servers")


@pytest.fixture(scope="session")
def tap_endpoint(server_tmp) -> str:
    return f"ipc://{server_tmp}/tap.sock"


@pytest.fixture(scope="session")
def tp1(server_tmp, tap_endpoint):
    """The default model at TP=1, with the tap on and requests' own chat templates allowed;
    shared by the API tests."""
    server = start_server(server_tmp, config=SMALL + f'\n[debug]\ntap = "{tap_endpoint}"\n'
                                                     '[server]\nallow_request_chat_template = true\n')
    yield server
    server.stop()


def chat(server: Server, content: str, **extra) -> httpx.Response:
    body = {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": content}], "temperature": 0, **extra}
    return httpx.post(f"{server.base}/chat/completions", json=body, timeout=120)


def greedy_ids(server: Server, prompt: str, max_tokens: int = 32) -> list[int]:
    """The default model's greedy token ids for a one-message chat."""
    r = chat(server, prompt, max_tokens=max_tokens, return_token_ids=True)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def concurrent_greedy_ids(server: Server, prompts: list[str], max_tokens: int = 32) -> list[list[int]]:
    """``greedy_ids`` of every prompt, all requests in flight at once."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda q: greedy_ids(server, q, max_tokens), prompts))


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny matrices: a second OpenMP thread only adds wake-up latency on a busy 2-core box."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@contextlib.contextmanager
def cpu_activations(kind: str):
    """Packed products take x as ``kind`` says (``NEURON_CPU_ACTIVATIONS``), in this process and in
    the rank processes and servers started meanwhile."""
    from neuron.kernels import cpu, isa

    before = os.environ.get(isa.ACTIVATIONS_ENV)
    os.environ[isa.ACTIVATIONS_ENV] = kind
    cpu.choose_again()
    try:
        yield
    finally:
        os.environ.pop(isa.ACTIVATIONS_ENV) if before is None else os.environ.update({isa.ACTIVATIONS_ENV: before})
        cpu.choose_again()


@pytest.fixture(scope="module")
def float32_activations():
    """x as it is (the default, whatever the environment asks), for comparisons of packed weights
    with their float reference as tight as float32 allows (int8: tests/test_int8_activations.py)."""
    with cpu_activations("float32"):
        yield


# ------------------------------------------------------------------------------------------------
# The operator's server: keys, JSON logs, CORS for one origin, a model root and a private HF cache.
OPS_API_KEY = "sk-ops-inference-51c2"
OPS_ADMIN_KEY = "sk-ops-admin-9a7d"
TINY_REPO = "neuron-test/tiny-llama"


@pytest.fixture(scope="session")
def tiny_checkpoint(server_tmp) -> Path:
    from devtools.checkpoints import make_checkpoint

    return make_checkpoint("llama", server_tmp / "tiny-llama-src", seed=3)


@pytest.fixture(scope="session")
def model_root(server_tmp, tiny_checkpoint) -> Path:
    """A directory listed in [server] model_roots, holding one tiny checkpoint."""
    import shutil

    root = server_tmp / "model-root"
    shutil.copytree(tiny_checkpoint, root / "tiny-llama")
    return root


@pytest.fixture(scope="session")
def hf_cache(server_tmp, tiny_checkpoint) -> Path:
    """A Hugging Face hub cache laid out as huggingface_hub writes it, holding TINY_REPO."""
    import shutil

    cache = server_tmp / "hf-cache"
    repo = cache / ("models--" + TINY_REPO.replace("/", "--"))
    revision = "0" * 40
    shutil.copytree(tiny_checkpoint, repo / "snapshots" / revision)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    return cache


@pytest.fixture(scope="session")
def ops(server_tmp, model_root, hf_cache):
    config = SMALL + f"""
[server]
api_key = "{OPS_API_KEY}"
admin_api_key = "{OPS_ADMIN_KEY}"
log_format = "json"
cors_allow_origins = ["http://app.example"]
model_roots = ["{model_root}"]

[runtime]
hf_cache = "{hf_cache}"
"""
    server = start_server(server_tmp, config=config)
    yield server
    server.stop()


def ops_headers(admin: bool = False) -> dict[str, str]:
    return {"Authorization": f"Bearer {OPS_ADMIN_KEY if admin else OPS_API_KEY}"}


def access_line(server: Server, rid: str, timeout: float = 10) -> str:
    """The access-log line of request ``rid``: its API process writes it after the answer has
    gone, so it may come a moment after the client read the response."""
    deadline = time.monotonic() + timeout
    while True:
        for line in server.log().splitlines():
            if "neuron.access" in line and f"id={rid} " in line + " ":
                return line
        assert time.monotonic() < deadline, f"no access line for {rid}:\n{server.log()[-3000:]}"
        time.sleep(0.05)


def json_log(server: Server) -> list[dict]:
    """The leader's JSON log lines (rank processes write text lines beside them)."""
    import json

    out = []
    for line in server.log().splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out
TINY = "tiny-tools"


@pytest.fixture(scope="session")
def tiny(server_tmp):
    """A random-weight qwen3 checkpoint (it wants nothing of any grammar) with a Qwen3-style chat
    template that renders tools and has a thinking switch, served as ``tiny-tools``."""
    from chat_templates import HERMES_TOOLS, use_template
    from devtools.checkpoints import make_checkpoint

    model_dir = make_checkpoint("qwen3", server_tmp / "tiny-tools", seed=5, max_position_embeddings=1024)
    use_template(model_dir, HERMES_TOOLS)
    server = start_server(server_tmp, config=f'[[models]]\nmodel = "{model_dir}"\nid = "{TINY}"\n'
                                             'max_model_len = 1024\nmax_slots = 8\n'
                                             '[server]\nallow_request_chat_template = true\n')
    yield server
    server.stop()
