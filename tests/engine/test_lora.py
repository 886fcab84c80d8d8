"""Multi-LoRA serving on tiny random models: each adapter's greedy tokens equal peft + transformers,
mixed batches give each request its solo tokens, the prefix cache never crosses adapters, GGUF adapters
equal their PEFT source, and malformed adapters are refused in one line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from lora_adapters import ALL_TARGETS, make_peft_adapter

from engine.llm import LLM
from engine.lora_manager import LoRAInUseError, LoRAManager
from engine.sampling_params import SamplingParams
from model.errors import ModelLoadError
from model.lora import load_adapter

PROMPTS = [[1, 17, 33, 90, 5, 66, 41, 12, 7, 250, 31, 8, 99, 120, 4, 18, 77, 3],
           [2, 200, 14, 15, 16, 300, 9],
           [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25]]
NUM_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
# name -> (peft LoraConfig arguments, seed): ranks, alphas and targets differ, rsLoRA and a rank pattern too.
ADAPTERS = {
    "all8": (dict(r=8, lora_alpha=16, target_modules=ALL_TARGETS), 1),
    "attn4": (dict(r=4, lora_alpha=4, target_modules=["q_proj", "v_proj"]), 2),
    "mlp16": (dict(r=16, lora_alpha=8, target_modules=["gate_proj", "down_proj"], use_rslora=True), 3),
    "pattern": (dict(r=8, lora_alpha=32, target_modules=["k_proj", "o_proj", "up_proj"],
                     rank_pattern={"o_proj": 2}, alpha_pattern={"up_proj": 4}), 4),
}


def hf_greedy(model, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NUM_TOKENS,
                             do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def adapters(tiny_hf_dir, tmp_path_factory):
    """The llama3 tiny model, four adapters on it, and peft's greedy tokens for each prompt and adapter
    (and for the base model)."""
    import transformers

    base_dir = tiny_hf_dir("llama3")
    root = tmp_path_factory.mktemp("loras")
    paths, reference = {}, {}
    for name, (settings, seed) in ADAPTERS.items():
        paths[name] = root / name
        model = make_peft_adapter(base_dir, paths[name], settings, seed)
        reference[name] = [hf_greedy(model, p) for p in PROMPTS]
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32).eval()
    reference[None] = [hf_greedy(base, p) for p in PROMPTS]
    return base_dir, paths, reference


@pytest.fixture(scope="module")
def llm(adapters):
    base_dir, paths, _ = adapters
    # Two slots for four adapters: batches that mix them load and evict.
    return LLM(str(base_dir), lora_modules={name: str(p) for name, p in paths.items()}, max_loras=2,
               max_lora_rank=16, kv_cache_memory_gib=0.05, max_model_len=128)


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_each_adapter_alone_gives_peft_tokens(llm, adapters):
    _, _, reference = adapters
    for name in [*ADAPTERS, None]:
        got = tokens(llm.generate(PROMPTS, GREEDY, lora=[name] * len(PROMPTS)))
        assert got == reference[name], name


def test_a_batch_mixing_adapters_and_the_base_gives_each_its_solo_tokens(llm, adapters):
    _, _, reference = adapters
    names = [*ADAPTERS, None]
    prompts = [p for p in PROMPTS for _ in names]
    loras = [n for _ in PROMPTS for n in names]
    got = tokens(llm.generate(prompts, GREEDY, lora=loras))
    expected = [reference[n][i] for i in range(len(PROMPTS)) for n in names]
    assert got == expected
    assert llm.engine.lora.num_loads >= 4  # two slots served four adapters
    assert all(pins == 0 for pins in llm.engine.lora.pins)


def test_rows_without_an_adapter_keep_their_logits_bit_for_bit(llm):
    # The base rows of a batch are computed the same whatever adapters the other rows use: the same
    # batch shape without any adapter gives the same logprobs to the last bit. (Across batch shapes
    # the float32 matmuls may round differently, as without LoRA: tokens are what stays equal.)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3)
    batch = [PROMPTS[0], PROMPTS[1], PROMPTS[0]]
    plain = llm.generate(batch, params, lora=[None, None, None])
    mixed = llm.generate(batch, params, lora=["all8", "attn4", None])
    assert mixed[2].outputs[0].logprobs == plain[2].outputs[0].logprobs
    solo = llm.generate([PROMPTS[0]], params, lora="all8")[0].outputs[0]
    assert mixed[0].outputs[0].token_ids == solo.token_ids
    for got, want in zip(mixed[0].outputs[0].logprobs, solo.logprobs):
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)


def run_alone(engine, request_id: str, prompt: list[int], lora: str | None) -> tuple[int, list[int]]:
    """(prompt tokens found in the prefix cache, greedy tokens) of one request run to its end."""
    engine.add_request(request_id, prompt, GREEDY, lora=lora)
    request = engine.requests[request_id][0]
    while engine.has_unfinished():
        engine.step()
    return request.num_cached_tokens, request.output_token_ids


def test_the_prefix_cache_is_never_shared_across_adapters(llm):
    engine = llm.engine
    prompt = list(range(3, 3 + 40))  # two full blocks of 16, and more
    cached, first = run_alone(engine, "p0", prompt, "all8")
    assert cached == 0
    assert run_alone(engine, "p1", prompt, "all8") == (32, first)  # its own blocks, found
    for i, other in enumerate(["attn4", None, "mlp16"]):
        cached, _ = run_alone(engine, f"q{i}", prompt, other)
        assert cached == 0, other  # all8's blocks are not found under another adapter, nor the base's


def test_unknown_adapter_and_removal_in_use(llm, adapters):
    with pytest.raises(ValueError, match="unknown LoRA adapter 'nope'"):
        llm.generate([PROMPTS[0]], GREEDY, lora="nope")
    engine = llm.engine
    engine.add_request("busy", PROMPTS[0], GREEDY, lora="attn4")
    with pytest.raises(LoRAInUseError, match="in use"):
        engine.remove_lora("attn4")
    while engine.has_unfinished():
        engine.step()
    _, paths, reference = adapters
    engine.remove_lora("attn4")
    with pytest.raises(ValueError, match="unknown LoRA adapter"):
        llm.generate([PROMPTS[0]], GREEDY, lora="attn4")
    engine.add_lora(load_adapter(paths["attn4"], engine.model.config, "attn4"))  # back, as a new adapter
    assert tokens(llm.generate(PROMPTS, GREEDY, lora="attn4")) == reference["attn4"]


# --- GGUF adapters ---------------------------------------------------------------------------------

def write_gguf_adapter(peft_dir, path, num_heads: int, num_kv_heads: int, permute: bool = True) -> None:
    """A PEFT adapter written the way llama.cpp's converter writes it: blk.N.<name>.weight.lora_a/b, q and
    k rows in llama.cpp's rotary order, alpha in adapter.lora.alpha."""
    import gguf
    from safetensors.torch import load_file
    from tiny_models import GGUF_LAYER_NAMES, llama_cpp_permute, write_and_close

    settings = json.loads((peft_dir / "adapter_config.json").read_text())
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_type("adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", float(settings["lora_alpha"]))
    for key, tensor in sorted(load_file(peft_dir / "adapter_model.safetensors").items()):
        rest = key.split("layers.", 1)[1]  # "0.self_attn.q_proj.lora_A.weight"
        layer, module, side = rest.split(".", 1)[0], rest.split(".")[1] + "." + rest.split(".")[2], rest.split(".")[3]
        array = tensor.float().numpy()
        if permute and side == "lora_B" and module in ("self_attn.q_proj", "self_attn.k_proj"):
            array = llama_cpp_permute(array, num_heads if "q_proj" in module else num_kv_heads)
        name = f"blk.{layer}.{GGUF_LAYER_NAMES[module]}.weight.lora_{side[-1].lower()}"
        writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
    write_and_close(writer)


def test_a_gguf_adapter_equals_its_peft_source(llm, adapters, tmp_path):
    base_dir, paths, reference = adapters
    config = llm.engine.model.config
    path = tmp_path / "all8_gguf.gguf"
    write_gguf_adapter(paths["all8"], path, config.num_heads, config.num_kv_heads)
    from_gguf, from_peft = load_adapter(path, config), load_adapter(paths["all8"], config)
    assert from_gguf.weights.keys() == from_peft.weights.keys()
    for key, weight in from_peft.weights.items():
        assert torch.equal(from_gguf.weights[key].a, weight.a) and torch.equal(from_gguf.weights[key].b, weight.b)
    llm.engine.add_lora(from_gguf)
    assert tokens(llm.generate(PROMPTS, GREEDY, lora=from_gguf.name)) == reference["all8"]
    llm.engine.remove_lora(from_gguf.name)


# --- refusals ---------------------------------------------------------------------------------------

def copy_adapter(src, dst, settings=None, tensors=None):
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    config = json.loads((src / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(json.dumps({**config, **(settings or {})}))
    weights = load_file(src / "adapter_model.safetensors")
    save_file(tensors(weights) if tensors else weights, dst / "adapter_model.safetensors")
    return dst


def test_malformed_adapters_are_refused_in_one_line(llm, adapters, tmp_path):
    _, paths, _ = adapters
    src, config = paths["all8"], llm.engine.model.config
    some_key = "base_model.model.model.layers.0.self_attn.v_proj.lora_A.weight"

    def without_v(weights):
        return {k: v for k, v in weights.items() if "v_proj" not in k}

    def wrong_shape(weights):
        return {k: (v[:, :-1].contiguous() if k == some_key else v) for k, v in weights.items()}

    def with_head(weights):
        return {**weights, "base_model.model.lm_head.lora_A.weight": torch.zeros(8, 64)}

    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "adapter_config.json").write_text((src / "adapter_config.json").read_text())
    (garbage / "adapter_model.safetensors").write_bytes(b"\x80\x04 not safetensors at all")
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "adapter_config.json").write_text((src / "adapter_config.json").read_text())
    (pickled / "adapter_model.bin").write_bytes(b"\x80\x04")
    cases = {
        copy_adapter(src, tmp_path / "rank", settings={"r": 4}): "do not fit rank 4",
        copy_adapter(src, tmp_path / "missing", tensors=without_v): "no weights for them",
        copy_adapter(src, tmp_path / "shape", tensors=wrong_shape): "do not fit rank 8",
        copy_adapter(src, tmp_path / "head", tensors=with_head): "lm_head",
        copy_adapter(src, tmp_path / "dora", settings={"use_dora": True}): "DoRA",
        garbage: "not a readable safetensors file",
        pickled: "pickle",
        tmp_path / "nowhere": "no such file",
    }
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_bytes(b"GGUF but not really")
    cases[not_gguf] = "not a readable GGUF file"
    for path, message in cases.items():
        with pytest.raises(ModelLoadError, match=message) as caught:
            load_adapter(path, config)
        assert "\n" not in str(caught.value) and str(path) in str(caught.value)
    big = copy_adapter(src, tmp_path / "big", settings={"r": 32, "lora_alpha": 32},
                       tensors=lambda w: {k: (torch.cat([v] * 4) if "lora_A" in k else torch.cat([v] * 4, dim=1))
                                          for k, v in w.items()})
    with pytest.raises(ValueError, match="over --max-lora-rank 16"):
        llm.engine.add_lora(load_adapter(big, config, "big"))
    assert tokens(llm.generate(PROMPTS[:1], GREEDY, lora="all8"))  # still serving


# --- the slot owner, alone ---------------------------------------------------------------------------

class FakeSlots:
    def __init__(self, max_loras: int) -> None:
        self.max_loras, self.max_rank = max_loras, 16
        self.loaded: list[tuple[int, str]] = []

    def load(self, slot, adapter):
        self.loaded.append((slot, adapter.name))

    def clear(self, slot):
        self.loaded.append((slot, None))


def fake_adapter(name: str):
    from model.lora import LoRAAdapter

    return LoRAAdapter(name, None, 4, {})


def test_the_manager_evicts_the_least_recently_used_unpinned_slot():
    slots = FakeSlots(2)
    manager = LoRAManager(slots)
    for name in "abc":
        manager.add(fake_adapter(name))
    a = manager.acquire("a")
    b = manager.acquire("b")
    assert manager.acquire("c") is None  # both pinned
    manager.release(a)
    assert manager.acquire("c") == a  # a's slot, the only unpinned one
    assert manager.acquire("b") == b and manager.pins[b] == 2  # resident: no load
    assert slots.loaded == [(0, "a"), (1, "b"), (0, "c")]
    with pytest.raises(LoRAInUseError):
        manager.remove("c")
    manager.release(a)
    manager.remove("c")
    assert manager.resident == [None, "b"]
    assert manager.cache_salt("a") != manager.cache_salt("b")
    manager.remove("a")
    manager.add(fake_adapter("a"))
    assert manager.cache_salt("a") == b"lora:4"  # a new registration: its old cached blocks are not found
    with pytest.raises(ValueError, match="already loaded"):
        manager.add(fake_adapter("b"))
