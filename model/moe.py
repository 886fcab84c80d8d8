"""The sparse mixture-of-experts MLP of Qwen3-MoE, Mixtral and GPT-OSS layers (docs/moe.md).

A router (`gate`, hidden -> E logits, no bias) picks `num_experts_per_tok` of `num_experts` SwiGLU experts
per token; the experts' weights are stacked so one tensor holds them all:

    gate.weight [E, H]        the router
    w13         [E, 2I, H]    per expert, the gate rows then the up rows (Hugging Face's gate_up_proj)
    w2          [E, H, I]     per expert, the down projection

The loader (model/moe_checkpoint.py, model/weights.py) builds w13 and w2 from whichever form a checkpoint
stores the experts in. The arithmetic is kernels/moe.py `fused_moe` (`fused_moe_triton` on the Triton side
of the kernels): only routed (token, expert) pairs are computed, grouped by expert. `--quantization int8`
swaps each block for an Int8SparseMoeBlock (`quantize_experts`, from model/quantization.py); `--quantization
w4a8` for a W4A8SparseMoeBlock over a GGUF file's own expert blocks (model/block_quantization.py).

Under expert parallelism (parallel/shard.py) a rank's block holds a contiguous part of the experts: w13 and
w2 stack experts `expert_offset` .. `expert_offset` + len(w13) - 1 while the router stays whole, and the
block returns that part's share of the output (0 from experts held elsewhere).

GPT-OSS's block (`GptOssMoeBlock`) has the same stacks plus a bias for each: the router's [E], w13_bias
[E, 2I] and w2_bias [E, H]; routing is a softmax over the top k logits (the renormalised form below), and
its experts' activation is the clamped SwiGLU (kernels/swiglu.py `clamped_swiglu_ref`).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from kernels import cpu_w4a8_linear
from kernels.cpu_int8_linear import int8_linear
from kernels.cpu_w4a8_experts import w4a8_experts
from kernels.int8_matmul import quantize_int8_ref
from kernels.moe import fused_moe, fused_moe_triton, grouped_experts, int8_moe, pack_int8_experts, route, w4a8_moe
from kernels.ops import Ops
from kernels.swiglu import clamped_swiglu_ref, gelu_tanh_and_mul_ref
from model.config import MOE_ARCHITECTURES, ModelConfig
from model.errors import ModelLoadError

if TYPE_CHECKING:  # the decoder imports this module: no import of the loaders here
    from model.gguf_blocks import BlockWeight


class SparseMoeBlock(nn.Module):
    def __init__(self, config: ModelConfig, ops: Ops | None = None) -> None:
        """`ops`: the model's kernels; their side picks the grouped GEMM (Triton's on "triton", torch's else)."""
        super().__init__()
        h, e, inter = config.hidden_size, config.num_experts, config.moe_intermediate_size
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        self.gate = nn.Linear(h, e, bias=False)
        self.w13 = nn.Parameter(torch.empty(e, 2 * inter, h))
        self.w2 = nn.Parameter(torch.empty(e, h, inter))
        self.moe = fused_moe_triton if ops is not None and ops.name == "triton" else fused_moe
        self.expert_offset = 0  # the router's index of w13[0] (expert parallelism; 0 in one process)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [T, H] -> [T, H]
        return self.moe(x, self.gate(x), self.w13, self.w2, self.top_k, self.renormalize,
                        expert_offset=self.expert_offset)


class Int8SparseMoeBlock(nn.Module):
    """SparseMoeBlock with weight-only int8 experts (`--quantization int8`): per expert, int8 weights and one
    float32 scale per output channel (symmetric), activations float32. The router stays float: it is E x H,
    and rounding its logits could change which experts a token goes to."""

    def __init__(self, num_experts: int, hidden: int, inter: int, top_k: int, renormalize: bool) -> None:
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.register_buffer("w13", torch.zeros(num_experts, 2 * inter, hidden, dtype=torch.int8))
        self.register_buffer("w13_scale", torch.ones(num_experts, 2 * inter))
        self.register_buffer("w2", torch.zeros(num_experts, hidden, inter, dtype=torch.int8))
        self.register_buffer("w2_scale", torch.ones(num_experts, hidden))
        # The CPU kernel's layout of each expert, rebuilt from w13 and w2 by `pack()` (not saved).
        self.register_buffer("w13_packed", None, persistent=False)
        self.register_buffer("w2_packed", None, persistent=False)
        self.expert_offset = 0  # as SparseMoeBlock's

    @classmethod
    def from_float(cls, block: SparseMoeBlock) -> Int8SparseMoeBlock:
        e, inter2, h = block.w13.shape
        module = cls(e, h, inter2 // 2, block.top_k, block.renormalize)
        module.gate = block.gate
        module.expert_offset = block.expert_offset
        module.w13, module.w13_scale = _quantize_stack(block.w13.detach())
        module.w2, module.w2_scale = _quantize_stack(block.w2.detach())
        return module.pack()

    def pack(self) -> Int8SparseMoeBlock:
        self.w13_packed, self.w2_packed = pack_int8_experts(self.w13), pack_int8_experts(self.w2)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [T, H] float32 -> [T, H]
        return int8_moe(x, self.gate(x), self.w13_packed, self.w13_scale, self.w2_packed, self.w2_scale,
                        self.top_k, self.renormalize, expert_offset=self.expert_offset)


def register_expert_stacks(module: nn.Module, w13: list[BlockWeight], w2: list[BlockWeight]) -> None:
    """Each expert's blocks packed as the dense W4A8 layers pack theirs, stacked: `module`'s w13_codes,
    w13_scales, w2_codes and w2_scales buffers, and the zero and bits of each stack (one format a stack)."""
    for name, experts in (("w13", w13), ("w2", w2)):
        packed = [cpu_w4a8_linear.pack(w.codes, w.d, w.m, w.bits, w.sub, w.table) for w in experts]
        module.register_buffer(f"{name}_codes", torch.stack([codes for codes, _ in packed]))
        module.register_buffer(f"{name}_scales", torch.stack([scales for _, scales in packed]))
        setattr(module, f"{name}_zero", experts[0].zero)
        setattr(module, f"{name}_bits", experts[0].bits)


class W4A8SparseMoeBlock(nn.Module):
    """SparseMoeBlock over a GGUF file's own expert blocks (`--quantization w4a8`): per expert, its 4-, 5-
    or 8-bit codes and float16 scales packed as the dense W4A8 layers pack theirs, activations quantized per
    32-block to int8 (kernels/moe.py `w4a8_moe`). The router stays float, as in Int8SparseMoeBlock."""

    def __init__(self, gate: nn.Linear, w13: list[BlockWeight], w2: list[BlockWeight], top_k: int,
                 renormalize: bool) -> None:
        """w13: each expert's gate rows then up rows [2I, H] (one format for all experts); w2: each expert's
        down rows [H, I]."""
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize
        self.gate = gate
        register_expert_stacks(self, w13, w2)
        self.expert_offset = 0  # as SparseMoeBlock's

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [T, H] float32 -> [T, H]
        return w4a8_moe(x, self.gate(x), self.w13_codes, self.w13_scales, self.w13_zero, self.w2_codes,
                        self.w2_scales, self.w2_zero, self.top_k, self.renormalize, expert_offset=self.expert_offset)

    def extra_repr(self) -> str:
        return f"experts={len(self.w13_codes)}, bits=({self.w13_bits}, {self.w2_bits})"


class Gemma4Router(nn.Module):
    """Gemma 4's router (26B-A4B): it reads the residual stream, RMS-normalised without a weight, times `scale`
    and hidden^-0.5; softmax over the E logits in float32, the top k renormalised to sum to 1, each then times
    its expert's `per_expert_scale`. Checkpoint names: router.proj, router.scale, router.per_expert_scale."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, e = config.hidden_size, config.num_experts
        self.proj = nn.Linear(h, e, bias=False)
        self.scale = nn.Parameter(torch.ones(h))
        self.per_expert_scale = nn.Parameter(torch.ones(e))
        self.top_k, self.eps, self.root = config.num_experts_per_tok, config.rms_norm_eps, h**-0.5

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k] float32, experts [T, k] int64), slots in descending probability."""
        x32 = x.float()
        normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        probs = torch.softmax(self.proj(normed * self.scale * self.root).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[experts], experts


class Gemma4Experts(nn.Module):
    """Gemma 4's experts, stacked as its checkpoints hold them: gate_up_proj [E, 2I, H] (each expert's gate
    rows, then its up rows) and down_proj [E, H, I]; expert(x) = down (gelu_tanh(gate) * up). Only the routed
    (token, expert) pairs are computed (kernels/moe.py `grouped_experts`)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, e, inter = config.hidden_size, config.num_experts, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * inter, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, inter))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """x [T, H]; weights, experts [T, k] (`Gemma4Router`) -> [T, H]."""
        def expert(e: int, rows: torch.Tensor, out: torch.Tensor) -> None:
            act = gelu_tanh_and_mul_ref(F.linear(rows, self.gate_up_proj[e]))
            torch.mm(act, self.down_proj[e].t(), out=out)

        return grouped_experts(x, weights, experts, expert, range(self.gate_up_proj.shape[0]))


class W4A8Gemma4Experts(nn.Module):
    """Gemma4Experts over a GGUF file's own expert blocks (`--quantization w4a8`), in one C++ call as
    W4A8SparseMoeBlock's experts (kernels/cpu_w4a8_experts.py, GeGLU)."""

    def __init__(self, w13: list[BlockWeight], w2: list[BlockWeight]) -> None:
        """w13: each expert's gate rows then up rows [2I, H] (one format for all experts); w2: its down rows."""
        super().__init__()
        register_expert_stacks(self, w13, w2)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        return w4a8_experts(x.float().contiguous(), weights.float().contiguous(), experts.contiguous(),
                            self.w13_codes, self.w13_scales, self.w13_zero, self.w2_codes, self.w2_scales, self.w2_zero,
                            0, True).to(x.dtype)

    def extra_repr(self) -> str:
        return f"experts={len(self.w13_codes)}, bits=({self.w13_bits}, {self.w2_bits})"


class GptOssMoeBlock(nn.Module):
    """GPT-OSS's MLP: a router with a bias picks num_experts_per_tok experts per token, weighted by a softmax
    over their logits; expert(x) = w2 act(w13 x + w13_bias) + w2_bias, act the clamped SwiGLU. Only the routed
    (token, expert) pairs are computed (kernels/moe.py `grouped_experts`). Checkpoint names (model/weights.py):
    gate.weight/bias, w13 [E, 2I, H] (each expert's gate rows, then its up rows), w13_bias, w2 [E, H, I], w2_bias."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, e, inter = config.hidden_size, config.num_experts, config.moe_intermediate_size
        self.top_k, self.alpha, self.limit = config.num_experts_per_tok, config.swiglu_alpha, config.swiglu_limit
        self.gate = nn.Linear(h, e, bias=True)
        self.w13 = nn.Parameter(torch.empty(e, 2 * inter, h))
        self.w13_bias = nn.Parameter(torch.empty(e, 2 * inter))
        self.w2 = nn.Parameter(torch.empty(e, h, inter))
        self.w2_bias = nn.Parameter(torch.empty(e, h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [T, H] -> [T, H]
        weights, experts = route(self.gate(x), self.top_k, True)

        def expert(e: int, rows: torch.Tensor, out: torch.Tensor) -> None:
            act = clamped_swiglu_ref(F.linear(rows, self.w13[e], self.w13_bias[e]), self.alpha, self.limit)
            out.copy_(F.linear(act, self.w2[e], self.w2_bias[e]))

        return grouped_experts(x, weights, experts, expert, range(self.w13.shape[0]))


class Int8GptOssMoeBlock(nn.Module):
    """GptOssMoeBlock with weight-only int8 experts (`--quantization int8`), as Int8SparseMoeBlock's; the
    router and the biases stay float."""

    def __init__(self, block: GptOssMoeBlock) -> None:
        super().__init__()
        self.top_k, self.alpha, self.limit = block.top_k, block.alpha, block.limit
        self.gate = block.gate
        w13, w13_scale = _quantize_stack(block.w13.detach())
        w2, w2_scale = _quantize_stack(block.w2.detach())
        for name, tensor in (("w13_packed", pack_int8_experts(w13)), ("w13_scale", w13_scale),
                             ("w2_packed", pack_int8_experts(w2)), ("w2_scale", w2_scale),
                             ("w13_bias", block.w13_bias.detach().float()),
                             ("w2_bias", block.w2_bias.detach().float())):
            self.register_buffer(name, tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [T, H] float32 -> [T, H]
        weights, experts = route(self.gate(x), self.top_k, True)
        inter2, hidden = self.w13_scale.shape[1], self.w2_scale.shape[1]

        def expert(e: int, rows: torch.Tensor, out: torch.Tensor) -> None:
            gate_up = int8_linear(rows, self.w13_packed[e], self.w13_scale[e], self.w13_bias[e], inter2)
            act = clamped_swiglu_ref(gate_up, self.alpha, self.limit)
            out.copy_(int8_linear(act, self.w2_packed[e], self.w2_scale[e], self.w2_bias[e], hidden))

        return grouped_experts(x, weights, experts, expert, range(self.w13_scale.shape[0]))


class W4A8GptOssMoeBlock(nn.Module):
    """GptOssMoeBlock over a GGUF file's own expert blocks (`--quantization w4a8`; MXFP4 read exactly as table
    codes, model/gguf_blocks.py), in one C++ call as W4A8SparseMoeBlock's experts (kernels/cpu_w4a8_experts.py,
    with each expert's biases and the clamped SwiGLU); the router stays float."""

    def __init__(self, block: GptOssMoeBlock, w13: list[BlockWeight], w2: list[BlockWeight]) -> None:
        super().__init__()
        self.top_k, self.alpha, self.limit = block.top_k, block.alpha, block.limit
        self.gate = block.gate
        register_expert_stacks(self, w13, w2)
        self.register_buffer("w13_bias", block.w13_bias.detach().float())
        self.register_buffer("w2_bias", block.w2_bias.detach().float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [T, H] float32 -> [T, H]
        weights, experts = route(self.gate(x), self.top_k, True)
        return w4a8_experts(x.float().contiguous(), weights.contiguous(), experts.contiguous(), self.w13_codes,
                            self.w13_scales, self.w13_zero, self.w2_codes, self.w2_scales, self.w2_zero, 0, False,
                            self.w13_bias, self.w2_bias, self.limit, self.alpha).to(x.dtype)

    def extra_repr(self) -> str:
        return f"experts={len(self.w13_codes)}, bits=({self.w13_bits}, {self.w2_bits})"


def _quantize_stack(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] float -> (int8 [E, N, K], scale [E, N] float32): per expert and output channel."""
    e, n, k = weight.shape
    q, scale = quantize_int8_ref(weight.reshape(e * n, k))
    return q.view(e, n, k), scale.view(e, n)


def quantize_experts(module: nn.Module) -> None:
    """Swap every SparseMoeBlock in `module` for an Int8SparseMoeBlock (a GptOssMoeBlock for an
    Int8GptOssMoeBlock), in place."""
    for name, block in list(module.named_modules()):
        if isinstance(block, SparseMoeBlock | GptOssMoeBlock):
            parent_name, _, child = name.rpartition(".")
            int8 = (Int8SparseMoeBlock.from_float(block) if isinstance(block, SparseMoeBlock)
                    else Int8GptOssMoeBlock(block))
            setattr(module.get_submodule(parent_name), child, int8)


def check_quantization(config: ModelConfig, quantization: str, source: str) -> None:
    """ModelLoadError (one line) for a load-time quantization the expert weights do not take: w8a8's
    SmoothQuant calibration covers dense MLPs only; int8 covers experts, and so does w4a8 (a GGUF file's
    own expert blocks)."""
    if config.num_experts and quantization not in ("none", "int8", "w4a8"):
        raise ModelLoadError(f"{source}: --quantization {quantization} does not cover mixture-of-experts layers "
                             f"({config.architecture}); load it with --quantization int8, w4a8 (a GGUF file) "
                             "or none")


def is_mxfp4_directory(path: Path) -> bool:
    """Whether the Hugging Face directory at `path` says its experts are MXFP4 (GPT-OSS's published files:
    `quantization_config.quant_method` mxfp4), which `--quantization w4a8` reads as they are."""
    try:
        config = json.loads((path / "config.json").read_text()) if path.is_dir() else {}
    except (OSError, ValueError):
        return False
    quantization = config.get("quantization_config") if isinstance(config, dict) else None
    return isinstance(quantization, dict) and quantization.get("quant_method") == "mxfp4"


def is_moe_checkpoint(path: Path) -> bool:
    """Whether the Hugging Face directory or GGUF file at `path` holds mixture-of-experts layers, from its
    config.json or its tensor names alone; False for anything unreadable (loading it says why)."""
    try:
        if path.is_dir():
            config = json.loads((path / "config.json").read_text())
            text = config.get("text_config") or config  # Gemma 4's experts: enable_moe_block in its text model's
            return config.get("model_type") in MOE_ARCHITECTURES or bool(text.get("enable_moe_block"))
        if path.is_file() and path.suffix.lower() == ".gguf":
            from model.gguf_checkpoint import tensor_types  # the gguf package, only for GGUF files

            return any(".ffn_gate_inp." in name for name in tensor_types(path))
    except (OSError, ValueError, AttributeError, struct.error):
        return False
    return False
