"""A safe admin surface: no admin routes beyond loopback without a key unless the operator says
so, and /models/load reads only the built-in model, the startup models, the local HF cache and
the configured model roots, answering everything else with one identical refusal."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from conftest import DEFAULT_MODEL, TINY_REPO, ops_headers, start_server
from neuron.config import Config, ModelEntry, ServerConfig
from neuron.errors import ApiError
from neuron.server.model_access import ModelAccess

NO_MODELS = "models = []\n"


# ------------------------------------------------------------------------------------------ bind
@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_a_bind_beyond_loopback_without_an_admin_key_exits_2_with_a_clear_message(server_tmp, host):
    # An inference key alone does not count: its holders would all be admins.
    server = start_server(server_tmp, config=NO_MODELS + '[server]\napi_key = "sk-x"\n', args=["--host", host],
                          healthy=False)
    assert server.proc.wait(60) == 2
    log = server.log()
    assert f"refusing to serve on {host!r} without an admin key" in log
    assert "admin_api_key" in log and "--insecure-admin" in log and "sk-x" not in log


@pytest.mark.parametrize("how", ["flag", "config", "env"])
def test_the_operator_may_allow_an_open_admin_surface_and_it_is_logged_as_a_warning(server_tmp, how):
    config, args, env = NO_MODELS, ["--host", "0.0.0.0"], {}
    if how == "flag":
        args.append("--insecure-admin")
    elif how == "config":
        config += "[server]\nallow_insecure_admin = true\n"
    else:
        env["NEURON_SERVER__ALLOW_INSECURE_ADMIN"] = "true"
    server = start_server(server_tmp, config=config, args=args, env=env, wait=60)
    try:
        assert httpx.get(f"{server.url}/models", timeout=10).json() == {"models": []}
        assert "WARNING neuron: serving on '0.0.0.0' with no admin key" in server.log()
    finally:
        assert server.stop() == 0


def test_a_bind_beyond_loopback_with_an_admin_key_starts_without_warning(server_tmp):
    server = start_server(server_tmp, config=NO_MODELS + '[server]\nadmin_api_key = "sk-admin-x"\n',
                          args=["--host", "0.0.0.0"], wait=60)
    try:
        assert httpx.get(f"{server.url}/models", timeout=10).status_code == 401
        assert "no admin key" not in server.log()
    finally:
        assert server.stop() == 0


# ---------------------------------------------------------------------------------- load policy
def escapes(root: Path, outside_model: Path) -> dict[str, str]:
    """References to paths outside the root, each one existing and one not where it applies."""
    (root / "escape").symlink_to(outside_model, target_is_directory=True)
    (root / "dangling").symlink_to("/nonexistent-neuron-target")
    return {
        "absolute, existing": "/etc",
        "absolute file, existing": "/etc/passwd",
        "absolute, missing": "/etc/nonexistent-neuron-xyz",
        "absolute gguf, missing": "/nonexistent/model.gguf",
        "absolute, a real model outside": str(outside_model),
        "the root's parent": str(root / ".."),
        "relative up, existing": "../../../../../../etc",
        "relative up, missing": "../../../../../../nonexistent-neuron-xyz",
        "relative up then down into a real model": f"../{outside_model.name}",
        "symlink inside the root to a real model outside": "escape",
        "absolute symlink inside the root": str(root / "escape"),
        "dangling symlink": "dangling",
        "home": "~",
        "home, missing": "~/nonexistent-neuron-xyz",
        "NUL byte": "tiny\x00llama",
        "missing inside the root": "not-here",
        "repo id not in the cache": "neuron-test/absent",
        "repo-like with dots": "../tiny-llama",
        "very long": "a/" * 3000,
    }


def test_load_answers_every_path_outside_the_roots_with_one_identical_refusal(ops, model_root, tiny_checkpoint):
    cases = escapes(model_root, tiny_checkpoint)
    before = httpx.get(f"{ops.url}/models", headers=ops_headers(admin=True), timeout=10).json()
    answers = {name: httpx.post(f"{ops.url}/models/load", json={"model": ref}, headers=ops_headers(admin=True),
                                timeout=60) for name, ref in cases.items()}
    statuses = {name: r.status_code for name, r in answers.items()}
    assert set(statuses.values()) == {404}, statuses
    bodies = {r.content for r in answers.values()}
    assert len(bodies) == 1, {name: r.text for name, r in answers.items()}
    error = answers["absolute, existing"].json()["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model"
    for word in ("etc", "nonexistent", str(model_root), "tiny", "escape"):
        assert word not in error["message"]
    after = httpx.get(f"{ops.url}/models", headers=ops_headers(admin=True), timeout=10).json()
    assert [m["id"] for m in after["models"]] == [m["id"] for m in before["models"]]
    assert [m["pids"] for m in after["models"]] == [m["pids"] for m in before["models"]]


def test_load_takes_a_repo_id_from_the_local_hf_cache(ops):
    r = httpx.post(f"{ops.url}/models/load", json={"model": TINY_REPO, "max_model_len": 64, "max_slots": 1},
                   headers=ops_headers(admin=True), timeout=300)
    assert r.status_code == 200, r.text
    try:
        assert r.json()["id"] == TINY_REPO and r.json()["status"] == "loaded"
        out = httpx.post(f"{ops.base}/completions", headers=ops_headers(),
                         json={"model": TINY_REPO, "prompt": [1, 2, 3], "max_tokens": 4, "ignore_eos": True},
                         timeout=60)
        assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 4
    finally:
        gone = httpx.post(f"{ops.url}/models/unload", json={"model": TINY_REPO}, headers=ops_headers(admin=True),
                          timeout=60)
        assert gone.status_code == 200


def test_errors_about_models_inside_a_root_are_told_in_full(ops, model_root):
    broken = model_root / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    r = httpx.post(f"{ops.url}/models/load", json={"model": "broken"}, headers=ops_headers(admin=True), timeout=60)
    assert r.status_code in (400, 404, 422) and "broken" in r.json()["error"]["message"], r.text


# Units: the policy itself, without a server.
def access(tmp_path: Path, *models: ModelEntry) -> tuple[ModelAccess, Path]:
    root = tmp_path / "root"
    (root / "llama").mkdir(parents=True)
    (root / "one.gguf").write_bytes(b"GGUF")
    cfg = Config(server=ServerConfig(model_roots=[str(root)]), models=list(models))
    return ModelAccess.from_config(cfg), root.resolve()


def test_paths_inside_a_root_resolve_to_their_real_path_and_a_relative_one_is_looked_up_in_the_roots(tmp_path):
    policy, root = access(tmp_path)
    assert policy.check("llama", {}).model == str(root / "llama")
    assert policy.check(str(root / "one.gguf"), {}).model == str(root / "one.gguf")
    assert policy.check("llama/../one.gguf", {}).model == str(root / "one.gguf")
    assert policy.check("one.gguf", {}).default_id == "one"
    (root / "alias").symlink_to(root / "llama")  # a link that stays inside is fine
    assert policy.check("alias", {}).model == str(root / "llama")
    # Missing but inside: the loader may say so in full; relative and missing: nowhere to look.
    assert policy.check(str(root / "gone.gguf"), {}).model == str(root / "gone.gguf")
    with pytest.raises(ApiError):
        policy.check("gone.gguf", {})


def test_the_builtin_model_startup_models_and_registered_ids_stay_loadable(tmp_path):
    outside = tmp_path / "elsewhere" / "model.gguf"
    policy, _ = access(tmp_path, ModelEntry(model=str(outside), id="mine"))
    assert policy.check(DEFAULT_MODEL, {}).model == DEFAULT_MODEL
    assert policy.check(str(outside), {}).model == str(outside)
    assert policy.check("mine", {}).model == str(outside) and policy.check("mine", {}).default_id == "mine"
    assert policy.check("loaded-later", {"loaded-later": "/some/vetted/path"}).model == "/some/vetted/path"
    with pytest.raises(ApiError) as refused:
        policy.check(str(outside.parent / "other.gguf"), {})
    assert refused.value.status == 404


def test_no_roots_means_no_paths_at_all(tmp_path):
    policy = ModelAccess.from_config(Config(models=[]))
    for ref in (str(tmp_path), "llama", os.path.relpath(tmp_path)):
        with pytest.raises(ApiError):
            policy.check(ref, {})


def test_a_broken_model_in_the_hf_cache_is_told_by_its_repo_id_not_its_cache_path(ops, hf_cache):
    repo = hf_cache / "models--neuron-test--broken"
    (repo / "snapshots" / ("1" * 40)).mkdir(parents=True)
    (repo / "snapshots" / ("1" * 40) / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("1" * 40)
    r = httpx.post(f"{ops.url}/models/load", json={"model": "neuron-test/broken"}, headers=ops_headers(admin=True),
                   timeout=60)
    message = r.json()["error"]["message"]
    assert r.status_code == 404 and "'neuron-test/broken'" in message and "no .safetensors weights" in message
    assert str(hf_cache) not in message and "snapshots" not in message
