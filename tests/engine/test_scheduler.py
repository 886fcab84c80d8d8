"""The continuous-batching scheduler without a model: budgets, caps, fairness, preemption, rejection.

A fake "model" appends one token to every request whose tokens are all computed, as the engine does.
"""

from __future__ import annotations

import random

import pytest

from engine.block_manager import KVBlockManager
from engine.request import FinishReason, Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig


def make(num_blocks=64, block_size=4, max_num_seqs=8, max_tokens_per_step=32, max_model_len=256, prefix=True):
    blocks = KVBlockManager(num_blocks, block_size, prefix)
    return Scheduler(SchedulerConfig(max_num_seqs, max_tokens_per_step, max_model_len), blocks)


def run(scheduler: Scheduler, requests: list[Request], max_steps: int = 10_000) -> list:
    """Drive to completion; check invariants every step; return the plans."""
    for r in requests:
        scheduler.add(r)
    plans = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished():
            return plans
        plan = scheduler.schedule()
        plans.append(plan)
        assert plan.num_tokens <= scheduler.config.max_num_batched_tokens
        assert len(scheduler.running) <= scheduler.config.max_num_seqs
        ids = [s.request.request_id for s in plan.scheduled]
        assert len(ids) == len(set(ids))
        for item in plan.scheduled:
            r = item.request
            assert r.num_computed_tokens + item.num_new_tokens <= len(r.block_ids) * scheduler.blocks.block_size
        scheduler.finish_step(plan)
        for item in plan.scheduled:
            r = item.request
            if r.num_computed_tokens == r.num_tokens:
                r.output_token_ids.append(7)
                if len(r.output_token_ids) >= r.params.max_tokens:
                    r.finish(FinishReason.LENGTH)
        scheduler.remove_finished()
        used = sum(1 for c in scheduler.blocks.ref_counts if c > 0)
        assert used + scheduler.blocks.num_free_blocks == scheduler.blocks.num_blocks
    raise AssertionError("did not finish")


def req(rid: str, prompt_len: int, max_tokens: int, seed: int = 0) -> Request:
    rng = random.Random(seed)
    return Request(rid, [rng.randrange(1000) for _ in range(prompt_len)], SamplingParams(max_tokens=max_tokens))


def test_every_request_finishes_and_blocks_balance():
    sched = make()
    requests = [req(str(i), 5 + 7 * i % 40, 3 + i % 9, seed=i) for i in range(30)]
    run(sched, requests)
    assert all(r.finish_reason is FinishReason.LENGTH for r in requests)
    assert all(len(r.output_token_ids) == r.params.max_tokens for r in requests)
    assert sched.blocks.num_free_blocks == sched.blocks.num_blocks
    assert all(c == 0 for c in sched.blocks.ref_counts)


def test_decodes_go_first_and_long_prompts_are_chunked():
    sched = make(max_tokens_per_step=16)
    short = req("short", 4, 20)
    sched.add(short)
    plan = sched.schedule()
    sched.finish_step(plan)
    short.output_token_ids.append(1)
    sched.add(req("long", 100, 2))
    plan = sched.schedule()
    assert [(s.request.request_id, s.num_new_tokens) for s in plan.scheduled] == [("short", 1), ("long", 15)]


def test_first_come_first_served_admission():
    sched = make(max_num_seqs=2)
    requests = [req(str(i), 4, 2, seed=i) for i in range(5)]
    plans = run(sched, requests)
    first_step = {}
    for step, plan in enumerate(plans):
        for item in plan.scheduled:
            first_step.setdefault(item.request.request_id, step)
    order = sorted(first_step, key=first_step.get)
    assert order == [str(i) for i in range(5)]


def test_preemption_under_a_tiny_cache_and_everyone_finishes():
    sched = make(num_blocks=8, block_size=4, max_num_seqs=8, max_model_len=32)
    requests = [req(str(i), 6, 10, seed=i) for i in range(6)]  # each grows to 16 tokens = 4 blocks
    run(sched, requests)
    assert sched.num_preemptions > 0
    assert all(len(r.output_token_ids) == 10 for r in requests)
    assert any(r.num_preemptions for r in requests)
    # The oldest request is never the victim while a younger one runs.
    assert requests[0].num_preemptions == 0


def test_never_fitting_request_is_rejected_with_a_reason():
    sched = make(num_blocks=4, block_size=4, max_model_len=1000)
    too_big = req("big", 10, 20)  # 30 tokens > 16 slots in the whole cache
    ok = req("ok", 4, 4)
    plans = run(sched, [too_big, ok])
    assert too_big.finish_reason is FinishReason.ERROR and "KV cache" in too_big.error
    assert ok.finish_reason is FinishReason.LENGTH
    assert any(too_big in p.rejected for p in plans)


def test_too_long_for_max_model_len_is_rejected():
    sched = make(max_model_len=16)
    r = req("long", 10, 10)
    run(sched, [r])
    assert r.finish_reason is FinishReason.ERROR and "max_model_len (16)" in r.error


@pytest.mark.parametrize("seed", range(5))
def test_random_workloads_hold_every_invariant(seed):
    rng = random.Random(seed)
    sched = make(num_blocks=rng.randint(12, 40), block_size=rng.choice([2, 4, 8]),
                 max_num_seqs=rng.randint(1, 6), max_tokens_per_step=rng.randint(4, 40), max_model_len=64)
    requests = [req(str(i), rng.randint(1, 30), rng.randint(1, 20), seed=seed * 100 + i) for i in range(25)]
    run(sched, requests)
    finished_ok = [r for r in requests if r.finish_reason is FinishReason.LENGTH]
    for r in finished_ok:
        assert len(r.output_token_ids) == r.params.max_tokens
    assert all(r.is_finished for r in requests)
    assert sched.blocks.num_free_blocks == sched.blocks.num_blocks


def test_samples_wait_for_their_leader_and_share_prompt_blocks():
    sched = make(block_size=4)
    leader = req("a#0", 13, 3)
    sample = Request("a#1", list(leader.prompt_token_ids), leader.params, leader=leader)
    sched.add(leader)
    sched.add(sample)
    plan = sched.schedule()
    assert [s.request.request_id for s in plan.scheduled] == ["a#0"]
    sched.finish_step(plan)
    leader.output_token_ids.append(1)
    plan = sched.schedule()
    assert {s.request.request_id: s.num_new_tokens for s in plan.scheduled} == {"a#0": 1, "a#1": 1}
    assert sample.num_cached_tokens == 12
    assert sample.block_ids[:3] == leader.block_ids[:3]


def test_prompts_share_a_smaller_budget_while_requests_decode():
    """Decodes first: with max_prefill_tokens, a burst of prompts is admitted a chunk at a time while every
    decoding request still advances each step; with nothing decoding, a prompt gets the whole budget."""
    blocks = KVBlockManager(256, 4, True)
    sched = Scheduler(SchedulerConfig(16, 64, 256, max_prefill_tokens=12), blocks)
    first = req("first", 40, 50)
    sched.add(first)
    plan = sched.schedule()  # nothing decodes yet: the whole 64-token budget
    assert [(s.request.request_id, s.num_new_tokens) for s in plan.scheduled] == [("first", 40)]
    sched.finish_step(plan)
    first.output_token_ids.append(7)
    burst = [req(f"b{i}", 10, 5, seed=i) for i in range(6)]
    for r in burst:
        sched.add(r)
    admitted_steps = []
    for _ in range(12):
        plan = sched.schedule()
        by_id = {s.request.request_id: s.num_new_tokens for s in plan.scheduled}
        assert by_id.get("first") == 1  # the decode runs every step
        assert sum(n for rid, n in by_id.items() if rid != "first" and n > 1) <= 12
        admitted_steps.append(sorted(rid for rid, n in by_id.items() if rid != "first" and n > 1))
        sched.finish_step(plan)
        for s in plan.scheduled:
            if s.request.num_computed_tokens == s.request.num_tokens:
                s.request.output_token_ids.append(7)
    # 6 prompts of 10 tokens through a 12-token prefill budget: spread over several steps, oldest first.
    started = [rid for step in admitted_steps for rid in step]
    assert len([s for s in admitted_steps if s]) >= 5
    assert [rid for i, rid in enumerate(started) if rid not in started[:i]] == [f"b{i}" for i in range(6)]


def make_pooled(num_blocks=16, block_size=4, max_num_seqs=8, max_model_len=32):
    blocks = KVBlockManager(num_blocks, block_size, True, num_pools=2)
    return Scheduler(SchedulerConfig(max_num_seqs, 64, max_model_len), blocks)


def test_pools_take_turns_and_a_prefix_holder_wins_a_near_tie():
    scheduler = make_pooled()
    shared = list(range(100, 108))  # two full blocks
    requests = [Request(str(i), shared + [i], SamplingParams(max_tokens=2)) for i in range(4)]
    plans = run(scheduler, requests[:1])  # pool 0 computes the prefix
    assert requests[0].kv_pool == 0 and plans
    for r in requests[1:]:
        scheduler.add(r)
    scheduler.schedule()
    # Pool 0 is empty again and holds the prefix: the first goes there, the next to pool 1 (pool 0 now
    # one request heavier, which the prefix evens out: a tie broken by the hit), then pool 1 leads.
    assert [r.kv_pool for r in requests[1:]] == [0, 0, 1]
    assert [r.num_cached_tokens for r in requests[1:]] == [8, 8, 0]


def test_a_full_pool_preempts_its_own_newest_request():
    scheduler = make_pooled(num_blocks=8, block_size=4)  # 4 blocks a pool
    a = Request("a", list(range(6)), SamplingParams(max_tokens=10, ignore_eos=True))  # up to 4 blocks
    b = Request("b", list(range(50, 56)), SamplingParams(max_tokens=2))
    c = Request("c", list(range(80, 85)), SamplingParams(max_tokens=10, ignore_eos=True))
    for r in (a, b, c):
        scheduler.add(r)
    plan = scheduler.schedule()
    assert [r.kv_pool for r in (a, b, c)] == [0, 1, 0]
    preempted = []
    while scheduler.has_unfinished() and not preempted:
        scheduler.finish_step(plan)
        for item in plan.scheduled:
            if item.request.num_computed_tokens == item.request.num_tokens:
                item.request.output_token_ids.append(1)
        plan = scheduler.schedule()
        preempted = plan.preempted
    assert preempted == [c]  # pool 0 ran out; b, in pool 1, was never a victim
    assert b.num_preemptions == 0 and a.num_preemptions == 0


def test_a_request_longer_than_a_pool_is_refused_with_the_pool_named():
    scheduler = make_pooled(num_blocks=8, block_size=4, max_model_len=64)
    reason = scheduler.why_never_fits(Request("long", list(range(10)), SamplingParams(max_tokens=10)))
    assert reason is not None and "a pool of the cache (one rank's) holds 16" in reason


class OneSlot:
    """The LoRA slot holder of engine/lora_manager.py, without tensors: one slot."""

    max_loras, max_rank = 1, 16

    def load(self, slot, adapter) -> None:
        pass

    def clear(self, slot) -> None:
        pass


def test_a_request_whose_adapter_has_no_slot_waits_and_the_ones_behind_it_go_first():
    from engine.lora_manager import LoRAManager
    from model.lora import LoRAAdapter

    adapters = LoRAManager(OneSlot())
    for name in ("a", "b"):
        adapters.add(LoRAAdapter(name, None, 4, {}))
    sched = Scheduler(SchedulerConfig(8, 64, 256), KVBlockManager(64, 4), adapters)
    first, other, same = req("first", 6, 5), req("other", 6, 5, seed=1), req("same", 6, 5, seed=2)
    first.lora, other.lora, same.lora = "a", "b", "a"
    for r in (first, other, same):
        sched.add(r)
    plan = sched.schedule()
    assert [s.request.request_id for s in plan.scheduled] == ["first", "same"]  # "other" waits for the slot
    assert list(sched.waiting) == [other] and adapters.pins == [2]
    sched.finish_step(plan)
    run(sched, [])  # drive everything to the end: "other" gets the slot once both "a" requests finish
    assert all(r.finish_reason is FinishReason.LENGTH for r in (first, other, same))
    assert adapters.pins == [0] and adapters.resident == ["b"] and adapters.num_loads == 2
