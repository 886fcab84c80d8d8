"""Tensor parallelism over 2 ranks on this CPU (gloo): the same greedy tokens as one process, batch
invariance and preemption under the split, a killed worker reported as a 503, a size the model cannot
be split into refused with one line.

Two 2-rank engines are started once each (a worker process costs seconds to start): a tiny Qwen2 in W8A8
(the quantized linears, q/k/v biases and an LM head apart from the tied embedding), and the default model
in float32 (30 layers, 3 KV heads over 2 ranks: the uneven split). The last test kills the default
engine's worker, so it runs last in this file.
"""

from __future__ import annotations

import os
import signal
import threading

import httpx
import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.async_engine import ENGINE_WORKER_LOST, AsyncLLMEngine
from engine.config import bytes_per_block
from ladder.cli import main as ladder_main
from parallel.row_parallel_w8a8 import RowParallelW8A8
from parallel.tensor_parallel_model import TensorParallelModel
from server.app import ServerSettings, ServerState
from greedy_checks import count_near_ties
from in_process_server import InProcessServer
from waiting import wait_until

NUM_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=2)


def run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[tuple[list, list]]:
    """Every prompt together: per prompt (tokens, logprobs)."""
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    out: dict[str, list] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for delta in engine.step():
            out[delta.request_id].append(delta)
    return [([t for d in deltas for t in d.token_ids], [lp for d in deltas for lp in d.logprobs])
            for deltas in out.values()]


def run_alone(engine: LLMEngine, prompts: list[list[int]]) -> list[tuple[list, list]]:
    return [run(engine, [prompt])[0] for prompt in prompts]


def assert_same_tokens(reference: list[tuple[list, list]], got: list[tuple[list, list]]) -> int:
    """The existing near-tie rule: a divergence only where the reference's best two logprobs are within
    1e-3. Returns how many prompts diverged so."""
    return count_near_ties(reference, [tokens for tokens, _ in got], NUM_TOKENS)


def tiny_prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(3, 320, (n,), generator=generator).tolist() for n in (9, 17, 24, 31, 38, 12, 45, 20)]


@pytest.fixture(scope="module")
def qwen2_dir(tiny_hf_dir):
    return tiny_hf_dir("qwen2")


@pytest.fixture(scope="module")
def tiny_w8a8(qwen2_dir):
    directory = qwen2_dir
    with pytest.MonkeyPatch.context() as patch:  # the SmoothQuant calibration cache stays in the test's tree
        patch.setenv("LADDER_CACHE_DIR", str(directory.parent / "cache"))
        from model.loader import load

        return load(directory, quantization="w8a8")


def tiny_engine(loaded, tensor_parallel_size: int, attention: str = "heads") -> LLMEngine:
    """A cache of 8 blocks of 16 tokens (split by sequences: 4 a rank): the longest prompt fits alone,
    the 8 prompts together do not."""
    per_block = bytes_per_block(loaded.config, 16, torch.float32)
    return LLMEngine(EngineConfig(kv_cache_memory_gib=8 * per_block / 2**30, max_model_len=64, max_num_seqs=8,
                                  tensor_parallel_size=tensor_parallel_size, tensor_parallel_attention=attention),
                     loaded=loaded)


@pytest.fixture(scope="module")
def tiny_reference(tiny_w8a8):
    return run_alone(tiny_engine(tiny_w8a8, 1), tiny_prompts())


@pytest.fixture(scope="module")
def tiny_tp(tiny_w8a8):
    engine = tiny_engine(tiny_w8a8, 2)
    yield engine
    engine.close()
    assert all(worker.exitcode is not None for worker in engine.runner.module.workers)  # none left behind


def test_two_ranks_give_one_process_tokens_on_a_tiny_w8a8_model(tiny_tp, tiny_reference):
    module = tiny_tp.runner.module
    assert isinstance(module, TensorParallelModel) and module.size == 2
    assert [len(r) for r in module.layout.kv_heads] == [1, 1]
    assert module.shard.layers[0].self_attn.qkv_proj.out_features == (2 + 2 * 1) * 16  # 2 q heads, 1 k, 1 v
    assert tiny_tp.runner.kv_caches[0].shape[3] == 1  # this rank's KV heads only
    # W8A8 on 2 ranks is one process bit for bit (integer sums across ranks, the whole o_proj on each):
    # the same tokens and the very same logprobs, no near-tie rule needed.
    assert run_alone(tiny_tp, tiny_prompts()) == tiny_reference
    assert isinstance(module.shard.layers[0].mlp.down_proj, RowParallelW8A8)
    assert module.shard.layers[0].mlp.down_proj.linear.in_features == 64  # its half of the MLP's columns
    assert module.shard.layers[0].self_attn.o_proj.in_features == 2 * 2 * 16  # whole: every head's columns


def test_a_gguf_whose_embedding_stays_its_blocks_splits_across_ranks(tmp_path):
    """Under W8A8 a GGUF's token embedding stays the file's Q8_0 rows (model/block_embedding.py); the ranks
    take it as the floats it holds, and two ranks give one process's tokens and logprobs bit for bit."""
    import transformers
    from tiny_models import hf_config, write_gguf

    from model.loader import load

    torch.manual_seed(0)
    write_gguf(transformers.AutoModelForCausalLM.from_config(hf_config("llama3")).eval(), tmp_path / "m.gguf", "Q8_0")
    with pytest.MonkeyPatch.context() as patch:  # the SmoothQuant calibration cache stays in the test's tree
        patch.setenv("LADDER_CACHE_DIR", str(tmp_path / "cache"))
        loaded = load(tmp_path / "m.gguf", quantization="w8a8")
    assert type(loaded.module.embed_tokens).__name__ == "BlockEmbedding"
    prompts = tiny_prompts()[:3]
    reference = run_alone(tiny_engine(loaded, 1), prompts)
    engine = tiny_engine(loaded, 2)
    try:
        assert run_alone(engine, prompts) == reference
    finally:
        engine.close()


def test_batch_with_preemption_gives_each_prompt_its_tokens_alone(tiny_tp, tiny_reference):
    preemptions = tiny_tp.stats.num_preemptions
    batched = run(tiny_tp, tiny_prompts())
    assert tiny_tp.stats.num_preemptions > preemptions
    # Batch invariance on 2 ranks (a preempted prompt is computed again by prefill: tokens, not bits).
    assert assert_same_tokens(run_alone(tiny_tp, tiny_prompts()), batched) == 0
    assert tiny_tp.blocks.num_free_blocks == tiny_tp.blocks.num_blocks
    seconds = tiny_tp.stats.snapshot()["communication"]
    assert seconds["all_reduce"] > 0 and seconds["gather"] > 0 and seconds["broadcast"] > 0
    # W8A8: the down_proj scales' maxima, and the attention output gathered for the whole o_proj
    assert seconds["all_reduce_max"] > 0 and seconds["all_gather"] > 0


@pytest.fixture(scope="module")
def tiny_by_sequences(tiny_w8a8):
    engine = tiny_engine(tiny_w8a8, 2, "sequences")
    yield engine
    engine.close()
    assert all(worker.exitcode is not None for worker in engine.runner.module.workers)


def test_attention_split_by_sequences_gives_one_process_bits(tiny_by_sequences, tiny_reference):
    engine = tiny_by_sequences
    module = engine.runner.module
    assert module.kv_pools == 2 and engine.blocks.num_pools == 2 and engine.blocks.pool_size == 4
    attention = module.shard.layers[0].self_attn.attention
    assert attention.qkv_proj.out_features == (4 + 2 * 2) * 16  # every head on every rank
    assert engine.runner.kv_caches[0].shape[1:4] == (4, 16, 2)  # rank 0's pool: 4 blocks, both KV heads
    # Alone, each prompt runs on one rank's attention while both split the MLP: one process, bit for bit.
    assert run_alone(engine, tiny_prompts()) == tiny_reference
    # Together, the prompts spread over both pools, a full pool preempts its own requests, and each
    # prompt's tokens are its tokens alone (after a preemption, recomputed: tokens, not bits).
    preemptions = engine.stats.num_preemptions
    batched = run(engine, tiny_prompts())
    assert engine.stats.num_preemptions > preemptions
    assert assert_same_tokens(tiny_reference, batched) == 0
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    seconds = engine.stats.snapshot()["communication"]
    assert seconds["all_gather"] > 0 and seconds["all_reduce"] > 0 and seconds["gather"] > 0


def test_split_by_sequences_finds_a_prefix_in_its_own_pool(tiny_by_sequences, tiny_reference):
    engine = tiny_by_sequences
    prompt = tiny_prompts()[6]  # 45 tokens: two full blocks to find again
    assert run(engine, [prompt]) == [tiny_reference[6]]
    for _ in range(2):  # with both pools idle, the one holding the prompt's two full blocks takes it
        hits = engine.blocks.prefix_hits
        assert run(engine, [prompt]) == [tiny_reference[6]]
        assert engine.blocks.prefix_hits - hits == 32


def test_sequences_driven_without_an_engine_keep_each_sequence_in_one_pool(tiny_by_sequences, tiny_w8a8):
    """model/sequences.py (generate, perplexity) gives a pooled model's sequences one pool each."""
    from model.sequences import Sequences

    prompts = tiny_prompts()[:3]
    split = Sequences(tiny_by_sequences.runner.module, 3, 48).step(prompts)
    whole = Sequences(tiny_w8a8.module, 3, 48).step(prompts)
    assert torch.equal(split, whole)


def test_an_engine_that_fails_after_starting_its_ranks_stops_them(tiny_w8a8):
    """A KV cache too small for max_model_len is found after the workers started: they stop at once."""
    import multiprocessing

    before = set(multiprocessing.active_children())
    per_block = bytes_per_block(tiny_w8a8.config, 16, torch.float32)
    with pytest.raises(ValueError, match="fewer than max_model_len=64"):
        LLMEngine(EngineConfig(kv_cache_memory_gib=2 * per_block / 2**30, max_model_len=64, tensor_parallel_size=2),
                  loaded=tiny_w8a8)
    assert not set(multiprocessing.active_children()) - before


def test_every_rank_takes_the_kv_cache_dtype(tiny_w8a8):
    """--kv-cache-dtype bfloat16 reaches the worker ranks: each holds its heads in a bfloat16 cache, and W8A8 on
    2 ranks is still one process bit for bit (a rank on a float32 cache would round other keys)."""
    per_block = bytes_per_block(tiny_w8a8.config, 16, torch.bfloat16)

    def engine(size: int) -> LLMEngine:
        return LLMEngine(EngineConfig(kv_cache_memory_gib=8 * per_block / 2**30, max_model_len=64, max_num_seqs=8,
                                      tensor_parallel_size=size, kv_cache_dtype="bfloat16"), loaded=tiny_w8a8)

    try:
        alone = run_alone(engine(1), tiny_prompts())
        split = engine(2)
        try:
            assert split.runner.kv_caches[0].dtype == torch.bfloat16 and split.blocks.num_blocks == 8
            assert run_alone(split, tiny_prompts()) == alone
        finally:
            split.close()
    finally:
        tiny_w8a8.module.kv_cache_dtype = None  # the other tests' float32 cache


def test_a_size_the_heads_cannot_take_is_refused_in_one_line(qwen2_dir, capsys):
    code = ladder_main(["generate", "hi", "--model", str(qwen2_dir), "--tensor-parallel-size", "3",
                        "--quantization", "none", "--device", "cpu"])
    err = capsys.readouterr().err.strip()
    assert code == 1 and "\n" not in err, err
    assert err.startswith("ladder generate: error: --tensor-parallel-size 3 exceeds the model's 2 KV heads")


# -- the default model ---------------------------------------------------------------------------------

TEXTS = ["What is the capital of France?", "Write a haiku about the sea.", "def add(a, b):\n    return",
         "List three primary colours."]


@pytest.fixture(scope="module")
def default_prompts(default_model):
    tok = default_model.tokenizer
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}]), add_special_tokens=False)
            for t in TEXTS]


def default_engine(loaded, tensor_parallel_size: int) -> LLMEngine:
    return LLMEngine(EngineConfig(kv_cache_memory_gib=0.05, max_model_len=512, max_num_seqs=8,
                                  tensor_parallel_size=tensor_parallel_size), loaded=loaded)


@pytest.fixture(scope="module")
def default_tp(default_model):
    engine = default_engine(default_model, 2)
    yield engine
    engine.close()
    assert all(worker.exitcode is not None for worker in engine.runner.module.workers)


def test_two_ranks_give_one_process_tokens_on_the_default_model(default_model, default_prompts, default_tp):
    assert [len(r) for r in default_tp.runner.module.layout.kv_heads] == [1, 2]  # 3 KV heads: rank 0 has less
    reference = run(default_engine(default_model, 1), default_prompts)
    assert assert_same_tokens(reference, run(default_tp, default_prompts)) <= 1
    assert default_model.module.layers[0].self_attn.num_heads == 9  # the model passed in is left whole


def test_a_killed_worker_turns_the_server_to_503_with_a_clear_error(default_tp):
    """Runs last: it ends the default engine's group. A request in flight when the worker dies gets a 503
    (no hang), health turns 503, new requests are refused, and shutting down leaves no process behind."""
    state = ServerState(ServerSettings())
    state.attach(AsyncLLMEngine(default_tp, step_timeout=None))
    server = InProcessServer(state)
    try:
        metrics = httpx.get(server.url + "/metrics").text  # the parity test's steps: communication measured
        share = [line for line in metrics.splitlines()
                 if line.startswith('ladder_tensor_parallel_communication_share{op="all_reduce"}')]
        assert len(share) == 1 and 0 < float(share[0].split()[-1]) < 1
        worker = default_tp.runner.module.workers[0]
        answers: list[httpx.Response] = []
        body = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True}
        request = threading.Thread(target=lambda: answers.append(
            httpx.post(server.url + "/v1/completions", json=body, timeout=60)))
        request.start()
        wait_until(lambda: state.engine.num_in_flight > 0 and default_tp.stats.num_steps >= 3, what="steps running")
        os.kill(worker.pid, signal.SIGKILL)
        request.join(30)
        assert not request.is_alive()
        assert answers[0].status_code == 503
        error = answers[0].json()["error"]
        assert error["message"] == ENGINE_WORKER_LOST and error["type"] == "service_unavailable"
        assert "rank 1" in state.engine.dead_reason and "SIGKILL" in state.engine.dead_reason
        assert httpx.get(server.url + "/health").status_code == 503
        after = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        assert after.status_code == 503
    finally:
        server.stop()
    assert worker.exitcode == -signal.SIGKILL
