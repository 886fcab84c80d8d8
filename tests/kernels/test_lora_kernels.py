"""The multi-LoRA kernels (kernels/lora.py) against the per-adapter torch reference: the C++ CPU kernel
(rows without an adapter copied bit for bit, a row's result the same alone and in any batch, its portable
loop equal to its AVX2 tiles), the Triton kernels (interpreted on a machine without CUDA, so tiny), and
the wrapper's argument checks; each also with `splits` (a fused projection's parts, b read only inside
each part's columns)."""

from __future__ import annotations

import pytest
import torch

from kernel_checks import DEVICE, DTYPES, assert_matches, poisoned_allocations

from kernels import lora
from kernels.runtime import HAS_TRITON, TRITON_IMPORT_ERROR

needs_cpp = pytest.mark.skipif(lora.load() is None, reason="the C++ CPU kernels could not be built here (a C++ "
                               "compiler and ninja are needed); the torch reference is used instead")
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason=f"triton is not importable ({TRITON_IMPORT_ERROR})")


def _case(t: int, k: int, n: int, rank: int, slots: int = 4, seed: int = 0, device: str = "cpu",
          dtype: torch.dtype = torch.float32):
    """(y, x, a, b, rows): random rows over slots -1 .. slots - 1, with both a -1 and a slot once t >= 2."""
    gen = torch.Generator().manual_seed(seed * 1000 + t * 7 + k + n + rank)
    y, x = torch.randn(t, n, generator=gen), torch.randn(t, k, generator=gen)
    a = torch.randn(slots, rank, k, generator=gen) / k**0.5
    b = torch.randn(slots, rank, n, generator=gen) / rank**0.5
    rows = torch.randint(-1, slots, (t,), generator=gen)
    if t >= 2:
        rows[0], rows[-1] = -1, slots - 1
    tensors = [v.to(device=device, dtype=dtype) for v in (y, x, a, b)]
    return (*tensors, rows.to(device))


def _poison_outside_parts(b: torch.Tensor, splits: list[int]) -> torch.Tensor:
    """b with NaN wherever a part's rank rows meet another part's columns (entries never to be read)."""
    b = b.clone()
    parts = len(splits) - 1
    per_part = b.shape[1] // parts
    for p in range(parts):
        ranks = slice(p * per_part, (p + 1) * per_part)
        b[:, ranks, :splits[p]] = float("nan")
        b[:, ranks, splits[p + 1]:] = float("nan")
    return b


def _block_diagonal(b: torch.Tensor, splits: list[int]) -> torch.Tensor:
    """b with zeros where _poison_outside_parts puts NaN: the same product without splits."""
    poisoned = _poison_outside_parts(b, splits)
    return torch.where(poisoned.isnan(), torch.zeros_like(b), b)


# (K, N, R, splits): uneven parts, some narrower than a vector or a tile; qkv's; gate_up's (smaller N).
SPLIT_CASES = [(100, 96, 24, [0, 64, 80, 96]), (40, 45, 6, [0, 3, 20, 45]), (576, 960, 48, [0, 576, 768, 960]),
               (200, 1536, 32, [0, 768, 1536])]


# --- The C++ CPU kernel --------------------------------------------------------------------------

@needs_cpp
@pytest.mark.parametrize("k,n", [(100, 72), (576, 960)], ids=str)
@pytest.mark.parametrize("rank", [8, 16])
@pytest.mark.parametrize("t", [1, 5, 37, 128])
def test_cpp_matches_the_reference(t, rank, k, n):
    y, x, a, b, rows = _case(t, k, n, rank)
    out = lora.lora_add(y, x, a, b, rows)
    torch.testing.assert_close(out, lora.lora_add_ref(y, x, a, b, rows), rtol=1e-5, atol=1e-5)
    none = rows < 0
    assert torch.equal(out[none], y[none])  # rows without an adapter: y bit for bit
    assert torch.equal(lora.lora_add(y, x, a, b, rows, portable=True), out)  # the portable loop: the same sums


@needs_cpp
@pytest.mark.parametrize("k,n", [(100, 72), (576, 960)], ids=str)
def test_cpp_row_is_the_same_alone_and_in_any_batch(k, n):
    """Bit for bit: alone, in a mixed batch, among 40 rows of its own adapter (other tiles, packed weights),
    shuffled, and on one thread."""
    y, x, a, b, rows = _case(45, k, n, 16, slots=5)
    rows[5:45] = 2  # a group of 40 rows of one slot: whole units, 4-row tiles and a remainder
    batch = lora.lora_add(y, x, a, b, rows)
    for t in range(0, 45, 4):
        assert torch.equal(lora.lora_add(y[t:t + 1], x[t:t + 1], a, b, rows[t:t + 1])[0], batch[t]), t
    perm = torch.randperm(45, generator=torch.Generator().manual_seed(1))
    assert torch.equal(lora.lora_add(y[perm], x[perm], a, b, rows[perm]), batch[perm])
    mixed = rows.clone()
    mixed[5:45:2] = 3
    assert torch.equal(lora.lora_add(y, x, a, b, mixed)[rows == mixed], batch[rows == mixed])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(lora.lora_add(y, x, a, b, rows), batch)
    finally:
        torch.set_num_threads(threads)


@needs_cpp
def test_cpp_rows_without_adapters_return_y():
    y, x, a, b, _ = _case(9, 100, 72, 8)
    y[0, 0] = -0.0  # -0.0 + 0.0 would be +0.0: the row must be copied, not summed
    rows = torch.full((9,), -1, dtype=torch.int64)
    out = lora.lora_add(y, x, a, b, rows)
    assert torch.equal(out, y) and out.data_ptr() != y.data_ptr()
    assert torch.signbit(out[0, 0])
    empty = lora.lora_add(y[:0], x[:0], a, b, rows[:0])
    assert empty.shape == (0, 72)


@needs_cpp
def test_cpp_rejects_a_slot_out_of_range():
    y, x, a, b, rows = _case(3, 100, 72, 8, slots=4)
    rows[1] = 4
    with pytest.raises(ValueError, match=r"rows\[1\] = 4 is not a slot in -1 .. 3"):
        lora.lora_add(y, x, a, b, rows)


@needs_cpp
@pytest.mark.parametrize("case", SPLIT_CASES, ids=lambda c: str(c[3]))
@pytest.mark.parametrize("t", [1, 6, 40])
def test_cpp_splits_match_the_reference_and_never_read_outside_the_parts(t, case):
    k, n, rank, splits = case
    y, x, a, b, rows = _case(t, k, n, rank)
    if t == 40:
        rows[3:30] = 1  # a group of one slot: packed weights, 4-row tiles
    poisoned = _poison_outside_parts(b, splits)
    ref = lora.lora_add_ref(y, x, a, poisoned, rows, splits)
    assert not ref.isnan().any()  # the reference never reads outside the parts either
    torch.testing.assert_close(ref, lora.lora_add_ref(y, x, a, _block_diagonal(b, splits), rows), rtol=1e-5,
                               atol=1e-5)  # the block-diagonal b without splits: the same product
    out = lora.lora_add(y, x, a, poisoned, rows, splits)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    none = rows < 0
    assert torch.equal(out[none], y[none])
    assert torch.equal(lora.lora_add(y, x, a, poisoned, rows, splits, portable=True), out)
    assert torch.equal(lora.lora_add(y, x, a, b, rows, tuple(splits)), out)  # what lies outside: no matter


@needs_cpp
def test_cpp_splits_row_is_the_same_alone_and_in_any_batch():
    k, n, rank, splits = SPLIT_CASES[2]
    y, x, a, b, rows = _case(45, k, n, rank, slots=5)
    rows[5:45] = 2
    batch = lora.lora_add(y, x, a, b, rows, splits)
    for t in range(0, 45, 11):
        assert torch.equal(lora.lora_add(y[t:t + 1], x[t:t + 1], a, b, rows[t:t + 1], splits)[0], batch[t]), t
    perm = torch.randperm(45, generator=torch.Generator().manual_seed(1))
    assert torch.equal(lora.lora_add(y[perm], x[perm], a, b, rows[perm], splits), batch[perm])
    mixed = rows.clone()
    mixed[5:45:2] = 3
    assert torch.equal(lora.lora_add(y, x, a, b, mixed, splits)[rows == mixed], batch[rows == mixed])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(lora.lora_add(y, x, a, b, rows, splits), batch)
    finally:
        torch.set_num_threads(threads)


def test_one_part_splits_are_no_splits():
    y, x, a, b, rows = _case(7, 24, 16, 8)
    out = lora.lora_add(y, x, a, b, rows)
    assert torch.equal(lora.lora_add(y, x, a, b, rows, [0, 16]), out)
    assert torch.equal(lora.lora_add_ref(y, x, a, b, rows, [0, 16]), lora.lora_add_ref(y, x, a, b, rows))


def test_other_cpu_dtypes_use_the_reference():
    y, x, a, b, rows = _case(5, 24, 16, 4, dtype=torch.bfloat16)
    assert torch.equal(lora.lora_add(y, x, a, b, rows), lora.lora_add_ref(y, x, a, b, rows))


def test_the_wrapper_rejects_bad_arguments():
    y, x, a, b, rows = _case(4, 24, 16, 8)
    with pytest.raises(ValueError, match="same rank R"):
        lora.lora_add(y, x, a, b[:, :4], rows)
    with pytest.raises(ValueError, match="same number of slots"):
        lora.lora_add(y, x, a, b[:2], rows)
    with pytest.raises(ValueError, match="same number of rows"):
        lora.lora_add(y, x[:3], a, b, rows)
    with pytest.raises(ValueError, match="x's K"):
        lora.lora_add(y, x[:, :20], a, b, rows)
    with pytest.raises(ValueError, match="one float dtype"):
        lora.lora_add(y, x.double(), a, b, rows)
    with pytest.raises(ValueError, match="rows must be int64"):
        lora.lora_add(y, x, a, b, rows.int())
    with pytest.raises(ValueError, match=r"y \[T, N\]"):
        lora.lora_add(y[0], x, a, b, rows)


@pytest.mark.parametrize("splits,match", [
    ([0, 10, 8, 16], "strictly increasing"), ([0, 8, 8, 16], "strictly increasing"), ([1, 8, 16], "from 0 to N"),
    ([0, 8, 15], "from 0 to N"), ([0, 8, 20], "from 0 to N"), ([0], "from 0 to N"), ([], "from 0 to N"),
    ([0, 5, 10, 16], "divisible"),
])
def test_the_wrapper_rejects_bad_splits(splits, match):
    y, x, a, b, rows = _case(4, 24, 16, 8)  # N 16, R 8
    with pytest.raises(ValueError, match=match):
        lora.lora_add(y, x, a, b, rows, splits)


# --- The Triton kernels --------------------------------------------------------------------------

@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 40, 24, 8), (3, 150, 140, 20)], ids=str)  # (T, K, N, R): one block; several
def test_triton_matches_the_reference(shape, dtype):
    from kernels.lora import lora_add_triton

    t, k, n, rank = shape
    y, x, a, b, rows = _case(t, k, n, rank, slots=3, device=DEVICE, dtype=dtype)
    with poisoned_allocations():
        out = lora_add_triton(y, x, a, b, rows)
    assert_matches(out, lora.lora_add_ref(y, x, a, b, rows))
    none = rows < 0
    assert torch.equal(out[none], y[none])


@needs_triton
def test_triton_row_is_the_same_alone_and_in_a_batch():
    from kernels.lora import lora_add_triton

    y, x, a, b, rows = _case(6, 40, 24, 8, slots=3, device=DEVICE)
    batch = lora_add_triton(y, x, a, b, rows)
    for t in (1, 4):
        assert torch.equal(lora_add_triton(y[t:t + 1], x[t:t + 1], a, b, rows[t:t + 1])[0], batch[t])


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_splits_match_the_reference_and_never_read_outside_the_parts(dtype):
    """Uneven parts that blocks of columns straddle (N 140: blocks of 128), b NaN outside the parts."""
    from kernels.lora import lora_add_triton

    splits = [0, 100, 130, 140]
    y, x, a, b, rows = _case(4, 40, 140, 12, slots=3, device=DEVICE, dtype=dtype)
    poisoned = _poison_outside_parts(b, splits)
    with poisoned_allocations():
        out = lora_add_triton(y, x, a, poisoned, rows, splits)
    assert_matches(out, lora.lora_add_ref(y, x, a, poisoned, rows, splits))
    none = rows < 0
    assert torch.equal(out[none], y[none])
    for t in (1, 3):
        assert torch.equal(lora_add_triton(y[t:t + 1], x[t:t + 1], a, poisoned, rows[t:t + 1], splits)[0], out[t])
    with pytest.raises(ValueError, match="at most 4 parts"):
        lora_add_triton(y, x, a[:, :10], b[:, :10], rows, [0, 20, 40, 60, 100, 140])
