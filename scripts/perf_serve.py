"""scripts/perf-gpu's servers: `neuron serve` of a checkpoint with the settings a measurement
needs, on a free loopback port, and scripts/bench against it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


MEMORY = 0.9  # --gpu-memory-utilization
DTYPE = "auto"  # --dtype
API_PROCESSES = 0  # --api-processes
PROFILE: Path | None = None  # --profile


def serve(model: Path, tp: int, slots: int, max_len: int, device: str, log: Path,
          caching: bool = True, quantize: str = "", speculative: str = "",
          env: dict | None = None) -> tuple[subprocess.Popen, str, float]:
    port = free_port()
    env = {**os.environ, **(env or {}), "NEURON_MODELS__0__MAX_SLOTS": str(slots), "NEURON_MODELS__0__MAX_MODEL_LEN": str(max_len),
           "NEURON_MODELS__0__PREFIX_CACHING": str(caching).lower(), "NEURON_MODELS__0__QUANTIZE": quantize,
           "NEURON_MODELS__0__GPU_MEMORY_UTILIZATION": str(MEMORY), "NEURON_MODELS__0__DTYPE": DTYPE,
           # a level's streams all arrive at once: none is refused for the queue's length
           "NEURON_ENGINE__QUEUE_SIZE": str(max(64, slots)), "NEURON_SERVER__API_PROCESSES": str(API_PROCESSES)}
    if speculative:
        env["NEURON_MODELS__0__SPECULATIVE"] = speculative
    cmd = [sys.executable, "-m", "neuron.cli", "serve", "--model", str(model), "--port", str(port),
           "--tensor-parallel", str(tp), "--device", device]
    if PROFILE is not None:  # the leader (or core) under cProfile, each rank's device thread too
        PROFILE.mkdir(parents=True, exist_ok=True)
        env["NEURON_RANK_PROFILE"] = str(PROFILE / f"ranks-{port}")
        os.makedirs(env["NEURON_RANK_PROFILE"], exist_ok=True)
        cmd[1:1] = ["-m", "cProfile", "-o", str(PROFILE / f"leader-{port}.prof")]
    # The server runs in a session of its own: a `timeout` that ends this script with SIGTERM
    # must unwind through the caller's stop(), or the server keeps the GPU's memory.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    while time.monotonic() - t0 < 600:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url, time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    raise SystemExit(f"server not healthy after 600 s:\n{log.read_text()[-3000:]}")


def words_for(model_dir: Path, tokens: int) -> int:
    """How many of scripts/bench's prompt words make about `tokens` prompt tokens here."""
    from tokenizers import Tokenizer

    words = "the quick brown fox jumps over the lazy dog".split() * 200
    per_word = len(Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(" ".join(words)).ids) / len(words)
    return max(1, int(tokens / per_word))


def bench(url: str, model: str, out: Path, *args: str) -> list[dict]:
    out.unlink(missing_ok=True)
    subprocess.run([sys.executable, str(ROOT / "scripts" / "bench"), "--url", f"{url}/v1", "--model", model,
                    "--json", str(out), *args], check=True)
    return [json.loads(line) for line in out.read_text().splitlines()]


CLIENT_BUSY = 0.8  # a bench process's CPU share from which it may be what limits a level


def client(row: dict) -> str:
    """A bench level's busiest client process's CPU share, starred where it may be the limit."""
    share = row.get("client_cpu")
    return "" if share is None else f"{100 * share:.0f}%" + ("*" if share >= CLIENT_BUSY else "")


def api_pids(proc: subprocess.Popen) -> list[int]:
    """The server's API processes ([server] api_processes), by their command lines."""
    out = []
    for task in Path(f"/proc/{proc.pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            try:
                if b"neuron.server.api_process" in Path(f"/proc/{child}/cmdline").read_bytes():
                    out.append(int(child))
            except OSError:
                pass
    return out


def stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
