"""Which images' embeddings the ranks keep, decided here: the ranks run the vision tower on an
image once and keep its embeddings under its content hash, least recently used first out, within
a bound of bytes; the leader mirrors that set, so an image's bytes cross the rank sockets only when
the ranks must encode it, and tells them which to drop (``Step.forget_images``, which a rank
applies after the step's own images, so that after each step both sides hold the same set). A new
rank group starts empty (``clear``)."""

from __future__ import annotations

from collections import OrderedDict

import protocol as p

from .request import GenRequest


class ImageCache:
    def __init__(self, bytes_per_token: int, budget: int) -> None:
        self.bytes_per_token, self.budget = bytes_per_token, budget
        self.held: OrderedDict[bytes, int] = OrderedDict()  # key -> bytes of its embeddings
        self.total = 0
        self.forget: list[bytes] = []
        self.encodes = 0  # images the ranks encoded
        self.reuses = 0  # images whose kept embeddings served again

    def clear(self) -> None:
        self.held.clear()
        self.forget.clear()
        self.total = 0

    def drop_all(self) -> None:
        """A step failed: what its ranks kept of it is unknown, so they drop every image."""
        self.forget += [key for key in self.held if key not in self.forget]
        self.held.clear()
        self.total = 0

    def step_images(self, req: GenRequest, start_pos: int) -> list[p.StepImage]:
        """The images of ``req``'s first step from ``start_pos``: with their bytes where the ranks
        need the embeddings and do not keep them."""
        out = []
        for image in req.images:
            data = b""
            if image.offset + image.tokens > start_pos:  # some of its tokens are still to compute
                if image.key in self.held:
                    self.held.move_to_end(image.key)
                    self.reuses += 1
                else:
                    data = image.data
                    self.encodes += 1
                    self._keep(image.key, image.tokens * self.bytes_per_token)
            out.append(p.StepImage(image.key, image.offset, image.tokens, image.grid, data))
        return out

    def _keep(self, key: bytes, size: int) -> None:
        if key in self.forget:  # dropped earlier in this step, encoded again: the ranks keep it after all
            self.forget.remove(key)
        self.held[key] = size
        self.total += size
        while self.total > self.budget and self.held:
            old, freed = self.held.popitem(last=False)
            self.forget.append(old)
            self.total -= freed

    def take_forget(self) -> list[bytes]:
        out, self.forget = self.forget, []
        return out
