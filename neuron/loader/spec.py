"""Everything the leader knows about a model before any rank exists: its files, architecture,
tokenizer, chat template, stop tokens and sampling defaults. No torch here."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from protocol import CheckpointQuant, ModelConfig

from .errors import BadModelConfig, LoadError
from .model_config import config_from_gguf, config_from_hf, missing_tensors, read_config_json, required_tensors
from .prequantized import checkpoint_quant
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
    if path.is_dir():
        return path.resolve().name
    return ref.split("/")[-1] if ref.startswith(("/", ".", "~")) else ref


def load_spec(ref: str, *, model_id: str | None = None, hf_cache: str | None = None) -> ModelSpec:
    files = resolve_model(ref, hf_cache=hf_cache)
    mid = model_id or (DEFAULT_MODEL if ref.startswith(("HuggingFaceTB/", DEFAULT_MODEL)) else model_id_for(ref))
    if files.format == "gguf":
        return _gguf_spec(mid, files)
    return _hf_spec(mid, files)


def _gguf_spec(mid: str, files: ModelFiles) -> ModelSpec:
    from .gguf_file import GgufFile, GgufFormatError, missing_gguf_tensors

    try:
        gguf = GgufFile(files.paths[0])  # also checks every tensor lies inside the file
    except GgufFormatError as exc:
        raise BadModelConfig(f"{files.paths[0].name} is not a readable GGUF file: {exc}") from None
    fields = gguf.fields
    names = set(gguf.tensors)
    tokens = fields.get("tokenizer.ggml.tokens") or []
    config = config_from_gguf(fields, names, len(tokens))
    arch = str(fields.get("general.architecture", ""))
    _refuse_missing(mid, missing_gguf_tensors(required_tensors(config), names, arch), "GGUF metadata")
    tk = tokenizer_from_gguf(fields)
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

    d = files.directory
    raw = read_config_json(d / "config.json")
    dtypes = _safetensors_dtypes(files.paths)
    quant = checkpoint_quant(raw, dtypes)
    config = config_from_hf(raw)
    names = files.tensor_names
    config = msgspec.structs.replace(config, vision=vision_settings(raw, d, names))
    if quant is not None:  # a packed linear X holds X.qweight, X.qzeros, X.scales for X.weight
        names = frozenset(names) | {n.removesuffix(".qweight") + ".weight" for n in names if n.endswith(".qweight")}
    _refuse_missing(mid, missing_tensors(config, names), "config.json")
    if not (d / "tokenizer.json").is_file():
        raise LoadError(f"model {mid!r} has no tokenizer.json")
    tk = Tokenizer.from_file(str(d / "tokenizer.json"))
    tk_cfg = _optional_json(d / "tokenizer_config.json")
    gen = _optional_json(d / "generation_config.json")
    template = tk_cfg.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if (d / "chat_template.jinja").is_file():
        template = (d / "chat_template.jinja").read_text()

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


def _optional_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise BadModelConfig(f"{path.name} does not parse: {exc}") from None
    return data if isinstance(data, dict) else {}
