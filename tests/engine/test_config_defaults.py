"""The defaults a GPU user expects (issue 30, item 3): `--dtype auto` resolved in one place for every entry
point, and the KV cache filling --gpu-memory-utilization of a CUDA device. No GPU runs here: the CUDA
queries (`is_available`, `device_count`, `is_bf16_supported`, `mem_get_info`) are monkeypatched, and only
the configuration and the cache plan, which read nothing else of the device, are checked."""

from __future__ import annotations

import pytest
import torch

from engine import config as engine_config
from engine.config import GIB, EngineConfig, bytes_per_block, plan_kv_cache
from ladder.cli import build_parser
from model.config import ModelConfig
from model.precision import resolve_dtype
from model.quantization import resolve_quantization

TINY = ModelConfig(architecture="llama", vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0,
                   max_position_embeddings=256, tie_word_embeddings=True)
CUDA = torch.device("cuda")


@pytest.fixture
def fake_cuda(monkeypatch):
    """A machine that says it has one CUDA device, with bfloat16 unless told otherwise."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)


def test_auto_dtype_per_device(monkeypatch):
    assert resolve_dtype("auto", "cpu") == "float32"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert resolve_dtype("auto", "cuda") == "bfloat16"
    assert resolve_dtype("auto", "cuda:1") == "bfloat16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    assert resolve_dtype("auto", "cuda") == "float16"  # a GPU before bfloat16 (V100, T4)
    for explicit in ("float32", "bf16", "float16", torch.bfloat16):  # asked for: kept as given, on any device
        assert resolve_dtype(explicit, "cuda") == explicit
        assert resolve_dtype(explicit, "cpu") == explicit
    with pytest.raises(ValueError, match="unknown dtype 'float8'"):
        resolve_dtype("float8", "cpu")


def test_engine_config_resolves_auto_before_quantization():
    config = EngineConfig()
    assert config.dtype == "float32"  # whatever the checkpoint holds: the CPU's quantized paths start from it
    auto = EngineConfig(quantization="auto")
    assert auto.quantization == resolve_quantization("auto", "float32", "cpu", None)
    assert EngineConfig(dtype="bf16").dtype == "bf16"
    assert EngineConfig(dtype="bf16", quantization="auto").quantization == "none"


def test_engine_config_on_cuda(fake_cuda):
    config = EngineConfig(device="auto", quantization="auto")
    assert (config.device, config.dtype, config.quantization) == ("cuda", "bfloat16", "none")
    assert config.gpu_memory_utilization == 0.9
    assert EngineConfig(device="cuda", dtype="float32").dtype == "float32"
    # W4A8 has only a CPU kernel: refused in one line.
    with pytest.raises(ValueError, match="w4a8 is a CPU kernel") as error:
        EngineConfig(device="cuda", quantization="w4a8")
    assert "\n" not in str(error.value)
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
            EngineConfig(device="cuda", gpu_memory_utilization=bad)


@pytest.mark.parametrize("command,extra", [("serve", []), ("bench", []), ("generate", ["hi"])])
def test_commands_default_to_auto(command, extra):
    args = build_parser().parse_args([command, *extra])
    assert args.dtype == "auto"
    args = build_parser().parse_args([command, *extra, "--dtype", "bf16"])
    assert args.dtype == "bf16"


def test_serve_gpu_memory_utilization_flag():
    parser = build_parser()
    assert parser.parse_args(["serve"]).gpu_memory_utilization == 0.9
    assert parser.parse_args(["serve", "--gpu-memory-utilization", "0.5"]).gpu_memory_utilization == 0.5
    assert parser.parse_args(["doctor"]).dtype == "float32"  # doctor's own default stays


def test_generate_runs_with_auto_dtype(tiny_dir, capsys):
    args = build_parser().parse_args(["generate", "hi", "--model", str(tiny_dir), "--max-tokens", "2",
                                      "--quantization", "none"])
    assert args.run(args) == 0
    assert "output 2 tokens" in capsys.readouterr().err


def _cuda_memory(monkeypatch, free: int, total: int) -> list:
    calls = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: calls.append(device) or (free, total))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    return calls


def test_cuda_cache_fills_the_utilization(monkeypatch):
    per_block = bytes_per_block(TINY, 16, torch.bfloat16)
    total, in_use = 80 * GIB, 10 * GIB  # the model and anything else on the device
    calls = _cuda_memory(monkeypatch, total - in_use, total)
    config = EngineConfig(max_num_seqs=10**9)  # no cap from the sequences: the memory decides
    num_blocks, max_model_len = plan_kv_cache(config, TINY, torch.bfloat16, CUDA)
    assert calls == [CUDA]
    assert num_blocks == (int(0.9 * total) - in_use) // per_block
    assert max_model_len == TINY.max_position_embeddings
    half = EngineConfig(max_num_seqs=10**9, gpu_memory_utilization=0.5)
    assert plan_kv_cache(half, TINY, torch.bfloat16, CUDA)[0] == (40 * GIB - in_use) // per_block
    # The default cap still holds: no more than every sequence at full length.
    assert plan_kv_cache(EngineConfig(max_num_seqs=4), TINY, torch.bfloat16, CUDA)[0] == 4 * 256 // 16


def test_cuda_utilization_without_room_is_one_line(monkeypatch):
    _cuda_memory(monkeypatch, free=2 * GIB, total=16 * GIB)  # 14 GiB in use, over 0.8 x 16 GiB
    with pytest.raises(ValueError, match="--gpu-memory-utilization 0.8 leaves no room for the KV cache") as error:
        plan_kv_cache(EngineConfig(gpu_memory_utilization=0.8), TINY, torch.bfloat16, CUDA)
    assert "\n" not in str(error.value) and "14.00 GiB" in str(error.value)
    # An explicit size is taken as given, without asking the device.
    calls = _cuda_memory(monkeypatch, free=2 * GIB, total=16 * GIB)
    explicit = EngineConfig(kv_cache_memory_gib=0.01, gpu_memory_utilization=0.8, max_num_seqs=10**9)
    num_blocks, _ = plan_kv_cache(explicit, TINY, torch.bfloat16, CUDA)
    assert calls == [] and num_blocks == int(0.01 * GIB) // bytes_per_block(TINY, 16, torch.bfloat16)


def test_cpu_cache_default_is_unchanged(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: pytest.fail("a CPU asks no CUDA device"))
    per_block = bytes_per_block(TINY, 16, torch.float32)
    config = EngineConfig(max_num_seqs=10**9)
    monkeypatch.setattr(engine_config, "available_memory", lambda: 1 * GIB)
    assert plan_kv_cache(config, TINY, torch.float32, torch.device("cpu"))[0] == int(0.25 * GIB) // per_block
    monkeypatch.setattr(engine_config, "available_memory", lambda: 100 * GIB)  # capped at CPU_DEFAULT_KV_GIB
    assert plan_kv_cache(config, TINY, torch.float32, torch.device("cpu"))[0] == 2 * GIB // per_block
