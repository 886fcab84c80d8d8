"""State slots (engine/state_slots.py): a Qwen3.5-shaped model's running sequences each keep their own
linear-attention state, through chunked prompts, preemption and recompute, beside others in any batch; and the
prefix cache of such a model (engine/state_cache.py): snapshots of the states at a prompt's last block boundary,
which a later prompt with that prefix starts from."""

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
from engine.state_cache import StateCache, checkpoint
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
    outputs = llm.generate(prompts, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outputs] == alone
    assert sorted(llm.engine.scheduler.states.free) == [0, 1, 2]
    # Snapshots in the rows after the running sequences', one per prompt with a block boundary before its end.
    assert set(llm.engine.state_cache.cached.values()) <= {3, 4, 5}


def test_the_state_cache_keeps_the_least_recently_used_last():
    cache = StateCache(first_slot=4, num_snapshots=2)
    assert [checkpoint(n, 16) for n in (1, 16, 17, 33, 48)] == [0, 0, 16, 32, 32]
    assert cache.keep(b"a") == 4 and cache.keep(b"b") == 5 and cache.keep(b"a") is None  # one per prefix
    assert cache.find(b"a") == 4  # now the most recent: "b" goes first
    assert cache.keep(b"c") == 5 and cache.find(b"b") is None and list(cache.cached) == [b"a", b"c"]
    assert StateCache(first_slot=2, num_snapshots=0).keep(b"a") is None


def test_a_prompt_ends_a_chunk_at_its_snapshot_boundary():
    """The scheduler stops a prompt's chunk at the last block boundary before its last token, so the states there
    can be kept; without a state cache the chunk runs on."""
    for cache, first in ((StateCache(2, 2), 32), (None, 40)):
        scheduler = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64),
                              KVBlockManager(8, 16), states=StateSlots(2), state_cache=cache)
        scheduler.add(Request("r", list(range(40)), SamplingParams(max_tokens=4)))
        assert [item.num_new_tokens for item in scheduler.schedule().scheduled] == [first]


def test_a_later_turn_starts_from_the_earlier_turns_states(qwen3_5):
    """A chat's second turn holds the first one's prompt: it starts from the states kept at that prompt's last
    block boundary (96 of its 100 tokens) and answers as an engine without a prefix cache does; the same prompt
    again starts there too. With two snapshot rows, later prompts' snapshots evict the least recently used."""
    directory, _ = qwen3_5
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    cached = LLM(str(directory), max_num_seqs=2, kv_cache_memory_gib=0.01)
    plain = LLM(str(directory), max_num_seqs=2, kv_cache_memory_gib=0.01, enable_prefix_caching=False)
    blocks = cached.engine.blocks

    def run(ids: list[int]) -> tuple[list[int], int]:
        """The reply's tokens, and the prompt tokens the prefix cache gave it."""
        before = blocks.prefix_hits
        out = cached.generate([ids], params)[0]
        return list(out.outputs[0].token_ids), blocks.prefix_hits - before

    first = prompt(100, seed=1)
    reply, hit = run(first)
    assert hit == 0
    second = first + reply + prompt(30, seed=2)
    answer, hit = run(second)
    assert hit == 96 and cached.engine.state_cache.hits == 1
    assert answer == list(plain.generate([second], params)[0].outputs[0].token_ids)
    assert run(first) == (reply, 96)
    for seed in (3, 4):  # two other prompts' snapshots evict the two kept (the second turn's, then the first's)
        run(prompt(50, seed=seed))
    assert run(first) == (reply, 0)


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


def test_states_take_at_most_half_the_budget_and_snapshots_a_quarter():
    """Qwen3.5-0.8B's shapes (19.3 MB of states a sequence) in the CPU default's 2 GiB: 53 sequences at once, not the
    64 asked, and 26 snapshots; without prefix caching none; a budget that holds no state is a one-line error."""
    from engine.config import GIB, EngineConfig, plan_state_rows, state_bytes
    from model.config import ModelConfig

    config = ModelConfig.from_hf({"model_type": "qwen3_5_text", "hidden_size": 1024, "intermediate_size": 3584,
                                  "num_hidden_layers": 24, "num_attention_heads": 8, "num_key_value_heads": 2,
                                  "head_dim": 256, "vocab_size": 248320, "linear_num_key_heads": 16,
                                  "linear_num_value_heads": 16})
    assert state_bytes(config, 1) == 18 * (3 * 6144 + 16 * 128 * 128) * 4
    rows = plan_state_rows(EngineConfig(max_num_seqs=64), config, 2 * GIB)
    assert (rows.running, rows.snapshots) == (53, 26)
    assert plan_state_rows(EngineConfig(max_num_seqs=8), config, 2 * GIB).total == 16
    assert plan_state_rows(EngineConfig(enable_prefix_caching=False), config, 2 * GIB).snapshots == 0
    with pytest.raises(ValueError, match="more than half the cache budget"):
        plan_state_rows(EngineConfig(), config, 30 * 2**20)


def test_requests_under_load_each_get_what_they_get_alone(qwen3_5):
    """Thirty greedy requests arriving over the steps, many sharing prefixes (the prefix cache's snapshots), some
    with n = 2, some aborted midway, in a cache small enough to preempt and three sequences at a time: every
    request that finishes has the tokens its prompt gives alone, and every slot and snapshot row is free or
    cached at the end."""
    import random

    from engine.llm_engine import LLMEngine

    directory, loaded = qwen3_5
    engine = LLMEngine(__import__("engine.config", fromlist=["EngineConfig"]).EngineConfig(
        model=str(directory), max_num_seqs=3, max_num_batched_tokens=40, kv_cache_memory_gib=0.00025,
        max_model_len=200), loaded=loaded)
    rng = random.Random(0)
    stems = [prompt(n, seed=100 + n) for n in (40, 90, 140)]
    requests = {}
    for i in range(30):
        ids = rng.choice(stems)[:rng.randint(20, 140)] + prompt(rng.randint(1, 40), seed=i)
        requests[f"r{i}"] = (ids, rng.choice([1, 1, 2]), rng.random() < 0.15)
    tokens: dict[str, list[list[int]]] = {rid: [[] for _ in range(n)] for rid, (_, n, _) in requests.items()}
    finished: set[tuple[str, int]] = set()
    pending = list(requests.items())
    for step in range(2000):
        for _ in range(rng.randint(0, 2)):
            if pending:
                rid, (ids, n, _) = pending.pop(0)
                engine.add_request(rid, ids, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, n=n))
        for rid, (_, _, abort) in requests.items():
            if abort and step == 3 * int(rid[1:]) + 2:
                engine.abort(rid)
        for delta in engine.step():
            tokens[delta.request_id][delta.index].extend(delta.token_ids)
            if delta.finished and delta.finish_reason.value == "length":
                finished.add((delta.request_id, delta.index))
        if not pending and not engine.has_unfinished():
            break
    assert engine.scheduler.num_preemptions > 0 and engine.state_cache.hits > 0
    assert len(finished) > 30
    for rid, index in finished:
        ids = requests[rid][0]
        assert tokens[rid][index] == [s.token_id for s in Generator(loaded.module, 200).generate(ids, 10)], rid
    assert sorted(engine.scheduler.states.free) == [0, 1, 2]


def test_conversations_sharing_a_system_prompt_keep_its_states(qwen3_5):
    """Three conversations with one 70-token system prompt, each its own message: the first computes everything;
    the second finds the prompt's KV blocks (64 tokens) but no snapshot there, so its chunk ends at 64 and the
    states there are kept; the third starts from them, and answers as an engine without a prefix cache does."""
    directory, _ = qwen3_5
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    cached = LLM(str(directory), max_num_seqs=2, kv_cache_memory_gib=0.01)
    plain = LLM(str(directory), max_num_seqs=2, kv_cache_memory_gib=0.01, enable_prefix_caching=False)
    system = prompt(70, seed=5)
    blocks = cached.engine.blocks
    hits = []
    for seed in (6, 7, 8):
        ids = system + prompt(20, seed=seed)
        before = blocks.prefix_hits
        out = cached.generate([ids], params)[0].outputs[0].token_ids
        hits.append((blocks.prefix_hits - before, cached.engine.state_cache.hits))
        assert out == plain.generate([ids], params)[0].outputs[0].token_ids
    assert hits == [(0, 0), (0, 0), (64, 1)]
