"""Fuzzing what a model load reads: GGUF metadata and tensor infos, safetensors headers,
config.json and tokenizer.json, each taken from a valid tiny checkpoint and mutated (values of
every type in every key, arrays and objects nested thousands deep, counts in the millions, bytes
overwritten, files cut short).

Every file either loads or is refused with a LoadError (an HTTP 4xx naming the problem), within
a second of CPU time; nothing else may come out: no TypeError, RecursionError, IndexError, OSError or
MemoryError, which the server would turn into a 500. The seed is fixed, so every run tries the
same files."""

from __future__ import annotations

import json
import shutil
import struct
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from devtools import gguf_edit as ge
from devtools.checkpoints import make_checkpoint
from neuron.errors import LoadError
from neuron.loader.spec import load_spec

SEED = 20261127
SETTINGS = dict(database=None, deadline=None, phases=[Phase.explicit, Phase.generate],
                suppress_health_check=list(HealthCheck), print_blob=False)
N = 250  # examples per kind of file
MAX_S = 1.0  # of this process's CPU time: what the load costs, not what else the machine runs

DEEP = 100_000


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return make_checkpoint("llama", tmp_path_factory.mktemp("fuzz-models") / "llama", seed=2, gguf_types="Q8_0")


def loads_or_refuses(ref: Path) -> None:
    t0 = time.process_time()
    try:
        load_spec(str(ref))
    except LoadError as exc:
        assert 400 <= exc.status < 500 and exc.message
    took = time.process_time() - t0
    assert took < MAX_S, f"{took:.2f}s"


# ------------------------------------------------------------------------------------------ values
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)


def deep_json(depth: int, opener: str = "[") -> str:
    closer = {"[": "]", "{": "}"}[opener]
    if opener == "{":
        return '{"a":' * depth + "1" + closer * depth
    return opener * depth + closer * depth


@st.composite
def gguf_values(draw) -> tuple[int, object]:
    """(type, value): a nested array is ("nested", depth), made when applied (its repr is short)."""
    kind = draw(st.sampled_from(["scalar", "string", "array", "nested", "raw"]))
    if kind == "scalar":
        vtype = draw(st.sampled_from(sorted(ge.SCALARS)))
        fmt = ge.SCALARS[vtype]
        if vtype in (6, 12):
            return vtype, draw(st.floats(width=32 if vtype == 6 else 64, allow_nan=True))
        if vtype == 7:
            return vtype, draw(st.booleans())
        bits = struct.calcsize(fmt) * 8
        signed = fmt[1].islower()
        lo, hi = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if signed else (0, 2 ** bits - 1)
        return vtype, draw(st.integers(lo, hi) | st.sampled_from([lo, hi, 0, min(hi, 1_000_000)]))
    if kind == "string":
        return ge.STRING, draw(st.text(max_size=40))
    if kind == "array":
        etype = draw(st.sampled_from([0, 4, 5, 6, 8]))
        items = draw(st.lists(st.text(max_size=5) if etype == ge.STRING else st.integers(0, 100), max_size=6))
        return ge.ARRAY, (etype, items)
    if kind == "nested":
        return -1, draw(st.sampled_from([2, 5, 50, 5000]))
    return draw(st.integers(0, 20)), ge.Raw(draw(st.binary(max_size=24)))


def made(value: tuple[int, object]) -> tuple[int, object]:
    return ge.nested_array(value[1]) if value[0] == -1 else value


# -------------------------------------------------------------------------------------------- GGUF
@st.composite
def gguf_edits(draw, data: bytes) -> tuple:
    """A mutation of ``data``, as a short description ``apply_gguf`` carries out."""
    spans = ge.layout(data)[0]
    kind = draw(st.sampled_from(["set", "drop", "add", "bytes", "cut"]))
    if kind == "set":
        keys = draw(st.lists(st.sampled_from(sorted(spans)), min_size=1, max_size=3, unique=True))
        return kind, {k: draw(gguf_values()) for k in keys}
    if kind == "drop":
        return kind, tuple(draw(st.lists(st.sampled_from(sorted(spans)), min_size=1, max_size=3)))
    if kind == "add":
        return kind, {draw(st.text(max_size=30)): draw(gguf_values())}
    infos_end = ge.layout(data)[2]
    if kind == "bytes":  # overwrite a few bytes of the header or the tensor infos
        return kind, [(draw(st.integers(0, infos_end - 1)), draw(st.binary(min_size=1, max_size=8)))
                      for _ in range(draw(st.integers(1, 4)))]
    return kind, draw(st.integers(0, len(data) - 1))


def apply_gguf(data: bytes, edit: tuple) -> bytes:
    kind, what = edit
    if kind in ("set", "add"):
        return ge.edit(data, {k: made(v) for k, v in what.items()})
    if kind == "drop":
        return ge.edit(data, drop=what)
    if kind == "bytes":
        out = bytearray(data)
        for at, chunk in what:
            out[at: at + len(chunk)] = chunk
        return bytes(out)
    return data[:what]


def test_fuzzed_gguf_files_load_or_are_refused(source, tmp_path):
    data = next(source.glob("*.gguf")).read_bytes()
    target = tmp_path / "model.gguf"

    @seed(SEED)
    @settings(max_examples=N, **SETTINGS)
    @given(gguf_edits(data))
    def one(edit: tuple) -> None:
        target.write_bytes(apply_gguf(data, edit))
        loads_or_refuses(target)

    one()


# --------------------------------------------------------------------------------- safetensors
@st.composite
def safetensors_headers(draw, header: dict) -> bytes | tuple:
    """A new header's bytes, or ("deep", depth, opener) for one nested thousands deep."""
    kind = draw(st.sampled_from(["entry", "whole", "deep", "length"]))
    header = json.loads(json.dumps(header))
    if kind == "entry":
        name = draw(st.sampled_from(sorted(k for k in header if k != "__metadata__")))
        field = draw(st.sampled_from(["dtype", "shape", "data_offsets", None]))
        if field is None:
            header[name] = draw(json_values)
        else:
            header[name][field] = draw(json_values | st.lists(st.integers(-5, 2**63), max_size=3)
                                       | st.sampled_from(["ab", [], [0], "F32", "Q4"]))
        return json.dumps(header).encode()
    if kind == "whole":
        return json.dumps(draw(json_values)).encode()
    if kind == "deep":
        return "deep", draw(st.sampled_from([1000, 200_000])), draw(st.sampled_from("[{"))
    return b"\xff" * draw(st.integers(0, 12))


def test_fuzzed_safetensors_headers_load_or_are_refused(source, tmp_path):
    weights = (source / "model.safetensors").read_bytes()
    (length,) = struct.unpack("<Q", weights[:8])
    header, body = json.loads(weights[8: 8 + length]), weights[8 + length:]
    d = tmp_path / "m"
    shutil.copytree(source, d, ignore=shutil.ignore_patterns("*.gguf"))

    @seed(SEED)
    @settings(max_examples=N, **SETTINGS)
    @given(safetensors_headers(header), st.booleans())
    def one(new_header: bytes | tuple, honest_length: bool) -> None:
        if isinstance(new_header, tuple):
            new_header = deep_json(new_header[1], new_header[2]).encode()
        size = len(new_header) if honest_length else len(new_header) + 10**6
        (d / "model.safetensors").write_bytes(struct.pack("<Q", size) + new_header + body)
        loads_or_refuses(d)

    one()


# ----------------------------------------------------------------------------- config, tokenizer
@st.composite
def config_files(draw, config: dict) -> str | tuple:
    """config.json's text, or ("deep", depth, opener) for one nested thousands deep."""
    kind = draw(st.sampled_from(["key", "key", "count", "whole", "deep"]))
    config = dict(config)
    if kind == "key":
        config[draw(st.sampled_from(sorted(config)) | st.text(max_size=10))] = draw(json_values)
        return json.dumps(config)
    if kind == "count":
        name = draw(st.sampled_from(["num_hidden_layers", "hidden_size", "vocab_size", "num_attention_heads",
                                     "num_key_value_heads", "intermediate_size", "head_dim",
                                     "max_position_embeddings"]))
        config[name] = draw(st.sampled_from([0, -1, 1, 3, 10**6, 2**40, 2**80]))
        return json.dumps(config)
    if kind == "whole":
        return json.dumps(draw(json_values))
    return "deep", draw(st.sampled_from([1000, DEEP])), draw(st.sampled_from("[{"))


def test_fuzzed_config_and_tokenizer_files_load_or_are_refused(source, tmp_path):
    config = json.loads((source / "config.json").read_text())
    d = tmp_path / "m"
    shutil.copytree(source, d, ignore=shutil.ignore_patterns("*.gguf"))
    tokenizer = (source / "tokenizer.json").read_bytes()

    @seed(SEED)
    @settings(max_examples=N, **SETTINGS)
    @given(config_files(config), st.sampled_from(["keep", "bytes", "json", "cut"]), st.binary(max_size=64),
           json_values)
    def one(text: str | tuple, tk_kind: str, junk: bytes, tk_json) -> None:
        (d / "config.json").write_text(deep_json(text[1], text[2]) if isinstance(text, tuple) else text)
        tk = {"keep": tokenizer, "bytes": junk, "json": json.dumps(tk_json).encode(),
              "cut": tokenizer[: len(tokenizer) // 2]}[tk_kind]
        (d / "tokenizer.json").write_bytes(tk)
        loads_or_refuses(d)

    one()
