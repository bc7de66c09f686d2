"""The frames exchanged between the leader and its rank processes.

Every frame is a msgspec Struct tagged by ``op`` and carries ``id`` (the correlation id; a reply
names the id it answers) and ``epoch`` (the rank group's generation; it changes at every
respawn, so a late reply from an old group can never be taken for an answer of the new one).
"""

from __future__ import annotations

from typing import Any, Union

import msgspec


class Frame(msgspec.Struct, tag_field="op", array_like=True, gc=False, frozen=True):
    id: int
    epoch: int


# ---------------------------------------------------------------------------------------------
# Shared payloads


class ModelConfig(msgspec.Struct, frozen=True):
    """The architecture a rank builds; parsed by the leader from config.json or GGUF metadata."""

    family: str  # the model_type of a family in neuron.models.families (llama, qwen3, qwen3_moe, ...)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_scaling: dict[str, float | str | int] | None = None
    qk_norm: bool = False
    attention_bias: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = []
    # What each layer is, where a family has more than one kind (e.g. "attention", "recurrent");
    # empty: every layer is attention.
    layer_types: list[str] = []
    # Settings only one family reads, by their config.json names (its module says which).
    extra: dict[str, int | float | str | bool | list[int]] = {}
    # A model that sees images (neuron.loader.vision_config): its vision tower's config.json
    # section ("config"), its image processor's settings ("processor"), the image tokens' ids and
    # the text model's M-RoPE sections. Empty: text only.
    vision: dict[str, Any] = {}


class StepImage(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """An image of a sequence's prompt: its ``tokens`` image-pad tokens from ``offset`` on, its
    patch grid (t, h, w) and content hash ``key``. ``data`` (the encoded file) is sent when the
    ranks must run the vision tower on it and have not kept its embeddings; empty otherwise (kept
    under ``key``, or not needed: the image lies wholly before the step's first position)."""

    key: bytes
    offset: int
    tokens: int
    grid: tuple[int, int, int]
    data: bytes = b""


class Sampling(msgspec.Struct, array_like=True, gc=False, frozen=True):
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    prompt_len: int = 0
    logprobs: int = 0  # 0: none; n > 0: the chosen token's logprob and the n - 1 most likely
    logit_bias: list[tuple[int, float]] = []  # added to those tokens' logits before anything else
    min_tokens: int = 0  # while fewer tokens than this are generated, `stop_token_ids` cannot be drawn
    stop_token_ids: list[int] = []


MAX_DRAFTS = 16  # drafts a seq may carry in a step (StepSeq.drafts)


class StepSeq(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """One sequence's share of a step: ``tokens`` at positions ``start_pos``.. of the sequence in
    ``slot`` (the rank's row for it: its block table and sampler state).

    - ``tokens == [-1]``: a decode whose input is the token the rank drew last for this slot, still
      on the device (overlapped steps: the leader has not seen it yet).
    - ``sample``: draw a token after the last of ``tokens`` (False for a prompt chunk that is not
      the prompt's last).
    - ``blocks``: KV-cache blocks that fill the slot's block table from entry ``block_start`` on
      (the blocks the sequence gained since its last step; all of them from entry 0 at its start).
    - ``sampling``: set on the first step of a sequence in this slot; it resets the slot's sampler
      state, and the slot keeps these parameters until the next sequence starts there.
    - ``allowed`` (structured output): a bitmask over the vocabulary, ceil(vocab / 32)
      little-endian uint32 words, bit ``t`` set when token ``t`` may be drawn next; None: any.
    - ``mask_later`` (with ``sample``, without ``allowed``): the mask comes in a ``StepMasks``
      frame for this step, which the sampling rank waits for before it samples (the leader
      learns the token before, which the mask depends on, while this step's forward runs).
    - ``context``: for a sequence whose first step starts past 0 (its prefix came from the prefix
      cache), the tokens before ``start_pos``, when its penalties need them.
    - ``state``: for a model whose layers keep a fixed-size state per sequence (a recurrent layer),
      the state slot the leader gave the sequence (-1: the model keeps none). The rank clears it
      on the sequence's first step (``sampling`` set).
    - ``state_from`` (with ``sampling``; the prefix cache of such a model): the sequence starts at
      ``start_pos`` from the state in this slot (a snapshot taken after the same first
      ``start_pos`` tokens), copied into ``state`` instead of clearing it; ``state`` itself: the
      slot holds it already (restored from the host tier, ``Step.state_restore``).
    - ``snapshots``: (position, slot) pairs: the state after the sequence's first ``position``
      tokens (``start_pos < position <= start_pos + len(tokens)``) is copied into ``slot``.
    - ``kv_from`` (with ``sampling``): a KV block whose K/V the sequence's block at table entry
      ``start_pos // block_size`` takes before the step (a cached partial block, copied: the
      sequence then writes the rest of it).
    - ``images`` (with ``sampling``): the prompt's images, in order; the slot keeps them (their
      embeddings and M-RoPE positions) until the next sequence starts there.
    - ``drafts`` (speculative decoding, with ``sample``): the last ``drafts`` of ``tokens`` are
      guesses of the tokens to come; the rank keeps the longest run of them its own draws
      confirm, and draws one token after it (``StepResult.drafted``).
    - ``propose`` (speculative decoding from the model's MTP layer): the MTP layer runs over the
      step's tokens; with ``sample``, it then proposes up to this many drafts to follow the draw
      (``StepResult.proposals``), chained from its own outputs. A prompt chunk without ``sample``
      only fills the layer's cache (its last position waits for the next chunk's first token).
    """

    slot: int
    tokens: list[int]
    start_pos: int
    sample: bool = False
    blocks: list[int] = []
    block_start: int = 0
    sampling: Sampling | None = None
    allowed: bytes | None = None
    context: list[int] = []  # with ``sampling``: the tokens before start_pos (penalties count them)
    state: int = -1
    state_from: int = -1
    snapshots: list[tuple[int, int]] = []
    kv_from: int = -1
    images: list[StepImage] = []
    drafts: int = 0
    propose: int = 0
    mask_later: bool = False


class StepTimings(msgspec.Struct, array_like=True, gc=False, frozen=True):
    forward_ms: float  # from the step's arrival on the device thread to its tokens on the host
    host_ms: float  # of which the rank's host work to prepare and launch it
    idle_ms: float = 0.0  # the device's idle gap before the step (0 when it was queued in time)
    mask_wait_ms: float = 0.0  # of host_ms, the wait for the step's late masks (StepMasks)
    offload_ms: float = 0.0  # the device's time copying KV blocks into the host tier (Step.offload)
    restore_ms: float = 0.0  # ... and back (Step.restore)


# ---------------------------------------------------------------------------------------------
# Leader -> rank


class Ping(Frame, tag="ping"):
    pass


class InitDist(Frame, tag="init_dist"):
    backend: str
    rendezvous: str
    world: int
    rank: int
    timeout_s: float = 60.0


class SanityCheck(Frame, tag="sanity_check"):
    pass


class CheckpointQuant(msgspec.Struct, frozen=True):
    """How a checkpoint its publisher quantized stores its projections (config.json's
    ``quantization_config``, as the leader read it): ``method`` awq | gptq | fp8."""

    method: str
    bits: int = 4
    group_size: int = 128  # -1: one group per row (AWQ, GPTQ)
    sym: bool = False  # GPTQ
    block: list[int] = []  # FP8 weight_block_size [rows, columns]; []: a scale per tensor or per row
    keep_float: list[str] = []  # modules left unquantized (names or name prefixes)


BlockHash = bytes  # a KV block's chain hash (engine/blocks.py); LoadOk has a field named bytes


class LoadShard(Frame, tag="load_shard"):
    model: str
    format: str  # safetensors | gguf
    paths: list[str]
    config: ModelConfig
    dtype: str
    max_slots: int  # sequences a step may hold (slots)
    max_len: int
    quant: str | None = None
    block_size: int = 16
    kv_tokens: int = 0  # KV-cache capacity; 0: as much as memory_fraction of the device allows
    memory_fraction: float = 0.9
    max_step_tokens: int = 2048  # the largest step the leader will send (sizes the activations)
    cuda_graphs: bool = True
    state_dtype: str = "float32"  # of a recurrent layer's accumulating state
    # State slots for snapshots (the prefix cache of a model with recurrent state) beside one per
    # running sequence; -1: by memory (neuron.runner.sizing.state_snapshots).
    state_snapshots: int = 0
    checkpoint_quant: CheckpointQuant | None = None
    # Pipeline stages the group's ranks form (neuron.models.stages): world / pipeline ranks a stage.
    pipeline: int = 1
    draft_rows: int = 0  # the most rows (decodes and their drafts) a step with drafts carries
    mtp: bool = False  # load the checkpoint's multi-token-prediction layer (StepSeq.propose)
    host_bytes: int = 0  # host memory for the host tier of the prefix cache (Step.offload); 0: none
    # The disk tier below it (Step.spill, Step.fetch): this rank's files under ``disk_dir``, at most
    # ``disk_bytes`` of them, kept only while ``disk_identity`` (what the K/V was computed with) holds.
    disk_dir: str = ""
    disk_bytes: int = 0
    disk_identity: str = ""


class Step(Frame, tag="step"):
    """``offload``: (KV block, host slot) pairs, each block's K/V copied into the slot of the
    rank's host tier (``LoadOk.host_blocks``) before anything else of the step; ``restore``:
    (host slot, KV block) pairs, each slot's copied back into the block next, before the
    step's sequences run.

    The disk tier, before those: ``disk_drop``, files deleted (by block hash); ``spill``, (host
    slot, hash) pairs, the slot's block written to disk (in the background) before the slot is
    reused; after the moves, ``fetch``, (hash, host slot) pairs, files read into host slots in
    the background (a restore from such a slot waits for its read). A step may hold no ``seqs``:
    it carries moves, or asks for the disk tier's news (``StepResult.disk_fetched``)."""

    step_id: int
    seqs: list[StepSeq]
    forget_images: list[bytes] = []  # image embeddings the ranks drop after the step's own images (by key)
    offload: list[tuple[int, int]] = []
    restore: list[tuple[int, int]] = []
    disk_drop: list[bytes] = []
    spill: list[tuple[int, bytes]] = []
    fetch: list[tuple[bytes, int]] = []
    # A model with recurrent state: its snapshots' pieces, a host slot each (LoadOk.state_pieces),
    # moved beside the blocks: (state slot, piece, host slot) copied in, (host slot, state slot,
    # piece) copied back; piece j is bytes j * slot bytes on of the state slot's buffers.
    state_offload: list[tuple[int, int, int]] = []
    state_restore: list[tuple[int, int, int]] = []


class StepMasks(Frame, tag="step_masks"):
    """The masks of a step's ``mask_later`` rows: slot ``slots[i]`` takes ``masks[which[i]]``
    (each distinct mask once: streams in the same grammar state share one; b"": that row samples
    unconstrained, its sequence has ended). Sent to the sampling rank only; no reply."""

    step_id: int
    slots: list[int]
    masks: list[bytes]
    which: list[int]


class Free(Frame, tag="free"):
    slots: list[int]


class Memory(Frame, tag="memory"):
    pass


class Unload(Frame, tag="unload"):
    model: str


class Shutdown(Frame, tag="shutdown"):
    pass


class InjectFault(Frame, tag="inject_fault"):
    """Test hook, honoured only by ranks started with fault injection enabled."""

    kind: str  # oom: the next step raises an out-of-memory error on this rank


# ---------------------------------------------------------------------------------------------
# Rank -> leader


class Pong(Frame, tag="pong"):
    rank: int
    world: int
    device: str
    pid: int


class InitOk(Frame, tag="init_ok"):
    pass


class SanityResult(Frame, tag="sanity_result"):
    observed: float


class LoadOk(Frame, tag="load_ok"):
    kv_capacity: int  # tokens of KV cache this rank holds (kv_blocks * block_size)
    bytes: int  # resident weight bytes of this rank's shard
    kv_bytes: int = 0
    kv_blocks: int = 0
    graphs: list[int] = []  # decode batch sizes captured as CUDA graphs
    packing: str = ""  # how the shard stores its projections, e.g. "int4 from Q4_1 x210, dense bfloat16 x0"
    state_slots: int = 0  # per-sequence state slots of the model's recurrent layers (0: it has none)
    state_bytes: int = 0
    state_snapshots: int = 0  # of the state slots, those for snapshots (the rest: one per running sequence)
    host_blocks: int = 0  # slots of the host tier (LoadShard.host_bytes), each one KV block
    disk_blocks: int = 0  # block files the disk tier holds at most (LoadShard.disk_bytes)
    disk_hashes: list[BlockHash] = []  # those it holds from before, least recently used first
    state_pieces: int = 0  # host slots one state snapshot takes in the host tier (0: snapshots stay here)
    cpu_isa: str = ""  # the CPU kernels' instruction-set level ("avx2", ...), "none" without them; "" on a GPU
    # What a step costs on a GPU with CUDA graphs, measured at load (runner/step_times.py):
    # (decode graph batch, ms) and (prefill graph tokens, ms); empty elsewhere.
    decode_ms: list[tuple[int, float]] = []
    prefill_ms: list[tuple[int, float]] = []


class StepResult(Frame, tag="step_result"):
    step_id: int
    tokens: list[int]  # one per seq of the step; -1 where the seq sampled nothing
    timings: StepTimings
    logprobs: list[list[tuple[int, float]]] | None = None
    # Speculative decoding: per seq, the drafts the rank accepted, which come before tokens[i]
    # (empty for a seq without drafts); None when the step carried none.
    drafted: list[list[int]] | None = None
    # Per seq, the drafts its MTP layer proposes to follow tokens[i] (StepSeq.propose); None when
    # no seq of the step asked.
    proposals: list[list[int]] | None = None
    # The disk tier's news since the last step (the sampling rank's own): blocks read into their
    # host slots, and blocks it no longer holds (a read or write that failed, a file deleted).
    disk_fetched: list[bytes] = []
    disk_lost: list[bytes] = []


class Freed(Frame, tag="freed"):
    pass


class MemoryInfo(Frame, tag="memory_info"):
    free: int
    total: int
    kv_used: int


class Unloaded(Frame, tag="unloaded"):
    pass


class Bye(Frame, tag="bye"):
    pass


class FaultArmed(Frame, tag="fault_armed"):
    kind: str


class Error(Frame, tag="error"):
    kind: str  # oom | device_fault | bad_request | unknown_op | load_failed | ...
    message: str


class Telemetry(msgspec.Struct, omit_defaults=True):
    """A rank's device, as its heartbeat last saw it; -1 where nothing reports it."""
    device: str  # "cuda:0", "cpu"
    memory_used: int  # bytes: on a GPU the device's (NVML) or this rank's allocator's, on a CPU the host's
    memory_total: int
    utilization: float = -1.0  # percent: the GPU's (NVML), or this rank's share of its CPU threads
    temperature_c: float = -1.0  # the GPU's (NVML) or the CPU package's (thermal zone)
    cpu_isa: str = ""  # the CPU kernels' level, on a CPU rank
    threads: int = 0  # torch's threads, on a CPU rank
    torch: str = ""  # torch's version on the rank
    cuda: str = ""  # the CUDA runtime torch was built with, on a GPU rank


class Heartbeat(Frame, tag="heartbeat"):
    rank: int
    busy_step: int  # the step id in flight on the device thread, -1 when idle
    loaded_bytes: int = 0  # weight bytes read so far by the load in progress (or the last one)
    telemetry: Telemetry | None = None


Request = Union[Ping, InitDist, SanityCheck, LoadShard, Step, StepMasks, Free, Memory, Unload, Shutdown, InjectFault]
Reply = Union[
    Pong, InitOk, SanityResult, LoadOk, StepResult, Freed, MemoryInfo, Unloaded, Bye, FaultArmed, Error, Heartbeat
]

REQUEST_TYPES: tuple[type[Frame], ...] = Request.__args__  # type: ignore[attr-defined]
REPLY_TYPES: tuple[type[Frame], ...] = Reply.__args__  # type: ignore[attr-defined]
