"""Random test images, encoded as a client sends them."""

from __future__ import annotations

import base64
import io

import numpy as np


def png(height: int, width: int, seed: int, mode: str = "RGB") -> tuple[bytes, object]:
    """A random image of `mode` (RGB, RGBA or L) as PNG bytes, and the PIL image they hold."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (height, width, len(mode)), dtype=np.uint8)
    image = Image.fromarray(pixels[..., 0] if mode == "L" else pixels, mode)
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue(), image


def png_bytes(height: int, width: int, seed: int) -> bytes:
    return png(height, width, seed)[0]


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()
