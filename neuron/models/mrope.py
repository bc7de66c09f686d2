"""Qwen3.5's multimodal rotary positions (M-RoPE): each token has a (t, h, w) position. Text
tokens take their running index in all three; an image's tokens take (start, start + row,
start + column) over its merged grid, and the text after it resumes at the image's start plus its
longer side. The rotary angles then take frequency i from the t, h or w position by
``mrope_section`` (interleaved: h for i % 3 == 1 up to 3 h-sections, w for i % 3 == 2, t else).
For a prompt without images all three positions are the token's index, which is plain RoPE."""

from __future__ import annotations

import numpy as np
import torch


def rope_positions(images: list[tuple[int, int, tuple[int, int, int]]], at: np.ndarray, merge: int) -> np.ndarray:
    """[3, len(at)] positions of a sequence's tokens at indices ``at`` (any of them: a prompt
    chunk, a decode), its images given as (first token, tokens, (t, h, w) grid), in order."""
    out = np.repeat(np.asarray(at, dtype=np.int64)[None], 3, axis=0)
    shift = 0  # how far the positions after the images so far lag behind the indices
    for offset, n, (t, h, w) in images:
        gh, gw = h // merge, w // merge
        if t * gh * gw != n:
            raise ValueError(f"an image of {n} tokens at {offset} has a grid of {t * gh * gw}")
        inside = (at >= offset) & (at < offset + n)
        k = at[inside] - offset
        start = offset + shift
        out[:, inside] = np.stack([k // (gh * gw), (k // gw) % gh, k % gw]) + start
        grown = max(gh, gw) - n
        out[:, at >= offset + n] += grown
        shift += grown
    return out


def mrope_positions(tokens: list[int], image_token: int, grids: list[tuple[int, int, int]],
                    merge: int) -> tuple[np.ndarray, int]:
    """[3, len(tokens)] positions of a prompt whose runs of ``image_token`` are its images (one
    run each, in order, of ``t h w / merge²`` tokens), and the delta a later token's position has
    over its index."""
    images, i = [], 0
    grid_iter = iter(grids)
    while i < len(tokens):
        if tokens[i] != image_token:
            i += 1
            continue
        t, h, w = next(grid_iter)
        n = t * (h // merge) * (w // merge)
        if tokens[i:i + n] != [image_token] * n:
            raise ValueError(f"an image of {n} tokens at {i} has {sum(x == image_token for x in tokens[i:i + n])}")
        images.append((i, n, (t, h, w)))
        i += n
    if next(grid_iter, None) is not None:
        raise ValueError("more image grids than images among the tokens")
    out = rope_positions(images, np.arange(len(tokens)), merge)
    return out, int(out.max(initial=-1)) + 1 - len(tokens)


def mrope_angles(positions: torch.Tensor, inv_freq: torch.Tensor, sections: list[int]) -> torch.Tensor:
    """The rotary angle of each frequency [n, len(inv_freq)] of ``positions`` [3, n], each
    frequency taking the t, h or w position as ``sections`` interleaves them."""
    freqs = positions[..., None].float() * inv_freq.float()  # [3, n, f]
    chosen = freqs[0].clone()
    for axis in (1, 2):
        idx = slice(axis, sections[axis] * 3, 3)
        chosen[..., idx] = freqs[axis, ..., idx]
    return chosen


def mrope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, sections: list[int]) -> tuple[torch.Tensor, ...]:
    """cos and sin [n, 2 len(inv_freq)] of ``positions`` [3, n], frequencies interleaved by
    ``sections`` (t, h, w)."""
    chosen = mrope_angles(positions, inv_freq, sections)
    angles = torch.cat([chosen, chosen], dim=-1)
    return angles.cos(), angles.sin()
