"""The shared-memory all-reduce of CPU tensor parallelism, with two threads as the two ranks (the C++ wait
releases the GIL, so they run side by side as two processes would): sums and maxima equal torch's, in
pieces when a tensor outgrows a slot, on every rank alike; a gather hands rank 0 every rank's rows; a
waiting rank stops on abort and on timeout."""

from __future__ import annotations

import threading

import pytest
import torch

from waiting import wait_until

from parallel.shared_memory_all_reduce import SharedMemoryAllReduce, available, create_region

pytestmark = pytest.mark.skipif(not available(), reason="the shared-memory all-reduce needs a C++ compiler "
                                "(gloo's all-reduce is used instead)")


def ranks(capacity: int, timeout_s: float = 20.0):
    path = create_region(2, capacity)
    group = [SharedMemoryAllReduce(path, rank, 2, timeout_s, capacity=capacity) for rank in range(2)]
    path.unlink()  # both mapped: the name is no longer needed
    return group


def on_both(group, work) -> list:
    results: list = [None, None]
    errors: list[BaseException] = []

    def target(rank: int) -> None:
        try:
            results[rank] = work(rank, group[rank])
        except BaseException as error:  # handed to the test
            errors.append(error)

    threads = [threading.Thread(target=target, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors, errors
    return results


def test_sums_and_maxima_match_torch_in_pieces_on_every_rank():
    gen = torch.Generator().manual_seed(0)
    inputs = [[torch.randn(3, 50, generator=gen) for _ in range(4)] for _ in range(2)]  # 150 floats > a 64 slot

    def work(rank, reduce):
        out = []
        for i, x in enumerate(inputs[rank]):
            y = x.clone()
            out.append(reduce(y, take_max=i % 2 == 1))
        out.append(reduce(torch.empty(0, 576)))  # an empty step still keeps the ranks in step
        out.append(reduce(torch.full((70,), 2**30 - 1 + rank, dtype=torch.int32)))  # int32: exact, in pieces
        return out

    results = on_both(ranks(capacity=64), work)
    for i in range(4):
        want = torch.maximum(inputs[0][i], inputs[1][i]) if i % 2 else inputs[0][i] + inputs[1][i]
        assert torch.equal(results[0][i], want) and torch.equal(results[1][i], want)
    integers = torch.full((70,), 2**31 - 1, dtype=torch.int32)  # beyond float32's exact integers
    assert torch.equal(results[0][5], integers) and torch.equal(results[1][5], integers)


def test_a_gather_gives_rank_0_every_rank_rows_in_pieces_between_all_reduces():
    gen = torch.Generator().manual_seed(1)
    logits = [torch.randn(5, 24, generator=gen), torch.randn(5, 17, generator=gen)]  # 120 floats > a 64 slot

    def work(rank, group):
        first = group(torch.full((3,), float(rank + 1)))  # the gather shares the call count with all-reduces
        gathered = group.gather_columns(logits[rank], [24, 17])  # in pieces of 2 rows
        everywhere = group.gather_columns(logits[rank], [24, 17], everywhere=True)
        last = group(torch.full((2,), float(rank + 1)), take_max=True)
        return first, gathered, everywhere, last

    (first0, gathered0, all0, last0), (first1, gathered1, all1, last1) = on_both(ranks(capacity=64), work)
    want = torch.cat(logits, dim=1)
    assert torch.equal(gathered0, want) and gathered1 is None
    assert torch.equal(all0, want) and torch.equal(all1, want)
    assert torch.equal(first0, torch.full((3,), 3.0)) and torch.equal(first1, first0)
    assert torch.equal(last0, torch.full((2,), 2.0)) and torch.equal(last1, last0)


def test_a_waiting_rank_stops_on_abort_and_on_timeout():
    group = ranks(capacity=8, timeout_s=30)
    errors: list[str] = []

    def wait_alone() -> None:
        try:
            group[0](torch.ones(4))
        except RuntimeError as error:
            errors.append(str(error))

    thread = threading.Thread(target=wait_alone)
    thread.start()
    # Rank 0 publishes its arrival (call 1, the first counter of the header) and then waits for rank 1.
    wait_until(lambda: group[1].region[:8].view(torch.int64).item() == 1, what="rank 0 arrived")
    group[1].abort()  # what rank 0's monitor does when a worker dies
    thread.join(5)
    assert not thread.is_alive() and "aborted" in errors[0]

    lonely = ranks(capacity=8, timeout_s=0.3)[0]
    with pytest.raises(RuntimeError, match="did not arrive within 0 s"):  # its own 0.3 s, not the 30 s above
        lonely(torch.ones(4))
