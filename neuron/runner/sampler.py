"""Token sampling on the rank's device, batched over the step's rows: structured-output masks,
min_tokens, logit_bias, repetition/frequency/presence penalties, temperature, top-k, top-p,
min-p and seeds. Nothing here reads a tensor back to the host; the runner copies the chosen
tokens (and requested logprobs) out once per step.

Per slot (a sequence's row) it keeps the sampling parameters (set when the slot starts a
sequence), the penalty state (which tokens the sequence has seen, and how often each came in
the output) and the last token it drew, which the next step may take as its input without the
leader ever having seen it (overlapped steps).

Random draws are Gumbel-max: argmax(logits / T + g), g = -log(-log(u)). A seeded sequence takes
u from a counter-based hash of (seed, position, token), so its draws depend on nothing else: not
on the batch it shares, nor on being preempted and recomputed.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from protocol import Sampling

GREEDY_BELOW = 1e-5  # temperatures this small are greedy: dividing by them overflows float32
_MASK64 = (1 << 64) - 1


def _i64(x: int) -> int:
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN, _MIX1, _MIX2 = _i64(0x9E3779B97F4A7C15), _i64(0xBF58476D1CE4E5B9), _i64(0x94D049BB133111EB)
_POS_KEY = _i64(0xD1B54A32D192ED03)


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def hashed_uniform(seed: torch.Tensor, position: torch.Tensor, vocab: int) -> torch.Tensor:
    """u in (0, 1) for every (row, token): splitmix64 of (seed, position, token). [R] -> [R, V]."""
    token = torch.arange(vocab, device=seed.device, dtype=torch.int64)
    z = (seed * _GOLDEN + position * _POS_KEY)[:, None] + token[None, :] * _GOLDEN
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    z = z ^ _shr(z, 31)
    return (_shr(z, 40).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def unpack_mask(allowed: bytes, vocab: int, device: torch.device) -> torch.Tensor:
    """A token bitmask (little-endian uint32 words, bit t = token t) as a bool tensor [vocab]."""
    return unpack_masks([allowed], vocab, device)[0]


def unpack_masks(masks: list[bytes], vocab: int, device: torch.device) -> torch.Tensor:
    """Token bitmasks as one bool tensor [len(masks), vocab]: one upload and one unpack for the
    whole batch, of each distinct mask once (a mask is 19 KB for a 152k vocabulary; one per row
    was 2 ms of host time; streams in one grammar state share theirs)."""
    words = (vocab + 31) // 32
    distinct: dict[bytes, int] = {}
    rows = [distinct.setdefault(m, len(distinct)) for m in masks]
    for m in distinct:
        if len(m) != 4 * words:
            raise ValueError(f"a token mask for {vocab} tokens has {4 * words} bytes, not {len(m)}")
    packed = np.frombuffer(b"".join(distinct), dtype=np.uint8).reshape(len(distinct), 4 * words)
    if device.type == "cpu":
        bits = torch.from_numpy(np.unpackbits(packed, axis=1, count=vocab, bitorder="little").view(bool))
    else:
        packed = upload(packed.copy(), torch.uint8, device)
        bits = ((packed[:, :, None] >> torch.arange(8, device=device, dtype=torch.uint8)) & 1).flatten(1)[:, :vocab].bool()
    if len(distinct) == len(masks):
        return bits
    return bits[upload(rows, torch.int64, device)]


def upload(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host values (a list or a numpy array) onto the device without waiting for the device: a
    plain copy from pageable memory would block the host until every queued kernel ran, which
    defeats overlapped steps."""
    t = torch.from_numpy(values).to(dtype) if isinstance(values, np.ndarray) else torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def check_sampling(p: Sampling, vocab: int) -> str | None:
    """Why the rank cannot sample with ``p``, or None."""
    for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"):
        if not math.isfinite(getattr(p, name)):
            return f"{name} is not finite"
    if p.repetition_penalty <= 0 or p.temperature < 0 or p.top_k < 0 or p.logprobs < 0 or p.min_tokens < 0:
        return "sampling parameters out of range"
    if p.logprobs > 21 or p.top_k > 1 << 31 or p.prompt_len < 0:
        return "sampling parameters out of range"
    if any(not 0 <= t < vocab or not math.isfinite(b) for t, b in p.logit_bias):
        return "logit_bias names a token outside the vocabulary or a non-finite bias"
    return None


def _penalised(p: Sampling) -> bool:
    return p.repetition_penalty != 1.0 or bool(p.frequency_penalty) or bool(p.presence_penalty)


class DeviceSampler:
    def __init__(self, rows: int, vocab: int, device: torch.device) -> None:
        self.rows, self.vocab, self.device = rows, vocab, device
        self.params: list[Sampling] = [Sampling(temperature=0.0)] * rows
        self.last_token = torch.zeros(rows, dtype=torch.int64, device=device)
        self.prompt_len = torch.zeros(rows, dtype=torch.int64, device=device)
        self.seen: torch.Tensor | None = None  # [rows, V] bool: tokens in the prompt or the output
        self.counts: torch.Tensor | None = None  # [rows, V] int32: occurrences in the output
        self.generator = torch.Generator(device=device)
        self.generator.seed()

    # ---------------------------------------------------------------------------- slot state
    def start(self, slot: int, p: Sampling) -> None:
        """The slot begins a sequence: new parameters, no history."""
        self.params[slot] = p
        self.prompt_len[slot] = p.prompt_len
        if _penalised(p):
            if self.seen is None:
                self.seen = torch.zeros(self.rows, self.vocab, dtype=torch.bool, device=self.device)
                self.counts = torch.zeros(self.rows, self.vocab, dtype=torch.int32, device=self.device)
            self.seen[slot] = False
            self.counts[slot] = 0

    def penalised(self, slots: list[int]) -> bool:
        return self.seen is not None and any(_penalised(self.params[s]) for s in slots)

    def feed(self, slots: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor) -> None:
        """Record the step's input tokens (device ids, resolved) in the penalty state of their
        slots; the ones at or past a sequence's prompt are output tokens."""
        assert self.seen is not None and self.counts is not None
        self.seen[slots, ids] = True
        output = (positions >= self.prompt_len[slots]).to(torch.int32)
        self.counts.index_put_((slots, ids), output, accumulate=True)

    # ---------------------------------------------------------------------------- sampling
    def sample(self, logits: torch.Tensor, slots: list[int], slot_t: torch.Tensor, positions: list[int],
               allowed: list[bytes | None], argmax: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
        """One token per row of ``logits`` [R, V] (float32); ``slots`` (also on the device as
        ``slot_t``) and ``positions`` (each row's last input position) per row. ``argmax``: the
        rows' argmax of ``logits``, computed and stored as the slots' last draws already (the
        decode graph's ``greedy_tokens``). Returns the tokens [R] (int64, on the device) and,
        when any row asked for logprobs, (chosen logprob [R], top logprobs [R, n], their ids
        [R, n])."""
        params = [self.params[s] for s in slots]
        x = logits
        if any(m is not None for m in allowed) or any(p.logit_bias or p.min_tokens for p in params):
            x = self._constrain(x.clone(), params, positions, allowed)
        if self.seen is not None and any(_penalised(p) for p in params):
            x = self._penalise(x, slot_t, params)
        greedy = [p.temperature < GREEDY_BELOW for p in params]
        stored = argmax is not None and x is logits and all(greedy)
        tokens = argmax if argmax is not None and x is logits else x.argmax(dim=-1)
        if not all(greedy):
            tokens = self._draw(x, tokens, params, positions, greedy)
        if not stored:
            self.last_token[slot_t] = tokens
        logprobs = None
        want = max((p.logprobs for p in params), default=0)
        if want:
            lp = torch.log_softmax(x, dim=-1)
            chosen = lp.gather(1, tokens[:, None])[:, 0]
            top = torch.topk(lp, max(1, want - 1), dim=-1)
            logprobs = (chosen, top.values, top.indices)
        return tokens, logprobs

    def verify(self, logits: torch.Tensor, slots: list[int], drafts: list[list[int]]
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Speculative decoding: sequence ``i`` (in ``slots[i]``) guessed ``drafts[i]``, and
        ``logits`` holds, for each sequence in turn, its ``len(drafts[i]) + 1`` rows: the logits
        after its input token and after each draft. A draft is accepted while the sequence's own
        draw agrees: greedy, when it is the argmax; sampled, with the probability the (filtered,
        temperature-scaled) distribution gives it, and at the first rejection the token is drawn
        from that distribution without the rejected draft (the rejection sampling of speculative
        decoding for a drafter that proposes one token: the output keeps the target's
        distribution). After the last accepted draft one token is drawn. Returns the tokens drawn
        last [S] and the accepted drafts' counts [S] (int64, on the device). Sequences drafting
        take no penalties, masks, biases, seeds nor logprobs (the leader drafts for no other)."""
        params = [self.params[s] for s in slots]
        dev, S, V = logits.device, len(slots), logits.shape[-1]
        k = max(len(d) for d in drafts)
        counts = [len(d) + 1 for d in drafts]
        first = np.cumsum([0] + counts[:-1])
        row_params = [p for p, n in zip(params, counts) for _ in range(n)]
        greedy = [p.temperature < GREEDY_BELOW for p in row_params]
        x = logits.float()
        if all(greedy):
            probs = None
        else:
            temperature = upload([1.0 if g else p.temperature for p, g in zip(row_params, greedy)], x.dtype, dev)
            z = torch.nan_to_num(x / temperature[:, None], nan=float("-inf"), posinf=torch.finfo(x.dtype).max)
            if any(p.top_k or p.top_p < 1.0 or p.min_p > 0 for p in row_params):
                z = self._filter(z, row_params)
            probs = torch.softmax(z, dim=-1)
        # [S, k] tables: each sequence's drafts (padded with 0) and the rows that judge them
        pad = np.zeros((S, k), dtype=np.int64)
        rows = np.zeros((S, k), dtype=np.int64)
        real = np.zeros((S, k), dtype=bool)
        for i, d in enumerate(drafts):
            pad[i, :len(d)] = d
            rows[i, :len(d)] = first[i] + np.arange(len(d))
            real[i, :len(d)] = True
        table = upload(np.stack([pad, rows, real.astype(np.int64)]), torch.int64, dev)
        d_t, r_t, real_t = table[0], table[1], table[2].bool()
        seq_greedy = upload([p.temperature < GREEDY_BELOW for p in params], torch.bool, dev)
        argmax = x.argmax(dim=-1)
        agree = argmax[r_t] == d_t
        if probs is not None:
            u = torch.rand((S, k), device=dev, generator=self.generator)
            agree = torch.where(seq_greedy[:, None], agree, u < probs[r_t, d_t])
        accepted = torch.cumprod((agree & real_t).to(torch.int64), dim=1).sum(dim=1)
        final_row = upload(first, torch.int64, dev) + accepted
        tokens = argmax[final_row]
        if probs is not None:
            rest = probs[final_row]
            rejected = accepted < upload([len(d) for d in drafts], torch.int64, dev)
            at = d_t.gather(1, accepted.clamp(max=k - 1)[:, None])[:, 0]
            rest = rest.scatter(1, at[:, None], torch.where(rejected, 0.0, rest.gather(1, at[:, None])[:, 0])[:, None])
            u = torch.rand((S, V), device=dev, generator=self.generator).clamp_(1e-10, 1 - 1e-7)
            drawn = (torch.log(rest) - torch.log(-torch.log(u))).argmax(dim=-1)
            tokens = torch.where(seq_greedy, tokens, drawn)
        self.last_token[upload(slots, torch.int64, dev)] = tokens
        return tokens, accepted

    def _constrain(self, x: torch.Tensor, params: list[Sampling], positions: list[int],
                   allowed: list[bytes | None]) -> torch.Tensor:
        """Structured-output mask, min_tokens and logit_bias, in that order (as vLLM applies them)."""
        rows = [row for row, mask in enumerate(allowed) if mask is not None]
        if rows:
            bits = unpack_masks([allowed[row] for row in rows], x.shape[-1], x.device)
            if len(rows) == len(allowed):
                x.masked_fill_(~bits, float("-inf"))
            else:
                index = upload(rows, torch.int64, x.device)
                x.index_copy_(0, index, x.index_select(0, index).masked_fill_(~bits, float("-inf")))
        for row, (p, pos) in enumerate(zip(params, positions)):
            generated = pos + 1 - p.prompt_len
            if p.min_tokens and p.stop_token_ids and generated < p.min_tokens:
                banned = [t for t in p.stop_token_ids if 0 <= t < x.shape[-1]]
                x[row].index_fill_(0, upload(banned, torch.int64, x.device), float("-inf"))
            if p.logit_bias:
                ids = upload([t for t, _ in p.logit_bias], torch.int64, x.device)
                x[row].index_add_(0, ids, upload([b for _, b in p.logit_bias], x.dtype, x.device))
        return x

    def _penalise(self, x: torch.Tensor, slots: torch.Tensor, params: list[Sampling]) -> torch.Tensor:
        assert self.seen is not None and self.counts is not None
        rep, freq, pres = upload([[p.repetition_penalty, p.frequency_penalty, p.presence_penalty] for p in params],
                                 x.dtype, x.device).T[:, :, None]
        seen, counts = self.seen[slots], self.counts[slots].to(x.dtype)
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
        x = x - freq * counts - pres * (counts > 0).to(x.dtype)
        # Extreme penalties overflow; an overflowed logit must not poison the batch.
        return torch.nan_to_num(x, nan=float("-inf"), posinf=torch.finfo(x.dtype).max)

    def _draw(self, x: torch.Tensor, greedy_tokens: torch.Tensor, params: list[Sampling], positions: list[int],
              greedy: list[bool]) -> torch.Tensor:
        temperature = upload([1.0 if g else p.temperature for p, g in zip(params, greedy)], x.dtype, x.device)[:, None]
        z = torch.nan_to_num(x / temperature, nan=float("-inf"), posinf=torch.finfo(x.dtype).max)
        if any(p.top_k or p.top_p < 1.0 or p.min_p > 0 for p in params):
            z = self._filter(z, params)
        seeded = [p.seed is not None for p in params]
        if any(seeded):
            seed_pos = upload([[p.seed or 0 for p in params], positions], torch.int64, x.device)
            u = hashed_uniform(seed_pos[0], seed_pos[1], x.shape[-1])
            if not all(seeded):
                free = torch.rand(x.shape, device=x.device, generator=self.generator).clamp_(1e-10, 1 - 1e-7)
                u = torch.where(upload(seeded, torch.bool, x.device)[:, None], u, free)
        else:
            u = torch.rand(x.shape, device=x.device, generator=self.generator).clamp_(1e-10, 1 - 1e-7)
        scores = z - torch.log(-torch.log(u))
        drawn = scores.argmax(dim=-1)
        # A row whose every token was filtered out falls back to its greedy choice.
        usable = torch.isfinite(scores.gather(1, drawn[:, None])[:, 0])
        drawn = torch.where(usable, drawn, greedy_tokens)
        return torch.where(upload(greedy, torch.bool, x.device), greedy_tokens, drawn)

    def _filter(self, z: torch.Tensor, params: list[Sampling]) -> torch.Tensor:
        """top-k, then min-p and top-p on the temperature-scaled distribution: -inf outside."""
        V = z.shape[-1]
        top_k, top_p, min_p = upload([[float(p.top_k if 0 < p.top_k < V else V) for p in params],
                                      [p.top_p for p in params], [p.min_p for p in params]],
                                     z.dtype, z.device)[:, :, None]
        ordered, order = z.sort(dim=-1, descending=True)
        rank = torch.arange(V, device=z.device)[None, :]
        drop = rank >= top_k
        ordered = ordered.masked_fill(drop, float("-inf"))
        probs = torch.softmax(ordered, dim=-1)
        drop |= probs < min_p * probs[:, :1]
        drop |= (probs.cumsum(-1) - probs) > top_p
        drop[:, 0] = False  # the most likely token always stays
        return z.scatter(1, order, ordered.masked_fill(drop, float("-inf")))
