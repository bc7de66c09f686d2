"""The configuration as the file and the environment give it: TOML's types converted by msgspec,
every misspelt key refused by name (in nested tables too), the environment's text read as
numbers, switches, lists and speculative settings, and each complaint naming the key."""

from __future__ import annotations

import pytest

from neuron.config import ConfigError, load_config


def toml(tmp_path, text: str):
    path = tmp_path / "neuron.toml"
    path.write_text(text)
    return load_config(path, env={})


def test_a_file_s_values_take_their_types(tmp_path):
    cfg = toml(tmp_path, '[server]\nport = 8080\ndrain_timeout_s = 3\nallow_insecure_admin = true\n'
                         'cors_allow_origins = ["http://a.example"]\napi_processes = 2\n'
                         '[[models]]\nmodel = "m"\nspeculative = { method = "ngram", tokens = 4 }\n')
    assert (cfg.server.port, cfg.server.drain_timeout_s, cfg.server.allow_insecure_admin) == (8080, 3.0, True)
    assert isinstance(cfg.server.drain_timeout_s, float) and cfg.server.api_processes == 2
    assert cfg.server.cors_allow_origins == ["http://a.example"]
    assert (cfg.models[0].speculative.method, cfg.models[0].speculative.tokens) == ("ngram", 4)


@pytest.mark.parametrize("text,words", [
    ('[server]\nport = "8080"\n', "server.port: expected int, got str"),
    ('[server]\nallow_insecure_admin = 1\n', "server.allow_insecure_admin: expected bool, got int"),
    ('[server]\ncors_allow_origins = ["a", 3]\n', r"server.cors_allow_origins\[1\]: expected str, got int"),
    ('[server]\nprot = 1\n', r"\[server\] has unknown keys: prot"),
    ('[[models]]\nmodel = "m"\nspeculative = { method = "ngram", depth = 2 }\n',
     r"\[models\[0\].speculative\] has unknown keys: depth"),
    ('[[models]]\nmodel = "m"\nspeculative = { tokens = "many" }\n', r"models\[0\].speculative.tokens: expected int"),
    ("server = 3\n", r"\[server\] must be a table"),
    ("[cache]\nhost_gb = -1.0\n", "cache.host_gb must be >= 0"),
    ("[cache]\nhost_gb = 1e9\n", r"at most 80% of this host's [0-9.]+ GB of memory"),
    ("[cache]\ndisk_size = 1.0\n", r"\[cache\] has unknown keys: disk_size"),
    ("[cache]\ndisk_gb = 1.0\n", "cache.disk_dir and cache.disk_gb go together"),
    ("[cache]\ndisk_gb = 1.0\ndisk_dir = \"/tmp/neuron-kv-test\"\n", r"and need cache.host_gb"),
    ("[cache]\nhost_gb = 0.1\ndisk_gb = 1.0\ndisk_dir = \"/tmp\"\n", "cache.disk_dir: .* writable by its group or others"),
])
def test_a_wrong_value_in_the_file_is_named(tmp_path, text, words):
    with pytest.raises(ConfigError, match=words):
        toml(tmp_path, text)


def test_the_environment_s_text_is_read_as_the_key_s_type():
    cfg = load_config(None, env={"NEURON_SERVER__PORT": "9000", "NEURON_SERVER__ALLOW_INSECURE_ADMIN": "on",
                                 "NEURON_SERVER__METRICS_PUBLIC": "No", "NEURON_SERVER__DRAIN_TIMEOUT_S": "2.5",
                                 "NEURON_SERVER__CORS_ALLOW_ORIGINS": "http://a.example, http://b.example",
                                 "NEURON_SERVER__API_PROCESSES": "auto",
                                 "NEURON_MODELS__0__SPECULATIVE": "method=ngram,tokens=3"})
    assert (cfg.server.port, cfg.server.allow_insecure_admin, cfg.server.metrics_public) == (9000, True, False)
    assert cfg.server.drain_timeout_s == 2.5 and cfg.server.api_processes == "auto"
    assert cfg.server.cors_allow_origins == ["http://a.example", "http://b.example"]
    assert cfg.models[0].speculative.tokens == 3


@pytest.mark.parametrize("env,words", [
    ({"NEURON_SERVER__PORT": "80a"}, "NEURON_SERVER__PORT: expected int, got str"),
    ({"NEURON_SERVER__METRICS_PUBLIC": "maybe"}, "NEURON_SERVER__METRICS_PUBLIC: expected true or false"),
    ({"NEURON_SERVER__PROT": "1"}, "NEURON_SERVER__PROT names no config key"),
    ({"NEURON_MODELS__0__SPECULATIVE": "tokens=3,depth=2"}, "unknown keys: depth"),
    ({"NODE_RANK": "first"}, "NODE_RANK: expected int"),
])
def test_a_wrong_value_in_the_environment_is_named(env, words):
    with pytest.raises(ConfigError, match=words):
        load_config(None, env=env)
