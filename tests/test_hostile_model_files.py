"""Model files written by an attacker who can write into a model root, loaded by an admin through
a real server: a symlink out of the root is refused by name before a byte of its target is read
(the daemon's own TOML with its keys was readable through /tokenize); configs that claim a
million layers are refused in milliseconds with the memory they took given back; malformed
files are 422 naming the file, never a 500 with a traceback."""

from __future__ import annotations

import json
import os
import shutil
import struct
import time
from pathlib import Path

import httpx
import pytest

from conftest import DEFAULT_MODEL, OPS_ADMIN_KEY, OPS_API_KEY, start_server
from devtools import gguf_edit as ge

ADMIN = {"Authorization": f"Bearer {OPS_ADMIN_KEY}"}
USER = {"Authorization": f"Bearer {OPS_API_KEY}"}
SECRET = "sk-secret-in-the-daemon-toml-7f3a"


@pytest.fixture(scope="module")
def gguf_source(tmp_path_factory) -> Path:
    from devtools.checkpoints import make_checkpoint

    d = make_checkpoint("llama", tmp_path_factory.mktemp("gguf-src") / "llama", seed=4, gguf_types="Q8_0")
    return next(d.glob("*.gguf"))


@pytest.fixture(scope="module")
def root(tmp_path_factory, tiny_checkpoint) -> Path:
    return tmp_path_factory.mktemp("hostile-root")


@pytest.fixture(scope="module")
def server(server_tmp, root):
    config = f"""
[[models]]
model = "{DEFAULT_MODEL}"
max_model_len = 512
max_slots = 2

[server]
api_key = "{OPS_API_KEY}"
admin_api_key = "{SECRET}-admin"
model_roots = ["{root}"]
"""
    s = start_server(server_tmp, config=config.replace(f"{SECRET}-admin", OPS_ADMIN_KEY) + f"# {SECRET}\n")
    yield s
    s.stop()


def load(server, ref: str, **extra) -> tuple[httpx.Response, float]:
    t0 = time.monotonic()
    r = httpx.post(f"{server.url}/models/load", headers=ADMIN, json={"model": ref, **extra}, timeout=120)
    return r, time.monotonic() - t0


def copy_model(tiny_checkpoint: Path, root: Path, name: str) -> Path:
    d = root / name
    shutil.copytree(tiny_checkpoint, d)
    return d


def refused(server, ref: str, *words: str, status: int = 422, code: str = "invalid_model") -> dict:
    r, took = load(server, ref)
    assert r.status_code == status and took < 10, (took, r.text[:500])
    err = r.json()["error"]
    assert err["code"] == code, err
    for w in words:
        assert w in err["message"], (w, err["message"])
    return err


@pytest.mark.parametrize("name,target", [("chat_template.jinja", "toml"), ("tokenizer.json", "toml"),
                                         ("model.safetensors", "outside"), ("config.json", "outside")])
def test_a_file_that_links_out_of_the_root_is_refused_by_name(server, root, tiny_checkpoint, tmp_path, name,
                                                              target):
    d = copy_model(tiny_checkpoint, root, f"link-{name}")
    outside = tmp_path / name
    shutil.copy(tiny_checkpoint / name if (tiny_checkpoint / name).exists() else tiny_checkpoint / "config.json",
                outside)
    (d / name).unlink(missing_ok=True)
    toml = next(server.log_path.parent.glob(f"neuron-{server.url.rsplit(':', 1)[1]}.toml"))
    (d / name).symlink_to(toml if target == "toml" else outside)
    err = refused(server, str(d), name, "resolves outside the model's directory")
    assert SECRET not in json.dumps(err)
    assert httpx.get(f"{server.url}/v1/models", headers=USER, timeout=10).json()["data"][0]["id"] == DEFAULT_MODEL


def test_links_that_stay_inside_the_roots_load(server, root, tiny_checkpoint):
    shared = root / "shared-weights"
    shared.mkdir(exist_ok=True)
    shutil.copy(tiny_checkpoint / "model.safetensors", shared / "tiny.safetensors")
    d = copy_model(tiny_checkpoint, root, "linked-inside")
    (d / "model.safetensors").unlink()
    (d / "model.safetensors").symlink_to(Path("..") / "shared-weights" / "tiny.safetensors")
    r, _ = load(server, str(d), id="linked")
    assert r.status_code == 200, r.text
    assert httpx.post(f"{server.url}/models/unload", headers=ADMIN, json={"model": "linked"},
                      timeout=120).status_code == 200


def leader_rss_mb(server) -> float:
    line = next(x for x in Path(f"/proc/{server.proc.pid}/status").read_text().splitlines() if x.startswith("VmRSS"))
    return int(line.split()[1]) / 1024


def test_configs_that_claim_a_million_layers_are_refused_at_once_and_cost_no_memory(server, root, tiny_checkpoint,
                                                                                     gguf_source):
    before = leader_rss_mb(server)
    (root / "million.gguf").write_bytes(ge.edit(gguf_source.read_bytes(), {"llama.block_count": (4, 1_000_000)}))
    refused(server, str(root / "million.gguf"), "num_layers = 1000000", code="invalid_model_config")
    d = copy_model(tiny_checkpoint, root, "million-layers")
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1_000_000}))
    refused(server, str(d), "num_layers = 1000000", code="invalid_model_config")
    (d / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 40}))
    refused(server, str(d), "config.json gives 40 layers; the weights hold", code="invalid_model_config")
    assert leader_rss_mb(server) < before + 100


def _safetensors_with_header(src: Path, dst: Path, edit) -> None:
    data = src.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8: 8 + length])
    raw = edit(header)
    raw = raw if isinstance(raw, bytes) else json.dumps(raw).encode()
    dst.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + length:])


def _first_tensor(header: dict) -> str:
    return next(k for k in header if k != "__metadata__")


def _offsets(value):
    def edit(header):
        header[_first_tensor(header)]["data_offsets"] = value
        return header
    return edit


@pytest.mark.parametrize("case", ["gguf-nested-5000", "gguf-alignment-array", "offsets-empty", "offsets-text",
                                  "header-nested-200k", "config-nested-100k"])
def test_malformed_files_are_a_422_naming_the_file(server, root, tiny_checkpoint, gguf_source, case):
    if case.startswith("gguf"):
        value = ge.nested_array(5000) if case == "gguf-nested-5000" else (ge.ARRAY, (4, [32, 32]))
        key = "x.nested" if case == "gguf-nested-5000" else "general.alignment"
        path = root / f"{case}.gguf"
        path.write_bytes(ge.edit(gguf_source.read_bytes(), {key: value}))
        refused(server, str(path), f"{case}.gguf")
    else:
        d = copy_model(tiny_checkpoint, root, case)
        if case == "config-nested-100k":
            (d / "config.json").write_text("[" * 100_000 + "]" * 100_000)
            refused(server, str(d), "config.json")
        else:
            edit = {"offsets-empty": _offsets([]), "offsets-text": _offsets("ab"),
                    "header-nested-200k": lambda h: b"[" * 200_000 + b"]" * 200_000}[case]
            _safetensors_with_header(tiny_checkpoint / "model.safetensors", d / "model.safetensors", edit)
            refused(server, str(d), "model.safetensors")
    assert "Traceback" not in server.log()


def test_a_path_thousands_of_levels_deep_is_an_answer_not_a_500(server, root):
    fds = [os.open(root, os.O_RDONLY)]
    try:
        for _ in range(3000):  # deeper than a path can name: made one level at a time
            os.mkdir("a", dir_fd=fds[-1])
            fds.append(os.open("a", os.O_RDONLY, dir_fd=fds[-1]))
        for ref in ("/".join(["a"] * 3000), str(root) + "/a" * 3000, "/".join([".."] * 3000)):
            r, took = load(server, ref)
            assert 400 <= r.status_code < 500 and took < 10, (r.status_code, r.text[:300])
        assert "Traceback" not in server.log()
    finally:  # removed the same way (pytest's own clean-up recurses, and would overflow)
        for parent, child in zip(reversed(fds[:-1]), reversed(fds[1:])):
            os.close(child)
            os.rmdir("a", dir_fd=parent)
        os.close(fds[0])
