"""The vision tower of a model that reads images: a SigLIP encoder over square image tiles, then a connector
that folds each s x s block of patches into one token and projects it into the language model's embedding
space. Two families:

- Idefics3 (SmolVLM): tiles of a grid plus a global one; the connector folds by pixel shuffle (an s x s
  block's features side by side) and projects with one linear layer.
- Gemma 3: one 896-pixel tile an image; the connector averages each s x s block (4 x 4: 256 tokens), then
  an RMSNorm and a projection. Its image tokens see each other both ways in the decoder (`bidirectional`):
  each image's run of tokens is one block of the attention mask, which the engine keeps in one chunk.

A tile of `image_size` pixels is (image_size / patch_size)^2 patches; the connector turns them into
`tokens_per_tile` = patches / scale_factor^2 embeddings, which take the places of as many image tokens in
the prompt (model/image_processor.py writes those). The decoder then runs them like any other token, so
the engine's batching, paged cache and prefix cache need nothing of images but the rows to put them in.

Module names follow the Idefics3 checkpoints (`vision_model.*`, `connector.*`); `vision_tensor_name` maps
Gemma 3's (`vision_tower.vision_model.*`, `multi_modal_projector.*`) onto them.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from model.errors import ModelLoadError, one_line

if TYPE_CHECKING:
    from model.image_processor import Gemma3ImageProcessor, ImageProcessor, ProcessedImage

# The config.json model types whose checkpoints hold this tower beside their text model.
VISION_MODEL_TYPES = ("idefics3", "smolvlm", "gemma3")


@dataclass(frozen=True)
class VisionConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int  # a tile's side in pixels
    patch_size: int
    layer_norm_eps: float
    scale_factor: int  # the connector folds scale_factor x scale_factor patches into one token
    text_hidden_size: int
    image_token_id: int  # the prompt token each image embedding replaces
    family: str = "idefics3"  # or "gemma3": which connector, processor and attention the images get
    # Gemma 3's image frame: the chat template writes <start_of_image> where an image goes, and the processor
    # turns it into begin, the image tokens, end (model/image_processor.py).
    begin_token_id: int | None = None
    end_token_id: int | None = None

    @property
    def bidirectional(self) -> bool:
        """Whether an image's tokens attend to each other both ways in the decoder (Gemma 3's)."""
        return self.family == "gemma3"

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def tokens_per_tile(self) -> int:
        return self.patches_per_side ** 2 // self.scale_factor ** 2

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> VisionConfig:
        """From an Idefics3/SmolVLM or Gemma 3 config.json (ValueError or KeyError when it is not one)."""
        model_type = cfg.get("model_type")
        if model_type not in VISION_MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} has no vision tower ladder reads")
        if "vision_config" not in cfg:
            raise ValueError(f"a {model_type} config.json without vision_config has no vision tower")
        vision, text = cfg["vision_config"], cfg["text_config"]
        act = vision.get("hidden_act", "gelu_pytorch_tanh")
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"vision_config.hidden_act {act!r} is not supported (gelu_pytorch_tanh)")
        family = "gemma3" if model_type == "gemma3" else "idefics3"
        image_size, patch_size = int(vision.get("image_size", 896)), int(vision.get("patch_size", 14))
        if family == "gemma3":  # the s x s average pool that leaves mm_tokens_per_image tokens
            tokens_per_side = math.isqrt(int(cfg.get("mm_tokens_per_image", 256)))
            scale_factor = (image_size // patch_size) // max(tokens_per_side, 1)
            ids = {"image_token_id": int(cfg.get("image_token_index", cfg.get("image_token_id", 262_144))),
                   "begin_token_id": int(cfg.get("boi_token_index", 255_999)),
                   "end_token_id": int(cfg.get("eoi_token_index", 256_000))}
            if scale_factor * tokens_per_side != image_size // patch_size:
                raise ValueError(f"mm_tokens_per_image {tokens_per_side ** 2} does not pool "
                                 f"{image_size // patch_size}^2 patches evenly")
        else:
            scale_factor = int(cfg.get("scale_factor", 2))
            ids = {"image_token_id": int(cfg["image_token_id"])}
        config = cls(
            hidden_size=int(vision.get("hidden_size", 1152)),
            intermediate_size=int(vision.get("intermediate_size", 4304)),
            num_layers=int(vision.get("num_hidden_layers", 27)),
            num_heads=int(vision.get("num_attention_heads", 16)),
            image_size=image_size,
            patch_size=patch_size,
            layer_norm_eps=float(vision.get("layer_norm_eps", 1e-6)),
            scale_factor=scale_factor,
            text_hidden_size=int(text.get("hidden_size", 2304) if family == "gemma3" else text["hidden_size"]),
            family=family,
            **ids,
        )
        if config.image_size % config.patch_size or config.patches_per_side % config.scale_factor:
            raise ValueError(f"image_size {config.image_size} is not whole patches of {config.patch_size} "
                             f"in blocks of {config.scale_factor}")
        return config


class VisionAttention(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_heads
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, P, hidden] -> [N, P, hidden]
        n, p, hidden = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:  # [N, heads, P, head_dim]
            return t.view(n, p, self.num_heads, -1).transpose(1, 2)

        # Every patch sees every patch of its own tile (no mask: tiles are never padded).
        out = F.scaled_dot_product_attention(heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x)))
        return self.out_proj(out.transpose(1, 2).reshape(n, p, hidden))


class VisionMLP(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class VisionLayer(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = VisionAttention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = VisionMLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class VisionEmbeddings(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(3, config.hidden_size, config.patch_size, stride=config.patch_size)
        self.position_embedding = nn.Embedding(config.patches_per_side ** 2, config.hidden_size)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:  # [N, 3, S, S] -> [N, P, hidden]
        # Contiguous once here: a transposed residual stream would make every layer's norms, adds and copies
        # strided (the tower 1.20x slower: benchmarks/RESULTS.md, Stop 49).
        patches = self.patch_embedding(pixels).flatten(2).transpose(1, 2).contiguous()
        # A whole tile's patches sit at positions 0 .. P - 1, row by row (the checkpoint's NaViT-style
        # fractional positions reduce to these when no tile is padded).
        return patches + self.position_embedding.weight[None]


class VisionEncoder(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.embeddings = VisionEmbeddings(config)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(VisionLayer(config) for _ in range(config.num_layers))
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(pixels)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)


class Connector(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.scale = config.scale_factor
        self.modality_projection = nn.Module()
        self.modality_projection.proj = nn.Linear(config.hidden_size * self.scale ** 2, config.text_hidden_size,
                                                  bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, P, hidden] -> [N, P / s^2, text hidden]
        n, p, hidden = x.shape
        side, s = int(p ** 0.5), self.scale
        # Pixel shuffle: each token holds an s x s block of patches, its features in the order the
        # checkpoint was trained with (a block's columns within a row, then its rows).
        x = x.view(n, side, side // s, hidden * s).permute(0, 2, 1, 3)
        x = x.reshape(n, side // s, side // s, hidden * s * s).permute(0, 2, 1, 3)
        return self.modality_projection.proj(x.reshape(n, p // (s * s), hidden * s * s))


class AveragePoolConnector(nn.Module):
    """Gemma 3's connector: the mean of each s x s block of patches, Gemma's RMSNorm (a scale of 1 + w), then
    a projection stored as [vision hidden, text hidden] (the checkpoint's `mm_input_projection_weight`)."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.scale = config.scale_factor
        self.eps = config.layer_norm_eps
        self.mm_input_projection_weight = nn.Parameter(torch.empty(config.hidden_size, config.text_hidden_size))
        self.mm_soft_emb_norm = nn.Module()
        self.mm_soft_emb_norm.weight = nn.Parameter(torch.empty(config.hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, P, hidden] -> [N, P / s^2, text hidden]
        n, p, hidden = x.shape
        side = int(p ** 0.5)
        grid = x.transpose(1, 2).reshape(n, hidden, side, side)
        pooled = F.avg_pool2d(grid, self.scale).flatten(2).transpose(1, 2)  # [N, tokens, hidden], row by row
        normed = pooled.float() * torch.rsqrt(pooled.float().pow(2).mean(-1, keepdim=True) + self.eps)
        normed = (normed * (1.0 + self.mm_soft_emb_norm.weight.float())).to(x.dtype)
        return normed @ self.mm_input_projection_weight


class ImageEncoder(nn.Module):
    """Image tiles -> the embeddings that replace their image tokens."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.vision_model = VisionEncoder(config)
        self.connector = AveragePoolConnector(config) if config.family == "gemma3" else Connector(config)

    @property
    def dtype(self) -> torch.dtype:
        return self.vision_model.post_layernorm.weight.dtype

    @torch.inference_mode()
    def forward(self, pixels: torch.Tensor, tiles_per_batch: int = 8) -> torch.Tensor:
        """pixels [N, 3, S, S] (normalized tiles) -> [N * tokens_per_tile, text hidden] in the tower's dtype;
        tiles go through in groups of `tiles_per_batch`, which bounds the activations' memory."""
        device = self.vision_model.post_layernorm.weight.device
        out = [self.connector(self.vision_model(group.to(device, self.dtype)))
               for group in pixels.split(tiles_per_batch)]
        return torch.cat(out).flatten(0, 1)


def vision_tensor_name(key: str) -> str | None:
    """A checkpoint tensor's name in `ImageEncoder`'s state dict, or None for one of the text model's.
    Idefics3 checkpoints say `model.vision_model.*` and `model.connector.*`; Gemma 3's
    `[model.]vision_tower.[vision_model.]*` and `[model.]multi_modal_projector.*`."""
    key = key.removeprefix("model.")
    if key.startswith("vision_tower."):
        name = key.removeprefix("vision_tower.").removeprefix("vision_model.")
        return None if name.startswith("head.") else "vision_model." + name  # a pooling head Gemma never reads
    if key.startswith("multi_modal_projector."):
        return "connector." + key.removeprefix("multi_modal_projector.")
    return key if key.startswith(("vision_model.", "connector.")) else None


@dataclass(frozen=True)
class EncodedImages:
    """A prompt's images as the decoder takes them: the rows that replace its `<image>` tokens, in order."""

    embeds: torch.Tensor  # [N, text hidden], every image's tiles' tokens in prompt order
    digest: bytes  # one sha256 over the images' pixels: equal images, equal prefix-cache keys


@dataclass
class Vision:
    """What a model needs to take images: the tower, the processor that makes its tiles and prompt text."""

    encoder: ImageEncoder
    processor: ImageProcessor | Gemma3ImageProcessor

    @property
    def image_token_id(self) -> int:
        return self.encoder.config.image_token_id

    @property
    def bidirectional(self) -> bool:
        """Whether each image's run of tokens is one block of the decoder's attention mask (Gemma 3)."""
        return self.encoder.config.bidirectional

    def encode(self, images: Sequence[ProcessedImage]) -> EncodedImages:
        """The images' embeddings, each image's tiles in order: [sum of tiles * tokens_per_tile, text hidden].
        CPU-heavy (a vision transformer over every tile): run it off an event loop."""
        if not images:
            raise ValueError("no images to encode")
        return EncodedImages(self.encoder(torch.cat([image.pixels for image in images])), images_digest(images))


def image_spans(positions: Sequence[int]) -> list[tuple[int, int]]:
    """The runs of consecutive positions [start, end) in ascending `positions`: each image's tokens."""
    spans: list[tuple[int, int]] = []
    for p in positions:
        if spans and spans[-1][1] == p:
            spans[-1] = (spans[-1][0], p + 1)
        else:
            spans.append((p, p + 1))
    return spans


def per_image(embeds: torch.Tensor, images: Sequence[ProcessedImage], tokens_per_tile: int) -> list[torch.Tensor]:
    """The tower's output over the images' tiles, in order, cut into each image's embeddings."""
    return list(embeds.split([image.pixels.shape[0] * tokens_per_tile for image in images]))


def images_digest(images: Sequence[ProcessedImage]) -> bytes:
    """One sha256 over a prompt's images' digests, in order."""
    return hashlib.sha256(b"".join(image.digest for image in images)).digest()


def joined(images: Sequence[ProcessedImage], embeds: Sequence[torch.Tensor]) -> EncodedImages:
    """A prompt's images' embeddings as the engine takes them: one tensor, one digest."""
    return EncodedImages(torch.cat(list(embeds)), images_digest(images))


def read_vision(directory: Path, raw_config: Mapping[str, Any], files: Sequence[Path], dtype: torch.dtype,
                device: torch.device | str, pan_and_scan: bool | None = None) -> Vision:
    """The vision tower of a Hugging Face directory whose config.json names one (VISION_MODEL_TYPES), its
    weights from the checkpoint's safetensors `files`; ModelLoadError when anything is missing.
    `pan_and_scan`: Gemma 3's crops on or off, over its processor config's setting."""
    from safetensors import safe_open

    from model.image_processor import processor_from_hf_dir

    try:
        config = VisionConfig.from_hf(raw_config)
    except (KeyError, TypeError, ValueError) as e:
        detail = f"missing field {e}" if isinstance(e, KeyError) else one_line(e)
        raise ModelLoadError(f"{directory / 'config.json'}: {detail}") from None
    processor = processor_from_hf_dir(directory, config, pan_and_scan)
    with torch.device("meta"):
        encoder = ImageEncoder(config)
    state: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                name = vision_tensor_name(key)
                if name is not None:
                    state[name] = f.get_tensor(key).to(device, dtype)
    expected = set(encoder.state_dict())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ModelLoadError(f"{directory}: the vision tower's tensors do not match its config (missing "
                             f"{missing[:3]}, unexpected {unexpected[:3]})")
    for name, tensor in state.items():
        shape = encoder.state_dict()[name].shape
        if tensor.shape != shape:
            raise ModelLoadError(f"{directory}: vision tensor {name} is {tuple(tensor.shape)}, the config says "
                                 f"{tuple(shape)}")
    encoder.load_state_dict(state, assign=True)
    return Vision(encoder.eval(), processor)
