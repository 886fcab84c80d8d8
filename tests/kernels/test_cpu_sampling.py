"""The C++ draw of rows without filters against its torch reference: the same token up to float32
rounding at a boundary, never a token without mass, NaN rows reported, bad arguments refused."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_sampling
from kernels.cpu_sampling import FLOAT32_MAX, sample_rows, sample_rows_ref

pytestmark = pytest.mark.skipif(not cpu_sampling.available(), reason="the CPU kernels could not be built here "
                                "(a C++ compiler and ninja are needed); the torch reference is used instead")

BELOW_ONE = 1.0 - 2.0**-53  # the largest double below 1


def weights(x: torch.Tensor, t: float) -> torch.Tensor:
    """The reference's weights of one row, float64."""
    z = (x / t).clamp(-FLOAT32_MAX, FLOAT32_MAX)
    d = z - z.max()
    return torch.where(d >= cpu_sampling.FLUSH, d.exp(), torch.zeros_like(d)).double()


def assert_same_draw(x: torch.Tensor, t: float, u: float, ours: int, reference: int) -> None:
    """Equal tokens, or both sides of a boundary that u * total lies on within float32 rounding."""
    if t == 0 or ours == reference:
        assert ours == reference
        return
    w = weights(x, t)
    assert w[ours] > 0, "a token without mass was drawn"
    running = w.cumsum(0)
    target = u * float(running[-1])
    boundary = float(running[min(ours, reference)])  # the sum up to the lower token, where the two draws part
    assert abs(boundary - target) <= 1e-5 * float(running[-1]), (ours, reference, boundary, target)


@pytest.mark.parametrize("vocab", [1, 7, 255, 256, 257, 1000, 49152])
def test_draws_match_the_reference(vocab):
    gen = torch.Generator().manual_seed(vocab)
    rows = 12
    logits = torch.randn(rows, vocab, generator=gen) * 4
    temperature = [0.0, 1.0, 0.7, 2.0, 1e-3, 0.05, 1.0, 1.0, 0.0, 1.5, 1.0, 0.3]
    uniform = [float(u) for u in torch.rand(rows, generator=gen, dtype=torch.float64)]
    uniform[6], uniform[7] = 0.0, BELOW_ONE
    ours, reference = sample_rows(logits, temperature, uniform), sample_rows_ref(logits, temperature, uniform).tolist()
    for i in range(rows):
        assert_same_draw(logits[i], temperature[i], uniform[i], ours[i], reference[i])
    # A row's token is its own: the same alone as in the batch.
    assert [sample_rows(logits[i:i + 1], temperature[i:i + 1], uniform[i:i + 1])[0] for i in range(rows)] == ours


def test_many_draws_agree_with_the_reference():
    """A thousand draws over the default model's vocabulary size: at most a handful on a boundary."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(1, 49152, generator=gen) * 3
    uniform = [float(u) for u in torch.rand(1000, generator=gen, dtype=torch.float64)]
    differ = 0
    for u in uniform:
        ours, reference = sample_rows(logits, [1.0], [u])[0], int(sample_rows_ref(logits, [1.0], [u])[0])
        assert_same_draw(logits[0], 1.0, u, ours, reference)
        differ += ours != reference
    assert differ <= 3


def test_a_grid_of_uniform_numbers_follows_the_distribution():
    """Uniform numbers evenly spread over [0, 1) land on each token in proportion to its probability."""
    logits = torch.tensor([[2.0, 0.0, -1.0, float("-inf"), 1.0, -30.0]])
    n = 20000
    tokens = [sample_rows(logits, [1.0], [(i + 0.5) / n])[0] for i in range(n)]
    counts = torch.bincount(torch.tensor(tokens), minlength=6).double()
    expected = torch.softmax(logits[0].double(), dim=0) * n
    assert counts[3] == 0  # -inf: no mass
    assert (counts - expected).abs().max() <= 1.0


def test_forbidden_and_infinite_logits():
    ninf, inf = float("-inf"), float("inf")
    logits = torch.tensor([[0.0, 0.0, ninf, ninf],  # the top of u lands on the last token with mass
                           [ninf, ninf, ninf, ninf],  # all forbidden: greedy 0, sampled uniform over all
                           [1.0, inf, 2.0, inf],  # +inf: the first at greedy, the +inf tokens share the mass
                           [1.0, inf, 2.0, inf]])
    assert sample_rows(logits, [1.0, 0.0, 0.0, 1.0], [BELOW_ONE, 0.5, 0.5, 0.4]) == [1, 0, 1, 1]
    assert sample_rows(logits[1:2], [1.0], [0.9]) == [3]
    assert sample_rows(logits[3:], [1.0], [0.6]) == [3]


def test_nan_rows_are_reported_and_tiny_temperatures_are_greedy():
    logits = torch.randn(3, 300, generator=torch.Generator().manual_seed(2))
    logits[1, 17] = float("nan")
    tokens = sample_rows(logits, [1.0, 1.0, 1e-45], [0.5, 0.5, 0.5])
    assert tokens[1] == -1
    assert tokens[2] == int(logits[2].argmax())
    assert sample_rows_ref(logits, [1.0, 1.0, 1e-45], [0.5, 0.5, 0.5]).tolist()[1:] == tokens[1:]


def test_strided_rows_and_bad_arguments():
    wide = torch.randn(4, 600, generator=torch.Generator().manual_seed(3))
    rows = wide[:, :500]  # each row contiguous, rows 600 apart
    assert sample_rows(rows, [0.0] * 4, [0.5] * 4) == rows.argmax(dim=1).tolist()
    with pytest.raises(RuntimeError, match="temperature must be finite and >= 0"):
        sample_rows(rows, [-1.0] * 4, [0.5] * 4)
    with pytest.raises(RuntimeError, match=r"uniform numbers lie in \[0, 1\)"):
        sample_rows(rows, [1.0] * 4, [1.0] * 4)
    with pytest.raises(RuntimeError, match="one temperature and one uniform number per row"):
        sample_rows(rows, [1.0], [0.5])
    with pytest.raises(RuntimeError, match="rows contiguous"):
        sample_rows(wide.t(), [1.0] * 600, [0.5] * 600)


def test_a_large_vocabulary_split_over_the_threads():
    """Gemma 3's 262,144 tokens (plus one, so the last block and part are short) run as parts of one row:
    the first maximum across parts, and draws as the reference's."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 262_145, generator=gen) * 3
    logits[0, [200_000, 20_000]] = 40.0  # a tie in two parts: the first index wins
    logits[1, 262_144] = 50.0  # the maximum in the last, one-logit block
    assert sample_rows(logits, [0.0, 0.0, 0.0], [0.5] * 3) == [20_000, 262_144, int(logits[2].argmax())]
    uniform = [float(u) for u in torch.rand(3, generator=gen, dtype=torch.float64)]
    ours, reference = sample_rows(logits, [1.0] * 3, uniform), sample_rows_ref(logits, [1.0] * 3, uniform).tolist()
    for i in range(3):
        assert_same_draw(logits[i], 1.0, uniform[i], ours[i], reference[i])
    assert ours[1] == 262_144  # all the mass there
