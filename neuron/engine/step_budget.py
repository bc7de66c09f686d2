"""How many prompt tokens a step may carry beside running decodes on a GPU, from the step times
the ranks measured at load (``runner/step_times.py``).

A step of ``d`` decode rows and ``C`` prompt tokens replays the prefill graph of the first token
bucket that holds ``d + C`` rows, and the decodes wait for all of it. So the prompt takes the
largest bucket whose measured time stays within ``slowdown`` times the decode graph's for ``d``
rows. Where no bucket does (a MoE model: a few prompt tokens already route to nearly every
expert, whose weights the step then reads, where the decodes read a few), the prompt takes the
bucket that holds the decodes back least per prompt token, so it is read in as few slow steps as
it can be. A short prompt's rest goes in whole (``WHOLE``): one slow step, not several."""

from __future__ import annotations

from dataclasses import dataclass, field

FLOOR = 16  # the fewest prompt tokens worth a bucket: below, a prompt crawls
# Beside decodes, a prompt whose rest fits this many tokens goes in whole, within the time budget
# or not: its first token comes a step later, not several (the size a fixed chunk had before the
# budget; on an H200 with the Qwen3-8B shape, 8 streams' ITL p99 1.86x its value alone).
WHOLE = 192


@dataclass
class StepBudget:
    decode_ms: list[tuple[int, float]]  # (decode graph batch, ms), ascending
    prefill_ms: list[tuple[int, float]]  # (prefill graph tokens, ms), ascending
    slowdown: float
    _chunks: dict[int, int] = field(default_factory=dict)

    def chunk(self, rows: int) -> int:
        """Prompt tokens for a step beside ``rows`` decode rows (0: none fit a prefill graph)."""
        if rows not in self._chunks:
            self._chunks[rows] = self._size(rows)
        return self._chunks[rows]

    def _size(self, rows: int) -> int:
        alone = next((ms for b, ms in self.decode_ms if b >= rows), self.decode_ms[-1][1])
        room = [(n, ms) for n, ms in self.prefill_ms if n - rows >= FLOOR]
        if not room:
            return 0
        within = [n for n, ms in room if ms <= self.slowdown * alone]
        if within:
            return within[-1] - rows
        n, _ = min(room, key=lambda e: (max(e[1] - alone, 0.0) / (e[0] - rows), -e[0]))
        return n - rows

    def table(self) -> dict[str, int]:
        """The chunk beside each decode graph's batch (for /models)."""
        return {str(b): self.chunk(b) for b, _ in self.decode_ms}


def prompt_takes(prompts: list, budget: int, chunk: int, measured: bool) -> list[tuple[object, int]]:
    """How many tokens of each prompt's rest (``req.rest``) a step takes, in order, with
    ``budget`` tokens for them and chunks of at most ``chunk``. ``measured`` (beside decodes, by
    measured step times): a rest that fits ``WHOLE`` goes in at once, before longer prompts
    (its first token comes a step later, not after theirs), which keep ``FLOOR`` tokens of it."""
    budget = min(budget, max(chunk, WHOLE) if measured else chunk)
    keep = 0
    if measured:
        short = [req for req in prompts if req.rest <= WHOLE]
        keep = FLOOR if len(short) < len(prompts) else 0
        prompts = short + [req for req in prompts if req.rest > WHOLE]
    takes = []
    for req in prompts:
        if budget <= 0:
            break
        rest = req.rest
        if measured and rest <= WHOLE and rest > budget - keep:
            continue
        n = rest if rest <= budget else min(rest, chunk, budget)
        takes.append((req, n))
        budget -= n
    return takes
