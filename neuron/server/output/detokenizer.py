"""Incremental detokenizing that never splits a UTF-8 character and keeps the spacing a
tokenizer only shows in context (decode a window that starts a few tokens back)."""

from __future__ import annotations

from tokenizers import Tokenizer


class Detokenizer:
    """``shown``: special tokens that appear in the text (tool-call and thinking markers that
    are special tokens; every one with ``skip_special_tokens: false``); the others are skipped."""

    def __init__(self, tokenizer: Tokenizer, shown: frozenset[int] | bool = frozenset()) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.hidden: frozenset[int] = frozenset()
        self.skip_special = shown is not True and not shown
        if shown is not True and shown:
            special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
            self.hidden = frozenset(special - set(shown))

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def push(self, token_id: int) -> str:
        if token_id in self.hidden:
            return ""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix):]
        return ""

    def flush(self) -> str:
        """What is still held back at the end (an incomplete character is dropped)."""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix):].rstrip("\ufffd") if len(full) > len(prefix) else ""
