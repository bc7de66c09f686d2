"""Images of a chat, as a Qwen2-VL-style processor (Qwen3.5's) prepares them: a ``data:`` URI
decoded with Pillow, the size it is resized to (``smart_resize``) and so its count of image
tokens, and its pixel patches. Pure Python with Pillow and numpy, no torch: the leader counts an
image's tokens (admission, ``usage``, context checks) from its header alone; a rank decodes it
and builds the patches the vision tower takes. Equal to transformers' Pillow image processor
(``Qwen2VLImageProcessorPil``), which the tests check."""

from __future__ import annotations

import base64
import binascii
import io
import math
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_DATA_URI = re.compile(r"data:(image/[a-zA-Z0-9.+-]+)?(;[^,]*)?,(.*)", re.DOTALL)


class ImageError(ValueError):
    """An image a request cannot have, with what is wrong in words a client can act on."""


@dataclass(frozen=True)
class ImageProcessing:
    """A checkpoint's ``preprocessor_config.json``, the settings that shape an image's tokens."""

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    mean: tuple[float, ...] = CLIP_MEAN
    std: tuple[float, ...] = CLIP_STD
    rescale_factor: float = 1 / 255
    resample: int = 3  # Pillow's BICUBIC
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True

    @classmethod
    def from_config(cls, raw: dict[str, Any]) -> ImageProcessing:
        size = raw.get("size") or {}
        base = cls()

        def get(key: str, default: Any) -> Any:
            value = raw.get(key)
            return default if value is None else value

        mean, std = get("image_mean", base.mean), get("image_std", base.std)
        return cls(patch_size=int(get("patch_size", base.patch_size)),
                   temporal_patch_size=int(get("temporal_patch_size", base.temporal_patch_size)),
                   merge_size=int(get("merge_size", base.merge_size)),
                   min_pixels=int(size.get("shortest_edge") or get("min_pixels", base.min_pixels)),
                   max_pixels=int(size.get("longest_edge") or get("max_pixels", base.max_pixels)),
                   mean=tuple(float(m) for m in (mean if isinstance(mean, (list, tuple)) else [mean] * 3)),
                   std=tuple(float(s) for s in (std if isinstance(std, (list, tuple)) else [std] * 3)),
                   rescale_factor=float(get("rescale_factor", base.rescale_factor)),
                   resample=int(get("resample", base.resample)), do_resize=bool(get("do_resize", True)),
                   do_rescale=bool(get("do_rescale", True)), do_normalize=bool(get("do_normalize", True)))

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def resized(self, height: int, width: int) -> tuple[int, int]:
        """The size an image of ``height`` x ``width`` is resized to."""
        if not self.do_resize:
            return height, width
        return smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)

    def grid(self, height: int, width: int) -> tuple[int, int, int]:
        """(t, h, w) of the image's patches."""
        h, w = self.resized(height, width)
        return 1, h // self.patch_size, w // self.patch_size

    def tokens(self, height: int, width: int) -> int:
        """Image-pad tokens the image takes in the prompt: its patches merged ``merge_size``²."""
        t, h, w = self.grid(height, width)
        return t * h * w // (self.merge_size ** 2)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The nearest size with both sides multiples of ``factor`` and an area within
    [min_pixels, max_pixels], keeping the aspect ratio as near as that allows."""
    if max(height, width) / min(height, width) > 200:
        raise ImageError(f"an image of {width}x{height} pixels is too elongated (aspect ratio above 200)")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def data_uri_bytes(url: str, max_bytes: int) -> bytes:
    """The bytes of a base64 ``data:`` URI; anything else (a URL to fetch above all) refused."""
    if not isinstance(url, str):
        raise ImageError("image_url.url must be a string")
    if url.startswith(("http://", "https://")):
        raise ImageError("image URLs are not fetched: send the image inline as a data: URI "
                         "(data:image/png;base64,...)")
    match = _DATA_URI.fullmatch(url.strip())
    if match is None:
        raise ImageError(f"image_url.url must be a data: URI (data:image/png;base64,...), not {url[:40]!r}")
    params, payload = match.group(2) or "", match.group(3)
    if ";base64" not in params:
        raise ImageError("an image data: URI must be base64-encoded (data:image/png;base64,...)")
    if len(payload) * 3 // 4 > max_bytes:
        raise ImageError(f"an image of about {len(payload) * 3 // 4} bytes is larger than the {max_bytes} allowed")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("an image data: URI is not valid base64") from None


# Decoded, an image takes 3 bytes a pixel: a small file of one colour can unpack to gigabytes.
MAX_PIXELS = 50_000_000  # a 48-megapixel photo passes
# An image may decode to the processor's max_pixels, or to this where that is less: the processor
# resizes it to what it keeps anyway, and decoding is what costs (0.3-0.8 s a 16-megapixel PNG).
DECODE_FLOOR = 16 * 1024 * 1024


def open_image(data: bytes, max_side: int = 16384, decode: bool = False, max_pixels: int = MAX_PIXELS,
               processing: ImageProcessing | None = None):
    """A Pillow image of ``data`` (PNG, JPEG, WebP, GIF: its first frame). ``decode``: read every
    pixel too (a truncated or corrupt file fails here, not later); only an image of at most
    ``max_pixels`` pixels is decoded. ``processing``: a JPEG more than twice the size that
    processor keeps is decoded at 1/2, 1/4 or 1/8 scale (libjpeg's DCT scaling, the largest that
    stays above that size): ``image.size`` is then what is decoded, ``source_size(image)`` the
    file's own."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError:
        raise ImageError(f"the image has more than {max_pixels} pixels") from None
    except (UnidentifiedImageError, OSError, ValueError):
        raise ImageError("the image data is not a PNG, JPEG, WebP or GIF image") from None
    if image.format not in FORMATS:
        raise ImageError(f"{image.format} images are not supported (PNG, JPEG, WebP, GIF are)")
    width, height = image.size
    if not 0 < width <= max_side or not 0 < height <= max_side:
        raise ImageError(f"an image of {width}x{height} pixels is larger than {max_side} on a side")
    if width * height > max_pixels:
        raise ImageError(f"an image of {width}x{height} pixels has more than {max_pixels} pixels")
    image.info["neuron_source_size"] = (width, height)
    if processing is not None and image.format == "JPEG":
        h, w = processing.resized(height, width)
        image.draft("RGB", (w, h))  # never below (w, h): the resize to it stays a downscale
    if decode:
        decode_pixels(image)
    return image


def decode_pixels(image) -> None:
    """Read every pixel of ``image`` (from ``open_image``): a truncated or corrupt file fails here."""
    try:
        image.seek(0)
        image.load()
    except (OSError, ValueError, SyntaxError) as exc:
        raise ImageError(f"the {image.format} image is truncated or corrupt ({exc})") from None


def source_size(image) -> tuple[int, int]:
    """(width, height) of the file's image, before any reduced decoding."""
    return image.info.get("neuron_source_size", image.size)


def decode_allowance(p: ImageProcessing) -> int:
    """The most pixels one image may decode to, for a model whose processor is ``p``."""
    return max(p.max_pixels, DECODE_FLOOR)


def rgb_array(image) -> np.ndarray:
    """[H, W, 3] uint8: transparency composited onto white, as the processor does."""
    from PIL import Image

    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        image = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba)
    return np.array(image.convert("RGB"))


def pixel_patches(image, p: ImageProcessing) -> tuple[np.ndarray, tuple[int, int, int]]:
    """The processor's ``pixel_values`` of one image, float32 [h * w, 3 * T * P * P] (patches in
    merge-window order, each frame repeated T times), and its (t, h, w) grid."""
    from PIL import Image

    rgb = rgb_array(image)
    height, width = rgb.shape[:2]
    source_w, source_h = source_size(image)
    h, w = p.resized(source_h, source_w)
    if (h, w) != (height, width):
        rgb = np.array(Image.fromarray(rgb).resize((w, h), resample=p.resample))
    x = rgb.astype(np.float64) * p.rescale_factor if p.do_rescale else rgb.astype(np.float64)
    x = x.astype(np.float32)
    if p.do_normalize:
        x = (x - np.array(p.mean, dtype=np.float32)) / np.array(p.std, dtype=np.float32)
    x = np.moveaxis(x, -1, 0)  # [C, H, W]
    P, M, T = p.patch_size, p.merge_size, p.temporal_patch_size
    gh, gw = h // P, w // P
    x = x.reshape(3, gh // M, M, P, gw // M, M, P).transpose(1, 4, 2, 5, 0, 3, 6)
    x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], T, P, P))
    return np.ascontiguousarray(x.reshape(gh * gw, 3 * T * P * P)), (1, gh, gw)
