"""The one typed configuration object: ``conf/neuron.toml``, then ``NEURON_SECTION__KEY``
environment overrides, then command-line flags."""

from __future__ import annotations

import dataclasses
import os
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, get_type_hints

import msgspec

from protocol import MAX_DRAFTS

from .prefix_tiers import CacheConfig, cache_refused


class ConfigError(ValueError):
    pass


QUANTIZE = ("", "q8_0", "q4", "fp8")
# How a model's tool calls and thinking are read from its output (neuron.parsing.tool_calls,
# neuron.parsing.reasoning); "auto" finds them in the chat template.
TOOL_PARSERS = ("auto", "none", "hermes", "llama3_json", "mistral")
REASONING_PARSERS = ("auto", "none", "think", "seed", "mistral", "kimi")


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 13131
    max_body_bytes: int = 4 * 1024 * 1024
    api_key: str = ""
    admin_api_key: str = ""
    drain_timeout_s: float = 15.0
    log_level: str = "info"
    log_format: str = "text"  # text | json (one JSON object per line)
    # Binding beyond loopback without an admin key exposes /models/load to the network.
    allow_insecure_admin: bool = False
    model_roots: list[str] = field(default_factory=list)  # directories /models/load may read from
    cors_allow_origins: list[str] = field(default_factory=list)  # empty: CORS off
    cors_allow_methods: list[str] = field(default_factory=lambda: ["GET", "POST", "OPTIONS"])
    cors_allow_headers: list[str] = field(default_factory=lambda: ["authorization", "content-type", "x-request-id"])
    stored_responses: int = 256
    allow_request_chat_template: bool = False  # a request's template is a program run here: off unless trusted
    api_keys_file: str = ""  # named keys: [[keys]] of name, key_sha256, caps, weight, gateway (server/keys.py)
    key_max_running: int = 0  # a key's running requests per model at most, unless its entry says (0: no cap)
    key_max_waiting: int = 0  # a key's waiting requests per model at most, unless its entry says (0: no cap)
    principal_header: str = ""  # a gateway's header naming the account: believed from gateway keys, trusted_proxies
    trusted_proxies: list[str] = field(default_factory=list)  # addresses whose principal_header is believed
    max_principals: int = 100  # distinct principals named in /metrics; the rest are counted as "other"
    metrics_public: bool = False  # true: /metrics needs no admin key
    api_processes: int | str = "auto"  # HTTP processes beside the engine core; 0: none (core/api_processes.py)


@dataclass
class SpeculativeConfig:
    """``[[models]] speculative = { method = "ngram", tokens = 4 }``: each decode guesses up to
    ``tokens`` tokens (prompt lookup: what followed the last place the sequence's latest tokens
    occurred; ``mtp``: the checkpoint's multi-token-prediction layer) and one step checks them
    all. Empty ``method``: off. ``replay`` (a recorded
    answer per prompt, from the JSON lines file ``replay``) and ``random`` measure the mechanism."""

    method: str = ""
    tokens: int = 4
    replay: str = ""  # method "replay": JSON lines of {"prompt": [ids], "output": [ids]}


@dataclass
class ModelEntry:
    model: str = "SmolLM2-135M-Instruct"
    id: str = ""
    aliases: list[str] = field(default_factory=list)  # more names it answers to: exact, or * globs (model_names.py)
    tensor_parallel: int = 1
    pipeline_parallel: int = 1  # stages of layers, each tensor_parallel ranks (docs/multihost.md)
    device: str = "auto"
    devices: list[int] = field(default_factory=list)
    dtype: str = "auto"
    quantize: str = ""  # q8_0 | q4: quantize float weights at load; "" keeps the file's format
    max_model_len: int = 2048
    max_slots: int = 8
    block_size: int = 16
    kv_cache_tokens: int = 0
    gpu_memory_utilization: float = 0.9
    cuda_graphs: bool = True
    prefix_caching: bool = True
    # Models whose layers keep a recurrent state (the hybrid family):
    state_dtype: str = "float32"  # of the delta-rule state (bfloat16 halves its memory)
    state_snapshots: int = -1  # slots for the prefix cache's state snapshots; -1: by memory, 0: none
    state_snapshot_interval: int = 512  # tokens between a prompt's snapshots
    tool_parser: str = "auto"
    reasoning_parser: str = "auto"
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)


@dataclass
class EngineConfig:
    max_batch_tokens: int = 0  # 0: by device (see engine_sizes)
    prefill_chunk: int = 0
    prefill_chunk_decoding: int = 0
    decode_slowdown: float = 1.4  # GPU, prefill_chunk_decoding 0: a step with prompt chunks beside decodes, × theirs alone
    queue_size: int = 64
    max_queue_wait_s: float = 60.0
    steps_in_flight: int = 0
    image_embedding_cache_mb: float = 512.0  # a rank's kept image embeddings (models that see images)
    image_pixels_per_request: int = 48 * 1024 * 1024  # what a request's images may decode to, together


@dataclass
class HttpConfig:
    max_header_bytes: int = 65536
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    keep_alive_timeout_s: float = 5.0
    write_timeout_s: float = 30.0
    max_connections: int = 1024
    max_inflight_body_bytes: int = 16 * 1024 * 1024


@dataclass
class GrammarConfig:
    max_bytes: int = 131072
    max_depth: int = 64
    max_refs: int = 256
    max_choices: int = 1024
    compile_timeout_s: float = 10.0
    compile_memory_bytes: int = 4 * 1024 * 1024 * 1024
    compile_workers: int = 2


@dataclass
class TemplateConfig:
    render_timeout_s: float = 5.0
    render_memory_bytes: int = 1024 * 1024 * 1024
    max_output_chars: int = 16 * 1024 * 1024
    workers: int = 4


@dataclass
class TimeoutConfig:
    spawn_s: float = 90.0
    control_s: float = 30.0
    load_s: float = 600.0
    step_base_s: float = 30.0
    step_per_token_s: float = 0.05
    heartbeat_timeout_s: float = 5.0
    recovery_attempts: int = 3


@dataclass
class RuntimeConfig:
    dir: str = ""
    hf_cache: str = ""
    transport: str = "ipc"  # ipc: sockets in a private directory; tcp: 127.0.0.1 with CURVE


@dataclass
class ClusterConfig:
    """One model across hosts (docs/multihost.md). Node 0 (the head) serves HTTP; the others
    only start their ranks for it. ``NNODES``, ``NODE_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``
    (torchrun's names) override the file; flags override both."""

    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = ""
    master_port: int = 29500
    group_key: str = ""  # the file `neuron keygen` wrote; every node holds the same one
    join_timeout_s: float = 300.0  # how long the head waits for the other nodes


@dataclass
class DebugConfig:
    tap: str = ""
    fault_injection: bool = False


@dataclass
class LogConfig:
    access: bool = True  # one line per request (method, path, status, principal, time, error): access_log.py


@dataclass
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    log: LogConfig = field(default_factory=LogConfig)
    models: list[ModelEntry] = field(default_factory=lambda: [ModelEntry()])
    engine: EngineConfig = field(default_factory=EngineConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    http: HttpConfig = field(default_factory=HttpConfig)
    grammar: GrammarConfig = field(default_factory=GrammarConfig)
    templates: TemplateConfig = field(default_factory=TemplateConfig)
    timeouts: TimeoutConfig = field(default_factory=TimeoutConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)


def _converted(kind: Any, value: Any, where: str, strict: bool = True) -> Any:
    """``value`` as ``kind`` by ``msgspec.convert`` (``strict``: TOML's own types; else the
    environment's strings read as numbers where a number is wanted); its complaint as ours."""
    try:
        return msgspec.convert(value, kind, strict=strict)
    except msgspec.ValidationError as exc:
        text, _, at = str(exc).partition(" - at `$")
        raise ConfigError(f"{where}{at.rstrip('`')}: {text[:1].lower()}{text[1:].replace('`', '')}") from None


def _check_keys(cls: type, data: Any, where: str) -> None:
    """A table of ``cls``'s keys only, and the same for each table inside it (msgspec would
    silently drop a misspelt key)."""
    if not isinstance(data, dict):
        raise ConfigError(f"[{where}] must be a table")
    hints = get_type_hints(cls)
    unknown = set(data) - set(hints)
    if unknown:
        raise ConfigError(f"[{where}] has unknown keys: {', '.join(sorted(unknown))} (known: {', '.join(sorted(hints))})")
    for key, value in data.items():
        if dataclasses.is_dataclass(hints[key]):
            _check_keys(hints[key], value, f"{where}.{key}")


def _fill(cls: type, data: Any, where: str, strict: bool = True) -> Any:
    return _check_keys(cls, data, where) or _converted(cls, data, where, strict)


BOOL_WORDS = {**dict.fromkeys(("1", "true", "yes", "on"), True), **dict.fromkeys(("0", "false", "no", "off", ""), False)}


def _from_env(kind: Any, value: str, where: str) -> Any:
    """An environment variable's text as ``kind``: true/false as on/off/yes/no/1/0 too, lists
    comma-separated, a speculative setting as ``method=ngram,tokens=4``, "auto" where a number
    may be that."""
    if kind is bool:
        if value.lower() not in BOOL_WORDS:
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return BOOL_WORDS[value.lower()]
    if kind == int | str:
        return "auto" if value == "auto" else _converted(int, value, where, strict=False)
    if kind in (list[int], list[str]):
        return _converted(kind, [v.strip() for v in value.split(",") if v.strip()], where, strict=False)
    if kind is SpeculativeConfig:
        table = dict(part.split("=", 1) if "=" in part else (part, "") for part in value.split(",") if part)
        return _fill(kind, table, where, strict=False)
    return _converted(kind, value, where, strict=False)


def load_config(path: str | Path | None = None, env: dict[str, str] | None = None) -> Config:
    data: dict[str, Any] = {}
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text())
        except OSError as exc:
            raise ConfigError(f"cannot read config {path}: {exc}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path} is not valid TOML: {exc}") from None
    sections: dict[str, type] = {f.name: type(getattr(Config(), f.name)) for f in fields(Config) if f.name != "models"}
    unknown = set(data) - set(sections) - {"models"}
    if unknown:
        raise ConfigError(f"unknown config sections: {', '.join(sorted(unknown))}")
    cfg = Config()
    for name, cls in sections.items():
        setattr(cfg, name, _fill(cls, data.get(name, {}), name))
    if "models" in data:
        if not isinstance(data["models"], list):
            raise ConfigError("models must be an array of tables ([[models]])")
        cfg.models = [_fill(ModelEntry, m, f"models[{i}]") for i, m in enumerate(data["models"])]
    _apply_env(cfg, os.environ if env is None else env)
    _apply_torchrun_env(cfg.cluster, os.environ if env is None else env)
    validate(cfg)
    return cfg


TORCHRUN_ENV = {"NNODES": "nnodes", "NODE_RANK": "node_rank", "MASTER_ADDR": "master_addr", "MASTER_PORT": "master_port"}


def _apply_torchrun_env(cluster: ClusterConfig, env: dict[str, str]) -> None:
    """What torchrun, ``srun`` wrappers and a LeaderWorkerSet set for every node."""
    hints = get_type_hints(ClusterConfig)
    for key, name in TORCHRUN_ENV.items():
        if env.get(key, "").strip():
            setattr(cluster, name, _from_env(hints[name], env[key].strip(), key))


def _apply_env(cfg: Config, env: dict[str, str]) -> None:
    """``NEURON_SERVER__PORT=8080`` sets ``[server] port``; ``NEURON_MODELS__0__DTYPE`` a model's."""
    for key, value in env.items():
        if not key.startswith("NEURON_") or "__" not in key:
            continue
        parts = key[len("NEURON_"):].lower().split("__")
        if parts[0] == "models" and len(parts) == 3 and parts[1].isdigit():
            index = int(parts[1])
            while len(cfg.models) <= index:
                cfg.models.append(ModelEntry())
            target, name, where = cfg.models[index], parts[2], f"{key}"
        elif len(parts) == 2 and hasattr(cfg, parts[0]) and parts[0] != "models":
            target, name, where = getattr(cfg, parts[0]), parts[1], key
        else:
            raise ConfigError(f"environment variable {key} names no config key")
        hints = get_type_hints(type(target))
        if name not in hints:
            raise ConfigError(f"environment variable {key} names no config key")
        setattr(target, name, _from_env(hints[name], value, where))


def validate(cfg: Config) -> None:
    for i, m in enumerate(cfg.models):
        if m.tensor_parallel < 1 or m.pipeline_parallel < 1:
            raise ConfigError(f"models[{i}].tensor_parallel and pipeline_parallel must be at least 1")
        if m.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"models[{i}].device must be auto, cpu or cuda")
        if m.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"models[{i}].dtype must be auto, float32, bfloat16 or float16")
        if m.quantize not in QUANTIZE:
            raise ConfigError(f"models[{i}].quantize must be empty, q8_0 or q4, not {m.quantize!r}")
        if not 1 <= m.max_slots <= 4096 or m.max_model_len < 16:
            raise ConfigError(f"models[{i}]: max_slots must be in 1..4096 and max_model_len >= 16")
        if m.block_size not in (8, 16, 32, 64, 128, 256):
            raise ConfigError(f"models[{i}].block_size must be one of 8, 16, 32, 64, 128, 256")
        if m.kv_cache_tokens < 0 or not 0.05 <= m.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"models[{i}]: kv_cache_tokens must be >= 0 and gpu_memory_utilization in [0.05, 1]")
        if m.state_dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"models[{i}].state_dtype must be float32, bfloat16 or float16")
        if not -1 <= m.state_snapshots <= 65536 or m.state_snapshot_interval < m.block_size \
                or m.state_snapshot_interval % m.block_size:
            raise ConfigError(f"models[{i}]: state_snapshots must be in -1..65536 and state_snapshot_interval a "
                              "multiple of block_size")
        if m.tool_parser not in TOOL_PARSERS:
            raise ConfigError(f"models[{i}].tool_parser must be one of {', '.join(TOOL_PARSERS)}")
        if m.speculative.method not in ("", "ngram", "mtp", "replay", "random"):
            raise ConfigError(f"models[{i}].speculative.method must be \"ngram\", \"mtp\", \"replay\" or "
                              f"\"random\" (or empty: off), not {m.speculative.method!r}")
        if not 1 <= m.speculative.tokens <= MAX_DRAFTS:
            raise ConfigError(f"models[{i}].speculative.tokens must be in 1..{MAX_DRAFTS}")
        if (m.speculative.method == "replay") != bool(m.speculative.replay):
            raise ConfigError(f"models[{i}].speculative.replay (a file of recorded answers) is for method "
                              "\"replay\", and that method needs it")
        if m.reasoning_parser not in REASONING_PARSERS:
            raise ConfigError(f"models[{i}].reasoning_parser must be one of {', '.join(REASONING_PARSERS)}")
        if not all(isinstance(a, str) and 0 < len(a) <= 200 for a in m.aliases):
            raise ConfigError(f"models[{i}].aliases must be names (or * globs) of 1 to 200 characters")
    if cfg.server.stored_responses < 0:
        raise ConfigError("server.stored_responses must not be negative")
    if cfg.server.api_processes != "auto" and not (isinstance(cfg.server.api_processes, int)
                                                   and 0 <= cfg.server.api_processes <= 64):
        raise ConfigError('server.api_processes must be "auto" or in 0..64')
    if cfg.debug.tap and not (cfg.debug.tap.startswith("ipc://") or cfg.debug.tap.startswith("tcp://127.")):
        raise ConfigError("debug.tap must be an ipc:// or tcp://127.x endpoint (the tap is local only)")
    if cfg.server.log_format not in ("text", "json"):
        raise ConfigError("server.log_format must be text or json")
    for origin in cfg.server.cors_allow_origins:
        if origin != "*" and not origin.startswith(("http://", "https://")):
            raise ConfigError(f"server.cors_allow_origins: {origin!r} is not \"*\" nor an http(s):// origin")
    for root in cfg.server.model_roots:
        if not Path(root).expanduser().is_absolute():
            raise ConfigError(f"server.model_roots: {root!r} must be an absolute path")
    validate_cluster(cfg)
    if cfg.runtime.transport not in ("ipc", "tcp"):
        raise ConfigError("runtime.transport must be ipc or tcp")
    if (cfg.engine.queue_size < 1 or cfg.engine.max_batch_tokens < 0 or cfg.engine.prefill_chunk < 0
            or cfg.engine.prefill_chunk_decoding < 0 or not 0 <= cfg.engine.steps_in_flight <= 8
            or not cfg.engine.decode_slowdown >= 1.0 or cfg.engine.image_embedding_cache_mb < 0 or cfg.engine.image_pixels_per_request < 1):
        raise ConfigError("engine sizes must be positive (0 for the device's default), decode_slowdown at least 1")
    for name, section in (("http", cfg.http), ("grammar", cfg.grammar), ("templates", cfg.templates)):
        for f in dataclasses.fields(section):
            if getattr(section, f.name) <= 0:
                raise ConfigError(f"{name}.{f.name} must be positive")
    if why := cache_refused(cfg.cache):
        raise ConfigError(why)
    if cfg.http.max_inflight_body_bytes < cfg.server.max_body_bytes:
        raise ConfigError("http.max_inflight_body_bytes must be at least server.max_body_bytes")


def validate_cluster(cfg: Config) -> None:
    c = cfg.cluster
    if c.nnodes < 1 or not 0 <= c.node_rank < c.nnodes:
        raise ConfigError(f"cluster: node_rank must be in 0..nnodes-1 (nnodes {c.nnodes}, node_rank {c.node_rank})")
    if c.nnodes == 1:
        return
    if not c.master_addr or not c.group_key:
        raise ConfigError("cluster: more than one node needs master_addr (--master-addr, MASTER_ADDR) and a "
                          "group_key file (--group-key; write one with `neuron keygen FILE`)")
    if not 0 < c.master_port < 65536 or c.join_timeout_s <= 0:
        raise ConfigError("cluster: master_port must be a TCP port and join_timeout_s positive")
    if len(cfg.models) != 1:
        raise ConfigError("cluster: a group of nodes serves exactly one model ([[models]] holds one entry)")
    world = cfg.models[0].tensor_parallel * cfg.models[0].pipeline_parallel
    if world % c.nnodes:
        raise ConfigError(f"cluster: tensor_parallel x pipeline_parallel = {world} ranks do not split over {c.nnodes} "
                          "nodes (each node runs world / nnodes ranks)")

