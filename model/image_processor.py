"""Images into the tiles a vision tower reads (model/vision.py), and the prompt tokens that hold their places.

Idefics3 (SmolVLM), `ImageProcessor`: an image is resized so its longest edge is `longest_edge` (the
checkpoint's preprocessor_config.json), then up to whole tiles of `tile_size`, cut into rows x cols tiles, and
followed by the whole image at one tile's size (the "global" tile); an image of one tile is that tile alone.
Each tile becomes `tokens_per_tile` `<image>` tokens, framed by `<fake_token_around_image>` and a
`<row_r_col_c>` or `<global-img>` tag, the layout the model was trained on. Resizing is PIL's Lanczos on 8-bit
pixels, then x/255 and (x - mean) / std, as the checkpoint's processor does.

Gemma 3, `Gemma3ImageProcessor`: an image is resized to one square tile (bilinear), and the template's
`<start_of_image>` becomes "\n\n", begin, 256 image tokens, end, "\n\n", as its processor writes it.

A processor's `place` turns a rendered chat's ids into the model's: each image marker the chat template
wrote replaced by its image's placeholder tokens.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import logging
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
    from model.vision import VisionConfig

log = logging.getLogger(__name__)

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
    image_token_id: int  # the `<image>` the chat template writes, and each image embedding's token
    longest_edge: int | None  # resize the longest edge to this first (None: keep the size)
    split: bool  # cut into tiles (else the whole image at one tile's size)
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    rescale: float = 1 / 255

    @classmethod
    def from_config(cls, raw: Mapping[str, Any], config: VisionConfig) -> ImageProcessor:
        """From a preprocessor_config.json's fields and the vision tower's config (model/vision.py)."""
        tile_size, tokens_per_tile = config.image_size, config.tokens_per_tile
        max_tile = (raw.get("max_image_size") or {}).get("longest_edge", tile_size)
        if int(max_tile) != tile_size:
            raise ValueError(f"max_image_size {max_tile} differs from the vision tower's image_size {tile_size}")
        if raw.get("do_rescale", True) is False or raw.get("do_normalize", True) is False:
            raise ValueError("only processors that rescale and normalize are supported")
        size = (raw.get("size") or {}).get("longest_edge") if raw.get("do_resize", True) else None
        mean, std = raw.get("image_mean", [0.5] * 3), raw.get("image_std", [0.5] * 3)
        return cls(tile_size, tokens_per_tile, config.image_token_id, int(size) if size else None,
                   bool(raw.get("do_image_splitting", True)),
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
        pixels = np.stack([normalized(t, self.rescale, self.mean, self.std) for t in tiles])
        return ProcessedImage(torch.from_numpy(pixels), rows, cols, digest)

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


    def place(self, ids: list[int], images: Sequence[ProcessedImage], tokenizer: Tokenizer) -> list[int]:
        """A rendered chat's ids with each `<image>` token its template wrote replaced by its image's
        placeholder ids (frames, tags and one `<image>` token per embedding); ValueError when the template
        wrote another number of images than there are."""
        check_markers(ids.count(self.image_token_id), len(images))
        placeholders: dict[tuple[int, int], list[int]] = {}
        out: list[int] = []
        images_left = iter(images)
        for token in ids:
            if token != self.image_token_id:
                out.append(token)
                continue
            image = next(images_left)
            grid = (image.rows, image.cols)
            if grid not in placeholders:  # special tokens at both ends: encoded alone, as in the whole text
                placeholders[grid] = tokenizer.encode(self.placeholder(*grid), add_special_tokens=False)
            out.extend(placeholders[grid])
        return out


@dataclass(frozen=True)
class Gemma3ImageProcessor:
    """Gemma 3's: each image one square tile of `tile_size` pixels (no pan and scan), its place in the prompt
    "\n\n", begin, `tokens_per_tile` image tokens, end, "\n\n"."""

    tile_size: int
    tokens_per_tile: int
    image_token_id: int  # each image embedding's token
    begin_token_id: int  # <start_of_image>: the chat template's image marker, and the image's first token
    end_token_id: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    rescale: float = 1 / 255
    resample: int = 2  # PIL's code (bilinear)

    @classmethod
    def from_config(cls, raw: Mapping[str, Any], config: VisionConfig) -> Gemma3ImageProcessor:
        size = raw.get("size") or {}
        side = (size.get("height", config.image_size), size.get("width", config.image_size))
        if side != (config.image_size, config.image_size):
            raise ValueError(f"size {side} differs from the vision tower's image_size {config.image_size}")
        if raw.get("do_pan_and_scan"):
            raise ValueError("do_pan_and_scan (Gemma 3's crops of wide images) is not supported; set it false")
        if raw.get("do_rescale", True) is False or raw.get("do_normalize", True) is False:
            raise ValueError("only processors that rescale and normalize are supported")
        mean, std = raw.get("image_mean", [0.5] * 3), raw.get("image_std", [0.5] * 3)
        return cls(config.image_size, config.tokens_per_tile, config.image_token_id, config.begin_token_id,
                   config.end_token_id, tuple(float(m) for m in mean), tuple(float(s) for s in std),
                   float(raw.get("rescale_factor", 1 / 255)), int(raw.get("resample", 2)))

    def process(self, data: bytes) -> ProcessedImage:
        """An encoded image -> its one normalized tile; ImageError when the bytes are not an image."""
        from PIL import Image

        image = decode_image(data)
        digest = hashlib.sha256(image.tobytes() + repr(image.size).encode()).digest()
        if image.size != (self.tile_size, self.tile_size):
            image = image.resize((self.tile_size, self.tile_size), Image.Resampling(self.resample))
        pixels = normalized(image, self.rescale, self.mean, self.std)[None]
        return ProcessedImage(torch.from_numpy(pixels), 0, 0, digest)

    def place(self, ids: list[int], images: Sequence[ProcessedImage], tokenizer: Tokenizer) -> list[int]:
        """A rendered chat's ids with each `<start_of_image>` its template wrote replaced by the image's
        tokens, framed by "\n\n" on both sides. Gemma's processor puts that text into the rendered chat
        before tokenizing, so the newlines merge with the text around them ("user\n" + "\n\n" is one
        token "\n\n\n"): the runs of ordinary tokens beside an image are encoded again with their newlines,
        the same runs the whole text's tokenization makes, since added tokens split it first."""
        check_markers(ids.count(self.begin_token_id), len(images))
        image = [self.begin_token_id, *[self.image_token_id] * self.tokens_per_tile, self.end_token_id]
        splits = tokenizer.added_ids
        # The ids as runs of ordinary tokens between single added tokens; an empty run on each side of a
        # marker, so every image has a run before and after it to carry its newlines.
        pieces: list[list[int]] = [[]]
        for token in ids:
            if token in splits:
                pieces += [[token], []]
            else:
                pieces[-1].append(token)
        out: list[int] = []
        for k, piece in enumerate(pieces):
            if k % 2:  # an added token
                out.extend(image if piece[0] == self.begin_token_id else piece)
                continue
            before = k > 0 and pieces[k - 1][0] == self.begin_token_id
            after = k + 1 < len(pieces) and pieces[k + 1][0] == self.begin_token_id
            if not (before or after):
                out.extend(piece)
                continue
            text = tokenizer.decode(piece, skip_special_tokens=False)
            out.extend(tokenizer.encode("\n\n" * before + text + "\n\n" * after, add_special_tokens=False))
        return out


def check_markers(found: int, expected: int) -> None:
    if found != expected:
        raise ValueError(f"the chat template wrote {found} images of the {expected} in the messages (this "
                         "template may not show images in every role)")


def processor_from_hf_dir(directory: Path, config: VisionConfig) -> ImageProcessor | Gemma3ImageProcessor:
    """The image processor of a vision model's directory, from its preprocessor_config.json (ModelLoadError
    when missing or unreadable) and its tower's config."""
    path = directory / "preprocessor_config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        if config.family != "gemma3":
            raise ModelLoadError(f"{path}: missing (a vision model needs its image processor's config)") from None
        # Gemma 3's processor has one setting that matters, the tile's size, which the tower's config gives.
        log.info("%s: missing; Gemma 3's defaults (%d-pixel bilinear tiles, mean and std 0.5)", path,
                 config.image_size)
        raw = {}
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}: not valid JSON ({one_line(e)})") from None
    kind = Gemma3ImageProcessor if config.family == "gemma3" else ImageProcessor
    try:
        return kind.from_config(raw, config)
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"{path}: {one_line(e)}") from None


def normalized(image, rescale: float, mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
    """An RGB PIL image -> [3, H, W] float32 numpy: x * rescale, then (x - mean) / std per channel.

    In numpy, one thread: the server processes images on worker threads, and torch's parallel ops there
    would keep an OpenMP team alive beside the engine's, which slows every later step (see
    `AsyncLLMEngine.encode_images`)."""
    pixels = np.asarray(image, dtype=np.uint8).transpose(2, 0, 1)  # [3, H, W]
    x = (pixels.astype(np.float64) * rescale).astype(np.float32)  # as the checkpoint's processor
    mean = np.asarray(mean, dtype=np.float32)[:, None, None]
    std = np.asarray(std, dtype=np.float32)[:, None, None]
    return (x - mean) / std


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
