"""The whole decoder on the Triton kernels (LADDER_KERNELS=triton; interpreted without CUDA) against the
same weights on the plain-torch ops."""

from __future__ import annotations

import pytest
import torch
from kernel_checks import DEVICE, relative_error
from tiny_models import make_hf_model

import model
from kernels.runtime import HAS_TRITON, TRITON_IMPORT_ERROR
from model.attention_metadata import AttentionMetadata
from model.generator import Generator

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason=f"triton is not importable ({TRITON_IMPORT_ERROR})")


@pytest.fixture(scope="module", params=["llama3", "qwen3", "gemma3"])  # q/k norms; windows, GeGLU
def both_sides(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    make_hf_model(request.param, directory)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LADDER_KERNELS", "torch")
        reference = model.load(directory, device=DEVICE).module
        mp.setenv("LADDER_KERNELS", "triton")
        kernels = model.load(directory, device=DEVICE).module
    assert reference.ops.name == "torch" and kernels.ops.name == "triton"
    return reference, kernels


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(0, 320, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_greedy_tokens_and_logits_match(both_sides):
    reference, kernels = both_sides
    ids = prompt(21, seed=1)
    ref_steps = list(Generator(reference, 48).generate(ids, 6))
    out_steps = list(Generator(kernels, 48).generate(ids, 6))
    assert [s.token_id for s in out_steps] == [s.token_id for s in ref_steps]
    for ours, ref in zip(out_steps, ref_steps):
        assert relative_error(ours.logits, ref.logits) < 1e-4


def test_mixed_flat_batch_matches(both_sides):
    """Prefill chunks after cached context and decodes in one forward (the prefill kernel's path)."""
    reference, kernels = both_sides
    shapes = [(0, 9), (20, 1), (16, 5)]  # (cached, new)
    seqs = [prompt(c + n, seed=10 + i) for i, (c, n) in enumerate(shapes)]
    tables = [[3 * i + 2, 3 * i, 3 * i + 1] for i in range(len(shapes))]
    logits = []
    for module in (reference, kernels):
        caches = module.allocate_kv_caches(3 * len(shapes))
        with torch.inference_mode():
            for (cached, _), seq, table in zip(shapes, seqs, tables):
                if cached:
                    meta = AttentionMetadata.build([cached], [cached], [table], module.block_size, DEVICE)
                    module(torch.tensor(seq[:cached], device=DEVICE), torch.arange(cached, device=DEVICE), caches,
                           meta)
            meta = AttentionMetadata.build([n for _, n in shapes], [c + n for c, n in shapes], tables,
                                           module.block_size, DEVICE)
            ids = torch.tensor([t for (c, _), seq in zip(shapes, seqs) for t in seq[c:]], device=DEVICE)
            positions = torch.cat([torch.arange(c, c + n) for c, n in shapes]).to(DEVICE)
            logits.append(module.compute_logits(module(ids, positions, caches, meta)))
    assert relative_error(logits[1], logits[0]) < 1e-4
