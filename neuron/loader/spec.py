"""Everything the leader knows about a model before any rank exists: its files, architecture,
tokenizer, chat template, stop tokens and sampling defaults. No torch here."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from protocol import CheckpointQuant, ModelConfig

from neuron.errors import BadModelConfig, BadModelFile, LoadError
from .model_config import check_counts, config_from_gguf, config_from_hf, missing_tensors, required_tensors
from .prequantized import checkpoint_quant
from .model_dir import read_bounded
from .resolve import DEFAULT_MODEL, ModelFiles, resolve_model
from .tokenizer import TokenizerInfo, tokenizer_from_gguf
from .vision_config import missing as vision_missing, vision_settings

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
FLOAT_GGUF_TYPES = ("F32", "F16", "BF16", "F64", "I8", "I16", "I32", "I64")


@dataclass
class ModelSpec:
    id: str
    files: ModelFiles
    config: ModelConfig
    tokenizer: TokenizerInfo
    sampling_defaults: dict[str, float] = field(default_factory=dict)
    weight_format: str = ""  # what the files hold: "gguf:Q4_1+Q8_0", "safetensors:bf16"
    quantized: bool = False  # the files hold quantized projection weights (kept packed on the CPU)
    checkpoint_quant: CheckpointQuant | None = None  # how (AWQ, GPTQ), for a quantized safetensors checkpoint
    no_vision: str = "it is a text model"  # why the model takes no images ('' when it does)

    @property
    def context_length(self) -> int:
        return self.config.max_position_embeddings


def model_id_for(ref: str) -> str:
    if ref.endswith(".gguf"):
        return Path(ref).stem
    path = Path(ref)
    try:
        if path.is_dir():
            return path.resolve().name
    except (OSError, ValueError, RuntimeError):  # a name too long, a NUL byte, a link loop
        pass
    return ref.split("/")[-1] if ref.startswith(("/", ".", "~")) else ref


def load_spec(ref: str, *, model_id: str | None = None, hf_cache: str | None = None,
              roots: list[str] | tuple[str, ...] = ()) -> ModelSpec:
    """``roots``: directories besides the model's own where its files may resolve."""
    files = resolve_model(ref, hf_cache=hf_cache, roots=roots)
    mid = model_id or (DEFAULT_MODEL if ref.startswith(("HuggingFaceTB/", DEFAULT_MODEL)) else model_id_for(ref))
    described = files.paths[0].name if files.format == "gguf" else "config.json"
    try:
        if files.format == "gguf":
            return _gguf_spec(mid, files)
        return _hf_spec(mid, files)
    except LoadError:
        raise
    except RecursionError:
        raise BadModelFile(f"model {mid!r}: {described} is nested too deeply") from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError) as exc:
        # A value of the wrong type or range where the format has a number or a name.
        raise BadModelConfig(f"model {mid!r}: {described} holds a malformed value "
                             f"({type(exc).__name__}: {str(exc)[:200]})") from None


def _gguf_spec(mid: str, files: ModelFiles) -> ModelSpec:
    from .gguf_file import GgufFile, GgufFormatError, missing_gguf_tensors

    try:
        gguf = GgufFile(files.paths[0])  # also checks every tensor lies inside the file
    except GgufFormatError as exc:
        raise BadModelFile(f"{files.paths[0].name} is not a readable GGUF file: {exc}") from None
    fields = gguf.fields
    names = set(gguf.tensors)
    tokens = fields.get("tokenizer.ggml.tokens") or []
    config = config_from_gguf(fields, names, len(tokens))
    embedding = gguf.tensors.get("token_embd.weight")
    check_counts(config, names, f"{files.paths[0].name}'s metadata", embedding.shape if embedding else None)
    arch = str(fields.get("general.architecture", ""))
    _refuse_missing(mid, missing_gguf_tensors(required_tensors(config), names, arch), "GGUF metadata")
    try:
        tk = tokenizer_from_gguf(fields)
    except LoadError:
        raise
    except Exception as exc:  # the tokenizers library raises plain Exception for a vocabulary it refuses
        raise BadModelFile(f"{files.paths[0].name}: its tokenizer cannot be built: {str(exc)[:200]}") from None
    eos = [int(fields[k]) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in fields]
    bos_id = fields.get("tokenizer.ggml.bos_token_id")
    info = TokenizerInfo(
        tokenizer=tk,
        bos_token=tk.id_to_token(int(bos_id)) if bos_id is not None else None,
        eos_token_ids=sorted(set(eos)),
        chat_template=fields.get("tokenizer.chat_template"),
        add_bos=bool(fields.get("tokenizer.ggml.add_bos_token", False)),
    )
    return ModelSpec(mid, files, config, info, weight_format=_gguf_format(gguf),
                     quantized=_gguf_format(gguf, quantized_only=True) != "")


def _gguf_format(gguf: Any, quantized_only: bool = False) -> str:
    """The types of the 2-D tensors, most bytes first: "Q4_1+Q8_0"."""
    from collections import Counter

    sizes: Counter[str] = Counter()
    for t in gguf.tensors.values():
        if len(t.shape) >= 2 and (t.qtype.name not in FLOAT_GGUF_TYPES or not quantized_only):
            sizes[t.qtype.name] += int(t.data.nbytes)
    types = "+".join(name for name, _ in sizes.most_common())
    return f"gguf:{types}" if types else ""


def _hf_spec(mid: str, files: ModelFiles) -> ModelSpec:
    from tokenizers import Tokenizer

    d = files.dir
    raw = d.read_json("config.json", required=True)
    dtypes = _safetensors_dtypes(files.paths)
    quant = checkpoint_quant(raw, dtypes)
    config = config_from_hf(raw)
    names = files.tensor_names
    check_counts(config, names, "config.json", files.embedding)
    config = msgspec.structs.replace(config, vision=vision_settings(raw, d, names))
    if quant is not None:  # a packed linear X holds X.qweight, X.qzeros, X.scales for X.weight
        names = frozenset(names) | {n.removesuffix(".qweight") + ".weight" for n in names if n.endswith(".qweight")}
    _refuse_missing(mid, missing_tensors(config, names), "config.json")
    tokenizer_json = d.file("tokenizer.json")
    if tokenizer_json is None:
        raise LoadError(f"model {mid!r} has no tokenizer.json")
    try:
        tk = Tokenizer.from_str(read_bounded(tokenizer_json, "tokenizer.json").decode("utf-8", errors="replace"))
    except Exception as exc:  # the tokenizers library raises plain Exception for a file it cannot read
        raise BadModelFile(f"tokenizer.json is not a tokenizer the tokenizers library reads: "
                           f"{str(exc)[:200]}") from None
    tk_cfg = d.read_json("tokenizer_config.json")
    gen = d.read_json("generation_config.json")
    template = tk_cfg.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    jinja = d.read_text("chat_template.jinja")
    if jinja is not None:
        template = jinja
    if template is not None and not isinstance(template, str):
        raise BadModelConfig("tokenizer_config.json's chat_template is not a string")

    def token_text(value: Any) -> str | None:
        return value.get("content") if isinstance(value, dict) else value

    eos: set[int] = set()
    for source in (raw.get("eos_token_id"), gen.get("eos_token_id")):
        eos.update([source] if isinstance(source, int) else [i for i in source or [] if isinstance(i, int)])
    eos_text = token_text(tk_cfg.get("eos_token"))
    if eos_text and tk.token_to_id(eos_text) is not None:
        eos.add(tk.token_to_id(eos_text))
    info = TokenizerInfo(
        tokenizer=tk,
        bos_token=token_text(tk_cfg.get("bos_token")),
        eos_token_ids=sorted(eos),
        chat_template=template,
        add_bos=bool(tk_cfg.get("add_bos_token", False)),
    )
    defaults = {k: float(gen[k]) for k in SAMPLING_KEYS if isinstance(gen.get(k), (int, float))}
    weight_format = "safetensors:" + "+".join(dtypes)
    if quant is not None and quant.method == "fp8":
        scales = f"blocks of {quant.block[0]}x{quant.block[1]}" if quant.block else "scales per tensor or row"
        weight_format = f"fp8:{scales} ({weight_format})"
    elif quant is not None:
        group = "per row" if quant.group_size == -1 else f"groups of {quant.group_size}"
        weight_format = f"{quant.method}:int{quant.bits} {group} ({weight_format})"
    return ModelSpec(mid, files, config, info, defaults, weight_format=weight_format, quantized=quant is not None,
                     checkpoint_quant=quant, no_vision=vision_missing(raw, d, names))


def _safetensors_dtypes(paths: tuple[Path, ...]) -> dict[str, int]:
    """How many 2-D tensors the headers give each dtype (lower case), most first: the weight
    format is "safetensors:bf16" (or "bf16+f32")."""
    import struct
    from collections import Counter

    dtypes: Counter[str] = Counter()
    for path in paths:
        try:
            with path.open("rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(length))
        except (OSError, ValueError, struct.error):
            continue
        for name, info in header.items():
            if name != "__metadata__" and isinstance(info, dict) and len(info.get("shape", ())) >= 2:
                dtypes[str(info.get("dtype", "?")).lower()] += 1
    return dict(dtypes.most_common())


def _refuse_missing(mid: str, missing: list[str], described_by: str) -> None:
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise BadModelConfig(f"model {mid!r} does not match its {described_by}: its weights lack {shown}")
