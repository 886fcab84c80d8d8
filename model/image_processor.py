"""Images into the tiles a vision tower reads (model/vision.py), and the prompt tokens that hold their places.

Idefics3 (SmolVLM), `ImageProcessor`: an image is resized so its longest edge is `longest_edge` (the
checkpoint's preprocessor_config.json), then up to whole tiles of `tile_size`, cut into rows x cols tiles, and
followed by the whole image at one tile's size (the "global" tile); an image of one tile is that tile alone.
Each tile becomes `tokens_per_tile` `<image>` tokens, framed by `<fake_token_around_image>` and a
`<row_r_col_c>` or `<global-img>` tag, the layout the model was trained on. Resizing is PIL's Lanczos on 8-bit
pixels, then x/255 and (x - mean) / std, as the checkpoint's processor does.

Gemma 3, `Gemma3ImageProcessor`: an image is resized to one square tile (bilinear), and the template's
`<start_of_image>` becomes "\n\n", begin, 256 image tokens, end, "\n\n", as its processor writes it; with
pan and scan (`PanAndScan`), a wide or tall image's crops follow as tiles of their own.

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
    rows: int  # the grid of tiles (0, 0: one tile, no grid); Gemma 3: rows 0, cols its pan-and-scan crops
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
class PanAndScan:
    """Gemma 3's optional crops of a wide or tall image (its processor's `do_pan_and_scan`): an image whose long
    side is at least `min_ratio` times its short one is also cut along the long side into 2 .. `max_crops`
    equal crops (about one per short side's length, each at least `min_crop_size` pixels), each shown to the
    model as an image of its own after the whole one."""

    min_crop_size: int = 256
    max_crops: int = 4
    min_ratio: float = 1.2

    def boxes(self, width: int, height: int) -> list[tuple[int, int, int, int]]:
        """The crops' (left, top, right, bottom) boxes, row by row; none for an image not wide or tall enough."""
        long, short = max(width, height), min(width, height)
        if long / short < self.min_ratio:
            return []
        count = min(math.floor(long / short + 0.5), long // self.min_crop_size)
        count = min(self.max_crops, max(2, count))
        across, down = (count, 1) if width >= height else (1, count)
        crop_w, crop_h = math.ceil(width / across), math.ceil(height / down)
        if min(crop_w, crop_h) < self.min_crop_size:
            return []
        # A box may reach past the image's edge (the last one of an uneven cut): it is cut at the edge.
        return [(c * crop_w, r * crop_h, min((c + 1) * crop_w, width), min((r + 1) * crop_h, height))
                for r in range(down) for c in range(across)]


@dataclass(frozen=True)
class Gemma3ImageProcessor:
    """Gemma 3's: each image one square tile of `tile_size` pixels, its place in the prompt "\n\n", begin,
    `tokens_per_tile` image tokens, end, "\n\n"; with `pan_and_scan`, a wide or tall image's crops follow as
    tiles of their own, in the text Gemma's processor writes around them."""

    tile_size: int
    tokens_per_tile: int
    image_token_id: int  # each image embedding's token
    begin_token_id: int  # <start_of_image>: the chat template's image marker, and the image's first token
    end_token_id: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    rescale: float = 1 / 255
    resample: int = 2  # PIL's code (bilinear)
    pan_and_scan: PanAndScan | None = None

    @classmethod
    def from_config(cls, raw: Mapping[str, Any], config: VisionConfig) -> Gemma3ImageProcessor:
        size = raw.get("size") or {}
        side = (size.get("height", config.image_size), size.get("width", config.image_size))
        if side != (config.image_size, config.image_size):
            raise ValueError(f"size {side} differs from the vision tower's image_size {config.image_size}")
        if raw.get("do_rescale", True) is False or raw.get("do_normalize", True) is False:
            raise ValueError("only processors that rescale and normalize are supported")
        pan_and_scan = None
        if raw.get("do_pan_and_scan"):
            defaults = PanAndScan()
            pan_and_scan = PanAndScan(int(raw.get("pan_and_scan_min_crop_size") or defaults.min_crop_size),
                                      int(raw.get("pan_and_scan_max_num_crops") or defaults.max_crops),
                                      float(raw.get("pan_and_scan_min_ratio_to_activate") or defaults.min_ratio))
        mean, std = raw.get("image_mean", [0.5] * 3), raw.get("image_std", [0.5] * 3)
        return cls(config.image_size, config.tokens_per_tile, config.image_token_id, config.begin_token_id,
                   config.end_token_id, tuple(float(m) for m in mean), tuple(float(s) for s in std),
                   float(raw.get("rescale_factor", 1 / 255)), int(raw.get("resample", 2)), pan_and_scan)

    def process(self, data: bytes) -> ProcessedImage:
        """An encoded image -> its normalized tile, then its crops' (pan and scan); ImageError when the bytes are
        not an image. `cols` counts the crops."""
        from PIL import Image

        image = decode_image(data)
        digest = hashlib.sha256(image.tobytes() + repr(image.size).encode()).digest()
        boxes = self.pan_and_scan.boxes(image.width, image.height) if self.pan_and_scan is not None else []
        tiles = [image, *(image.crop(box) for box in boxes)]
        side = (self.tile_size, self.tile_size)
        tiles = [t if t.size == side else t.resize(side, Image.Resampling(self.resample)) for t in tiles]
        pixels = np.stack([normalized(t, self.rescale, self.mean, self.std) for t in tiles])
        return ProcessedImage(torch.from_numpy(pixels), 0, len(boxes), digest)

    def expansion(self, image: ProcessedImage) -> list[str | list[int]]:
        """What one `<start_of_image>` becomes: text and each tile's framed tokens, alternating, text first."""
        frame = [self.begin_token_id, *[self.image_token_id] * self.tokens_per_tile, self.end_token_id]
        if not image.cols:
            return ["\n\n", frame, "\n\n"]
        crops: list[str | list[int]] = []
        for _ in range(image.cols):
            crops += [frame, "\n\n \n\n"]
        crops[-1] = "\n\n"
        return ["Here is the original image \n\n", frame,
                "\n\n and here are some crops to help you see better \n\n", *crops]

    def place(self, ids: list[int], images: Sequence[ProcessedImage], tokenizer: Tokenizer) -> list[int]:
        """A rendered chat's ids with each `<start_of_image>` its template wrote replaced by its `expansion`.
        Gemma's processor puts that text into the rendered chat before tokenizing, so it merges with the text
        around it ("user\n" + "\n\n" is one token "\n\n\n"): the runs of ordinary tokens beside an image are
        encoded again with the text next to them, the same runs the whole text's tokenization makes, since
        added tokens split it first."""
        check_markers(ids.count(self.begin_token_id), len(images))
        splits = tokenizer.added_ids
        # The ids as items: text to encode (str), ordinary tokens as they are (a tuple), or added tokens (a list).
        items: list[str | tuple[int, ...] | list[int]] = []
        images_left = iter(images)
        run: list[int] = []
        for token in ids:
            if token not in splits:
                run.append(token)
                continue
            items.append(tuple(run))
            run = []
            items += self.expansion(next(images_left)) if token == self.begin_token_id else [[token]]
        items.append(tuple(run))
        out: list[int] = []
        pending: list[str | tuple[int, ...]] = []  # the text between two added tokens

        def flush() -> None:
            if any(isinstance(piece, str) for piece in pending):  # touched by an image's text: encoded again
                text = "".join(p if isinstance(p, str) else tokenizer.decode(p, skip_special_tokens=False)
                               for p in pending)
                out.extend(tokenizer.encode(text, add_special_tokens=False))
            else:
                out.extend(token for piece in pending for token in piece)
            pending.clear()

        for item in items:
            if isinstance(item, list):
                flush()
                out.extend(item)
            else:
                pending.append(item)
        flush()
        return out


def check_markers(found: int, expected: int) -> None:
    if found != expected:
        raise ValueError(f"the chat template wrote {found} images of the {expected} in the messages (this "
                         "template may not show images in every role)")


def processor_from_hf_dir(directory: Path, config: VisionConfig, pan_and_scan: bool | None = None,
                          ) -> ImageProcessor | Gemma3ImageProcessor:
    """The image processor of a vision model's directory, from its preprocessor_config.json (ModelLoadError
    when missing or unreadable) and its tower's config; `pan_and_scan` overrides the file's
    `do_pan_and_scan` (Gemma 3's alone)."""
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
    return processor_for(raw, config, pan_and_scan, path)


def processor_for(raw: Mapping[str, Any], config: VisionConfig, pan_and_scan: bool | None,
                  source: Path) -> ImageProcessor | Gemma3ImageProcessor:
    """The tower's family's processor from preprocessor_config.json's fields (`raw`, or a projector file's
    metadata in those names), `pan_and_scan` over its `do_pan_and_scan` (Gemma 3's alone); ModelLoadError
    naming `source` for anything it cannot take."""
    kind = Gemma3ImageProcessor if config.family == "gemma3" else ImageProcessor
    if pan_and_scan is not None:
        if kind is not Gemma3ImageProcessor:
            raise ModelLoadError(f"{source}: pan and scan is Gemma 3's image processing; this is {config.family}")
        raw = {**raw, "do_pan_and_scan": pan_and_scan}
    try:
        return kind.from_config(raw, config)
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"{source}: {one_line(e)}") from None


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
