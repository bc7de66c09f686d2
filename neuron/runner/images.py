"""A rank's images: each slot's prompt images (their M-RoPE positions, and their embeddings until
the prompt is computed), the embeddings kept by content hash as the leader says
(``neuron.engine.image_cache``), and a step's inputs for them: the rows its image-pad tokens take
and what they take there (the tower's embeddings), and each row's rotary tables (M-RoPE: an
image's tokens are placed by row and column; the text after it resumes past the image's longer
side). The tower runs once per image, on the step that first needs it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

import protocol as p
from neuron.loader.images import ImageError, ImageProcessing, open_image, pixel_patches
from neuron.models.mrope import rope_positions

from .inputs import StepRejected


@dataclass
class SlotImage:
    offset: int
    tokens: int
    grid: tuple[int, int, int]
    embeds: torch.Tensor | None  # None: the image lies before the sequence's first computed token


@dataclass
class StepImages:
    """What the model takes for a step that holds image sequences (``StepMeta.images``)."""

    rope: object  # RopeTables of the step's rows, at rows 0..T-1
    rope_index: torch.Tensor  # [T]: arange
    rows: torch.Tensor | None  # the rows that take image embeddings
    embeds: torch.Tensor | None  # [len(rows), hidden]


class RankImages:
    def __init__(self, model, device: torch.device) -> None:
        self.model, self.device = model, device
        vision = model.cfg.vision
        self.processing = ImageProcessing.from_config(vision["processor"])
        self.merge = int(vision["config"].get("spatial_merge_size", 2))
        self.kept: dict[bytes, torch.Tensor] = {}
        self.slots: dict[int, list[SlotImage]] = {}

    def forget(self, keys: list[bytes]) -> None:
        for key in keys:
            self.kept.pop(key, None)

    def start(self, seq: p.StepSeq) -> None:
        """A sequence starts in ``seq.slot`` (its first step): its images, encoded where needed."""
        if not seq.images:
            self.slots.pop(seq.slot, None)
            return
        images = []
        for image in seq.images:
            embeds = None
            if image.offset + image.tokens > seq.start_pos:
                embeds = self.kept.get(image.key) if not image.data else None
                if embeds is None:
                    if not image.data:
                        raise StepRejected(f"image {image.key.hex()} was neither sent nor kept")
                    embeds = self.kept[image.key] = self._encode(image)
            images.append(SlotImage(image.offset, image.tokens, tuple(image.grid), embeds))
        self.slots[seq.slot] = images

    def _encode(self, image: p.StepImage) -> torch.Tensor:
        try:
            patches, grid = pixel_patches(open_image(image.data, decode=True, processing=self.processing),
                                          self.processing)
        except ImageError as exc:
            raise StepRejected(f"image {image.key.hex()}: {exc}") from None
        if tuple(grid) != tuple(image.grid):
            raise StepRejected(f"image {image.key.hex()} has the grid {grid}, not {tuple(image.grid)}")
        with torch.inference_mode():
            return self.model.vision(torch.from_numpy(patches), [grid])

    def involved(self, seqs: list[p.StepSeq]) -> bool:
        return any(s.slot in self.slots for s in seqs)

    def step_inputs(self, seqs: list[p.StepSeq], positions: np.ndarray) -> StepImages:
        """``positions``: each row's token index (``inputs.flatten``)."""
        pos3 = np.repeat(positions[None], 3, axis=0)
        rows, embeds = [], []
        row = 0
        for s in seqs:
            n = len(s.tokens)
            images = self.slots.get(s.slot)
            if images:
                at = positions[row: row + n]
                pos3[:, row: row + n] = rope_positions([(i.offset, i.tokens, i.grid) for i in images], at, self.merge)
                for image in images:
                    lo, hi = max(image.offset, s.start_pos), min(image.offset + image.tokens, s.start_pos + n)
                    if lo < hi:
                        if image.embeds is None:
                            raise StepRejected(f"slot {s.slot}: an image at {image.offset} has no embeddings")
                        rows.append(torch.arange(row + lo - s.start_pos, row + hi - s.start_pos))
                        embeds.append(image.embeds[lo - image.offset: hi - image.offset])
                if s.start_pos + n >= images[-1].offset + images[-1].tokens:
                    for image in images:  # the prompt's images are in: their embeddings are no longer needed
                        image.embeds = None
            row += n
        T = len(positions)
        return StepImages(self.model.mrope_tables(torch.from_numpy(pos3).to(self.device)),
                          torch.arange(T, device=self.device),
                          torch.cat(rows).to(self.device) if rows else None,
                          torch.cat(embeds) if embeds else None)
