"""Qwen3.5's multimodal rotary positions (M-RoPE): each token has a (t, h, w) position. Text
tokens take their running index in all three; an image's tokens take (start, start + row,
start + column) over its merged grid, and the text after it resumes at the image's start plus its
longer side. The rotary angles then take frequency i from the t, h or w position by
``mrope_section`` (interleaved: h for i % 3 == 1 up to 3 h-sections, w for i % 3 == 2, t else).
For a prompt without images all three positions are the token's index, which is plain RoPE."""

from __future__ import annotations

import numpy as np
import torch


def mrope_positions(tokens: list[int], image_token: int, grids: list[tuple[int, int, int]],
                    merge: int) -> tuple[np.ndarray, int]:
    """[3, len(tokens)] positions of a prompt whose runs of ``image_token`` are its images (one
    run each, in order, of ``t h w / merge²`` tokens), and the delta a later token's position has
    over its index."""
    out = np.zeros((3, len(tokens)), dtype=np.int64)
    images = iter(grids)
    pos = i = 0
    while i < len(tokens):
        if tokens[i] != image_token:
            out[:, i] = pos
            pos, i = pos + 1, i + 1
            continue
        t, h, w = next(images)
        gh, gw = h // merge, w // merge
        n = t * gh * gw
        if tokens[i:i + n] != [image_token] * n:
            raise ValueError(f"an image of {n} tokens at {i} has {sum(x == image_token for x in tokens[i:i + n])}")
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
        out[:, i:i + n] = np.stack([tt.reshape(-1), hh.reshape(-1), ww.reshape(-1)]) + pos
        pos += max(gh, gw)
        i += n
    if next(images, None) is not None:
        raise ValueError("more image grids than images among the tokens")
    return out, int(out.max(initial=-1)) + 1 - len(tokens)


def mrope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, sections: list[int]) -> tuple[torch.Tensor, ...]:
    """cos and sin [n, 2 len(inv_freq)] of ``positions`` [3, n], frequencies interleaved by
    ``sections`` (t, h, w)."""
    freqs = positions[..., None].float() * inv_freq.float()  # [3, n, f]
    chosen = freqs[0].clone()
    for axis in (1, 2):
        idx = slice(axis, sections[axis] * 3, 3)
        chosen[..., idx] = freqs[axis, ..., idx]
    angles = torch.cat([chosen, chosen], dim=-1)
    return angles.cos(), angles.sin()
