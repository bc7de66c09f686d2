"""Images as Qwen3.5's processor prepares them (neuron/loader/images.py) against transformers'
Pillow image processor: pixel values, grids and image-token counts for several sizes, aspect
ratios and modes, under Qwen3.5's processor config and the CLIP defaults; and the data: URIs
and files a request may not send, each refused with what is wrong."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image

from neuron.loader.images import ImageError, ImageProcessing, data_uri_bytes, open_image, pixel_patches

# Qwen3.5's preprocessor_config.json (the published one), shrunk in its pixel bounds so that tests
# see both the up- and the down-sizing; and transformers' defaults (CLIP mean/std, patch 14).
QWEN35 = {"patch_size": 16, "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
          "image_std": [0.5, 0.5, 0.5], "size": {"shortest_edge": 32 * 32 * 4, "longest_edge": 32 * 32 * 64},
          "do_resize": True, "do_rescale": True, "do_normalize": True, "resample": 3}
DEFAULTS: dict = {}


def image(width: int, height: int, mode: str, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    if mode == "L":
        return Image.fromarray(rng.integers(0, 256, (height, width), dtype=np.uint8), "L")
    if mode == "RGBA":
        pixels = rng.integers(0, 256, (height, width, 4), dtype=np.uint8)
        return Image.fromarray(pixels, "RGBA")
    rgb = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")
    return rgb.convert("P") if mode == "P" else rgb


def encoded(img: Image.Image, fmt: str) -> bytes:
    out = io.BytesIO()
    img.save(out, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return out.getvalue()


@pytest.mark.parametrize("config", [QWEN35, DEFAULTS], ids=["qwen3.5", "defaults"])
@pytest.mark.parametrize("width, height, mode, fmt", [
    (64, 64, "RGB", "PNG"), (300, 120, "RGB", "JPEG"), (33, 700, "RGBA", "PNG"), (10, 12, "L", "PNG"),
    (640, 480, "RGB", "WEBP"), (97, 211, "P", "GIF"), (1000, 30, "RGB", "PNG")])
def test_pixel_values_and_token_counts_equal_transformers_processor(config, width, height, mode, fmt):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    data = encoded(image(width, height, mode, width * height), fmt)
    processor = Qwen2VLImageProcessorPil(**config)
    want = processor(images=Image.open(io.BytesIO(data)), return_tensors="np")
    p = ImageProcessing.from_config(config)
    got, grid = pixel_patches(open_image(data, decode=True), p)
    assert [list(grid)] == want["image_grid_thw"].tolist()
    assert got.shape == want["pixel_values"].shape and got.dtype == np.float32
    assert np.array_equal(got, want["pixel_values"]), np.abs(got - want["pixel_values"]).max()
    head = open_image(data)  # the leader reads the header only
    assert p.tokens(head.height, head.width) == int(np.prod(grid)) // p.merge_size ** 2
    assert p.tokens(head.height, head.width) == processor.get_number_of_image_patches(height, width) // 4


def uri(data: bytes, kind: str = "image/png") -> str:
    return f"data:{kind};base64,{base64.b64encode(data).decode()}"


def test_a_data_uri_gives_its_bytes():
    data = encoded(image(20, 20, "RGB", 1), "PNG")
    assert data_uri_bytes(uri(data), 1 << 20) == data
    assert data_uri_bytes(uri(data, ""), 1 << 20) == data  # the media type may be left out


@pytest.mark.parametrize("url, words", [
    ("https://example.com/cat.png", "not fetched"), ("http://example.com/cat.png", "not fetched"),
    ("file:///etc/passwd", "must be a data: URI"), ("data:image/png,abcd", "base64-encoded"),
    ("data:image/png;base64,@@@@", "not valid base64"), (42, "must be a string"),
    ("data:image/png;base64," + "A" * 4000, "larger than the 1000 allowed")])
def test_what_is_not_an_inline_image_is_refused_naming_why(url, words):
    with pytest.raises(ImageError, match=words):
        data_uri_bytes(url, 1000)


def test_corrupt_unsupported_huge_and_elongated_images_are_refused():
    png = encoded(image(40, 40, "RGB", 2), "PNG")
    with pytest.raises(ImageError, match="not a PNG, JPEG, WebP or GIF"):
        open_image(b"not an image at all")
    with pytest.raises(ImageError, match="truncated or corrupt"):
        open_image(png[: len(png) // 2], decode=True)
    with pytest.raises(ImageError, match="BMP images are not supported"):
        open_image(encoded(image(8, 8, "RGB", 3), "BMP"))
    with pytest.raises(ImageError, match="larger than 32 on a side"):
        open_image(png, max_side=32)
    with pytest.raises(ImageError, match="40x40 pixels has more than 1000 pixels"):
        open_image(png, max_pixels=1000)
    with pytest.raises(ImageError, match="aspect ratio above 200"):
        ImageProcessing().tokens(2, 1000)


def test_a_large_jpeg_is_decoded_at_a_reduced_scale_to_the_same_grid_and_nearly_the_same_pixels():
    """A JPEG four times the size the processor keeps decodes at 1/2 or 1/4 scale (a sixteenth of
    the pixels or less), never below the size it is resized to: the same grid and token count as
    a full decode, pixel values within a few grey levels (a smooth image, as photos are)."""
    p = ImageProcessing.from_config(QWEN35)
    y, x = np.mgrid[0:1600, 0:2400]
    smooth = np.stack([(x / 10) % 256, (y / 7) % 256, ((x + y) / 13) % 256], -1).astype(np.uint8)
    data = encoded(Image.fromarray(smooth), "JPEG")
    full, reduced = open_image(data, decode=True), open_image(data, decode=True, processing=p)
    h, w = p.resized(1600, 2400)
    assert full.size == (2400, 1600) and reduced.size[0] * reduced.size[1] <= 2400 * 1600 // 4
    assert reduced.size[0] >= w and reduced.size[1] >= h
    want, want_grid = pixel_patches(full, p)
    got, grid = pixel_patches(reduced, p)
    assert grid == want_grid and got.shape == want.shape
    assert np.abs(got - want).mean() < 4 / 127.5, np.abs(got - want).mean()  # values in [-1, 1]
    png = encoded(Image.fromarray(smooth), "PNG")  # no reduced decoding for other formats
    assert open_image(png, processing=p).size == (2400, 1600)


def test_an_image_sent_to_the_server_is_refused_as_vision_unsupported_never_dropped(tp1):
    """A text model (the default one): an image part in a chat (the official client's shape) or a
    Responses input is a 400 vision_unsupported naming the part, and the server answers the next
    request as before."""
    import httpx
    import openai

    client = openai.OpenAI(base_url=tp1.base, api_key="none")
    image = uri(encoded(Image.new("RGB", (16, 16), (255, 0, 0)), "PNG"))
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                         {"type": "image_url", "image_url": {"url": image}}]}])
    body = err.value.body
    assert body["code"] == "vision_unsupported" and body["param"] == "messages.0.content.1", body
    r = httpx.post(f"{tp1.base}/responses", timeout=30, json={"model": "SmolLM2-135M-Instruct", "input": [
        {"role": "user", "content": [{"type": "input_image", "image_url": image}]}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "vision_unsupported", r.text
    ok = client.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=4,
                                        messages=[{"role": "user", "content": "Hi"}])
    assert ok.choices[0].message.content is not None
