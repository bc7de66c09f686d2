"""Finding and describing models on the leader, without the network and without torch: local
directories, .gguf paths, HF repo ids in a Hugging Face cache (explicit path, HF_HUB_CACHE,
HF_HOME/hub); chat templates rendered as transformers renders them; EOS ids and sampling
defaults from the model's own files."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from neuron.loader.chat_template import CHATML, TemplateError, render_chat
from neuron.errors import ModelNotFound
from neuron.loader.resolve import DEFAULT_MODEL, default_model_path, hf_cache_dirs, resolve_model
from neuron.loader.spec import load_spec
from devtools.checkpoints import CHAT_TEMPLATE, make_checkpoint

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> Path:
    return make_checkpoint("qwen3", tmp_path_factory.mktemp("loading") / "qwen3", seed=1, gguf_types="Q8_0")


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return make_checkpoint("llama", tmp_path_factory.mktemp("loading") / "llama", seed=2)


@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to open a connection fails the test."""
    def refuse(self, address, *args):
        raise AssertionError(f"network access to {address} during model resolution")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # we must not rely on offline mode to stay offline


@pytest.fixture
def clean_hf_env(monkeypatch, tmp_path):
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # the default ~/.cache/huggingface/hub is empty


def fake_hf_cache(cache: Path, repo_id: str, source: Path, *, include=lambda name: True,
                  commit: str = "0" * 39 + "1") -> Path:
    """Lay out `source`'s files the way huggingface_hub caches a repo: content-addressed blobs,
    a snapshot folder of relative symlinks named by the commit, and refs/main naming it."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    for f in sorted(source.iterdir()):
        if not include(f.name):
            continue
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    return snapshot


def no_gguf(name: str) -> bool:
    return not name.endswith(".gguf")


# ---------------------------------------------------------------------------- local files


def test_a_local_directory_resolves_to_its_safetensors(qwen3, no_network):
    files = resolve_model(str(qwen3))
    assert files.format == "safetensors" and files.paths == (qwen3 / "model.safetensors",)
    spec = load_spec(str(qwen3))
    assert spec.id == "qwen3" and spec.config.family == "qwen3" and spec.config.num_kv_heads == 4


def test_a_gguf_path_resolves_to_that_file(qwen3, no_network):
    path = qwen3 / "model-Q8_0.gguf"
    files = resolve_model(str(path))
    assert files.format == "gguf" and files.paths == (path,)
    spec = load_spec(str(path))
    assert spec.id == "model-Q8_0" and spec.config.family == "qwen3"
    assert spec.tokenizer.chat_template == CHAT_TEMPLATE  # from the GGUF's metadata


def test_the_default_model_is_the_packaged_smollm2_gguf(no_network):
    files = resolve_model(DEFAULT_MODEL)
    assert files.format == "gguf" and files.paths == (default_model_path(),)
    assert resolve_model(f"HuggingFaceTB/{DEFAULT_MODEL}").paths == files.paths


def test_the_leader_describes_a_model_without_importing_torch(qwen3):
    code = ("import sys; from neuron.loader.spec import load_spec; "
            f"load_spec({str(qwen3)!r}); load_spec({str(qwen3 / 'model-Q8_0.gguf')!r}); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)


# ---------------------------------------------------------------------------- HF cache


def test_repo_id_in_an_explicit_hf_cache(qwen3, tmp_path, clean_hf_env, no_network):
    snapshot = fake_hf_cache(tmp_path / "cache", "acme/tiny-qwen3", qwen3, include=no_gguf)
    files = resolve_model("acme/tiny-qwen3", hf_cache=str(tmp_path / "cache"))
    assert files.format == "safetensors" and files.directory == snapshot
    spec = load_spec("acme/tiny-qwen3", hf_cache=str(tmp_path / "cache"))
    assert spec.id == "acme/tiny-qwen3"
    assert spec.config == load_spec(str(qwen3)).config
    assert spec.sampling_defaults == {"temperature": 0.7, "top_p": 0.9}


def test_repo_id_through_hf_hub_cache_then_hf_home(qwen3, llama, tmp_path, clean_hf_env, monkeypatch, no_network):
    fake_hf_cache(tmp_path / "hub-cache", "acme/tiny", qwen3, include=no_gguf)
    fake_hf_cache(tmp_path / "hf-home" / "hub", "acme/tiny", llama)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    assert load_spec("acme/tiny").config.family == "llama"  # HF_HOME/hub
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    assert load_spec("acme/tiny").config.family == "qwen3"  # HF_HUB_CACHE comes first
    fake_hf_cache(tmp_path / "explicit", "acme/tiny", llama)
    assert load_spec("acme/tiny", hf_cache=str(tmp_path / "explicit")).config.family == "llama"  # explicit first


def test_a_gguf_repo_in_the_hf_cache(qwen3, tmp_path, clean_hf_env, no_network):
    fake_hf_cache(tmp_path / "cache", "acme/tiny-GGUF", qwen3, include=lambda n: n == "model-Q8_0.gguf")
    files = resolve_model("acme/tiny-GGUF", hf_cache=str(tmp_path / "cache"))
    # the weights are read at their real path: the cache's blob the snapshot's link leads to
    assert files.format == "gguf" and files.paths[0].parent.name == "blobs"


def test_a_repo_absent_from_every_cache_names_what_was_searched(tmp_path, clean_hf_env, monkeypatch, no_network):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    (tmp_path / "hub-cache").mkdir()
    with pytest.raises(ModelNotFound) as info:
        load_spec("acme/missing", hf_cache=str(tmp_path / "explicit"))
    message = info.value.message
    assert info.value.status == 404 and "'acme/missing'" in message and "not in the local Hugging Face cache" in message
    for searched in hf_cache_dirs(str(tmp_path / "explicit")):
        assert str(searched) in message
    assert str(tmp_path / "hf-home" / "hub") in message


# ---------------------------------------------------------------------------- chat templates

TOOLS_TEMPLATE = """\
{{- bos_token }}
{%- set ns = namespace(system='') %}
{%- if messages and messages[0].role == 'system' %}{% set ns.system = messages[0].content %}{% endif %}
{%- if tools is not none %}
    {{- '<|im_start|>system\\n' + (ns.system + '\\n\\n' if ns.system else '') + '# Tools\\n<tools>' }}
    {%- for tool in tools %}{{- '\\n' + tool | tojson }}{% endfor %}
    {{- '\\n</tools><|im_end|>\\n' }}
{%- elif ns.system %}
    {{- '<|im_start|>system\\n' + ns.system + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' %}
        {%- if not loop.first %}{{ raise_exception('the system message must come first') }}{% endif %}
        {%- continue %}
    {%- endif %}
    {%- if message.role == 'user' %}
        {{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant\\n' }}
        {%- generation %}
        {%- if message.reasoning_content %}{{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}{% endif %}
        {{- message.content or '' }}
        {%- for call in message.tool_calls or [] %}
            {%- set fn = call.function if call.function is defined else call %}
            {{- '\\n<tool_call>\\n{"name": "' + fn.name + '", "arguments": ' }}
            {{- fn.arguments if fn.arguments is string else fn.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>' }}
        {%- endgeneration %}
        {{- '\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{% endif %}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{% endif %}
    {%- else %}
        {{- raise_exception('unknown role ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{% endif %}
{%- endif %}
{%- if documents is not none %}{{ raise_exception('documents are not supported') }}{% endif %}
"""

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city, in °C",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}

CONVERSATIONS = {
    "user only": ([{"role": "user", "content": "Hello there"}], None, {}),
    "system prompt": ([{"role": "system", "content": "You are terse."},
                       {"role": "user", "content": "Hi"},
                       {"role": "assistant", "content": "Hello."},
                       {"role": "user", "content": "Bye"}], None, {}),
    "tools and a tool round trip": ([
        {"role": "system", "content": "Use tools when useful."},
        {"role": "user", "content": "Weather in Paris and Zürich?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18"},
        {"role": "tool", "tool_call_id": "c2", "content": "12"},
    ], [WEATHER], {}),
    "empty tool list": ([{"role": "user", "content": "x"}], [], {}),
    "thinking off via chat_template_kwargs": ([{"role": "user", "content": "2+2?"}], None, {"enable_thinking": False}),
    "reasoning under another name": ([{"role": "user", "content": "q"},
                                      {"role": "assistant", "content": "a", "reasoning": "because"},
                                      {"role": "user", "content": "and?"}], None, {"enable_thinking": True}),
}


@pytest.fixture(scope="module")
def hf_tokenizer(qwen3):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen3)


def hf_render(tokenizer, template, messages, tools, kwargs, add_generation_prompt=True) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools, chat_template=template, tokenize=False,
                                         add_generation_prompt=add_generation_prompt, **kwargs)


def smollm2_template() -> str:
    return load_spec(DEFAULT_MODEL).tokenizer.chat_template


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("case", list(CONVERSATIONS))
@pytest.mark.parametrize("template_name", ["checkpoint", "tools", "smollm2"])
def test_render_chat_equals_transformers_apply_chat_template(hf_tokenizer, template_name, case,
                                                            add_generation_prompt):
    template = {"checkpoint": CHAT_TEMPLATE, "tools": TOOLS_TEMPLATE, "smollm2": None}[template_name]
    template = template or smollm2_template()
    messages, tools, kwargs = CONVERSATIONS[case]
    if template_name != "tools" and any(m["role"] == "tool" or m.get("tool_calls") for m in messages):
        pytest.skip("this template has no tool messages")
    theirs = hf_render(hf_tokenizer, template, messages, tools, kwargs, add_generation_prompt)
    ours = render_chat(template, [dict(m) for m in messages], tools=tools, add_generation_prompt=add_generation_prompt,
                       bos_token=hf_tokenizer.bos_token, eos_token=hf_tokenizer.eos_token, extra=kwargs)
    assert ours == theirs
    if template_name == "tools" and tools:
        assert '"name": "get_weather"' in ours and "Zürich" in ours and "<tool_response>\n12" in ours


def test_template_errors_are_reported_like_transformers(hf_tokenizer):
    import jinja2

    bad = [{"role": "user", "content": "a"}, {"role": "system", "content": "late"}]
    with pytest.raises(jinja2.TemplateError, match="the system message must come first"):
        hf_render(hf_tokenizer, TOOLS_TEMPLATE, bad, None, {})
    with pytest.raises(TemplateError, match="the system message must come first"):
        render_chat(TOOLS_TEMPLATE, bad)
    with pytest.raises(TemplateError, match="does not compile"):
        render_chat("{% if %}", bad)


def test_chatml_fallback_when_the_model_has_no_template(qwen3, tmp_path):
    import shutil

    d = tmp_path / "no-template"
    shutil.copytree(qwen3, d, ignore=shutil.ignore_patterns("*.gguf"))
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    spec = load_spec(str(d))
    assert spec.tokenizer.chat_template is None
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    text = render_chat(spec.tokenizer.chat_template, messages)
    assert text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    assert render_chat(None, messages) == render_chat(CHATML, messages)
    # a chat_template.jinja file next to it is the model's template
    (d / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    assert load_spec(str(d)).tokenizer.chat_template == TOOLS_TEMPLATE


def test_eos_ids_and_sampling_defaults_come_from_the_model_files(qwen3, tmp_path):
    import shutil

    spec = load_spec(str(qwen3))
    tk = spec.tokenizer.tokenizer
    assert spec.tokenizer.eos_token_ids == [tk.token_to_id("<|im_end|>")]
    assert spec.tokenizer.bos_token == "<|endoftext|>"
    assert spec.sampling_defaults == {"temperature": 0.7, "top_p": 0.9}

    d = tmp_path / "more-eos"
    shutil.copytree(qwen3, d, ignore=shutil.ignore_patterns("*.gguf"))
    gen = json.loads((d / "generation_config.json").read_text())
    gen |= {"eos_token_id": [511, 509], "top_k": 20, "repetition_penalty": 1.05, "temperature": 0.6}
    (d / "generation_config.json").write_text(json.dumps(gen))
    spec = load_spec(str(d))
    assert spec.tokenizer.eos_token_ids == [509, 511]
    assert spec.sampling_defaults == {"temperature": 0.6, "top_p": 0.9, "top_k": 20.0, "repetition_penalty": 1.05}
    (d / "generation_config.json").unlink()
    assert load_spec(str(d)).sampling_defaults == {}

    smol = load_spec(DEFAULT_MODEL)
    assert smol.tokenizer.eos_token_ids == [smol.tokenizer.tokenizer.token_to_id("<|im_end|>")]
    assert smol.sampling_defaults == {}
