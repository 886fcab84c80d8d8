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
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from model.config import ModelConfig
from model.errors import ModelLoadError

ROUTER, GATE_UP, DOWN = "mlp.gate.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj"
# Per-expert names: (gate, up, down) under a layer's prefix, with {e} for the expert's index.
PER_EXPERT_NAMES = (
    ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight", "mlp.experts.{e}.down_proj.weight"),
    ("block_sparse_moe.experts.{e}.w1.weight", "block_sparse_moe.experts.{e}.w3.weight",
     "block_sparse_moe.experts.{e}.w2.weight"),
)
STACKED_NAMES = ("mlp.experts.gate_proj.weight", "mlp.experts.up_proj.weight", "mlp.experts.down_proj.weight")
MIXTRAL_ROUTER = "block_sparse_moe.gate.weight"


def expert_shapes(config: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """The stacked tensors of sparse layer `layer`, with their shapes."""
    p, h, e, inter = f"layers.{layer}.", config.hidden_size, config.num_experts, config.moe_intermediate_size
    return {p + ROUTER: (e, h), p + GATE_UP: (e, 2 * inter, h), p + DOWN: (e, h, inter)}


def expert_sources(layer: int) -> dict[str, list[str]]:
    """SparseMoeBlock's state-dict names of layer `layer` -> the stacked tensor each is (weights.fused_sources)."""
    p = f"layers.{layer}."
    return {p + "mlp.gate.weight": [p + ROUTER], p + "mlp.w13": [p + GATE_UP], p + "mlp.w2": [p + DOWN]}


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
