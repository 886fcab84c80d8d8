"""The C++ CPU decode attention against the plain-torch reference (float32, bfloat16 and float16
caches, float32 queries over a 16-bit cache), and inside a bfloat16 model."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_decode_attention as kernel
from kernels.paged_attention import paged_attention_ref

# A 16-bit kernel computes in float32 and rounds once at the output: within half a unit in the last
# place of the float32 reference on the widened inputs, plus float32's own error (the atol, for outputs
# near 0). 2**-8 and 2**-10 are one unit of bfloat16's and float16's significands.
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=2**-8, atol=1e-5),
             torch.float16: dict(rtol=2**-10, atol=1e-5)}
DTYPES = [pytest.param(d, id=str(d).removeprefix("torch.")) for d in TOLERANCE]

pytestmark = pytest.mark.skipif(kernel.load() is None, reason="the CPU kernel could not be built here "
                                "(a C++ compiler and ninja are needed); the torch path is used instead")


@pytest.mark.parametrize("num_seqs,max_len,num_heads,num_kv_heads,head_dim,window", [
    (1, 1, 4, 4, 16, None),
    (5, 37, 8, 2, 32, None),
    (7, 100, 9, 3, 64, None),  # the default model's heads
    (3, 64, 12, 1, 64, None),
    (4, 90, 4, 4, 16, 10),
    (6, 33, 8, 4, 128, 16),
    # The vector version's shapes: 8 query heads per KV head, windows starting inside a block, Gemma 3's
    # head of 256 (4 query heads on one KV head, a window of 512 over longer contexts).
    (5, 300, 8, 1, 64, None),
    (4, 200, 6, 2, 64, 37),
    (3, 50, 4, 2, 128, None),
    (3, 700, 4, 1, 256, 512),
    (2, 40, 4, 1, 256, None),
])
@pytest.mark.parametrize("portable", [False, True], ids=["fast", "portable"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_kernel_matches_reference(num_seqs, max_len, num_heads, num_kv_heads, head_dim, window, portable,
                                         dtype):
    gen = torch.Generator().manual_seed(num_seqs * 100 + max_len)
    block_size = 16
    blocks_per_seq = -(-max_len // block_size) + 1
    num_blocks = num_seqs * blocks_per_seq + 3
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:blocks_per_seq] for _ in range(num_seqs)])
    seq_lens = torch.randint(1, max_len + 1, (num_seqs,), generator=gen)
    seq_lens[0] = max_len  # block boundaries and odd lengths both occur
    q = torch.randn(num_seqs, num_heads, head_dim, generator=gen)
    cache, q = cache.to(dtype), q.to(dtype)
    # The reference in float32 on the same (widened) values.
    ref = paged_attention_ref(q.float(), cache.float(), torch.arange(num_seqs + 1), seq_lens, tables, 1,
                              int(seq_lens.max()), head_dim**-0.5, window)
    out = kernel.paged_decode_attention(q, cache, tables, seq_lens, head_dim**-0.5, window, portable=portable)
    assert out.dtype == dtype and not out.isnan().any()
    torch.testing.assert_close(out.float(), ref, **TOLERANCE[dtype])
    if dtype == torch.float32:
        assert ((out - ref).norm() / ref.norm()).item() < 1e-5


@pytest.mark.parametrize("head_dim", [64, 128, 256, 32])
@pytest.mark.parametrize("portable", [False, True], ids=["fast", "portable"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_ignores_slots_past_the_sequence(head_dim, portable, dtype):
    """The unused tail of a sequence's last block may hold anything (here NaN): it must not leak in."""
    block_size, lens = 16, [5, 16, 21, 40]
    cache = torch.full((2, 12, block_size, 2, head_dim), float("nan"), dtype=dtype)
    tables = torch.arange(12).view(4, 3)
    for s, n in enumerate(lens):
        for pos in range(n):
            cache[:, tables[s, pos // block_size], pos % block_size] = torch.randn(2, 2, head_dim).to(dtype)
    seq_lens = torch.tensor(lens)
    q = torch.randn(4, 6, head_dim).to(dtype)
    ref = paged_attention_ref(q.float(), cache.float().nan_to_num(0.0), torch.arange(5), seq_lens, tables, 1, 40,
                              head_dim**-0.5, None)
    out = kernel.paged_decode_attention(q, cache, tables, seq_lens, head_dim**-0.5, portable=portable)
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), ref, **TOLERANCE[dtype])


@pytest.mark.parametrize("num_seqs,max_len,num_heads,num_kv_heads,head_dim,window", [
    (7, 100, 9, 3, 64, None),  # the default model's heads
    (4, 200, 6, 2, 64, 37),
    (3, 50, 4, 2, 128, None),
    (3, 700, 4, 1, 256, 512),  # Gemma 3's head, a window, contexts cut into chunks
    (5, 37, 8, 2, 32, None),  # the portable loop's shape
])
@pytest.mark.parametrize("portable", [False, True], ids=["fast", "portable"])
@pytest.mark.parametrize("cache_dtype", DTYPES[1:])
def test_float32_queries_over_a_16bit_cache(num_seqs, max_len, num_heads, num_kv_heads, head_dim, window, portable,
                                            cache_dtype):
    """A float32 model's queries over a 16-bit cache (--kv-cache-dtype): the float32 reference on the widened
    cache, to float32's accuracy (nothing is rounded to 16 bits at the output), in float32."""
    gen = torch.Generator().manual_seed(num_seqs * 10 + max_len)
    block_size = 16
    blocks_per_seq = -(-max_len // block_size) + 1
    num_blocks = num_seqs * blocks_per_seq + 3
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(cache_dtype)
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:blocks_per_seq] for _ in range(num_seqs)])
    seq_lens = torch.randint(1, max_len + 1, (num_seqs,), generator=gen)
    seq_lens[0] = max_len
    q = torch.randn(num_seqs, num_heads, head_dim, generator=gen)
    ref = paged_attention_ref(q, cache.float(), torch.arange(num_seqs + 1), seq_lens, tables, 1,
                              int(seq_lens.max()), head_dim**-0.5, window)
    out = kernel.paged_decode_attention(q, cache, tables, seq_lens, head_dim**-0.5, window, portable=portable)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, **TOLERANCE[torch.float32])
    # The reference the CPU backend falls back to takes the same pair of dtypes.
    fallback = kernel.paged_decode_attention_ref(q, cache, tables, seq_lens, head_dim**-0.5, window or 0, False)
    assert fallback.dtype == torch.float32
    torch.testing.assert_close(fallback, ref, **TOLERANCE[torch.float32])


def test_rejects_what_it_cannot_run():
    q = torch.randn(2, 6, 16)
    cache = torch.randn(2, 4, 16, 4, 16)
    with pytest.raises(ValueError, match="group"):
        kernel.paged_decode_attention(q, cache, torch.zeros(2, 1, dtype=torch.long), torch.ones(2, dtype=torch.long),
                                      0.25)
    q = torch.randn(2, 4, 16)
    tables, lens = torch.zeros(2, 1, dtype=torch.long), torch.ones(2, dtype=torch.long)
    with pytest.raises(ValueError, match="q of its dtype or float32"):  # a 16-bit q over a float32 cache
        kernel.paged_decode_attention(q.bfloat16(), cache, tables, lens, 0.25)
    with pytest.raises(ValueError, match="q of its dtype or float32"):
        kernel.paged_decode_attention(q.half(), cache.bfloat16(), tables, lens, 0.25)
    with pytest.raises(ValueError, match="q of its dtype or float32"):
        kernel.paged_decode_attention(q.double(), cache.double(), tables, lens, 0.25)


def greedy_tokens(module, prompts: list[list[int]], steps: int) -> tuple[list[list[int]], torch.Tensor]:
    """Decode several sequences of different lengths side by side; their tokens and the last logits."""
    from model.sequences import Sequences

    sequences = Sequences(module, len(prompts), max(map(len, prompts)) + steps)
    with torch.inference_mode():
        logits = sequences.step(prompts)
        tokens = [[t] for t in logits.argmax(dim=-1).tolist()]
        for _ in range(steps - 1):
            logits = sequences.step([[out[-1]] for out in tokens])
            for out, t in zip(tokens, logits.argmax(dim=-1).tolist()):
                out.append(t)
    return tokens, logits


@pytest.mark.parametrize("head_dim", [16, 64], ids=["portable", "fast"])
def test_bfloat16_model_decodes_on_the_kernel_with_the_gather_paths_tokens(head_dim, tmp_path, monkeypatch):
    """A bfloat16 model's decode steps run on the kernel (not the gather path) and pick the same greedy
    tokens as the plain-torch backend, over block boundaries and sequences of different lengths."""
    import transformers
    from tiny_models import hf_config

    import model

    config = hf_config("llama3")
    config.head_dim = head_dim  # 64: the AVX-512 version's shape; 16: the portable loop
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path, safe_serialization=True)
    monkeypatch.setenv("LADDER_KERNELS", "torch")
    reference = model.load(tmp_path, dtype="bfloat16").module
    monkeypatch.setenv("LADDER_KERNELS", "auto")
    ours = model.load(tmp_path, dtype="bfloat16").module
    assert reference.ops.name == "torch" and ours.ops.name == "cpu"

    calls = []
    real = kernel.paged_decode_attention

    def counted(q, kv_cache, *args, **kwargs):
        calls.append(kv_cache.dtype)
        return real(q, kv_cache, *args, **kwargs)

    monkeypatch.setattr(kernel, "paged_decode_attention", counted)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 320, (n,), generator=gen).tolist() for n in (5, 14, 31)]
    ref_tokens, ref_logits = greedy_tokens(reference, prompts, 10)
    assert not calls
    tokens, logits = greedy_tokens(ours, prompts, 10)
    # 9 decode steps, and the prefill step, whose prompts run as rows too: one call per layer each.
    assert set(calls) == {torch.bfloat16} and len(calls) == 10 * config.num_hidden_layers
    assert tokens == ref_tokens
    # Both in bfloat16: the kernel's float32 sums differ from the gather path's by bfloat16 rounding.
    assert ((logits - ref_logits).norm() / ref_logits.norm()).item() < 3e-2


@pytest.mark.parametrize("window", [None, 300])
def test_long_contexts_are_cut_into_chunks_the_same_in_any_batch(window):
    """A context past 128 tokens runs as chunks combined afterwards (every thread busy at batch 1): each
    sequence's output is bit for bit its output alone, and within float32 rounding of the reference."""
    gen = torch.Generator().manual_seed(11)
    lens = [1000, 129, 128, 700, 17]
    blocks_per_seq = -(-max(lens) // 16)
    num_blocks = len(lens) * blocks_per_seq
    cache = torch.randn(2, num_blocks, 16, 3, 64, generator=gen)
    tables = torch.randperm(num_blocks, generator=gen).view(len(lens), blocks_per_seq)
    seq_lens = torch.tensor(lens)
    q = torch.randn(len(lens), 9, 64, generator=gen)
    batch = kernel.paged_decode_attention(q, cache, tables, seq_lens, 0.125, window)
    for s in range(len(lens)):
        alone = kernel.paged_decode_attention(q[s:s + 1], cache, tables[s:s + 1], seq_lens[s:s + 1], 0.125, window)
        assert torch.equal(alone[0], batch[s])
    ref = paged_attention_ref(q, cache, torch.arange(len(lens) + 1), seq_lens, tables, 1, max(lens), 0.125, window)
    assert ((batch - ref).norm() / ref.norm()).item() < 1e-5


@pytest.mark.parametrize("max_len,num_heads,num_kv_heads,head_dim,window", [
    (37, 8, 2, 32, None),  # the portable loop's shape
    (300, 8, 2, 64, None),  # the vector task's, cut into chunks of 128
    (200, 8, 2, 64, 128),  # GPT-OSS's window
])
@pytest.mark.parametrize("portable", [False, True], ids=["fast", "portable"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_sinks_join_the_softmax_as_the_reference_has_them(max_len, num_heads, num_kv_heads, head_dim, window,
                                                          portable, dtype):
    """GPT-OSS's sink logits, one per query head, from far below the scores to far above them: the kernel
    against the reference's extra softmax column, in one chunk and across chunks."""
    gen = torch.Generator().manual_seed(max_len)
    num_seqs, block_size = 4, 16
    blocks_per_seq = -(-max_len // block_size)
    num_blocks = num_seqs * blocks_per_seq
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    tables = torch.randperm(num_blocks, generator=gen).view(num_seqs, blocks_per_seq)
    seq_lens = torch.tensor([max_len, 1, 17, max_len // 2 + 3])
    q = (3 * torch.randn(num_seqs, num_heads, head_dim, generator=gen)).to(dtype)
    sinks = torch.linspace(-30, 30, num_heads)
    ref = paged_attention_ref(q.float(), cache.float(), torch.arange(num_seqs + 1), seq_lens, tables, 1,
                              max_len, head_dim**-0.5, window, sinks=sinks)
    out = kernel.paged_decode_attention(q, cache, tables, seq_lens, head_dim**-0.5, window, portable, sinks)
    torch.testing.assert_close(out.float(), ref, **TOLERANCE[dtype])
    plain = kernel.paged_decode_attention(q, cache, tables, seq_lens, head_dim**-0.5, window, portable)
    assert out[:, -1].abs().max() < 1e-6 * plain[:, -1].abs().max()  # a sink of 30 takes all the weight
    with pytest.raises(ValueError, match="one per query head"):
        kernel.paged_decode_attention(q, cache, tables, seq_lens, head_dim**-0.5, window, portable, sinks[:-1])
