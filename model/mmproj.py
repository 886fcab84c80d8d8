"""A vision tower from llama.cpp's multimodal projector file (`mmproj-*.gguf`, `--mmproj`), beside a GGUF
text model: the same tower as model/vision.py, its config and processor read from the file's `clip.*`
metadata and its tensors renamed from llama.cpp's names.

llama.cpp's converter writes SmolVLM's (Idefics3's) tower as projector type `idefics3`: SigLIP blocks
`v.blk.N.*`, the patch and position embeddings, `v.post_ln`, and the connector's projection `mm.model.fc`;
`clip.vision.preproc_image_size` is the processor's longest edge, and the image tokens come from the text
model's vocabulary (`<image>`). Gemma 3's is type `gemma3`: the same SigLIP, then `mm.soft_emb_norm` (stored
as 1 + w, Gemma's scale) and `mm.input_projection`; its average pool is 4 x 4 unless
`clip.vision.projector.scale_factor` says otherwise, and its tokens are `<start_of_image>`,
`<image_soft_token>` and `<end_of_image>`. Other projector types are refused by name.
"""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import torch

from model.errors import ModelLoadError, one_line
from model.image_processor import IMAGE_TOKEN, processor_for
from model.tokenizer import Tokenizer
from model.vision import ImageEncoder, Vision, VisionConfig

SUPPORTED_PROJECTORS = ("idefics3", "gemma3")
# Gemma 3's image tokens, by their text in its vocabulary: begin, each embedding's, end.
GEMMA3_IMAGE_TOKENS = ("<start_of_image>", "<image_soft_token>", "<end_of_image>")
# llama.cpp's name (without .weight/.bias) -> ImageEncoder's; `{i}` is a block's index.
_BLOCK_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_out": "self_attn.out_proj", "ln1": "layer_norm1", "ln2": "layer_norm2",
                "ffn_up": "mlp.fc1", "ffn_down": "mlp.fc2"}
_NAMES = {"v.patch_embd": "vision_model.embeddings.patch_embedding",
          "v.position_embd": "vision_model.embeddings.position_embedding",
          "v.post_ln": "vision_model.post_layernorm",
          "mm.model.fc": "connector.modality_projection.proj",
          "mm.soft_emb_norm": "connector.mm_soft_emb_norm"}


def encoder_name(name: str) -> str | None:
    """An mmproj tensor's name in ImageEncoder's state dict (None: not one of this tower's)."""
    stem, _, kind = name.rpartition(".")
    if stem == "mm.input_projection":  # a bare parameter of the connector, not a module's weight
        return "connector.mm_input_projection_weight"
    if stem in _NAMES:
        return f"{_NAMES[stem]}.{kind}"
    parts = stem.split(".")
    if len(parts) == 4 and parts[:2] == ["v", "blk"] and parts[3] in _BLOCK_NAMES:
        return f"vision_model.encoder.layers.{parts[2]}.{_BLOCK_NAMES[parts[3]]}.{kind}"
    return None


def read_mmproj(path: str | Path, tokenizer: Tokenizer, text_hidden_size: int, dtype: torch.dtype,
                device: torch.device | str, pan_and_scan: bool | None = None) -> Vision:
    """The tower and processor of an mmproj file for a text model of `text_hidden_size` whose vocabulary
    (`tokenizer`) holds the image tokens; ModelLoadError (one line) for anything else."""
    from model.gguf_file import GGUFFile

    path = Path(path).expanduser()
    try:
        file = GGUFFile(path)
    except (OSError, ValueError, struct.error) as e:  # struct.error: a file cut short
        raise ModelLoadError(f"{path}: not a readable GGUF file ({one_line(e)})") from None
    meta = file.metadata
    if meta.get("general.architecture") != "clip" or not meta.get("clip.has_vision_encoder", False):
        raise ModelLoadError(f"{path}: not a multimodal projector file (general.architecture "
                             f"{meta.get('general.architecture')!r}, expected 'clip' with a vision encoder)")
    projector = meta.get("clip.projector_type") or meta.get("clip.vision.projector_type")
    if projector not in SUPPORTED_PROJECTORS:
        raise ModelLoadError(f"{path}: projector type {projector!r} is not supported "
                             f"({', '.join(SUPPORTED_PROJECTORS)}: SmolVLM and Idefics3, Gemma 3)")
    gemma3 = projector == "gemma3"
    names = GEMMA3_IMAGE_TOKENS if gemma3 else (IMAGE_TOKEN,)
    ids = [tokenizer.token_to_id(name) for name in names]
    if None in ids:
        missing = names[ids.index(None)]
        raise ModelLoadError(f"{path}: the text model's vocabulary has no {missing} token for its images")
    token_ids = ({"begin_token_id": ids[0], "image_token_id": ids[1], "end_token_id": ids[2], "family": "gemma3"}
                 if gemma3 else {"image_token_id": ids[0]})
    try:
        config = VisionConfig(
            hidden_size=int(meta["clip.vision.embedding_length"]),
            intermediate_size=int(meta["clip.vision.feed_forward_length"]),
            num_layers=int(meta["clip.vision.block_count"]),
            num_heads=int(meta["clip.vision.attention.head_count"]),
            image_size=int(meta["clip.vision.image_size"]),
            patch_size=int(meta["clip.vision.patch_size"]),
            layer_norm_eps=float(meta.get("clip.vision.attention.layer_norm_epsilon", 1e-6)),
            scale_factor=int(meta.get("clip.vision.projector.scale_factor", 4 if gemma3 else 2)),
            text_hidden_size=text_hidden_size,
            **token_ids,
        )
    except KeyError as e:
        raise ModelLoadError(f"{path}: missing metadata {e}") from None
    projection = meta.get("clip.vision.projection_dim")
    if projection is not None and int(projection) != text_hidden_size:
        raise ModelLoadError(f"{path}: projects images to {projection} dimensions; the text model's are "
                             f"{text_hidden_size} (a projector made for another model)")
    # The processor's settings under preprocessor_config.json's names: the mean and std, and Idefics3's longest
    # edge (`preproc_image_size`; none: the image is not resized first).
    longest = meta.get("clip.vision.preproc_image_size")
    raw = {"image_mean": meta.get("clip.vision.image_mean", [0.5] * 3),
           "image_std": meta.get("clip.vision.image_std", [0.5] * 3),
           "do_resize": bool(longest), "size": {"longest_edge": longest} if longest else None}
    processor = processor_for(raw, config, pan_and_scan, path)
    with torch.device("meta"):
        encoder = ImageEncoder(config)
    expected = encoder.state_dict()
    state: dict[str, torch.Tensor] = {}
    for tensor in file.tensors:
        name = encoder_name(tensor.name)
        if name is None or name not in expected:
            raise ModelLoadError(f"{path}: tensor {tensor.name!r} is not one of an {projector} tower's")
        try:
            array = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
        except NotImplementedError:
            raise ModelLoadError(f"{path}: tensor {tensor.name!r} has unsupported type "
                                 f"{tensor.tensor_type.name}") from None
        shape = expected[name].shape
        if array.size != shape.numel():
            raise ModelLoadError(f"{path}: tensor {tensor.name!r} holds {array.size} values; the file's config "
                                 f"says {tuple(shape)}")
        value = torch.from_numpy(np.array(array, dtype=np.float32)).reshape(shape)
        if name == "connector.mm_soft_emb_norm.weight":  # the file holds Gemma's scale 1 + w; the connector w
            value = value - 1.0
        state[name] = value.to(device, dtype)
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ModelLoadError(f"{path}: missing tensors for {missing[:3]}")
    encoder.load_state_dict(state, assign=True)
    return Vision(encoder.eval(), processor)
