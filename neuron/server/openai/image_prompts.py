"""The images of a chat: each ``image_url`` part read (a ``data:`` URI decoded with Pillow, every
pixel, so a corrupt file is a 400 now and never a failed step), hashed, and counted in image
tokens; its place in the prompt marked for the chat template, and each marker's image-pad token
then expanded to the image's count. Off the event loop, as the prompt is.

Decoding is what an image costs, here and again on the ranks, where it holds up every stream of
the model. So before any pixel is decoded, from its header alone: an image may decode to no more
than its model's processor keeps (``decode_allowance``; a large JPEG is decoded at a reduced
scale instead), and a request's images together to no more than ``[engine]
image_pixels_per_request``."""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec

from protocol.api_core import Image
from neuron.errors import ApiError
from neuron.loader.images import (ImageError, ImageProcessing, data_uri_bytes, decode_allowance, decode_pixels,
                                  open_image, source_size)

MAX_IMAGES = 16  # a request's images
MAX_IMAGE_BYTES = 20 << 20  # one image's encoded bytes


class ImageReader:
    """A request's images, in the order their parts come."""

    def __init__(self, vision: dict[str, Any], tokenizer, model: str, no_vision: str,
                 pixels_per_request: int = 1 << 62) -> None:
        self.vision, self.model, self.no_vision = vision, model, no_vision
        self.images: list[Image] = []
        self.pixels_left = pixels_per_request
        self._undecoded: list[tuple[Any, str]] = []  # (image, param): decoded once all are counted
        if vision:
            self.processing = ImageProcessing.from_config(vision["processor"])
            self.marker = "".join(tokenizer.id_to_token(vision[k]) or "" for k in (
                "vision_start_token_id", "image_token_id", "vision_end_token_id"))

    def part(self, part: Any, param: str) -> str:
        """The text an image part stands as in the prompt."""
        if not self.vision:
            raise ApiError(400, "vision_unsupported", f"model {self.model[:80]!r} does not take images: "
                           f"{self.no_vision}; send text parts only", param=param)
        if len(self.images) >= MAX_IMAGES:
            raise ApiError(400, "too_many_images", f"a request may hold at most {MAX_IMAGES} images", param=param)
        url = part.image_url.get("url") if isinstance(part.image_url, dict) else part.image_url
        try:
            data = data_uri_bytes(url, MAX_IMAGE_BYTES)
            image = open_image(data, processing=self.processing)  # the header, and a JPEG's decoding scale
            self._budget(*image.size, f"{param}.image_url")
            width, height = source_size(image)
            grid = self.processing.grid(height, width)
            tokens = self.processing.tokens(height, width)
        except ImageError as exc:
            raise ApiError(400, "invalid_image", str(exc), param=f"{param}.image_url") from None
        self.images.append(Image(hashlib.blake2b(data, digest_size=16).digest(), data, grid, tokens))
        self._undecoded.append((image, f"{param}.image_url"))
        return self.marker

    def decode(self) -> None:
        """Every pixel of every image read, now that all of them are within the budget."""
        for image, param in self._undecoded:
            try:
                decode_pixels(image)
            except ImageError as exc:
                raise ApiError(400, "invalid_image", str(exc), param=param) from None
        self._undecoded.clear()

    def _budget(self, width: int, height: int, param: str) -> None:
        pixels, allowance = width * height, decode_allowance(self.processing)
        if pixels > allowance:
            raise ApiError(400, "invalid_image", f"an image of {width}x{height} pixels is larger than this model "
                           f"keeps ({allowance} pixels): send it smaller", param=param)
        if pixels > self.pixels_left:
            raise ApiError(400, "invalid_image", "the request's images have more pixels than the "
                           "[engine] image_pixels_per_request allowed: send fewer or smaller images", param=param)
        self.pixels_left -= pixels

    def expand(self, ids: list[int]) -> tuple[list[int], list[Image]]:
        """``ids`` with each image's pad token repeated to its count, and the images with their
        offsets; exactly one pad token per image, or the template lost or added one."""
        if not self.vision:
            return ids, []
        self.decode()
        pad = int(self.vision["image_token_id"])
        at = [i for i, t in enumerate(ids) if t == pad]
        if len(at) != len(self.images):
            raise ApiError(400, "invalid_request", f"the prompt holds {len(at)} image tokens for {len(self.images)} "
                           "images: image tokens cannot be sent as text, and the chat template must keep each "
                           "image part", param="messages")
        out: list[int] = []
        images = []
        last = 0
        for i, image in zip(at, self.images):
            out += ids[last:i]
            images.append(msgspec.structs.replace(image, offset=len(out)))
            out += [pad] * image.tokens
            last = i + 1
        return out + ids[last:], images
