"""The decoder's layers as one C++ call per step, on the CPU (kernels/csrc/decoder_step.cpp).

At batch 1 a decode step of SmolLM2-135M is about 600 eager calls (four linears, two norms, the rotary
embedding, the cache write, attention and SiLU per layer), each a few microseconds of Python and
dispatch beside a few microseconds of work: a third of the step. `CpuDecoderStep` hands the whole layer
stack to C++ once per step instead; the embedding, the LM head and sampling stay in Python.

It runs the same kernel functions as the eager ops, in the eager order, so its hidden states equal the
eager model's bit for bit (tests/model/test_cpu_step.py); the eager module stays the definition and runs
whenever the step cannot. `step_support(model)` says why a model cannot (None: it can). The step covers
the decoders `ladder serve` runs on a CPU by default: float32 activations; W4A8 (a GGUF's blocks) or W8A8
linears; the C++ attention kernel; Llama, Mistral, Qwen2 and Qwen3 layers, Gemma 3's (q/k norms,
sandwich norms, GeGLU, sliding-window layers beside full ones with their own tables) and Gemma 4's dense ones
(each layer's own head size and KV heads, values from the keys, normed values, layers reading an earlier
layer's cache, per-layer embeddings, the scaled stream: their per-layer inputs are computed in Python and
passed in) and Qwen3.5's (linear-attention layers, whose state update is gated_delta.cpp's, in decode steps: a
prompt's chunk runs the eager layers; attention with an output gate); LoRA slots on the
linears (model/lora_slots.py: each row's adapter added after its linear, as the eager wrapper adds it, from
the wrapper's own tensors, so an adapter loaded into a slot later is read); mixtures of experts whose
experts are W4A8 (the router and routing through ATen's own calls, as the eager block makes them). Not
covered: float or weight-only int8 linears and experts, a rank's part of the experts, any other wrapper or
hook (tensor-parallel all-reduces). Gemma 4's experts beside its MLPs (26B-A4B) run in it when they are W4A8,
their router through the ATen calls the eager router makes. Per step it takes a float32, bfloat16 or float16 cache
(`--kv-cache-dtype`) and plans whose every token is a kernel row (`CpuAttentionPlan` without a gathered
part: chunks up to 1,024 tokens).

The step holds the modules' tensors as they were when it was built. A module, parameter or buffer
registered anywhere afterwards (a swapped linear, LoRA slots attached, weights reloaded) bumps
`structure_version()`, and the model checks it before each step and builds again. Forward hooks added
after the build are not seen: the step does not call the modules (the doctor times the parts inside it).
"""

from __future__ import annotations

import itertools

import torch
from torch import nn
from torch.nn.modules import module as nn_module

from kernels import cpu_extension
from model.attention.cpu_backend import CpuAttentionPlan, CpuPagedAttention
from model.linear_attention import RecurrentPlan
from model.lora_slots import LoRALinear, LoRASlots
from model.moe import W4A8Gemma4Experts, W4A8SparseMoeBlock
from model.precision import KV_CACHE_DTYPES
from model.quantization import W8A8Linear
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


def _norms(model: nn.Module, layer: nn.Module) -> list[nn.Module]:
    attn = layer.self_attn
    extra = [layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm] if model.config.sandwich_norms else []
    qk = [n for n in (attn.q_norm, attn.k_norm) if n is not None] if attn is not None else []
    ple = [layer.post_per_layer_input_norm] if layer.post_per_layer_input_norm is not None else []
    beside = ([layer.pre_feedforward_layernorm_2, layer.post_feedforward_layernorm_1,
               layer.post_feedforward_layernorm_2] if layer.experts is not None else [])
    return [layer.input_layernorm, layer.post_attention_layernorm, *extra, *qk, *ple, *beside]


def _base(linear: nn.Module) -> nn.Module:
    """The linear under a LoRA wrapper, or the linear itself."""
    return linear.base if type(linear) is LoRALinear else linear


def _lora_ok(linear: nn.Module) -> bool:
    """Whether a LoRA wrapper's slots are what the step reads (float32 contiguous CPU tensors); True for none."""
    if type(linear) is not LoRALinear:
        return True
    return all(t.dtype == torch.float32 and t.is_contiguous() and t.device.type == "cpu" for t in (linear.a, linear.b))


def _linear_kind(linear: nn.Module) -> int | None:
    """0 for a W4A8 linear, 1 for a W8A8 one packed for the CPU kernel, None for any other."""
    if type(linear) is W4A8Linear:
        return 0
    if type(linear) is W8A8Linear and linear.packed is not None:
        return 1
    return None


def step_support(model: nn.Module) -> str | None:
    """None if `model` (a LlamaForCausalLM) can run its layers as one C++ step, else why not, in words."""
    config = model.config
    if cpu_extension.load() is None or not hasattr(torch.classes.ladder_cpu, "DecoderStep"):
        return "the C++ CPU kernels are not built here"
    if model.ops.name != "cpu" or model.device.type != "cpu":
        return f"ops {model.ops.name!r} on {model.device.type}: the step is the CPU kernels' own"
    if config.hidden_act not in ("silu", "gelu_tanh"):
        return f"the gate {config.hidden_act}"
    if config.attention_sinks:
        return "attention with sink logits (GPT-OSS)"
    if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
        return "global forward hooks are registered"
    if _hooked(model) or _hooked(model.norm) or model.norm.weight.dtype != torch.float32:
        return "the model or its final norm has forward hooks, or the norm is not float32"
    for backend in (model.attention, model.local_attention):
        if backend is not None and type(backend) is not CpuPagedAttention:
            return f"attention {type(backend).__name__}, not the C++ kernel's backend"
    owners = set()  # the LoRASlots of the wrapped linears: one, whose rows each step passes
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn or layer.linear_attn, layer.mlp
        mixer = (attn.qkv_proj, attn.o_proj) if layer.linear_attn is None else (attn.in_proj, attn.out_proj)
        if layer.shared_expert is not None and (type(layer.shared_expert_gate) is not nn.Linear
                                                or layer.shared_expert_gate.weight.dtype != torch.float32):
            return f"layer {i}: a shared expert's gate other than a float32 linear"
        if layer.linear_attn is not None and any(p.dtype != torch.float32 for p in (
                attn.A_log, attn.dt_bias, attn.norm_weight, attn.conv1d.weight)):
            return f"layer {i}: linear attention's parameters not float32"
        if isinstance(mlp, W4A8SparseMoeBlock):
            if mlp.expert_offset or type(mlp.gate) is not nn.Linear or mlp.gate.bias is not None \
                    or mlp.gate.weight.dtype != torch.float32 or _hooked(mlp.gate):
                return f"layer {i}: experts held in part, or a router other than a float32 linear"
            linears = mixer
        elif not hasattr(mlp, "gate_up_proj"):
            return f"layer {i}: a {type(mlp).__name__} (the step takes dense MLPs and W4A8 experts)"
        else:
            linears = (*mixer, mlp.gate_up_proj, mlp.down_proj)
        if layer.per_layer_input_gate is not None:  # Gemma 4's per-layer embedding's two linears
            linears = (*linears, layer.per_layer_input_gate, layer.per_layer_projection)
        if layer.shared_expert is not None:  # Qwen3.5-MoE's shared expert's two linears
            linears = (*linears, layer.shared_expert.gate_up_proj, layer.shared_expert.down_proj)
        if layer.experts is not None:  # Gemma 4's experts beside the MLP: W4A8 ones, a float32 router
            router = layer.router
            floats = (router.proj.weight, router.scale, router.per_expert_scale)
            if type(layer.experts) is not W4A8Gemma4Experts or type(router.proj) is not nn.Linear \
                    or any(t.dtype != torch.float32 for t in floats) \
                    or _hooked(router) or _hooked(router.proj) or _hooked(layer.experts):
                return f"layer {i}: experts beside the MLP that are not W4A8, or a router other than float32"
        for linear in linears:
            if _linear_kind(_base(linear)) is None:
                return f"layer {i}: a {type(_base(linear)).__name__} linear (the step takes W4A8 and W8A8 linears)"
            if not _lora_ok(linear):
                return f"layer {i}: LoRA slots not float32 contiguous CPU tensors"
            if type(linear) is LoRALinear:
                owners.add(id(linear.slots[0]))
        norms = _norms(model, layer)
        if any(_hooked(m) for m in (layer, attn, mlp, *linears, *map(_base, linears), *norms)):
            return f"layer {i} has forward hooks"
        if any(n.weight.dtype != torch.float32 or n.eps != config.rms_norm_eps for n in norms):
            return f"layer {i}: norms not float32"
        if layer.layer_scalar is not None and layer.layer_scalar.dtype != torch.float32:
            return f"layer {i}: its scalar not float32"
    if config.per_layer_input_size and (_hooked(model.per_layer_projection_norm)
                                        or model.per_layer_projection_norm.weight.dtype != torch.float32):
        return "the per-layer embeddings' norm has hooks or is not float32"
    if len(owners) > 1:
        return "LoRA wrappers of more than one LoRASlots"
    return None


class CpuDecoderStep:
    """The layers of one model as `ladder_cpu::DecoderStep`; call it in place of the layer loop."""

    # The parts the C++ step times when profiling (its `take_profile` order), under the doctor's names.
    PARTS = ("rms_norm", "qkv", "rotary", "attention", "o", "gate_up", "silu_and_mul", "down", "experts")

    def __init__(self, model: nn.Module) -> None:
        config = model.config
        tensors: list[torch.Tensor] = []
        ints = [config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim, config.intermediate_size,
                int(config.hidden_act == "gelu_tanh"), config.per_layer_input_size]
        empty = torch.empty(0)
        loras: list[tuple[int, int, LoRALinear]] = []  # (layer, linear 0-3, wrapper)
        # Every layer reads the windowed tables in a model whose layers are all windowed (a Mistral with
        # sliding_window: its one backend plans them); in a mixed one, the layers the model marks. A layer so
        # marked takes the step's second rotation too: in a model with NoPE layers (SmolLM3, which has no
        # windows: both plans are one) the second rotation is none (cos 1, sin 0; LlamaForCausalLM.run).
        mixed = model.local_attention is not None
        uniform_window = not mixed and bool(model.attention.sliding_window)
        nope = set(config.nope_layers)

        def linear_tensors(linear: nn.Module) -> tuple[list[torch.Tensor], list[int]]:
            kind = _linear_kind(linear)
            bias = empty if linear.bias is None else linear.bias
            if kind == 0:
                return [linear.codes, linear.scales, empty, bias], [kind, linear.zero]
            return [linear.packed, linear.wsum, linear.scale, bias], [kind, 0]

        def two_linears(first: nn.Module, second: nn.Module, after: torch.Tensor) -> tuple[list[torch.Tensor],
                                                                                          list[int]]:
            """Two linears' tensors and ints one after the other, then the tensor `after`."""
            (t1, i1), (t2, i2) = linear_tensors(first), linear_tensors(second)
            return [*t1, *t2, after.detach()], [*i1, *i2]

        for i, layer in enumerate(model.layers):
            attn, linear_attn, mlp = layer.self_attn, layer.linear_attn, layer.mlp
            qk_norms = (attn.q_norm, attn.k_norm) if attn is not None else (None, None)
            norms = [layer.input_layernorm, layer.post_attention_layernorm, layer.pre_feedforward_layernorm,
                     layer.post_feedforward_layernorm, *qk_norms]
            tensors += [empty if n is None else n.weight.detach() for n in norms]
            ints.append(int(model.windowed[i] if mixed else (uniform_window or i in nope)))
            moe = isinstance(mlp, W4A8SparseMoeBlock)
            dense = () if moe else (mlp.gate_up_proj, mlp.down_proj)
            # A linear-attention layer's input and output projections take the qkv and o places.
            mixer = (attn.qkv_proj, attn.o_proj) if attn is not None else (linear_attn.in_proj, linear_attn.out_proj)
            for which, wrapped in enumerate((*mixer, *dense)):
                if type(wrapped) is LoRALinear:
                    loras.append((i, which, wrapped))
                more_tensors, more_ints = linear_tensors(_base(wrapped))
                tensors += more_tensors
                ints += more_ints
            if moe:  # kind 2: the experts' stacks and the router in the gate_up and down places
                tensors += [mlp.w13_codes, mlp.w13_scales, mlp.gate.weight.detach(), empty,
                            mlp.w2_codes, mlp.w2_scales, empty, empty]
                ints += [2, mlp.w13_zero, 2, mlp.w2_zero, mlp.top_k, int(mlp.renormalize)]
            else:
                ints += [0, 0]
            # Gemma 4 (the model's shape else): the layer's own attention shape and MLP width, what its qkv
            # projects and whose cache it reads, the values' norm; its scalar and per-layer embedding parts.
            if attn is not None:
                ints += [attn.head_dim, attn.num_kv_heads, config.layer_intermediate_size(i), attn.kv_outputs,
                         attn.kv_source, int(attn.value_norm_eps is not None)]
            else:  # (a linear-attention layer: the model's attention shape, unused)
                ints += [config.head_dim, config.num_kv_heads, config.layer_intermediate_size(i), 2, i, 0]
            tensors.append(empty if layer.layer_scalar is None else layer.layer_scalar.detach())
            if layer.per_layer_input_gate is not None:
                more_tensors, more_ints = two_linears(layer.per_layer_input_gate, layer.per_layer_projection,
                                                      layer.post_per_layer_input_norm.weight)
                tensors += more_tensors
                ints += more_ints
            else:
                tensors += [empty] * 9
                ints += [0, 0, 0, 0]
            if layer.experts is not None:  # Gemma 4's experts beside the MLP: router, stacks, three norms
                router, experts = layer.router, layer.experts
                tensors += [router.proj.weight.detach(), router.scale.detach(), router.per_expert_scale.detach(),
                            experts.w13_codes, experts.w13_scales, experts.w2_codes, experts.w2_scales,
                            layer.pre_feedforward_layernorm_2.weight.detach(),
                            layer.post_feedforward_layernorm_1.weight.detach(),
                            layer.post_feedforward_layernorm_2.weight.detach()]
                ints += [1, router.top_k, experts.w13_zero, experts.w2_zero]
            else:
                tensors += [empty] * 10
                ints += [0, 0, 0, 0]
            if linear_attn is not None:  # Qwen3.5's gated delta rule: taps [K, C], A_log, dt_bias [Hv], norm [Dv]
                tensors += [linear_attn.conv_taps(), linear_attn.A_log.detach(), linear_attn.dt_bias.detach(),
                            linear_attn.norm_weight.detach()]
                ints += [1, 0, linear_attn.key_heads, linear_attn.key_dim, linear_attn.value_dim,
                         int(linear_attn.tiled)]
            else:
                tensors += [empty] * 4
                ints += [0, int(attn.gate_size > 0), 0, 0, 0, 0]
            if layer.shared_expert is not None:  # Qwen3.5-MoE: the shared expert's linears and float32 gate
                more_tensors, more_ints = two_linears(layer.shared_expert.gate_up_proj, layer.shared_expert.down_proj,
                                                      layer.shared_expert_gate.weight)
                tensors += more_tensors
                ints += [config.shared_expert_intermediate_size, *more_ints]
            else:
                tensors += [empty] * 9
                ints += [0, 0, 0, 0, 0]
        tensors.append(model.norm.weight.detach())
        self.step = torch.classes.ladder_cpu.DecoderStep(tensors, ints, config.rms_norm_eps)
        for layer, which, wrapper in loras:
            self.step.set_lora(layer, which, wrapper.a, wrapper.b, wrapper.splits or [])
        # Whose rows the step reads (the one LoRASlots its wrappers share), or None: no adapters.
        self.lora: LoRASlots | None = loras[0][2].slots[0] if loras else None
        self.no_lora = torch.empty(0, dtype=torch.long)
        self.no_inputs = torch.empty(0)
        self.scale = config.attention_scale
        self.window = (model.local_attention or model.attention).sliding_window or 0

    def __deepcopy__(self, memo: dict) -> None:
        """None: a copied model holds other tensors and builds a step of its own (LlamaForCausalLM.__setstate__)."""

    @staticmethod
    def takes(plan: object, kv_caches: list[torch.Tensor]) -> bool:
        """Whether a step's plan (or pair of plans) and caches are the step's: every token a kernel row (with
        linear-attention layers, every sequence's one new token: a decode step), a float32 or 16-bit cache, no
        autograd, not under torch.compile."""
        plans = plan if isinstance(plan, tuple) else (plan,)
        if isinstance(plans[-1], RecurrentPlan):
            if plans[-1].runs:
                return False
            plans = plans[:-1]
        return (all(isinstance(p, CpuAttentionPlan) and p.gather is None for p in plans)
                and kv_caches[0].dtype in KV_CACHE_DTYPES and not torch.is_grad_enabled()
                and not torch.compiler.is_compiling())

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, local_cos: torch.Tensor,
                 local_sin: torch.Tensor, kv_caches: list[torch.Tensor],
                 plan: CpuAttentionPlan | tuple[CpuAttentionPlan, CpuAttentionPlan],
                 per_layer_inputs: torch.Tensor | None = None, q_scale: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, hidden] embeddings, cos/sin [T, head_dim / 2] of the full and of the windowed layers, the
        plan (a pair with windowed layers among full ones), Gemma 4's per-layer inputs [T, layers, P], each
        token's query scale [T] (Ministral 3's attention temperature) -> the final norm's output [T, hidden]."""
        states = self.no_lora  # each row's state slot in the linear-attention layers' pools (none without)
        if isinstance(plan, tuple) and isinstance(plan[-1], RecurrentPlan):
            plan, states = plan[0], plan[-1].step_slots  # (every row a sequence's one token, in order)
        full, local = plan if isinstance(plan, tuple) else (plan, plan)
        rows = self.lora.rows_for(x.shape[0]) if self.lora is not None else None  # [T] LoRA slots, or None
        return self.step.forward(x, cos, sin, local_cos, local_sin, kv_caches, full.slot_mapping,
                                 full.row_block_tables, full.row_seq_lens, local.slot_mapping,
                                 local.row_block_tables, local.row_seq_lens, self.scale, self.window,
                                 self.no_lora if rows is None else rows.contiguous(),
                                 self.no_inputs if per_layer_inputs is None else per_layer_inputs.contiguous(),
                                 self.no_inputs if q_scale is None else q_scale.reshape(-1).contiguous(), states)

    def set_profiling(self, on: bool) -> None:
        """Time each part of the coming steps inside C++ (a clock read between parts), or stop."""
        self.step.set_profiling(on)
        self.step.take_profile()

    def take_profile(self) -> dict[str, float]:
        """Seconds per part (PARTS; attention includes the cache write) since the last call."""
        return dict(zip(self.PARTS, self.step.take_profile(), strict=True))
