"""The model's tokenizer as a ``tokenizers.Tokenizer``: from ``tokenizer.json`` or rebuilt
from GGUF metadata (byte-level BPE, as llama.cpp's ``gpt2`` tokenizer model)."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from neuron.errors import UnsupportedModel

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp's pre-tokenizer names -> the split its merges were learned with.
_SPLITS = {
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}
_CONTROL, _USER_DEFINED = 3, 4


def encode_ids(tokenizer: Tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """``tokenizer.encode(text).ids``, with the GIL released while it runs (the batch call drops
    it, the single one does not: a 4 MB prompt would hold every other thread for seconds) and
    without the offsets nobody reads."""
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
    return encode([text], add_special_tokens=add_special_tokens)[0].ids


@dataclass
class TokenizerInfo:
    tokenizer: Tokenizer
    bos_token: str | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    chat_template: str | None = None
    add_bos: bool = False

    def token(self, token_id: int) -> str | None:
        return self.tokenizer.id_to_token(token_id)


@lru_cache(maxsize=1)
def byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = keep[:]
    n = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(keep, chars)}


def tokenizer_from_gguf(fields: dict[str, Any]) -> Tokenizer:
    kind = fields.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise UnsupportedModel(f"GGUF tokenizer model {kind!r} is not supported (supported: 'gpt2' byte-level BPE)")
    tokens: list[str] = list(fields["tokenizer.ggml.tokens"])
    types: list[int] = list(fields.get("tokenizer.ggml.token_type") or [])
    merges = [tuple(m.split(" ", 1)) for m in fields.get("tokenizer.ggml.merges") or []]
    alphabet = set(byte_alphabet().values())
    spell = byte_alphabet()
    vocab = {}
    for i, tok in enumerate(tokens):
        key = tok if set(tok) <= alphabet else "".join(spell[b] for b in tok.encode("utf-8"))
        vocab.setdefault(key, i)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=False))
    pre = str(fields.get("tokenizer.ggml.pre") or "default")
    if pre in _SPLITS:
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    elif pre == "smollm":
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    else:
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    special = [AddedToken(tok, special=True, normalized=False)
               for tok, t in zip(tokens, types) if t == _CONTROL and set(tok) <= alphabet]
    user = [AddedToken(tok, special=False, normalized=False)
            for tok, t in zip(tokens, types) if t == _USER_DEFINED]
    tk.add_special_tokens(special)
    if user:
        tk.add_tokens(user)
    return tk
