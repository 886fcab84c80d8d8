"""The expert tensors of a mixture-of-experts checkpoint, in whichever form it stores them, as one stacked form.

The loader (model/weights.py) expects, per sparse layer N (names without the `model.` prefix):

    layers.N.mlp.gate.weight             [E, H]      the router
    layers.N.mlp.experts.gate_up_proj    [E, 2I, H]  per expert, gate rows then up rows
    layers.N.mlp.experts.down_proj       [E, H, I]

which is how transformers 5 holds the experts in memory. `stack_experts` makes those names out of what a
checkpoint has, one layer's tensors at a time (lazily, like the GGUF reader):

- the names above as they are (a checkpoint saved with transformers 5's fused layout);
- per expert M, Qwen3-MoE's names `layers.N.mlp.experts.M.{gate,up,down}_proj.weight` (the hub's
  checkpoints, and what transformers 5.24's save_pretrained writes);
- Mixtral's `layers.N.block_sparse_moe.gate.weight` and `...block_sparse_moe.experts.M.{w1,w3,w2}.weight`
  (w1 gate, w3 up, w2 down);
- the GGUF reader's `layers.N.mlp.experts.{gate,up,down}_proj.weight`, already stacked [E, out, in]
  (llama.cpp's ffn_gate_exps, ffn_up_exps, ffn_down_exps).

GPT-OSS (`gpt_oss_experts`) adds a bias to each: `layers.N.mlp.gate.bias` [E], `...experts.gate_up_proj_bias`
[E, 2I] and `...experts.down_proj_bias` [E, H], made from transformers' layout (`mlp.router.*`; gate_up_proj
[E, H, 2I] with the gate and up columns interleaved, down_proj [E, I, H]), from the published checkpoints'
MXFP4 blocks (`*_blocks` [E, out, in / 32, 16] and `*_scales` [E, out, in / 32], dequantized here), or from a
GGUF's stacks and their `.bias` tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import torch

from model.config import ModelConfig
from model.errors import ModelLoadError

if TYPE_CHECKING:  # model.gguf_blocks is imported where a weight is made (it needs numpy, and the decoder none)
    from model.gguf_blocks import BlockWeight

ROUTER, GATE_UP, DOWN = "mlp.gate.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj"
# Per-expert names: (gate, up, down) under a layer's prefix, with {e} for the expert's index.
PER_EXPERT_NAMES = (
    ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight", "mlp.experts.{e}.down_proj.weight"),
    ("block_sparse_moe.experts.{e}.w1.weight", "block_sparse_moe.experts.{e}.w3.weight",
     "block_sparse_moe.experts.{e}.w2.weight"),
)
STACKED_NAMES = ("mlp.experts.gate_proj.weight", "mlp.experts.up_proj.weight", "mlp.experts.down_proj.weight")
MIXTRAL_ROUTER = "block_sparse_moe.gate.weight"


ROUTER_BIAS, GATE_UP_BIAS, DOWN_BIAS = "mlp.gate.bias", GATE_UP + "_bias", DOWN + "_bias"
# MXFP4's 16 values (E2M1), indexed by a 4-bit code; a block of 32 shares a power-of-two scale 2^(e - 127).
MXFP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def expert_shapes(config: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """The stacked tensors of sparse layer `layer`, with their shapes."""
    p, h, e, inter = f"layers.{layer}.", config.hidden_size, config.num_experts, config.moe_intermediate_size
    shapes = {p + ROUTER: (e, h), p + GATE_UP: (e, 2 * inter, h), p + DOWN: (e, h, inter)}
    if config.swiglu_limit is not None:  # GPT-OSS: a bias for each
        shapes |= {p + ROUTER_BIAS: (e,), p + GATE_UP_BIAS: (e, 2 * inter), p + DOWN_BIAS: (e, h)}
    return shapes


def expert_sources(config: ModelConfig, layer: int) -> dict[str, list[str]]:
    """The expert block's state-dict names of layer `layer` -> the stacked tensor each is (weights.fused_sources)."""
    p = f"layers.{layer}."
    sources = {p + "mlp.gate.weight": [p + ROUTER], p + "mlp.w13": [p + GATE_UP], p + "mlp.w2": [p + DOWN]}
    if config.swiglu_limit is not None:
        sources |= {p + "mlp.gate.bias": [p + ROUTER_BIAS], p + "mlp.w13_bias": [p + GATE_UP_BIAS],
                    p + "mlp.w2_bias": [p + DOWN_BIAS]}
    return sources


def mxfp4_dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 as the published GPT-OSS checkpoints hold it: blocks [..., G, 16] uint8 (byte j holds values 2j in
    its low and 2j + 1 in its high nibble), scales [..., G] uint8 (E8M0) -> float32 [..., G * 32]."""
    values = torch.tensor(MXFP4_VALUES, dtype=torch.float32)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).long()  # [..., G, 16, 2]
    weight = values[codes].flatten(-2)  # [..., G, 32]
    weight = torch.ldexp(weight, (scales.long() - 127)[..., None].to(torch.float32))
    return weight.flatten(-2)


def mxfp4_block_weight(blocks: torch.Tensor, scales: torch.Tensor) -> BlockWeight:
    """An MXFP4 weight in the published layout (blocks [N, G, 16] uint8, scales [N, G] uint8: `mxfp4_dequantize`'s)
    as W4A8 table codes, exactly as a GGUF's MXFP4 is read (model/gguf_blocks.py): the 4-bit indices, d =
    2^(scale - 128) in float16, MXFP4_TABLE; requantized to 8 bits where float16 cannot hold a block's scale."""
    from model.gguf_blocks import MXFP4_TABLE, MXFP4_ZERO, TABLE_CODES, BlockWeight, requantize_8bit

    exponent = scales.to(torch.int32) - 128
    if int(exponent.min()) < -24 or int(exponent.max()) > 15:
        return requantize_8bit(mxfp4_dequantize(blocks, scales))
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).reshape(blocks.shape[0], -1)  # inputs 2j, 2j + 1
    d = torch.ldexp(torch.ones(exponent.shape), exponent.float()).half()
    return BlockWeight(codes.contiguous(), d, None, TABLE_CODES, MXFP4_ZERO, table=MXFP4_TABLE)


def deinterleave_gate_up(t: torch.Tensor) -> torch.Tensor:
    """[E, 2I, ...] with GPT-OSS's gate and up rows alternating -> each expert's gate rows, then its up rows."""
    index = torch.arange(t.shape[1])
    return t.index_select(1, torch.cat([index[0::2], index[1::2]]))


def gpt_oss_experts(config: ModelConfig, tensors: Mapping[str, torch.Tensor], shapes: dict[str, tuple[int, ...]],
                    makers: dict[str, Callable[[], torch.Tensor]], layer: int, source: str) -> None:
    """GPT-OSS layer `layer`'s experts and router under the stacked names, in `shapes` and `makers` (in place),
    from transformers' layout, MXFP4 blocks or a GGUF's stacks (the module docstring lists them)."""
    p = f"layers.{layer}."
    deinterleave = deinterleave_gate_up
    gate_up, down = p + GATE_UP, p + DOWN
    if p + "mlp.router.weight" in shapes:  # transformers' names
        if gate_up + "_blocks" in shapes:  # MXFP4: rows are outputs already, gate and up rows interleaved
            read = {gate_up: lambda: deinterleave(mxfp4_dequantize(tensors[gate_up + "_blocks"],
                                                                   tensors[gate_up + "_scales"])),
                    down: lambda: mxfp4_dequantize(tensors[down + "_blocks"], tensors[down + "_scales"])}
            used = [name + part for name in (gate_up, down) for part in ("_blocks", "_scales")]
        else:  # gate_up_proj [E, H, 2I] and down_proj [E, I, H]: inputs first
            read = {gate_up: lambda: deinterleave(tensors[gate_up].transpose(1, 2)).contiguous(),
                    down: lambda: tensors[down].transpose(1, 2).contiguous()}
            used = [gate_up, down]
        read |= {p + ROUTER: lambda: tensors[p + "mlp.router.weight"],
                 p + ROUTER_BIAS: lambda: tensors[p + "mlp.router.bias"],
                 p + GATE_UP_BIAS: lambda: deinterleave(tensors[gate_up + "_bias"]),
                 p + DOWN_BIAS: lambda: tensors[down + "_bias"]}
        used += [p + "mlp.router.weight", p + "mlp.router.bias", gate_up + "_bias", down + "_bias"]
        if any(name not in shapes for name in used):
            raise ModelLoadError(f"{source}: missing tensor {next(n for n in used if n not in shapes)!r} (GPT-OSS "
                                 f"layer {layer}'s experts)")
        if gate_up + "_blocks" in shapes:  # [E, out, in / 32, 16] -> [E, out, in]
            made = {name: (*shapes[name + "_blocks"][:2], shapes[name + "_blocks"][2] * 32) for name in (gate_up, down)}
        else:
            made = {name: (shapes[name][0], shapes[name][2], shapes[name][1]) for name in (gate_up, down)}
        made |= {p + ROUTER: shapes[p + "mlp.router.weight"], p + ROUTER_BIAS: shapes[p + "mlp.router.bias"],
                 p + GATE_UP_BIAS: shapes[gate_up + "_bias"], p + DOWN_BIAS: shapes[down + "_bias"]}
    else:  # GGUF: the router as mlp.gate; gate and up [E, I, H], down [E, H, I], each with a .bias
        gate, up, down_stack = (p + name for name in STACKED_NAMES)
        bias = {name: name.removesuffix(".weight") + ".bias" for name in (gate, up, down_stack)}
        read = {gate_up: lambda: torch.cat([tensors[gate], tensors[up]], dim=1),
                down: lambda: tensors[down_stack],
                p + GATE_UP_BIAS: lambda: torch.cat([tensors[bias[gate]], tensors[bias[up]]], dim=1),
                p + DOWN_BIAS: lambda: tensors[bias[down_stack]]}
        used = [gate, up, down_stack, *bias.values()]
        if any(name not in shapes for name in used):
            raise ModelLoadError(f"{source}: missing tensor {next(n for n in used if n not in shapes)!r} (GPT-OSS "
                                 f"layer {layer}'s experts)")
        for first, second in ((gate, up), (bias[gate], bias[up])):
            if shapes[first] != shapes[second]:
                raise ModelLoadError(f"{source}: {first!r} {list(shapes[first])} and {second!r} "
                                     f"{list(shapes[second])} differ in shape")
        (e, inter, *rest), (_, inter_b) = shapes[gate], shapes[bias[gate]]
        made = {gate_up: (e, 2 * inter, *rest), down: shapes[down_stack], p + GATE_UP_BIAS: (e, 2 * inter_b),
                p + DOWN_BIAS: shapes[bias[down_stack]]}
    for name in used:
        del shapes[name]
    for name, maker in read.items():
        shapes[name], makers[name] = made[name], maker


def stack_experts(config: ModelConfig, tensors: Mapping[str, torch.Tensor], source: str) -> Mapping[str, torch.Tensor]:
    """`tensors` with every sparse layer's experts under the stacked names above (the per-expert and
    Mixtral names they came from are dropped). Each stacked tensor is made when it is read, from its
    sources as `tensors` gives them. ModelLoadError (one line, naming `source`) for a layer whose experts
    are incomplete or of differing shapes."""
    from model.weights import LazyTensors  # model.weights imports this module

    def shape_of(name: str) -> tuple[int, ...]:
        return tensors.shapes[name] if isinstance(tensors, LazyTensors) else tuple(tensors[name].shape)

    shapes = {name: shape_of(name) for name in tensors}
    makers: dict[str, Callable[[], torch.Tensor]] = {}
    for layer in range(config.num_layers):
        if not config.is_sparse_layer(layer):
            continue
        if config.swiglu_limit is not None:
            gpt_oss_experts(config, tensors, shapes, makers, layer, source)
            continue
        p = f"layers.{layer}."
        if p + MIXTRAL_ROUTER in shapes:
            shapes[p + ROUTER] = shapes.pop(p + MIXTRAL_ROUTER)
            makers[p + ROUTER] = lambda name=p + MIXTRAL_ROUTER: tensors[name]
        if p + GATE_UP in shapes:  # transformers 5's own layout (or a GGUF's ffn_gate_up_exps beside its down stack)
            if p + STACKED_NAMES[2] in shapes:
                shapes[p + DOWN] = shapes.pop(p + STACKED_NAMES[2])
                makers[p + DOWN] = lambda name=p + STACKED_NAMES[2]: tensors[name]
            continue
        if all(p + name in shapes for name in STACKED_NAMES):  # GGUF: [E, I, H] gate and up, [E, H, I] down
            gate, up, down = (p + name for name in STACKED_NAMES)
            if shapes[gate] != shapes[up] or len(shapes[gate]) != 3:
                raise ModelLoadError(f"{source}: {gate!r} {list(shapes[gate])} and {up!r} {list(shapes[up])} "
                                     "are not two stacks of one shape")
            e, inter, h = shapes.pop(gate)
            shapes.pop(up)
            shapes[p + GATE_UP], shapes[p + DOWN] = (e, 2 * inter, h), shapes.pop(down)
            makers[p + GATE_UP] = lambda g=gate, u=up: torch.cat([tensors[g], tensors[u]], dim=1)
            makers[p + DOWN] = lambda d=down: tensors[d]
            continue
        for names in PER_EXPERT_NAMES:
            if p + names[0].format(e=0) in shapes:
                _stack_per_expert(config, p, names, shapes, makers, tensors, source)
                break
    if not makers:
        return tensors
    return LazyTensors(shapes, lambda name: makers[name]() if name in makers else tensors[name])


def _stack_per_expert(config: ModelConfig, p: str, names: tuple[str, str, str], shapes: dict[str, tuple[int, ...]],
                      makers: dict[str, Callable[[], torch.Tensor]], tensors: Mapping[str, torch.Tensor],
                      source: str) -> None:
    """Replace layer prefix `p`'s per-expert entries of `shapes` by the two stacked ones, made by `makers`."""
    parts = [[p + name.format(e=e) for name in names] for e in range(config.num_experts)]
    for expert_parts in parts:
        for name, like in zip(expert_parts, parts[0], strict=True):
            if name not in shapes:
                raise ModelLoadError(f"{source}: missing tensor {name!r} ({config.num_experts} experts)")
            if shapes[name] != shapes[like]:
                raise ModelLoadError(f"{source}: tensor {name!r} has shape {list(shapes[name])}, "
                                     f"{like!r} {list(shapes[like])}")
    (gate_rows, h), (up_rows, _), down = (shapes[name] for name in parts[0])
    for name in (name for expert_parts in parts for name in expert_parts):
        del shapes[name]
    shapes[p + GATE_UP] = (config.num_experts, gate_rows + up_rows, h)
    shapes[p + DOWN] = (config.num_experts, *down)
    makers[p + GATE_UP] = lambda: torch.stack([torch.cat([tensors[g], tensors[u]]) for g, u, _ in parts])
    makers[p + DOWN] = lambda: torch.stack([tensors[d] for _, _, d in parts])
