"""The shipped package: a wheel built from the repo holds neuron (with its CPU kernels built for
every instruction-set level of this machine's architecture, and their C++ sources), the protocol
and the ``neuron`` command, and none of the test tooling; installed alone into a fresh virtual
environment (its dependencies taken from this one's site-packages), ``neuron serve`` serves the
default model from a directory outside the repo, on the kernels of this CPU's level, compiling
nothing."""

from __future__ import annotations

import os
import site
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import httpx
import pytest

from conftest import DEFAULT_MODEL, free_port

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(600)
def test_the_wheel_has_no_test_tooling_and_serves_the_default_model(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path / "dist"), str(ROOT)], check=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("neuron-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"neuron", "protocol"}, tops
    assert not [n for n in names if "devtools" in n or n.startswith("tests/") or "/tools/" in n]
    from neuron.kernels.isa import choose, levels_for, module_name

    assert {"neuron/kernels/csrc/module.cpp", "neuron/kernels/csrc/qlinear.h"} <= set(names)
    built = {n.split("/")[-1].split(".")[0] for n in names if n.startswith("neuron/kernels/_cpu_")}
    assert built == {module_name(level.name) for level in levels_for()}, built
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "neuron = neuron.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    ours = Path(subprocess.check_output([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                        text=True).strip())
    # This environment's packages (torch, the default model, ...) but not its neuron: the wheel's.
    (ours / "deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(ours), str(wheel)],
                   check=True, timeout=300)
    where = subprocess.check_output([str(py), "-c", "import neuron, protocol; print(neuron.__file__, protocol.__file__)"],
                                    text=True, cwd=tmp_path)
    assert str(ROOT) not in where and str(ours) in where, where
    assert subprocess.run([str(py), "-c", "import devtools"], cwd=tmp_path, capture_output=True).returncode != 0

    port = free_port()
    log = open(tmp_path / "serve.log", "wb")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "NEURON_FAMILIES", "NEURON_CPU_ISA")}
    # What the ``neuron`` console script runs (pip --target leaves scripts out of the venv's bin).
    proc = subprocess.Popen([str(py), "-m", "neuron.cli", "serve", "--port", str(port)], cwd=tmp_path, stdout=log,
                            stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
        r = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
            "model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"]
        models = httpx.get(f"{url}/models", timeout=10).json()["models"]
        assert models[0]["cpu_isa"] == choose().name, models[0]
    finally:
        proc.terminate()
        proc.wait(60)
