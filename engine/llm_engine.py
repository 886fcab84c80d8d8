"""The synchronous engine: requests in, one step at a time, deltas out.

A step is: drop aborted requests, schedule, build tensors, run the model, sample, append tokens and
check stop conditions, release the blocks of finished requests. The offline `LLM` and the async engine
both drive this class; nothing in it is thread-safe, so the async engine calls it from one thread.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.backends.artifact import LoadedArtifact, load_artifact
from engine.block_manager import KVBlockManager
from engine.config import (EngineConfig, StateRows, fit_to_artifact, kv_budget, plan_kv_cache, plan_state_rows,
                           plan_window_kv_cache)
from engine.draft_model import DraftModelProposer
from engine.guide import GuideCompiler
from engine.guide_masks import GUIDE_FAILED, GuideMasker
from engine.image_cache import ImageCache, ImageEncoding
from engine.lora_manager import LoRAInUseError, LoRAManager
from engine.model_runner import ModelInputs, ModelRunner, PooledRows, ScoredRows
from engine.outputs import SampleDelta
from engine.request import FinishReason, Request
from engine.sampler import NON_FINITE_LOGITS, SAMPLING_FAILED, Sampler, compute_logprobs
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput, is_decode
from engine.speculative import NgramProposer, Proposer
from engine.state_cache import StateCache, boundaries
from engine.state_slots import StateSlots
from engine.stats import EngineStats
from engine.text_stream import TextStream
from engine.window_blocks import WindowedBlockManager
from model.chat_template import read_chat_template
from model.llama import LlamaForCausalLM
from model.loader import LoadedModel, load, return_freed_memory
from model.lora import LoRAAdapter, load_adapter
from model.lora_slots import LoRASlots
from model.pooling import POOLING_KINDS, Pooling
from model.precision import parse_kv_cache_dtype
from model.quantization import release_unpacked, resolve_quantization
from model.step import keeps_states, returns_hidden
from model.vision import EncodedImages, Vision, image_spans, joined
from parallel import tensor_parallel_model

if TYPE_CHECKING:
    from model.image_processor import ProcessedImage

log = logging.getLogger(__name__)

# The errors a request ends with when its own part of a step fails; the other requests of the step go on.
PREPARE_FAILED = "building this request's step inputs failed"
OUTPUT_FAILED = "turning this request's next token into text failed"
PROMPT_SCORING_FAILED = "computing this request's prompt log-probabilities failed"
POOLING_FAILED = "pooling this request's hidden states into an embedding failed"
REQUEST_FAILURES = frozenset({PREPARE_FAILED, OUTPUT_FAILED, NON_FINITE_LOGITS, SAMPLING_FAILED, GUIDE_FAILED,
                              PROMPT_SCORING_FAILED, POOLING_FAILED})


SCORED_LOGITS = 1 << 25  # float32 logits of prompt rows a step keeps for one request (128 MiB)


def scored_tokens_per_step(vocab_size: int) -> int:
    """Prompt tokens a request that scores its prompt runs per step: each is a row of logits, so their
    [rows, vocab] float32 (and its log-softmax) stay within SCORED_LOGITS floats; 16 at least."""
    return max(16, SCORED_LOGITS // max(vocab_size, 1))


def resolve_pooling(config: EngineConfig, declared: Pooling | None) -> Pooling:
    """The embedding rule: the engine's options over what the checkpoint declares, over last + normalize."""
    declared = declared or Pooling()
    kind = declared.kind if config.pooling == "auto" else config.pooling
    normalize = declared.normalize if config.embedding_normalize is None else config.embedding_normalize
    return Pooling(kind, normalize)


def set_kv_cache_dtype(loaded: LoadedModel, name: str) -> None:
    """`--kv-cache-dtype` on the model the engine serves (before its ranks start: they copy it). An eager model
    takes any; an artifact's graph was compiled for one cache dtype, and anything else is refused."""
    dtype = parse_kv_cache_dtype(name)
    module = loaded.module
    if isinstance(module, LlamaForCausalLM):
        module.kv_cache_dtype = dtype  # None (auto): the activations' dtype, whatever an earlier engine set
    elif dtype is not None and dtype != module.kv_cache_dtype:
        raise ValueError(f"--kv-cache-dtype {name}: this artifact's graph takes a "
                         f"{str(module.kv_cache_dtype).removeprefix('torch.')} KV cache, fixed when it was compiled")


@dataclass
class _Rows:
    """A step's sampled requests split by whether they speculate, as indexes into `sample_requests`, and
    their rows of the logits: a plain request's one row, a speculating request's every row."""

    plain: list[int]
    plain_rows: list[int]
    speculating: list[int]
    speculating_rows: list[int]


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        # A model the engine loads itself is its own: it keeps only what serving reads (`release_unpacked`).
        # One passed in stays whole: its caller may use it again (tensor-parallel shards, another engine).
        self._owns_model = loaded is None and config.artifact is None
        if loaded is None and config.artifact is not None:
            loaded = load_artifact(config.artifact, config.device)
        self.model = loaded or load(config.model, dtype=config.dtype, device=config.device,
                                    quantization=config.quantization, block_size=config.block_size,
                                    revision=config.revision, download_dir=config.download_dir,
                                    vision_dtype=config.vision_dtype, mmproj=config.mmproj,
                                    pan_and_scan=config.pan_and_scan)
        if isinstance(self.model, LoadedArtifact):
            config = fit_to_artifact(config, self.model.manifest.shapes)
        set_kv_cache_dtype(self.model, config.kv_cache_dtype)
        if config.tensor_parallel_size > 1:  # a model passed in is left whole: the ranks get copies
            self.model = tensor_parallel_model.start(self.model, config.tensor_parallel_size,
                                                     attention=config.tensor_parallel_attention)
        try:
            self._set_up(config)
        except BaseException:
            # Stop the workers and leave the group now: left to interpreter exit, the workers are killed
            # first and the group's teardown aborts the process ("terminate called ...", exit 134) after
            # the command line has printed its one-line error.
            self.model.module.close()
            raise

    def _set_up(self, config: EngineConfig) -> None:
        """Everything after the model (and its ranks) are up: cache, scheduler, runner, sampler."""
        self.config = config
        if self.model.module.block_size != config.block_size:
            raise ValueError(f"the model was built for block size {self.model.module.block_size}, "
                             f"the engine asks for {config.block_size}")
        self.tokenizer = self.model.tokenizer
        # A vision model's tower outputs by image: a chat sends its image again every turn.
        self.image_cache = ImageCache(config.image_cache_mib << 20)
        if config.chat_template is not None:
            if self.tokenizer is None:
                raise ValueError("--chat-template: this model has no tokenizer")
            self.tokenizer.set_chat_template(read_chat_template(config.chat_template))
        # What a request's sampling fields default to when it leaves them out (the server applies them).
        self.sampling_defaults = {}
        for name, value in (self.model.sampling_defaults if config.generation_config == "auto" else {}).items():
            try:
                SamplingParams(**{name: value})
                self.sampling_defaults[name] = value
            except ValueError as error:  # the model's file, not a request, is wrong: serve with ladder's default
                log.warning("generation_config.json: %s; ladder's default is used", error)
        if self.sampling_defaults:
            log.info("sampling defaults from the model's generation_config.json: %s", self.sampling_defaults)
        self.pooling = resolve_pooling(config, getattr(self.model, "pooling", None))
        module = self.model.module
        if self._owns_model and isinstance(module, LlamaForCausalLM):  # its int8 layers read their packed copies
            freed = release_unpacked(module)
            if freed:
                return_freed_memory()
                log.info("int8 weights kept in their kernels' layout only: %.0f MiB freed", freed / 2**20)
        # Linear-attention layers (Qwen3.5) keep a state per sequence that holds every token before it: a cached
        # prefix needs a snapshot of them (engine/state_cache.py), and no rejected draft can be taken back out.
        self.keeps_states = keeps_states(module)
        if self.keeps_states and (config.speculative_model is not None or config.speculative_tokens):
            raise ValueError(f"speculative decoding is not supported for {self.model.config.architecture}, whose "
                             "linear-attention states cannot take back rejected drafts")
        states = StateRows()
        if self.keeps_states:  # their rows first; fewer sequences run at once where their states would not fit
            states = plan_state_rows(config, self.model.config, kv_budget(config, module.device)[0])
            if states.running < config.max_num_seqs:
                log.info("linear-attention states for %d sequences at once (max_num_seqs %d): half the cache budget",
                         states.running, config.max_num_seqs)
                config = self.config = dataclasses.replace(config, max_num_seqs=states.running)
            log.info("linear-attention states: %d rows running, %d prefix-cache snapshots", states.running,
                     states.snapshots)
        num_window_blocks = None
        if isinstance(module, LlamaForCausalLM) and module.config.windowed_layers:
            # Sliding-window layers (Gemma 3's beside full ones, or every layer of a Mistral with a window), in
            # this process: they keep only their window.
            num_blocks, num_window_blocks, self.max_model_len = plan_window_kv_cache(
                config, self.model.config, module.kv_cache_dtype, module.device)
            self.blocks = WindowedBlockManager(num_blocks, num_window_blocks, config.block_size,
                                               self.model.config.sliding_window, config.enable_prefix_caching)
            log.info("KV cache: %d blocks for the full-attention layers, %d for the %d-token windows", num_blocks,
                     num_window_blocks, self.model.config.sliding_window)
        else:
            num_blocks, self.max_model_len = plan_kv_cache(config, self.model.config, module.kv_cache_dtype,
                                                           module.device, module.kv_pools, states)
            self.blocks = KVBlockManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                         module.kv_pools)
        original_context = self.model.config.rope_original_max_position_embeddings
        if isinstance(module, LlamaForCausalLM):
            module.fit_rotary_to(self.max_model_len)  # LongRoPE's factors for this context
        elif original_context is not None and self.max_model_len > original_context:
            raise ValueError(f"a context of {self.max_model_len} tokens takes LongRoPE's long factors, which only "
                             f"the model in one process switches to; lower --max-model-len to {original_context}")
        elif self.model.config.attention_temperature_beta and \
                self.max_model_len > (length := self.model.config.attention_temperature_length):
            raise ValueError(f"a context of {self.max_model_len} tokens takes Llama 4's attention temperature, which "
                             f"only the model in one process applies; lower --max-model-len to {length}")
        bound = config.max_prefill_tokens
        prefill_bound = bound if bound is not None and bound < config.max_num_batched_tokens else None
        scheduler_config = SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len,
                                           prefill_bound, scored_tokens_per_step(self.model.config.vocab_size))
        lora_slots = self._set_up_lora(config)
        # The linear-attention pools' rows: the running sequences' states, then the prefix cache's snapshots.
        self.state_cache = StateCache(states.running, states.snapshots) if states.snapshots else None
        self.scheduler = Scheduler(scheduler_config, self.blocks, self.lora,
                                   StateSlots(states.running) if states.running else None, self.state_cache)
        self.runner = ModelRunner(module, num_blocks, lora_slots, num_window_blocks, states.total)
        self.runner.warm_up()
        self.sampler = Sampler(config.seed)
        self.speculator = self._set_up_speculation(config)
        vocab = self.model.config.vocab_size
        self.guides = GuideCompiler(self.tokenizer, vocab) if self.tokenizer is not None else None
        self.masker = GuideMasker(vocab, self.guides)
        self.eos_token_ids = frozenset(self.tokenizer.stop_token_ids if self.tokenizer else self.model.config.eos_token_ids)
        self.requests: dict[str, list[Request]] = {}  # request id -> its samples
        self.streams: dict[Request, TextStream] = {}
        self.pending: list[SampleDelta] = []  # finished outside a step (rejected, aborted)
        self.stats = EngineStats()
        self.stats.observe_queue(self.scheduler, self.blocks)

    def _set_up_lora(self, config: EngineConfig) -> LoRASlots | None:
        """The LoRA slots on the model and the adapters named at start (None, and `lora` None, without)."""
        self.lora: LoRAManager | None = None
        if not config.lora_enabled:
            return None
        module = self.model.module
        if not isinstance(module, LlamaForCausalLM):
            raise ValueError(f"LoRA adapters run on the eager model in one process, not on {type(module).__name__}")
        if any(not hasattr(layer.mlp, "gate_up_proj") for layer in module.layers):
            raise ValueError("LoRA adapters need dense MLP layers; this model's are mixtures of experts")
        adapters = [load_adapter(path, self.model.config, name) for name, path in config.lora_modules]
        slots = LoRASlots.attach(module, config.max_loras, config.max_lora_rank)
        self.lora = LoRAManager(slots)
        for adapter in adapters:
            self.lora.add(adapter)
        return slots

    def _set_up_speculation(self, config: EngineConfig) -> Proposer:
        """The draft source: a draft model loaded like the served one (its own quantization chosen the same
        way), or prompt lookup."""
        if config.speculative_model is None:
            return NgramProposer(config.speculative_tokens, config.speculative_max_batch)
        quantization = resolve_quantization("auto", config.dtype, config.device, config.speculative_model)
        draft = load(config.speculative_model, dtype=config.dtype, device=config.device, quantization=quantization,
                     block_size=config.block_size)
        return DraftModelProposer(draft, self.model.config.vocab_size, self.max_model_len, config.speculative_tokens,
                                  config.speculative_max_batch)

    # -- LoRA adapters -------------------------------------------------------------------------

    def add_lora(self, adapter: LoRAAdapter) -> None:
        """Serve another adapter (read with `model.lora.load_adapter` for this model); ValueError when the
        engine has no LoRA slots, the name is taken, or its rank is over max_lora_rank."""
        if self.lora is None:
            raise ValueError("this engine serves no LoRA adapters (start it with --enable-lora or --lora-modules)")
        self.lora.add(adapter)

    def remove_lora(self, name: str) -> None:
        """Stop serving an adapter; KeyError when unknown, LoRAInUseError while requests use it."""
        if self.lora is None or name not in self.lora.adapters:
            raise KeyError(name)
        users = sum(1 for samples in self.requests.values() for s in samples if s.lora == name and not s.is_finished)
        if users:
            raise LoRAInUseError(f"LoRA adapter {name!r} is in use by {users} unfinished requests")
        self.lora.remove(name)

    # -- requests ------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    lora: str | None = None, pooling: str | None = None, images: EncodedImages | None = None,
                    ) -> None:
        """Queue a request; its n samples share the prompt's KV blocks through the prefix cache. `lora`: the
        name of a loaded adapter to run it with (None: the base model). `pooling` (model/pooling.py
        POOLING_KINDS) makes it an embedding request: its prompt runs, nothing is sampled (`params` apply
        only as far as n, which must be 1), and its last delta carries the pooled hidden state. `images`:
        the embeddings of the prompt's images (`encode_images`), one row per `<image>` token, in order."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if pooling is not None:
            self._check_embedding(pooling, params)
        if lora is not None and (self.lora is None or lora not in self.lora.adapters):
            raise ValueError(f"unknown LoRA adapter {lora!r}" if self.lora is not None else
                             "this engine serves no LoRA adapters (start it with --enable-lora or --lora-modules)")
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        if params.speculative_tokens and self.keeps_states:
            raise ValueError(f"speculative_tokens: {self.model.config.architecture}'s linear-attention states cannot "
                             "take back rejected drafts")
        vocab = self.model.config.vocab_size
        if not all(0 <= t < vocab for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if not all(0 <= t < vocab for t, _ in params.logit_bias):
            raise ValueError(f"logit_bias token ids must be in [0, {vocab})")
        image_positions = self._image_positions(prompt_token_ids, images)
        spans = image_spans(image_positions) if self.vision is not None and self.vision.bidirectional else []
        compiled = None
        if params.guide is not None:
            if self.guides is None:
                raise ValueError("this model has no tokenizer, so its output cannot follow a grammar")
            compiled = self.guides.compile(params.guide)  # cached: the server compiled it already
        salt = self.lora.cache_salt(lora) if lora is not None else b""
        streams = {}
        samples: list[Request] = []
        for index in range(params.n):
            seed = None if params.seed is None else params.seed + index
            sample = Request(f"{request_id}#{index}", list(prompt_token_ids), params.replace(seed=seed, n=1),
                             self.eos_token_ids, leader=samples[0] if samples else None,
                             parent_id=request_id, index=index,
                             matcher=compiled.matcher() if compiled is not None else None,
                             lora=lora, cache_salt=salt, pooling=pooling, image_positions=image_positions,
                             image_embeds=images.embeds if images is not None else None,
                             image_digest=images.digest if images is not None else b"",
                             image_spans=spans)
            streams[sample] = TextStream(self.tokenizer, params.stop, params.skip_special_tokens)
            samples.append(sample)
        self.requests[request_id] = samples
        self.streams.update(streams)
        for sample in samples:
            reason = self.scheduler.why_never_fits(sample)
            if reason is not None:
                self._finish(sample, FinishReason.ERROR, reason)
            else:
                self.scheduler.add(sample)

    @property
    def vision(self) -> Vision | None:
        """The model's vision tower and image processor (model/vision.py), or None: it takes no images."""
        return getattr(self.runner.module, "vision", None)

    def encode_images(self, images: Sequence[ProcessedImage]) -> EncodedImages:
        """The embeddings `add_request` takes for a prompt's images: the tower's, or those kept from an earlier
        request with the same image (`image_cache`). ValueError when the model takes no images."""
        encoding = self.start_encoding(images)
        self.advance_encoding(encoding, encoding.num_tiles)  # every tile at once
        return joined(images, encoding.result())

    def advance_encoding(self, encoding: ImageEncoding, max_tiles: int) -> None:
        """`encoding.advance(max_tiles)`, counted in the engine's stats (tiles, seconds, and the image cache's
        counts, also for an encoding the cache answered whole)."""
        started, before = time.perf_counter(), encoding.next_tile
        encoding.advance(max_tiles)
        self.stats.record_vision(self.image_cache, encoding.next_tile - before, time.perf_counter() - started)

    def start_encoding(self, images: Sequence[ProcessedImage]) -> ImageEncoding:
        """`encode_images` in pieces (`ImageEncoding.advance`), for a caller that runs steps between them."""
        if self.vision is None:
            raise ValueError(f"{self.model.name} takes no images")
        if not images:
            raise ValueError("no images to encode")
        return self.image_cache.start(images, self.vision.encoder, self.vision.encoder.config.tokens_per_tile)

    def _image_positions(self, prompt_token_ids: list[int], images: EncodedImages | None) -> list[int]:
        """Where the prompt's `<image>` tokens are, checked against the images' embeddings."""
        vision = self.vision
        if vision is None:
            if images is not None:
                raise ValueError(f"{self.model.name} takes no images")
            return []
        positions = [i for i, t in enumerate(prompt_token_ids) if t == vision.image_token_id]
        given = 0 if images is None else images.embeds.shape[0]
        if len(positions) != given:
            raise ValueError(f"the prompt has {len(positions)} image tokens and its images {given} embeddings")
        return positions

    @property
    def embeddings_unavailable(self) -> str | None:
        """Why this engine cannot pool hidden states into embeddings, or None."""
        if returns_hidden(self.runner.module):
            return None
        return ("embeddings need the eager model in one process, whose hidden states the engine reads; this "
                f"engine runs {type(self.runner.module).__name__}")

    def _check_embedding(self, pooling: str, params: SamplingParams) -> None:
        if pooling not in POOLING_KINDS:
            raise ValueError(f"unknown pooling {pooling!r} (choose from {', '.join(POOLING_KINDS)})")
        if params.n != 1 or params.guide is not None or params.prompt_logprobs is not None:
            raise ValueError("an embedding request samples nothing: n 1, no guide, no prompt_logprobs")
        if params.score_token_ids and pooling != "last":
            raise ValueError("score_token_ids are the next token's: they need the last token's pooling")
        if not all(0 <= t < self.model.config.vocab_size for t in params.score_token_ids):
            raise ValueError(f"score_token_ids must be in [0, {self.model.config.vocab_size})")
        if self.embeddings_unavailable is not None:
            raise ValueError(self.embeddings_unavailable)

    def abort(self, request_id: str) -> None:
        """Finish every sample of the request; blocks are released at the start of the next step."""
        for sample in self.requests.get(request_id, []):
            if not sample.is_finished:
                self._finish(sample, FinishReason.ABORT)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def close(self) -> None:
        """Release the model's workers, if any; the engine runs no more steps after."""
        self.masker.close()
        self.speculator.close()
        self.runner.module.close()

    # -- the step ------------------------------------------------------------------------------

    def step(self) -> list[SampleDelta]:
        started = time.perf_counter()
        self._release_finished()
        batch = self.scheduler.schedule(self._drafts())
        for sample in batch.rejected:
            self._finish(sample, FinishReason.ERROR, sample.error)
        scheduled_at = time.perf_counter()
        deltas = self.pending
        self.pending = []
        inputs = self._prepare(batch) if not batch.is_empty else None
        if inputs is not None:
            prepared_at = time.perf_counter()
            # Requests with drafts are verified (engine/speculative.py); the rest sample one token each.
            rows = self._row_split(inputs)
            plain = [inputs.sample_requests[i] for i in rows.plain]
            # The guided rows' masks are computed while the model runs (engine/guide_masks.py).
            pending_masks = self.masker.start([r.matcher for r in plain], [r.guide_opening for r in plain],
                                              [r.forced_token for r in plain])
            logits, hidden = self.runner.forward(inputs)
            if inputs.pooled:
                self._pool(hidden, inputs.pooled)
            if inputs.scored:  # prompt rows first (their logits as the model gave them), then the sampled rows
                self._score_prompts(logits, inputs.scored)
                logits = logits[inputs.sample_logit_rows]
            forward_at = time.perf_counter()
            masks = pending_masks.result() if pending_masks is not None else None
            plain_logits = logits if not inputs.speculates else logits[rows.plain_rows]
            sampled = self.sampler(plain_logits, plain, masks) if plain else None
            speculating = [inputs.sample_requests[i] for i in rows.speculating]
            drafts = [inputs.drafts[i] for i in rows.speculating]
            verified = self.sampler.verify(logits[rows.speculating_rows], speculating, drafts) if drafts else []
            sampled_at = time.perf_counter()
            self.stats.record_step(batch, len(inputs.sample_requests), scheduled_at - started,
                                   prepared_at - scheduled_at, forward_at - prepared_at, sampled_at - forward_at)
            self.stats.record_communication(self.runner.module.communication_seconds())
            self.scheduler.finish_step(batch)
            if self.state_cache is not None:
                self._keep_state_snapshots(batch)
            for part in inputs.pooled:
                if part.completes and not part.request.is_finished:
                    self._finish_embedding(part.request)
            for i, request in enumerate(plain):
                if request.is_finished:  # its prompt's scoring failed
                    continue
                error = sampled.error(i) or (masks.errors.get(i) if masks is not None else None)
                if error is None:
                    error = self._append(deltas, request, [sampled.token_ids[i]], [sampled.logprobs[i]])
                if error is not None:
                    self._finish(request, FinishReason.ERROR, error)
            for request, draft, outcome in zip(speculating, drafts, verified):
                error = outcome.error
                if error is None:
                    kept = len(outcome.token_ids) - 1
                    self.speculator.record(request, len(draft), kept)
                    self.stats.record_speculation(len(draft), kept)
                    request.num_computed_tokens += kept  # the kept drafts' keys and values are in the cache
                    error = self._append(deltas, request, outcome.token_ids, outcome.logprobs)
                    self.blocks.register_computed_blocks(request)
                if error is not None:
                    self._finish(request, FinishReason.ERROR, error)
        deltas.extend(self.pending)
        self.pending = []
        self._release_finished()
        self.stats.observe_queue(self.scheduler, self.blocks)
        return deltas

    def _score_prompts(self, logits: torch.Tensor, scored: tuple[ScoredRows, ...]) -> None:
        """Each scored prompt's log-probabilities from its rows of the step's logits, as the model gave them
        (no sampling parameter applies); a request whose scoring fails ends with an error, not the step."""
        for part in scored:
            request = part.request
            try:
                position = part.first_position
                targets = request.prompt_token_ids[position:position + part.count]
                rows = logits[part.first_row:part.first_row + part.count]
                entries = compute_logprobs(rows, targets, [request.params.prompt_logprobs] * part.count, ranks=True)
                request.prompt_scores.update(zip(range(position, position + part.count), entries, strict=True))
            except Exception:
                log.exception("scoring the prompt of request %s failed", request.request_id)
                self._finish(request, FinishReason.ERROR, PROMPT_SCORING_FAILED)

    def _pool(self, hidden: torch.Tensor, pooled: tuple[PooledRows, ...]) -> None:
        """Each embedding request's rows of the step's final hidden states, gathered into `Request.pooled`:
        a float64 running sum (mean), or the one row (last, cls); a failure ends that request alone."""
        for part in pooled:
            request = part.request
            if not part.count:
                continue
            try:
                rows = hidden[part.first_row:part.first_row + part.count]
                if request.pooling == "mean":
                    total = rows.double().sum(0)
                    request.pooled = total if request.pooled is None else request.pooled + total
                else:
                    request.pooled = rows[0].clone()
            except Exception:
                log.exception("pooling the hidden states of request %s failed", request.request_id)
                self._finish(request, FinishReason.ERROR, POOLING_FAILED)

    def _finish_embedding(self, request: Request) -> None:
        """An embedding request whose prompt has run: its pooled vector [hidden] float32 (mean: the sum over
        the prompt's tokens / their number), unnormalized, on its last delta; or, with
        params.score_token_ids, the next-token logits of those tokens."""
        pooled = request.pooled
        if pooled is None:  # cannot happen: its prompt's chunks each gave their rows
            self._finish(request, FinishReason.ERROR, POOLING_FAILED)
            return
        if request.pooling == "mean":
            pooled = pooled / request.num_prompt_tokens
        if request.params.score_token_ids:
            try:
                pooled = self.runner.module.token_logits(pooled, request.params.score_token_ids)
            except Exception:
                log.exception("scoring the next tokens of request %s failed", request.request_id)
                self._finish(request, FinishReason.ERROR, POOLING_FAILED)
                return
        request.finish(FinishReason.STOP)
        delta = self._delta(request, [], "", [])
        self.pending.append(dataclasses.replace(delta, embedding=pooled.float().cpu()))

    def _prepare(self, batch: SchedulerOutput) -> ModelInputs | None:
        """The step's inputs. If building them raises, each scheduled request is tried alone: the ones that
        fail alone end with an error and leave the batch, the rest run (None if none is left)."""
        try:
            return self.runner.prepare(batch)
        except Exception:
            log.exception("preparing a step of %d requests failed; trying each alone", len(batch.scheduled))
        kept = []
        for item in batch.scheduled:
            try:
                self.runner.prepare(SchedulerOutput(scheduled=[item]))
                kept.append(item)
            except Exception:
                log.exception("preparing request %s failed; it ends with an error", item.request.request_id)
                self._finish(item.request, FinishReason.ERROR, PREPARE_FAILED)
        batch.scheduled = kept  # finish_step must not count the dropped requests' tokens as computed
        return self.runner.prepare(batch) if kept else None

    def _keep_state_snapshots(self, output: SchedulerOutput) -> None:
        """Keep a copy of the linear-attention states of each prompt whose step ended at a boundary they are kept at
        (engine/state_cache.py), under the hash of the prefix's last block."""
        block_size = self.config.block_size
        copies = []
        for item in output.scheduled:
            request = item.request
            if request.num_computed_tokens in boundaries(request, block_size):  # (its blocks' hashes are known)
                snapshot = self.state_cache.keep(request.block_hashes[request.num_computed_tokens // block_size - 1])
                if snapshot is not None:
                    copies.append((request.state_slot, snapshot))
        self.runner.copy_states(copies)

    def _drafts(self) -> dict[Request, list[int]]:
        """Speculative drafts for the requests about to decode. Drafts only ever cost speed (the model
        verifies each), so a draft source that fails leaves this step without them, not the requests."""
        decoding = [r for r in self.scheduler.running if is_decode(r)]
        try:
            return self.speculator.propose(decoding, self.max_model_len)
        except Exception:
            log.exception("proposing speculative drafts failed; this step decodes without them")
            return {}

    @staticmethod
    def _row_split(inputs: ModelInputs) -> _Rows:
        """Which sampled requests speculate, and their rows of the step's logits."""
        if not inputs.speculates:
            every = list(range(len(inputs.sample_requests)))
            return _Rows(every, every, [], [])
        rows = _Rows([], [], [], [])
        start = 0
        for i, draft in enumerate(inputs.drafts):
            end = start + len(draft) + 1
            if draft:
                rows.speculating.append(i)
                rows.speculating_rows.extend(range(start, end))
            else:
                rows.plain.append(i)
                rows.plain_rows.append(start)
            start = end
        return rows

    def _append(self, deltas: list[SampleDelta], request: Request, token_ids: list[int], logprobs: list) -> str | None:
        """Append a step's tokens to the request and their delta to `deltas`; the error the request ends with
        when its text stream fails (its own failure), else None."""
        try:
            deltas.append(self._append_tokens(request, token_ids, logprobs))
            return None
        except Exception:
            log.exception("appending tokens to request %s failed", request.request_id)
            return OUTPUT_FAILED

    def _append_tokens(self, request: Request, token_ids: list[int], logprobs: list) -> SampleDelta:
        """Append tokens one at a time, checking the stop conditions after each: the ones after a stop are
        dropped. One delta for them all."""
        first = request.first_token_time is None
        if first:
            request.first_token_time = time.monotonic()
        stream = self.streams[request]
        params = request.params
        text = ""
        appended: list[int] = []
        for token_id, token_logprobs in zip(token_ids, logprobs):
            opening = request.guide_opening
            request.note_reasoning(token_id)
            appended.append(token_id)
            request.output_token_ids.append(token_id)
            if token_logprobs is not None:
                request.output_logprobs.append(token_logprobs)
            text += stream.push(token_id)
            reason = None
            guide_done = False
            if opening is not None and token_id == opening and not request.matcher.validate_tokens([token_id]):
                # The reply reasons first, and the grammar does not cover the block: it waits for its end.
                request.held_matcher, request.matcher = request.matcher, None
            elif request.held_matcher is not None:
                if token_id == params.reasoning.end_id:  # the reasoning ended: the guide holds from here
                    request.matcher, request.held_matcher = request.held_matcher, None
            elif request.matcher is not None:
                if not request.matcher.consume_token(token_id):
                    raise RuntimeError(f"the guide refused token {token_id}: {request.matcher.get_error()}")
                guide_done = request.matcher.is_stopped()  # complete: nothing but a stop token could follow
            if stream.stopped or guide_done:
                reason = FinishReason.STOP
            elif token_id in params.stop_token_ids or (token_id in request.eos_token_ids and not params.ignore_eos):
                reason = FinishReason.STOP
            elif len(request.output_token_ids) >= params.max_tokens or request.num_tokens >= self.max_model_len:
                reason = FinishReason.LENGTH
            if reason is not None:
                text += stream.finish()
                request.finish(reason)
                break
        kept_logprobs = [lp for lp in logprobs[:len(appended)] if lp is not None]
        delta = self._delta(request, appended, text, kept_logprobs)
        if first and request.params.prompt_logprobs is not None:  # the prompt's, complete before its first token
            delta = dataclasses.replace(delta, prompt_logprobs=request.prompt_logprobs)
        return delta

    def _finish(self, request: Request, reason: FinishReason, error: str | None = None) -> None:
        request.finish(reason, error)
        text = self.streams[request].finish() if reason is not FinishReason.ERROR else ""
        self.pending.append(self._delta(request, [], text, []))

    def _delta(self, request: Request, token_ids: list[int], text: str, logprobs: list) -> SampleDelta:
        return SampleDelta(request_id=request.parent_id, index=request.index, token_ids=token_ids, text=text,
                           logprobs=logprobs, num_prompt_tokens=request.num_prompt_tokens,
                           num_output_tokens=len(request.output_token_ids),
                           num_cached_tokens=request.num_cached_tokens, finish_reason=request.finish_reason,
                           error=request.error, num_reasoning_tokens=request.num_reasoning_output_tokens
                           if request.params.reasoning is not None else None)

    def _release_finished(self) -> None:
        self.scheduler.remove_finished()
        for request_id in [rid for rid, samples in self.requests.items() if all(s.is_finished for s in samples)]:
            for sample in self.requests.pop(request_id):
                self.streams.pop(sample, None)
                self.sampler.forget(sample.request_id)
                self.speculator.forget(sample.request_id)
                self.stats.record_finished(sample)
