"""The GPU kernels the step calls, in one namespace (``from neuron.kernels import gpu``). Importing
it imports Triton: only where a GPU runs the step, or under ``TRITON_INTERPRET=1`` in tests."""

from __future__ import annotations

from .attention import MERGE_PARTS, decode_splits, paged_decode, paged_prefill, quantizable
from .conv import causal_conv, conv_snapshots
from .deltanet import delta_rule, delta_rule_chunked, delta_rule_recurrent, gated_rms_norm
from .dense import GEMV_CONFIGS, gemv
from .fused import rms_norm, rope_store, silu_mul
from .int8_rows import int8_rows_buffers, quantize_rows
from .quantized_rows import reference_quantized_rows
from .launch import pdl, pdl_args, pdl_by_default
from .moe import route as moe_route
from .moe import sparse_moe
from .moe_packed import PackedExperts
from .packed import GEMV_ROWS, dequantize, qlinear, reference_qlinear
from .packed_gemm import GEMM_ROWS
from .packed_mma import candidates as mma_candidates
from .packed_mma import supported as mma_supported
from .packed_scales import coarsen_scales, pair_scales, unpack_modes
from .prefill_work import prefill_splits, prefill_work, prefill_work_size
from .sampling import ARGMAX_CHUNK, greedy_tokens, resolve_tokens

__all__ = [
    "ARGMAX_CHUNK", "causal_conv", "coarsen_scales", "conv_snapshots", "decode_splits", "delta_rule",
    "delta_rule_chunked", "delta_rule_recurrent", "dequantize", "gated_rms_norm", "GEMM_ROWS", "gemv", "GEMV_CONFIGS",
    "GEMV_ROWS", "greedy_tokens", "int8_rows_buffers", "MERGE_PARTS", "mma_candidates", "mma_supported", "moe_route", "PackedExperts", "paged_decode",
    "paged_prefill", "pair_scales", "pdl", "pdl_args", "pdl_by_default", "prefill_splits", "prefill_work",
    "prefill_work_size",
    "qlinear", "quantizable", "quantize_rows", "reference_qlinear", "reference_quantized_rows", "resolve_tokens",
    "rms_norm", "rope_store", "silu_mul", "sparse_moe"
]
