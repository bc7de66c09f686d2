"""Token sampling on rank 0: penalties, temperature, top-k, top-p, min-p, per-request seeds.

Rank 0 remembers the tokens fed into each KV slot (a slot restarts at ``start_pos`` 0), which
is all the history the penalties need; the leader never resends it.
"""

from __future__ import annotations

import torch

from protocol import Sampling

GREEDY_BELOW = 1e-5  # temperatures this small are greedy: dividing by them overflows float32


class Sampler:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.history: dict[int, list[int]] = {}
        self.generators: dict[int, torch.Generator] = {}

    def feed(self, slot: int, start_pos: int, tokens: list[int]) -> None:
        if start_pos == 0:
            self.generators.pop(slot, None)
        seen = self.history.setdefault(slot, [])
        del seen[start_pos:]
        seen.extend(tokens)

    def free(self, slot: int) -> None:
        self.history.pop(slot, None)
        self.generators.pop(slot, None)

    def sample(self, logits: torch.Tensor, slots: list[int], params: list[Sampling],
               allowed: list[bytes | None] | None = None) -> tuple[list[int], list[list[tuple[int, float]]] | None]:
        """One token per row of ``logits`` [B, V] (float32)."""
        tokens: list[int] = []
        allowed = allowed or [None] * len(params)
        want_logprobs = any(p.logprobs for p in params)
        logprobs: list[list[tuple[int, float]]] = []
        plain = [p.temperature < GREEDY_BELOW and not _has_penalty(p) and not _constrains(p) and mask is None
                 for p, mask in zip(params, allowed)]
        if all(plain) and not want_logprobs:
            return logits.argmax(dim=-1).tolist(), None
        for row, (slot, p) in enumerate(zip(slots, params)):
            x = logits[row]
            if allowed[row] is not None or _constrains(p):
                x = self._constrain(x.clone(), slot, p, allowed[row])
            if _has_penalty(p):
                x = self._penalise(x.clone(), slot, p)
                # Extreme penalties overflow; an overflowed logit must not poison the batch.
                x = torch.nan_to_num(x, nan=float("-inf"), posinf=torch.finfo(x.dtype).max)
            if p.temperature < GREEDY_BELOW:
                token = int(x.argmax())
            else:
                token = self._draw(x / p.temperature, slot, p)
            tokens.append(token)
            if want_logprobs:
                lp = torch.log_softmax(x, dim=-1)
                top = torch.topk(lp, p.logprobs - 1) if p.logprobs > 1 else None
                entry = [(token, float(lp[token]))]
                if top is not None:
                    entry += list(zip(top.indices.tolist(), top.values.tolist()))
                logprobs.append(entry)
        return tokens, logprobs if want_logprobs else None

    def _constrain(self, x: torch.Tensor, slot: int, p: Sampling, allowed: bytes | None) -> torch.Tensor:
        """Structured-output mask, min_tokens and logit_bias, in that order (as vLLM applies them)."""
        if allowed is not None:
            x = x.masked_fill(~unpack_mask(allowed, x.shape[-1], x.device), float("-inf"))
        generated = len(self.history.get(slot, [])) - p.prompt_len
        if p.min_tokens and p.stop_token_ids and generated < p.min_tokens:
            banned = [t for t in p.stop_token_ids if 0 <= t < x.shape[-1]]
            x[banned] = float("-inf")
        if p.logit_bias:
            ids = torch.tensor([t for t, _ in p.logit_bias], device=x.device)
            x.index_add_(0, ids, torch.tensor([b for _, b in p.logit_bias], device=x.device, dtype=x.dtype))
        return x

    def _penalise(self, x: torch.Tensor, slot: int, p: Sampling) -> torch.Tensor:
        seen = self.history.get(slot, [])
        if p.repetition_penalty != 1.0 and seen:
            ids = torch.tensor(sorted(set(seen)), device=x.device)
            vals = x[ids]
            x[ids] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        output = seen[p.prompt_len:]
        if output and (p.frequency_penalty or p.presence_penalty):
            ids, counts = torch.tensor(output, device=x.device).unique(return_counts=True)
            x[ids] -= p.frequency_penalty * counts.to(x.dtype) + p.presence_penalty
        return x

    def _draw(self, x: torch.Tensor, slot: int, p: Sampling) -> int:
        x = torch.nan_to_num(x, nan=float("-inf"), posinf=torch.finfo(x.dtype).max)
        if p.top_k > 0 and p.top_k < x.shape[-1]:
            kth = torch.topk(x, p.top_k).values[-1]
            x = x.masked_fill(x < kth, float("-inf"))
        probs = torch.softmax(x, dim=-1)
        if p.min_p > 0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        if p.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            cumulative = sorted_probs.cumsum(-1)
            drop = cumulative - sorted_probs > p.top_p
            sorted_probs[drop] = 0.0
            probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
        if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0.0:
            return int(x.argmax())
        generator = None
        if p.seed is not None:
            generator = self.generators.get(slot)
            if generator is None:
                generator = torch.Generator(device=x.device)
                generator.manual_seed(p.seed)
                self.generators[slot] = generator
        return int(torch.multinomial(probs, 1, generator=generator))


def unpack_mask(allowed: bytes, vocab: int, device: torch.device) -> torch.Tensor:
    """A token bitmask (little-endian uint32 words, bit t = token t) as a bool tensor [vocab]."""
    words = (vocab + 31) // 32
    if len(allowed) != 4 * words:
        raise ValueError(f"a token mask for {vocab} tokens has {4 * words} bytes, not {len(allowed)}")
    packed = torch.frombuffer(bytearray(allowed), dtype=torch.uint8).to(device)
    bits = (packed[:, None] >> torch.arange(8, device=device, dtype=torch.uint8)) & 1
    return bits.flatten()[:vocab].bool()


def _constrains(p: Sampling) -> bool:
    return bool(p.logit_bias) or (p.min_tokens > 0 and bool(p.stop_token_ids))


def _has_penalty(p: Sampling) -> bool:
    return p.repetition_penalty != 1.0 or bool(p.frequency_penalty) or bool(p.presence_penalty)
