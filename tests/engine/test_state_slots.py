"""State slots (engine/state_slots.py): a Qwen3.5-shaped model's running sequences each keep their own
linear-attention state, through chunked prompts, preemption and recompute, beside others in any batch."""

from __future__ import annotations

import pytest
import torch
from tiny_models import QWEN3_5, make_hf_model

import model
from engine.block_manager import KVBlockManager
from engine.llm import LLM
from engine.request import FinishReason, Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig
from engine.state_slots import StateSlots
from model.generator import Generator


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(0, 320, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_slots_are_held_while_running_and_given_back_at_preemption_and_the_end():
    slots = StateSlots(2)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64),
                          KVBlockManager(6, 4, enable_prefix_caching=False), states=slots)
    requests = [Request(f"r{i}", list(range(8)), SamplingParams(max_tokens=12)) for i in range(3)]
    for request in requests:
        scheduler.add(request)
    preempted = 0
    for _ in range(200):
        if not scheduler.has_unfinished():
            break
        plan = scheduler.schedule()
        preempted += len(plan.preempted)
        running = [r.state_slot for r in scheduler.running]
        assert all(slot >= 0 for slot in running) and len(set(running)) == len(running)
        assert all(r.state_slot == -1 for r in scheduler.waiting)
        scheduler.finish_step(plan)
        for item in plan.scheduled:
            request = item.request
            if request.num_computed_tokens == request.num_tokens:
                request.output_token_ids.append(7)
                if len(request.output_token_ids) >= request.params.max_tokens:
                    request.finish(FinishReason.LENGTH)
        scheduler.remove_finished()
    assert not scheduler.has_unfinished() and preempted  # 6 blocks of 4 cannot hold two 20-token sequences
    assert sorted(slots.free) == [0, 1] and all(r.state_slot == -1 for r in requests)
    with pytest.raises(ValueError, match="cannot serve"):
        Scheduler(SchedulerConfig(max_num_seqs=3), KVBlockManager(6, 4), states=slots)


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen3_5")
    make_hf_model(QWEN3_5, directory)
    return directory, model.load(directory)


def test_the_engine_gives_each_sequence_its_own_state(qwen3_5):
    """Eight greedy requests through three sequences at a time, prompts in chunks of up to 48 tokens and a cache
    small enough to preempt: each output is the one its prompt gives alone."""
    directory, loaded = qwen3_5
    prompts = [prompt(n, seed=n) for n in (5, 70, 1, 33, 130, 17, 9, 64)]
    alone = [[s.token_id for s in Generator(loaded.module, 160).generate(p, 20)] for p in prompts]
    llm = LLM(str(directory), max_num_seqs=3, max_num_batched_tokens=48, kv_cache_memory_gib=0.0002,
              max_model_len=160)
    assert not llm.engine.config.enable_prefix_caching  # a state holds every token before it: no prefix reuse
    outputs = llm.generate(prompts, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outputs] == alone
    assert sorted(llm.engine.scheduler.states.free) == [0, 1, 2]


def test_speculative_decoding_is_refused_for_linear_attention(qwen3_5):
    directory, _ = qwen3_5
    with pytest.raises(ValueError, match="cannot take back rejected drafts"):
        LLM(str(directory), speculative_tokens=3, kv_cache_memory_gib=0.01)
    llm = LLM(str(directory), kv_cache_memory_gib=0.01)
    with pytest.raises(ValueError, match="speculative_tokens"):
        llm.engine.add_request("x", [1, 2, 3], SamplingParams(max_tokens=2, speculative_tokens=2))


def test_a_linear_attention_draft_model_is_refused(qwen3_5, tmp_path):
    directory, _ = qwen3_5
    make_hf_model("qwen3", tmp_path / "served")  # the same 320-token vocabulary
    with pytest.raises(ValueError, match="draft model with linear-attention layers"):
        LLM(str(tmp_path / "served"), speculative_model=str(directory), kv_cache_memory_gib=0.01)
