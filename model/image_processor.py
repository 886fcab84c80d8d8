"""Images into the tiles an Idefics3-style vision tower reads, and the prompt text that holds their places.

An image is resized so its longest edge is `longest_edge` (the checkpoint's preprocessor_config.json), then
up to whole tiles of `tile_size`, cut into rows x cols tiles, and followed by the whole image at one tile's
size (the "global" tile); an image of one tile is that tile alone. Each tile becomes `tokens_per_tile`
`<image>` tokens, framed by `<fake_token_around_image>` and a `<row_r_col_c>` or `<global-img>` tag, the
layout the model was trained on. Resizing is PIL's Lanczos on 8-bit pixels, then x/255 and (x - mean) / std,
as the checkpoint's processor does.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from model.errors import ModelLoadError, one_line

if TYPE_CHECKING:
    from model.tokenizer import Tokenizer

IMAGE_TOKEN = "<image>"
FRAME_TOKEN = "<fake_token_around_image>"
GLOBAL_TAG = "<global-img>"
MAX_LONGEST_EDGE = 4096  # the processor's own bound on the resized image
# Images of more pixels are refused before they are decoded (a small file can hold a huge image).
MAX_IMAGE_PIXELS = 64 * 1024 * 1024


class ImageError(ValueError):
    """An input that is not an image this model can read (one line, for a client)."""


@dataclass(frozen=True)
class ProcessedImage:
    pixels: torch.Tensor  # [tiles, 3, tile_size, tile_size] float32, normalized
    rows: int  # the grid of tiles (0, 0: one tile, no grid)
    cols: int
    digest: bytes  # sha256 of the pixels the tiles came from: equal images share prefix-cache blocks


@dataclass(frozen=True)
class ImageProcessor:
    tile_size: int
    tokens_per_tile: int
    longest_edge: int | None  # resize the longest edge to this first (None: keep the size)
    split: bool  # cut into tiles (else the whole image at one tile's size)
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    rescale: float = 1 / 255

    @classmethod
    def from_hf_dir(cls, directory: Path, tile_size: int, tokens_per_tile: int) -> ImageProcessor:
        """The directory's preprocessor_config.json (ModelLoadError when missing or unreadable);
        `tile_size` and `tokens_per_tile` are the vision tower's (model/vision.py)."""
        path = directory / "preprocessor_config.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ModelLoadError(f"{path}: missing (a vision model needs its image processor's config)") from None
        except (OSError, json.JSONDecodeError) as e:
            raise ModelLoadError(f"{path}: not valid JSON ({one_line(e)})") from None
        try:
            return cls.from_config(raw, tile_size, tokens_per_tile)
        except (KeyError, TypeError, ValueError) as e:
            raise ModelLoadError(f"{path}: {one_line(e)}") from None

    @classmethod
    def from_config(cls, raw: Mapping[str, Any], tile_size: int, tokens_per_tile: int) -> ImageProcessor:
        max_tile = (raw.get("max_image_size") or {}).get("longest_edge", tile_size)
        if int(max_tile) != tile_size:
            raise ValueError(f"max_image_size {max_tile} differs from the vision tower's image_size {tile_size}")
        if raw.get("do_rescale", True) is False or raw.get("do_normalize", True) is False:
            raise ValueError("only processors that rescale and normalize are supported")
        size = (raw.get("size") or {}).get("longest_edge") if raw.get("do_resize", True) else None
        mean, std = raw.get("image_mean", [0.5] * 3), raw.get("image_std", [0.5] * 3)
        return cls(tile_size, tokens_per_tile, int(size) if size else None, bool(raw.get("do_image_splitting", True)),
                   tuple(float(m) for m in mean), tuple(float(s) for s in std),
                   float(raw.get("rescale_factor", 1 / 255)))

    # -- images ---------------------------------------------------------------------------------------

    def process(self, data: bytes) -> ProcessedImage:
        """An encoded image (PNG, JPEG, WebP, GIF's first frame...) -> its normalized tiles; ImageError when
        the bytes are not one."""
        image = decode_image(data)
        digest = hashlib.sha256(image.tobytes() + repr(image.size).encode()).digest()
        if self.longest_edge is not None:
            image = resized(image, *longest_edge_size(image.height, image.width, self.longest_edge))
        rows = cols = 0
        if self.split:
            image = resized(image, *whole_tiles_size(image.height, image.width, self.tile_size))
            tiles = []
            if image.height > self.tile_size or image.width > self.tile_size:
                rows, cols = image.height // self.tile_size, image.width // self.tile_size
                t = self.tile_size
                tiles = [image.crop((c * t, r * t, (c + 1) * t, (r + 1) * t)) for r in range(rows) for c in range(cols)]
                image = resized(image, t, t)
            tiles.append(image)
        else:
            tiles = [resized(image, self.tile_size, self.tile_size)]
        return ProcessedImage(torch.from_numpy(np.stack([self.normalize(t) for t in tiles])), rows, cols, digest)

    def normalize(self, image) -> np.ndarray:
        """An RGB PIL image -> [3, H, W] float32 numpy: x * rescale, then (x - mean) / std per channel.

        In numpy, one thread: the server processes images on worker threads, and torch's parallel ops there
        would keep an OpenMP team alive beside the engine's, which slows every later step (see
        `AsyncLLMEngine.encode_images`)."""
        pixels = np.asarray(image, dtype=np.uint8).transpose(2, 0, 1)  # [3, H, W]
        x = (pixels.astype(np.float64) * self.rescale).astype(np.float32)  # as the checkpoint's processor
        mean = np.asarray(self.mean, dtype=np.float32)[:, None, None]
        std = np.asarray(self.std, dtype=np.float32)[:, None, None]
        return (x - mean) / std

    # -- prompt text ----------------------------------------------------------------------------------

    def placeholder(self, rows: int, cols: int) -> str:
        """The text one `<image>` of a rendered chat becomes: each tile's frame, tag and image tokens."""
        run = IMAGE_TOKEN * self.tokens_per_tile
        global_tile = f"{FRAME_TOKEN}{GLOBAL_TAG}{run}{FRAME_TOKEN}"
        if rows == 0 and cols == 0:
            return global_tile
        grid = "".join("".join(f"{FRAME_TOKEN}<row_{r + 1}_col_{c + 1}>{run}" for c in range(cols)) + "\n"
                       for r in range(rows))
        return f"{grid}\n{global_tile}"


    def place(self, ids: list[int], images: Sequence[ProcessedImage], image_token_id: int,
              tokenizer: Tokenizer) -> list[int]:
        """A rendered chat's ids with each `<image>` token its template wrote replaced by its image's
        placeholder ids (frames, tags and one `<image>` token per embedding); ValueError when the template
        wrote another number of images than there are."""
        found = ids.count(image_token_id)
        if found != len(images):
            raise ValueError(f"the chat template wrote {found} images of the {len(images)} in the messages (this "
                             "template may not show images in every role)")
        placeholders: dict[tuple[int, int], list[int]] = {}
        out: list[int] = []
        images_left = iter(images)
        for token in ids:
            if token != image_token_id:
                out.append(token)
                continue
            image = next(images_left)
            grid = (image.rows, image.cols)
            if grid not in placeholders:  # special tokens at both ends: encoded alone, as in the whole text
                placeholders[grid] = tokenizer.encode(self.placeholder(*grid), add_special_tokens=False)
            out.extend(placeholders[grid])
        return out


def data_url_bytes(url: str) -> bytes:
    """The bytes of a `data:[<type>];base64,<data>` URL; ImageError for another form."""
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64"):
        raise ImageError("an image data URL must be data:<type>;base64,<data>")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("an image data URL's data is not valid base64") from None


def decode_image(data: bytes):
    """Bytes -> an RGB PIL image (transparent pixels over white); ImageError for anything else."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
        if image.width * image.height > MAX_IMAGE_PIXELS:
            raise ImageError(f"the image is {image.width}x{image.height} pixels; at most {MAX_IMAGE_PIXELS} are read")
        image.load()
    except ImageError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise ImageError(f"not a readable image ({one_line(e)})") from None
    if image.mode == "RGB":
        return image
    rgba = image.convert("RGBA")
    white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(white, rgba).convert("RGB")


def resized(image, height: int, width: int):
    from PIL import Image

    if (image.height, image.width) == (height, width):
        return image
    return image.resize((width, height), Image.Resampling.LANCZOS)


def longest_edge_size(height: int, width: int, longest: int) -> tuple[int, int]:
    """The size with the longest edge at `longest` (up or down), the other edge even and by the aspect ratio,
    then both within MAX_LONGEST_EDGE (as the checkpoint's processor computes them)."""
    aspect = width / height
    if width >= height:
        width, height = longest, int(longest / aspect)
        height += height % 2
    else:
        height, width = longest, int(longest * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    if max(height, width) > MAX_LONGEST_EDGE:
        if width >= height:
            width, height = MAX_LONGEST_EDGE, int(MAX_LONGEST_EDGE / aspect)
        else:
            height, width = MAX_LONGEST_EDGE, int(MAX_LONGEST_EDGE * aspect)
    return max(height, 1), max(width, 1)


def whole_tiles_size(height: int, width: int, tile: int) -> tuple[int, int]:
    """Both edges up to whole tiles, the shorter one by the aspect ratio first."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    return height, width
