"""The decoder's layers as one C++ call per step, on the CPU (kernels/csrc/decoder_step.cpp).

At batch 1 a decode step of SmolLM2-135M is about 600 eager calls (four linears, two norms, the rotary
embedding, the cache write, attention and SiLU per layer), each a few microseconds of Python and
dispatch beside a few microseconds of work: a third of the step. `CpuDecoderStep` hands the whole layer
stack to C++ once per step instead; the embedding, the LM head and sampling stay in Python.

It runs the same kernel functions as the eager ops, in the eager order, so its hidden states equal the
eager model's bit for bit (tests/kernels/test_decoder_step.py); the eager module stays the definition and
runs whenever the step cannot. `step_support(model)` says why a model cannot (None: it can): the step
covers the Llama layout that `ladder serve` runs by default on a CPU (float32 activations, W4A8 linears
over a GGUF's blocks, the C++ attention kernel, SiLU, no q/k norms, no mixture of experts), nothing
wrapped or hooked (LoRA slots, tensor-parallel all-reduces, the doctor's timers), and per step a float32
cache and a plan whose every token is a kernel row (`CpuAttentionPlan` without a gathered part).

The step holds the modules' tensors as they were when it was built. A module, parameter or buffer
registered anywhere afterwards (a swapped linear, LoRA slots attached, weights reloaded) bumps
`structure_version()`, and the model checks it before each step and builds again.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn
from torch.nn.modules import module as nn_module

from kernels import cpu_extension
from model.attention.cpu_backend import CpuAttentionPlan, CpuPagedAttention
from model.w4a8_linear import W4A8Linear

_version = itertools.count(1)
_structure = [0]


def _bump(*_args: object) -> None:
    _structure[0] = next(_version)


nn_module.register_module_module_registration_hook(_bump)
nn_module.register_module_parameter_registration_hook(_bump)
nn_module.register_module_buffer_registration_hook(_bump)


def structure_version() -> int:
    """Changes whenever any module, parameter or buffer is registered in this process."""
    return _structure[0]


def _hooked(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks)


def step_support(model: nn.Module) -> str | None:
    """None if `model` (a LlamaForCausalLM) can run its layers as one C++ step, else why not, in words."""
    config = model.config
    if cpu_extension.load() is None or not hasattr(torch.classes.ladder_cpu, "DecoderStep"):
        return "the C++ CPU kernels are not built here"
    if model.ops.name != "cpu" or model.device.type != "cpu":
        return f"ops {model.ops.name!r} on {model.device.type}: the step is the CPU kernels' own"
    if model.local_attention is not None:
        return "sliding-window layers beside full ones"
    if config.qk_norm or config.sandwich_norms or config.hidden_act != "silu":
        return "q/k norms, sandwich norms or a gate other than SiLU"
    if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
        return "global forward hooks are registered"
    if _hooked(model):
        return "the model has forward hooks"
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        if type(attn.backend) is not CpuPagedAttention:
            return f"layer {i}: attention {type(attn.backend).__name__}, not the C++ kernel's backend"
        linears = (attn.qkv_proj, attn.o_proj, getattr(mlp, "gate_up_proj", None), getattr(mlp, "down_proj", None))
        for linear in linears:
            if type(linear) is not W4A8Linear:
                return f"layer {i}: a {type(linear).__name__} linear (the step takes W4A8 linears)"
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if any(_hooked(m) for m in (layer, attn, mlp, *linears, *norms)):
            return f"layer {i} has forward hooks"
        if any(n.weight.dtype != torch.float32 or n.eps != config.rms_norm_eps for n in norms):
            return f"layer {i}: norms not float32"
    if model.norm.weight.dtype != torch.float32 or _hooked(model.norm):
        return "the final norm is not a plain float32 RMSNorm"
    return None


class CpuDecoderStep:
    """The layers of one model as `ladder_cpu::DecoderStep`; call it in place of the layer loop."""

    def __init__(self, model: nn.Module) -> None:
        config = model.config
        tensors: list[torch.Tensor] = []
        zeros: list[int] = []
        empty = torch.empty(0)
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            tensors.append(layer.input_layernorm.weight.detach())
            for linear in (attn.qkv_proj, attn.o_proj):
                tensors += [linear.codes, linear.scales, empty if linear.bias is None else linear.bias]
                zeros.append(linear.zero)
            tensors.append(layer.post_attention_layernorm.weight.detach())
            for linear in (mlp.gate_up_proj, mlp.down_proj):
                tensors += [linear.codes, linear.scales, empty if linear.bias is None else linear.bias]
                zeros.append(linear.zero)
        tensors.append(model.norm.weight.detach())
        ints = [config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim,
                config.intermediate_size, *zeros]
        self.step = torch.classes.ladder_cpu.DecoderStep(tensors, ints, config.rms_norm_eps)
        self.scale = config.attention_scale
        self.window = model.attention.sliding_window or 0

    @staticmethod
    def takes(plan: object, kv_caches: list[torch.Tensor]) -> bool:
        """Whether this step's plan and caches are the step's: every token a kernel row, a float32 cache."""
        return (isinstance(plan, CpuAttentionPlan) and plan.gather is None
                and kv_caches[0].dtype == torch.float32 and not torch.is_grad_enabled()
                and not torch.compiler.is_compiling())

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_caches: list[torch.Tensor],
                 plan: CpuAttentionPlan) -> torch.Tensor:
        """x [T, hidden] embeddings, cos/sin [T, head_dim / 2] -> the final norm's output [T, hidden]."""
        return self.step.forward(x, cos, sin, kv_caches, plan.slot_mapping, plan.row_block_tables, plan.row_seq_lens,
                                 self.scale, self.window)
