"""Small-batch products on the GPU: for each weight shape and decode batch size, whichever of
cuBLAS and our Triton skinny GEMM ran faster when the model was loaded (measured, not assumed);
for packed weights, the decode kernel's config for one row of x that ran fastest on each shape.
"""

from __future__ import annotations

import logging
import time

import torch

from neuron.models.tp_linear import Linear

from neuron.kernels import gpu as kernels

from .tune_cache import Choice, TuneCache

log = logging.getLogger("neuron.runner")

Config = tuple[int, int, int]


class SkinnyLinear:
    """A dense Linear whose products with ``rows`` rows run the skinny GEMM ``plan[rows]`` where
    that won, cuBLAS elsewhere."""

    def __init__(self, base: Linear, plan: dict[int, Config]) -> None:
        self.base, self.plan = base, plan

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    @property
    def out_features(self) -> int:
        return self.base.out_features

    def tensors(self) -> list[torch.Tensor]:
        return self.base.tensors()

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        config = self.plan.get(x.shape[0])
        if config is None:
            return self.base(x, out_dtype)
        y = kernels.gemv(x, self.base.weight, config)
        return y if out_dtype is None else y.to(out_dtype)


def _time(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def tune_all(model, batch_sizes: list[int], rank: int) -> None:
    """Every tuner over ``model``'s products, its choices kept in the tuning cache (tune_cache.py)."""
    t0, cache = time.perf_counter(), TuneCache.for_device(model.device)
    tune(model, batch_sizes, cache)
    tune_packed(model, batch_sizes, cache)
    tune_fp8(model, cache)
    cache.save()
    log.info("rank %d: kernels tuned in %.1f s (%d choices from the tuning cache %s, %d timed)", rank,
             time.perf_counter() - t0, cache.hits, cache.path or "(off)", cache.misses)


def choose(cache: TuneCache | None, key: str, candidates, ms) -> tuple[Choice, tuple[float, float] | None]:
    """The config for ``key``: the tuning cache's, else the fastest of ``candidates`` by ``ms``
    (of a config; None: the default) where it beats the default by 3% (None where none does).
    Returns it and, when timed, the (best, default) milliseconds."""
    found, choice = cache.lookup(key, candidates) if cache is not None else (False, None)
    if found:
        return choice, None
    default = ms(None)
    best, config = min((ms(c), c) for c in candidates)
    choice = config if best < 0.97 * default else None
    if cache is not None:
        cache.record(key, choice)
    return choice, (best, default)


def _timed(times: tuple[float, float] | None, parts: int = 1) -> str:
    if times is None:
        return "from the tuning cache"
    return f"{1000 * times[0] / parts:.1f} us (default {1000 * times[1] / parts:.1f} us)"


def tune(model, batch_sizes: list[int], cache: TuneCache | None = None) -> None:
    """Time cuBLAS against each skinny-GEMM config for every projection shape and batch size up
    to 16; wrap the projections where a config won."""
    slots = [(owner, name) for owner, name in model.tunable()
             if type(getattr(owner, name)) is Linear and getattr(owner, name).bias is None
             and getattr(owner, name).weight.dtype in (torch.bfloat16, torch.float16)]
    by_shape: dict[tuple[int, int], list[Linear]] = {}
    for owner, name in slots:
        w = getattr(owner, name).weight
        by_shape.setdefault(tuple(w.shape), []).append(getattr(owner, name))
    plans: dict[tuple[int, int], dict[int, Config]] = {}
    for shape, linears in by_shape.items():
        weights = [linears[0].weight, linears[-1].weight]  # two of them, so the L2 cache cannot serve a repeat
        plan: dict[int, Config] = {}
        for m in [b for b in batch_sizes if b <= 16]:
            x = torch.randn(m, shape[1], device=weights[0].device, dtype=weights[0].dtype)
            flip = [0]

            def run(config: Config | None) -> float:
                def once():
                    flip[0] ^= 1
                    w = weights[flip[0]]
                    return torch.nn.functional.linear(x, w) if config is None else kernels.gemv(x, w, config)
                return _time(once)

            key = f"skinny {shape[0]}x{shape[1]} {x.dtype} rows {m}"
            choice, _ = choose(cache, key, kernels.GEMV_CONFIGS, run)
            if choice is not None:
                plan[m] = choice
        plans[shape] = plan
        if plan:
            log.info("skinny GEMM for %dx%d at batch %s (cuBLAS otherwise)", shape[0], shape[1],
                     ",".join(map(str, sorted(plan))))
    for owner, name in slots:
        linear = getattr(owner, name)
        plan = plans[tuple(linear.weight.shape)]
        if plan:
            setattr(owner, name, SkinnyLinear(linear, plan))


# Configs (BLOCK_N, BLOCK_G, num_warps) of the packed decode kernel tried for one row of x. The
# fastest differs by shape and bits: in an H200 sweep (scripts/bench-qlinear --sweep) the narrow
# 4-bit matrices wanted 4 rows of W a program, the 8-bit ones 1-2, and the long-K ones more warps
# (q4 qkv of Qwen3-8B: (4, 64, 1) 6.83 us, (4, 64, 2) 7.18, the default (2, 32, 1) 7.64).
# In a later sweep (.gpu/sweep2.py, 24 configs more) only o gained alone, (4, 64, 4) 4.27 us against
# (4, 128, 1) 4.48, but the step with it was slower (q4 one stream 1.85 -> 1.89 ms): not offered.
PACKED_CANDIDATES: tuple[Config, ...] = ((2, 32, 1), (4, 32, 4), (4, 64, 1), (4, 64, 2), (4, 128, 1), (2, 64, 4),
                                         (1, 128, 4), (1, 64, 1))
# For 2..8 rows of x, where each row adds accumulators a thread keeps. Timed on an H200 at 8 rows
# (q4 / q8_0, us): qkv (8, 32, 1) 15.3 / (2, 32, 1) 16.3, o (4, 64, 1) 8.8 / (4, 32, 1) 10.7,
# gate_up (8, 32, 1) 45.0 / (2, 32, 1) 56.6, down (4, 64, 1) 23.5 / (4, 32, 1) 29.7; at 2 and 4 rows
# (2, 32, 1) or (1, 32, 1) won.
PACKED_BATCH_CANDIDATES: tuple[Config, ...] = ((2, 32, 1), (4, 32, 1), (1, 32, 1), (8, 32, 1), (4, 64, 1))
# The tensor-core kernel's (BLOCK_N, BLOCK_K, num_warps, num_stages), tried from 4 rows up (at 8
# rows it beat the decode kernel on an H200 for Qwen3-8B's q/k/v and gate/up, .gpu/qg.py). The
# fastest in an H200 sweep of 16 (.gpu/qg3.py --sweep, Qwen3-8B's four shapes at 4 bits, 9 to 64
# rows): (128, 64, 8, 3) near the best of every shape; (128, 128, 8, 3) for gate/up up to 16 rows,
# (128, 128, 4, 3) for q/k/v at 16 and gate/up at 32, (128, 64, 4, 3) for gate/up at 64 and
# (64, 64, 4, 3) for o at 64.
GEMM_CANDIDATES: tuple[tuple[int, int, int, int], ...] = ((128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 4, 3),
                                                          (128, 64, 4, 3), (64, 64, 4, 3))


def _graph_ms(fn, reps: int = 10) -> float:
    """Milliseconds a replay of ``fn`` captured in a CUDA graph takes (as a decode step runs it:
    no launch costs from the host, consecutive kernels overlapping as they do there)."""
    fn()  # compiles the kernel
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # another thread's calls go on
        fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def tune_packed(model, batch_sizes: list[int], cache: TuneCache | None = None) -> None:
    """For every packed weight shape and every decode batch of up to ``GEMM_ROWS`` rows (its
    rows rounded up to a power of two, as the kernels' ``BLOCK_M``; at least 16 past
    ``GEMV_ROWS``), time the candidate configs of the kernels for that many rows over all the
    model's weights of that shape in a row (so that none is read from the L2 cache); where one
    beats the default config by 3%, the weights of that shape use it for that many rows."""
    import triton

    from neuron.models.tp_linear import packed_parts
    from neuron.kernels.gpu import GEMM_ROWS, GEMV_ROWS, mma_candidates, mma_supported, qlinear, quantize_rows

    by_shape: dict[tuple, list] = {}
    for part in packed_parts(model):
        if part.stacked:  # an expert's: the grouped kernels run it (kernels/moe_packed.py)
            continue
        by_shape.setdefault((part.n, part.k, part.bits, part.sm.shape[1], part.sm.dtype), []).append(part)
    blocks = sorted({triton.next_power_of_2(b) if b <= GEMV_ROWS else max(16, triton.next_power_of_2(b))
                     for b in batch_sizes if b <= GEMM_ROWS})
    for (n, k, bits, groups, sm_dtype), parts in by_shape.items():
        unpack = parts[0].unpack.get(model.dtype, "float")
        for block_m in blocks:
            x = torch.randn(block_m, k, device=model.device, dtype=model.dtype)
            rows = quantize_rows(x) if block_m <= GEMV_ROWS else None

            def run(config: tuple[int, ...] | None) -> None:
                for p in parts:
                    qlinear(x, p.u, p.sm, p.bits, rows, {block_m: config} if config else None,
                            unpack=p.unpack.get(x.dtype, "float"))

            if block_m > GEMV_ROWS:
                candidates = split_candidates(n, k, block_m, model.device)
            elif block_m >= 4:
                candidates = PACKED_BATCH_CANDIDATES + GEMM_CANDIDATES
            else:
                candidates = PACKED_CANDIDATES if block_m == 1 else PACKED_BATCH_CANDIDATES
            if bits == 4 and mma_supported(x, bits, k, groups, unpack):
                candidates = [*candidates, *mma_candidates(block_m)]
            key = f"packed {n}x{k} int{bits} groups {groups} {sm_dtype} {unpack} {x.dtype} rows {block_m}"
            choice, times = choose(cache, key, candidates, lambda c: _graph_ms(lambda: run(c)))
            if choice is not None:
                for p in parts:
                    p.configs[block_m] = choice
            log.info("packed product of %dx%d int%d at %d row(s): %s, %s", n, k, bits, block_m,
                     choice or "default", _timed(times, len(parts)))


def split_candidates(n: int, k: int, rows: int, device: torch.device) -> list[tuple[int, ...]]:
    """``GEMM_CANDIDATES``, each with the kernel's own split of K and with half and twice as many
    parts: which is fastest turned on the shape (H200, splits 1-16 of each: Qwen3-8B's gate/up at
    32 rows was fastest at twice the parts, at 64 rows with 2 parts where the rule gives 1)."""
    from neuron.kernels.packed_gemm import default_split

    out = []
    for config in GEMM_CANDIDATES:
        split = default_split(n, rows, k, config, device)
        out += [(*config, s) for s in dict.fromkeys((split, max(1, split // 2), split * 2))]
    return out


def tune_fp8(model, cache: TuneCache | None = None) -> None:
    """For every FP8 weight shape on the FP8 tensor cores, time the fused decode kernel's
    candidate tile configs at one row over all the model's weights of that shape in a row (a
    config holds for every row count up to ``FUSED_ROWS``: they share its tiles); where one beats
    the default by 3%, the weights of that shape use it."""
    from neuron.kernels.fp8 import FUSED_CANDIDATES, fp8_linear
    from neuron.models.fp8 import Fp8Linear

    by_shape: dict[tuple, list] = {}
    for part in model.linears()[0]:
        if isinstance(part, Fp8Linear) and part.kernel is not None:
            by_shape.setdefault((part.n, part.k, part.kernel), []).append(part)
    for (n, k, kernel), parts in by_shape.items():
        x = torch.randn(1, k, device=model.device, dtype=model.dtype)

        def run(config) -> None:
            for p in parts:
                fp8_linear(x, p.values, p.scale_t, *p.kernel, config=config)

        key = f"fp8 {n}x{k} {kernel} {x.dtype} rows 1"
        choice, times = choose(cache, key, FUSED_CANDIDATES, lambda c: _graph_ms(lambda: run(c)))
        if choice is not None:
            for p in parts:
                p.fused_config = choice
        log.info("FP8 decode of %dx%d at 1 row: %s, %s", n, k, choice or "default", _timed(times, len(parts)))
