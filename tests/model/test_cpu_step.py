"""The decoder's layers as one C++ call (model/cpu_step.py): the same hidden states as the eager layers, bit
for bit, on every step shape the engine makes, and the eager layers wherever the step does not apply."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import k_quant_model, make_hf_model, write_gguf

import model
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from kernels import cpu_extension
from model.cpu_step import step_support
from model.lora import TARGETS, LoRAAdapter, LoRAWeight, target_shape
from model.lora_slots import LoRASlots
from model.sequences import Sequences

pytestmark = pytest.mark.skipif(cpu_extension.load() is None, reason="the C++ CPU kernels do not build here")


def _run(module, use_step: bool, turns: list[list[list[int]]], max_len: int = 256) -> list[torch.Tensor]:
    """Logits of every new token of each turn (one list of new tokens per sequence), on a fresh cache."""
    module.use_cpu_step = use_step
    try:
        seqs = Sequences(module, len(turns[0]), max_len)
        return [seqs.step(turn, all_rows=True) for turn in turns]
    finally:
        module.use_cpu_step = True


def _assert_same(module, turns, max_len: int = 256) -> None:
    eager = _run(module, False, turns, max_len)
    step = _run(module, True, turns, max_len)
    assert module.cpu_step is not None, module.cpu_step_reason
    for a, b in zip(eager, step, strict=True):
        assert torch.equal(a, b)


@pytest.fixture(scope="module")
def default_w4a8():
    """The embedded default model as `ladder serve` runs it on a CPU: W4A8 over the GGUF's blocks."""
    return model.load(quantization="w4a8")


def test_default_model_equals_the_eager_layers(default_w4a8):
    """Prompts of different lengths in one step, then decodes beside a prompt's chunk: the step's logits
    are the eager layers' bits, on the real weights (SmolLM2: 9 heads on 3 KV heads of 64, the AVX-512
    attention task)."""
    module = default_w4a8.module
    assert step_support(module) is None
    prompts = [list(range(100, 160)), list(range(300, 305)), [42]]
    turns = [prompts, [[7], [8], list(range(500, 540))]] + [[[t], [t + 1], [t + 2]] for t in range(900, 906)]
    _assert_same(module, turns)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_16bit_caches_equal_the_eager_layers(default_w4a8, cache_dtype):
    """--kv-cache-dtype: the step rounds keys and values into a 16-bit cache as the eager write does, and its
    attention over it equals the eager layers' bit for bit; the logits stay near the float32 cache's."""
    module = default_w4a8.module
    prompts = [list(range(100, 160)), list(range(300, 305)), [42]]
    turns = [prompts, [[7], [8], list(range(500, 540))]] + [[[t], [t + 1], [t + 2]] for t in range(900, 904)]
    float32 = _run(module, True, turns)
    module.kv_cache_dtype = cache_dtype
    try:
        assert Sequences(module, 1, 16).kv_caches[0].dtype == cache_dtype
        _assert_same(module, turns)
        ours = _run(module, True, turns)
    finally:
        module.kv_cache_dtype = None
    assert module.kv_cache_dtype == torch.float32
    a, b = torch.cat(float32), torch.cat(ours)  # [rows, vocab]
    assert not torch.equal(a, b)  # the cache's rounding reaches the logits
    # ... as a small change of the next-token distributions (total variation per row).
    distance = (a.softmax(-1) - b.softmax(-1)).abs().sum(-1) / 2
    assert distance.mean().item() < 0.08 and distance.max().item() < 0.3, distance  # measured 0.04, 0.10-0.11


def test_a_16bit_cache_on_gemmas_windowed_head_of_256(tiny_hf_dir):
    """Gemma 3's head of 256 and its windowed layer over a bfloat16 cache: the step equals the eager layers."""
    module = model.load(tiny_hf_dir("gemma3"), quantization="w8a8").module
    module.kv_cache_dtype = torch.bfloat16
    long_turns = [[list(range(3, 40)), [7, 7, 8]]] + [[[t], [t + 1]] for t in range(50, 56)]
    _assert_same(module, long_turns, max_len=64)


TURNS = [[[5, 9, 30, 31, 2, 17, 40], [7, 7, 8]], [[11], [12, 13, 14]], [[15], [16]]]


@pytest.mark.parametrize("family,qtype", [("llama3", "Q4_1"), ("qwen2", "Q8_0"), ("mistral", "Q4_0"),
                                          ("llama3", "Q5_1"), ("mistral", "Q5_0"), ("phi3", "Q4_1")])
def test_tiny_w4a8_models_equal_the_eager_layers(tmp_path, family, qtype):
    """4-bit codes with d and m (Q4_1), with an implied m (Q4_0), 8-bit codes with q/k/v biases (Qwen2's
    Q8_0), 5-bit codes both ways (Q5_1, Q5_0); head size 16 runs the attention's portable task."""
    hf = make_hf_model(family, tmp_path / "hf")
    write_gguf(hf, tmp_path / "m.gguf", qtype, {"qwen2": "qwen2", "phi3": "phi3"}.get(family, "llama"))
    module = model.load(tmp_path / "m.gguf", quantization="w4a8").module
    assert module.layers[0].mlp.down_proj.bits == int(qtype[1])
    _assert_same(module, TURNS, max_len=64)


def test_a_gemma4_file_in_w4a8_equals_the_eager_layers(tmp_path):
    """Gemma 4's small shape from a Q4_0 file: its per-layer embedding's gate and projection W4A8 too, every
    linear in the step."""
    import transformers
    from tiny_models import hf_config

    cfg = hf_config("gemma4_e", hidden_size=256, intermediate_size=512, head_dim=64, global_head_dim=128,
                    hidden_size_per_layer_input=64)
    torch.manual_seed(0)
    write_gguf(transformers.AutoModelForCausalLM.from_config(cfg).eval(), tmp_path / "m.gguf", "Q4_0", "gemma4")
    module = model.load(tmp_path / "m.gguf", quantization="w4a8").module
    assert type(module.layers[0].per_layer_projection).__name__ == "W4A8Linear"
    long_turns = [[list(range(3, 40)), [7, 7, 8]]] + [[[t], [t + 1]] for t in range(50, 56)]
    _assert_same(module, TURNS, max_len=64)
    _assert_same(module, long_turns, max_len=64)


def test_a_k_quant_mix_equals_the_eager_layers(tmp_path):
    """6-bit codes with their sub-scales in the step: a Q4_K_M-like file's Q6_K v fused beside Q4_K q and k
    (6-bit with d and m), its Q6_K down and LM head (6-bit with d alone)."""
    write_gguf(k_quant_model(), tmp_path / "m.gguf", "Q4_K", "llama",
               qtypes={"attn_v": "Q6_K", "ffn_down": "Q6_K", "output": "Q6_K"})
    module = model.load(tmp_path / "m.gguf", quantization="w4a8").module
    qkv, down = module.layers[0].self_attn.qkv_proj, module.layers[0].mlp.down_proj
    assert (qkv.bits, qkv.scales.shape[2], down.bits, down.scales.shape[2], module.lm_head.bits) == (6, 2, 6, 1, 6)
    _assert_same(module, TURNS, max_len=64)


@pytest.mark.parametrize("family,arch,qtype", [("qwen3_moe", "qwen3moe", "Q4_1"), ("mixtral", "llama", "Q8_0")])
def test_w4a8_experts_equal_the_eager_layers(tmp_path, family, arch, qtype):
    """Mixture-of-experts layers in the step: the router and the routing by ATen's calls, the experts by the
    C++ experts kernel, bit for bit the eager block's (Qwen3-MoE with its dense middle layer, Mixtral all
    sparse), on prefill chunks beside decodes."""
    write_gguf(make_hf_model(family, tmp_path / "hf"), tmp_path / "m.gguf", qtype, arch)
    module = model.load(tmp_path / "m.gguf", quantization="w4a8").module
    assert step_support(module) is None
    prompts = [list(range(100, 160)), list(range(300, 305)), [42]]
    turns = [prompts, [[7], [8], list(range(200, 240))]] + [[[t], [t + 1], [t + 2]] for t in range(250, 254)]
    _assert_same(module, turns)
    module.layers[0].mlp.expert_offset = 1  # a rank's part of the experts: the eager block runs it
    assert "experts held in part" in step_support(module)
    module.layers[0].mlp.expert_offset = 0


@pytest.mark.parametrize("family", ["gemma3", "gemma4", "gemma4_e", "qwen3", "smollm3", "phi3", "qwen3_5"])
def test_tiny_w8a8_models_equal_the_eager_layers(tiny_hf_dir, family):
    """W8A8 linears; Qwen3's q/k norms; Gemma 3's sandwich norms, q/k norms, GeGLU, scaled embedding and a
    16-token window on its first layer (its own rotary base) beside a full layer; Gemma 4's full-attention
    layers with heads of their own size, one KV head whose values are its keys, normed values and a scaled
    stream, and its small models' per-layer embeddings and layers reading the first two's caches; SmolLM3's
    fourth layer without rotary embeddings (NoPE); Phi-3's rotation of part of each head, LongRoPE-scaled;
    Qwen3.5's linear attention (grouped value heads, two to a key head) and gated attention."""
    module = model.load(tiny_hf_dir(family), quantization="w8a8").module
    long_turns = [[list(range(3, 40)), [7, 7, 8]]] + [[[t], [t + 1]] for t in range(50, 56)]
    _assert_same(module, TURNS, max_len=64)
    _assert_same(module, long_turns, max_len=64)


def test_gemma3_through_the_engine_keeps_its_windowed_blocks(tiny_hf_dir):
    """The engine gives Gemma's windowed layers a pool of their own (engine/window_blocks.py): the step reads
    their tables, and the greedy tokens equal the eager layers' past the window."""
    loaded = model.load(tiny_hf_dir("gemma3"), quantization="w8a8")
    llm = LLM(loaded=loaded, kv_cache_memory_gib=0.01)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [list(range(5, 30)), list(range(40, 45))]
    with_step = [r.outputs[0].token_ids for r in llm.generate(prompts, params)]
    assert loaded.module.cpu_step is not None, loaded.module.cpu_step_reason
    loaded.module.use_cpu_step = False
    eager = [r.outputs[0].token_ids for r in llm.generate(prompts, params)]
    assert with_step == eager


def test_a_sliding_window_reaches_the_kernel(tmp_path):
    """Every layer windowed (a Mistral with sliding_window): the step passes the window to the kernel."""
    hf = make_hf_model("mistral", tmp_path / "hf")
    write_gguf(hf, tmp_path / "m.gguf", "Q4_1")
    module = model.load(tmp_path / "m.gguf", quantization="w4a8").module
    module.attention.sliding_window = 8  # the backend every layer shares; the step is built after this
    prompt = list(range(3, 40))
    turns = [[prompt]] + [[[t]] for t in range(50, 60)]
    _assert_same(module, turns, max_len=64)
    window = _run(module, True, turns, 64)
    module.attention.sliding_window = None
    module.cpu_step, module._cpu_step_version = None, -1  # a rebuilt step without the window
    full = _run(module, True, turns, 64)
    assert not torch.equal(window[-1], full[-1])  # the window changed what the last tokens see


def test_long_chunks_and_other_models_run_the_eager_layers(tmp_path, default_w4a8):
    """A prompt over 1,024 tokens gathers its keys (not kernel rows): that step runs the eager layers, and
    still equals itself; float linears, LoRA slots and hooks each name why the step does not apply."""
    hf = make_hf_model("llama3", tmp_path / "hf")
    write_gguf(hf, tmp_path / "m.gguf", "Q4_1")
    module = model.load(tmp_path / "m.gguf", quantization="w4a8").module
    calls = []
    module.cpu_step = None
    _run(module, True, [[[1] * 8]], 2048)
    assert module.cpu_step is not None
    original = module.cpu_step.step.forward
    module.cpu_step.step = type("Counting", (), {"forward": lambda self, *a: calls.append(1) or original(*a)})()
    _run(module, True, [[list(range(1, 301)) * 4]], 2048)  # 1,200 tokens: a gathered chunk
    assert calls == []
    _run(module, True, [[list(range(1, 101))]], 2048)
    assert calls == [1]

    float_model = model.load(tmp_path / "m.gguf").module
    assert "Linear linear" in step_support(float_model)
    assert "Int8Linear linear" in step_support(model.load(tmp_path / "m.gguf", quantization="int8").module)

    handle = module.layers[1].mlp.down_proj.register_forward_hook(lambda *args: None)
    assert step_support(module) == "layer 1 has forward hooks"
    handle.remove()
    slots = LoRASlots.attach(module, max_loras=2, max_rank=4)  # registers modules: the next step checks again
    _run(module, True, [[[1, 2, 3]]], 64)
    assert module.cpu_step is not None and module.cpu_step.lora is slots  # LoRA slots: still one C++ call


def test_served_greedy_text_is_the_same(default_w4a8):
    """Through the engine (prefix cache, batches of several requests): the same greedy tokens with the
    step as with the eager layers."""
    llm = LLM(loaded=default_w4a8, kv_cache_memory_gib=0.05)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = ["The capital of France is", "def fibonacci(n):", "The capital of France is a city"]
    with_step = [r.outputs[0].token_ids for r in llm.generate(prompts, params)]
    default_w4a8.module.use_cpu_step = False
    try:
        eager = [r.outputs[0].token_ids for r in llm.generate(prompts, params)]
    finally:
        default_w4a8.module.use_cpu_step = True
    assert with_step == eager


def test_a_copied_model_builds_its_own_step(default_w4a8):
    import copy

    module = default_w4a8.module
    Sequences(module, 1, 32).step([[1, 2, 3]])
    twin = copy.deepcopy(module)
    assert twin.cpu_step is None
    a, b = Sequences(module, 1, 32).step([[4, 5, 6]]), Sequences(twin, 1, 32).step([[4, 5, 6]])
    assert twin.cpu_step is not None and twin.cpu_step is not module.cpu_step and torch.equal(a, b)


def test_bad_step_inputs_raise_one_line(default_w4a8):
    module = default_w4a8.module
    seqs = Sequences(module, 1, 32)
    seqs.step([[1, 2, 3]])
    step = module.cpu_step.step
    x = torch.zeros(1, module.config.hidden_size)
    cos = sin = torch.zeros(1, module.config.head_dim // 2)
    slots, tables, lens = torch.tensor([10**9]), torch.zeros(1, 2, dtype=torch.long), torch.tensor([1])
    no_lora = torch.empty(0, dtype=torch.long)

    no_inputs = torch.empty(0)  # no per-layer inputs (Gemma 4's)

    def forward(x, caches, slots, lora=no_lora, q_scale=no_inputs):
        return step.forward(x, cos, sin, cos, sin, caches, slots, tables, lens, slots, tables, lens, 0.125, 0, lora,
                            no_inputs, q_scale, no_lora)  # (no state slots: no linear-attention layers)

    with pytest.raises(RuntimeError, match="slot 1000000000 outside layer 0's cache"):
        forward(x, seqs.kv_caches, slots)
    with pytest.raises(RuntimeError, match="x \\[T, 576\\] float32"):
        forward(torch.zeros(1, 5), seqs.kv_caches, torch.tensor([0]))
    with pytest.raises(RuntimeError, match="one KV cache per layer"):
        forward(x, seqs.kv_caches[:2], torch.tensor([0]))
    mixed = [c.bfloat16() if i == 1 else c for i, c in enumerate(seqs.kv_caches)]
    with pytest.raises(RuntimeError, match="all of one dtype"):
        forward(x, mixed, torch.tensor([0]))
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16 KV cache"):
        forward(x, [c.double() for c in seqs.kv_caches], torch.tensor([0]))
    with pytest.raises(RuntimeError, match="lora_slots \\[T\\] int64"):
        forward(x, seqs.kv_caches, torch.tensor([0]), torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="q_scale \\[T\\] float32"):
        forward(x, seqs.kv_caches, torch.tensor([0]), q_scale=torch.ones(2))
    a, b = torch.zeros(2, 4, 576), torch.zeros(2, 4, 960)
    with pytest.raises(RuntimeError, match="LoRA a \\[S, R, 576\\] and b \\[S, R, 576\\] expected"):
        step.set_lora(0, 1, torch.zeros(2, 4, 576), b, [])  # o_proj's b is [S, R, 576]
    with pytest.raises(RuntimeError, match="set_lora of layer 99"):
        step.set_lora(99, 0, a, b, [])
    with pytest.raises(ValueError, match="splits must run from 0 to N = 960"):
        step.set_lora(0, 0, a, b, [0, 5])


def _random_adapter(config, rank: int, seed: int, targets) -> LoRAAdapter:
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(config.num_layers):
        for target in targets:
            out_features, in_features = target_shape(config, target)
            a = torch.randn(rank, in_features, generator=generator) / in_features**0.5
            weights[(layer, target)] = LoRAWeight(a, torch.randn(out_features, rank, generator=generator) * 0.1)
    return LoRAAdapter(f"r{seed}", Path(f"r{seed}"), rank, weights)


@pytest.mark.parametrize("quantization", ["w4a8", "w8a8"])
def test_lora_slots_equal_the_eager_layers(tmp_path, quantization):
    """LoRA slots on the linears: every row's adapter (rows of two adapters and rows of none in one step, a
    prefill and decode rows) gives the eager wrappers' logits bit for bit, and an adapter loaded into a slot
    after the step was built is the one the step reads."""
    hf = make_hf_model("qwen2", tmp_path / "hf")  # q/k/v biases: the adapter adds after the bias
    write_gguf(hf, tmp_path / "m.gguf", "Q4_1")
    module = model.load(tmp_path / "m.gguf", quantization=quantization).module
    config = module.config
    slots = LoRASlots.attach(module, max_loras=3, max_rank=8)
    slots.load(0, _random_adapter(config, 8, 1, TARGETS))
    slots.load(2, _random_adapter(config, 4, 2, ("q_proj", "v_proj", "down_proj")))  # some targets, a lower rank
    turns = [[[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]], [[1], [2], [3]], [[4], [5], [6]]]
    adapters = [0, -1, 2]  # a slot per sequence

    def run(use_step: bool) -> list[torch.Tensor]:
        module.use_cpu_step = use_step
        seqs = Sequences(module, 3, 64)
        out = []
        try:
            for turn in turns:
                slots.rows = torch.tensor([a for a, tokens in zip(adapters, turn) for _ in tokens])
                out.append(seqs.step(turn, all_rows=True))
        finally:
            slots.rows, module.use_cpu_step = None, True
        return out

    eager = run(False)
    step = run(True)
    assert module.cpu_step is not None and module.cpu_step.lora is slots, module.cpu_step_reason
    for a, b in zip(eager, step, strict=True):
        assert torch.equal(a, b)
    slots.rows = None
    base = Sequences(module, 1, 64).step([[5, 6, 7, 8, 9]], all_rows=True)
    assert not torch.equal(step[0][:5], base)  # the adapter moved slot 0's rows

    slots.load(1, _random_adapter(config, 8, 3, TARGETS))  # in place: no rebuild, the step reads it
    adapters = [1, 1, -1]
    built = module.cpu_step
    eager, step = run(False), run(True)
    assert module.cpu_step is built
    for a, b in zip(eager, step, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_qwen3_5_decode_steps_equal_the_eager_layers(tmp_path, family):
    """Qwen3.5 (linear-attention layers beside attention with an output gate; a GGUF's tiled value heads),
    Qwen3.5-MoE (W4A8 experts beside a shared expert and its float32 gate) and Qwen3-Next (grouped value heads, a
    dense layer among the sparse ones): decode steps run as one C++ call, a prompt's chunk the eager layers (the
    recurrent plan's runs), and the logits of both are the eager layers' bits, for sequences starting with a
    one-token prompt too."""
    import transformers
    from tiny_models import hf_config, spread_qwen3_5_parameters, write_qwen35_gguf

    config = hf_config(family)
    config.linear_value_head_dim = 16  # (llama.cpp's files: value heads as wide as key heads)
    torch.manual_seed(1)
    write_qwen35_gguf(spread_qwen3_5_parameters(transformers.AutoModelForCausalLM.from_config(config)),
                      tmp_path / "m.gguf", "Q8_0")
    module = model.load(tmp_path / "m.gguf", quantization="w4a8").module
    assert step_support(module) is None
    turns = [[list(range(1, 40)), [7], list(range(50, 60))]] + [[[t], [t + 1], [t + 2]] for t in range(90, 96)]
    _assert_same(module, turns, max_len=64)
    calls = []
    original = module.cpu_step.step.forward
    module.cpu_step.step = type("Counting", (), {"forward": lambda self, *a: calls.append(1) or original(*a)})()
    _run(module, True, turns, 64)
    assert len(calls) == 6  # the decode steps; not the prompts' step
