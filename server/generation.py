"""From validated OpenAI requests to engine requests, and from engine deltas to OpenAI responses."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from engine.async_engine import (
    ENGINE_DIED,
    ENGINE_HUNG,
    ENGINE_WORKER_LOST,
    STEP_FAILED,
    AsyncLLMEngine,
    EngineDeadError,
)
from engine.guide import Guide
from engine.llm_engine import REQUEST_FAILURES
from engine.outputs import SampleDelta
from engine.request import FinishReason, TokenLogprobs
from engine.sampling_params import SamplingParams
from model.tokenizer import Tokenizer
from model.vision import EncodedImages
from server import protocol as p
from server.errors import APIError, sse_error
from server.harmony import HarmonyReasoning, HarmonySplit
from server.reasoning import Reasoning, ReasoningSplit
from server.tool_calls import ToolCallStream, parse_tool_calls
from server.tool_use import ToolUse

ENGINE_FAILED = "the engine failed while running this request"
ENGINE_STOPPED = "the engine has stopped after an internal error"  # it died before this request started


@dataclass(frozen=True)
class Prompt:
    token_ids: list[int]
    text: str  # for echo
    images: EncodedImages | None = None  # the embeddings of its `<image>` tokens (a chat's images)


@dataclass
class Job:
    """One HTTP request: its prompts, their shared sampling parameters, and how to report."""

    request_id: str
    prompts: list[Prompt]
    params: SamplingParams
    model_name: str
    num_top_logprobs: int | None  # None: no logprobs in the response
    lora: str | None = None  # the LoRA adapter it runs with (None: the base model)
    # max_tokens 0 with echo: the engine makes one token (it always samples one), which the response leaves
    # out: the prompt alone, "length", no completion tokens.
    prompt_only: bool = False
    num_prompt_logprobs: int | None = None  # vLLM's prompt_logprobs: so many alternatives (None: not asked)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(x.token_ids) for x in self.prompts)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sampling_params(body: p._Request, max_tokens: int, logprobs: int | None, guide: Guide | None = None,
                    defaults: dict | None = None) -> SamplingParams:
    """The engine's parameters for a request; a sampling field it leaves out takes `defaults` (the model's
    generation_config.json), then ladder's own default."""
    defaults = defaults or {}

    def given(name: str, builtin):
        value = getattr(body, name)
        return value if value is not None else defaults.get(name, builtin)

    try:
        return SamplingParams(
            n=body.n, max_tokens=max_tokens, min_tokens=min(body.min_tokens, max_tokens),
            temperature=given("temperature", 1.0), top_p=given("top_p", 1.0), top_k=given("top_k", 0) or 0,
            min_p=given("min_p", 0.0), presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=given("repetition_penalty", 1.0),
            seed=None if body.seed is None else body.seed % 2**63, stop=body.stop_list,
            ignore_eos=body.ignore_eos, logprobs=logprobs, skip_special_tokens=body.skip_special_tokens,
            stop_token_ids=tuple(body.stop_token_ids or ()),
            logit_bias={int(token): bias for token, bias in (body.logit_bias or {}).items()}, guide=guide,
            speculative_tokens=body.speculative_tokens, prompt_logprobs=body.prompt_logprobs,
        )
    except ValueError as error:
        raise APIError(400, str(error)) from None


def check_length(num_prompt_tokens: int, max_tokens: int, max_model_len: int, what: str) -> None:
    if num_prompt_tokens + max_tokens > max_model_len:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the {what}, {max_tokens} in the "
            f"completion). Please reduce the length of the {what} or the completion.",
            param="max_tokens", code="context_length_exceeded",
        )


def joined(first: SampleDelta | None, then: SampleDelta) -> SampleDelta:
    """Two consecutive deltas of one sample as one."""
    if first is None:
        return then
    return dataclasses.replace(then, token_ids=first.token_ids + then.token_ids, text=first.text + then.text,
                               logprobs=first.logprobs + then.logprobs,
                               prompt_logprobs=first.prompt_logprobs or then.prompt_logprobs)


def prompt_alone(delta: SampleDelta) -> SampleDelta:
    """A delta of a max_tokens 0 job without the token the engine made: the prompt's log-probabilities (on
    the first delta) and the end, "length" unless it failed."""
    reason = delta.finish_reason
    if reason is not None and reason is not FinishReason.ERROR:
        reason = FinishReason.LENGTH
    return dataclasses.replace(delta, token_ids=[], text="", logprobs=[], num_output_tokens=0, finish_reason=reason)


async def run_job(engine: AsyncLLMEngine, job: Job, on_delta: Callable[[SampleDelta], None] | None = None,
                  interval: int = 1) -> AsyncIterator[tuple[int, SampleDelta]]:
    """Every prompt's deltas, merged, as (choice index, delta). Closing the iterator aborts them all.

    `interval` > 1 holds a sample's deltas back until they carry that many tokens (its first delta and its
    last go at once: time to first token and the end are not delayed); `on_delta` still sees each delta
    as the engine makes it."""
    merged: asyncio.Queue[tuple[int, SampleDelta] | None] = asyncio.Queue()

    async def pump(prompt_index: int, prompt: Prompt) -> None:
        held: dict[int, SampleDelta] = {}  # sample index -> tokens not yet passed on
        started: set[int] = set()
        try:
            async for delta in engine.generate(prompt.token_ids, job.params, f"{job.request_id}-{prompt_index}",
                                             job.lora, images=prompt.images):
                if on_delta is not None:
                    on_delta(delta)
                if job.prompt_only:
                    delta = prompt_alone(delta)
                delta = joined(held.pop(delta.index, None), delta)
                if len(delta.token_ids) < interval and delta.index in started and not delta.finished:
                    held[delta.index] = delta
                    continue
                started.add(delta.index)
                await merged.put((prompt_index * job.params.n + delta.index, delta))
        except EngineDeadError:
            for i in range(job.params.n):
                failure = SampleDelta.failure(job.request_id, i, ENGINE_STOPPED)
                await merged.put((prompt_index * job.params.n + i, failure))
        finally:
            await merged.put(None)

    tasks = [asyncio.create_task(pump(i, x)) for i, x in enumerate(job.prompts)]
    try:
        running = len(tasks)
        while running:
            item = await merged.get()
            if item is None:
                running -= 1
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(tokenizer: Tokenizer, entries: list[TokenLogprobs], offset: int) -> p.CompletionLogprobs:
    out = p.CompletionLogprobs()
    for entry in entries:
        text = token_text(tokenizer, entry.token_id)
        out.tokens.append(text)
        out.token_logprobs.append(entry.logprob)
        out.top_logprobs.append({token_text(tokenizer, t): lp for t, lp in entry.top})
        out.text_offset.append(offset)
        offset += len(text)
    return out


def echo_logprobs(tokenizer: Tokenizer, prompt: Prompt, entries: list[TokenLogprobs] | None,
                  completion: p.CompletionLogprobs, k: int) -> p.CompletionLogprobs:
    """An echoed completion's logprobs: the prompt's tokens first, each with its log-probability after the
    tokens before it and its `k` best alternatives (the first token has none), offsets from 0; then the
    completion's."""
    if entries is None or not prompt.token_ids:
        return completion
    first = token_text(tokenizer, prompt.token_ids[0])
    rest = completion_logprobs(tokenizer, [dataclasses.replace(e, top=e.top[:k]) for e in entries], len(first))
    return p.CompletionLogprobs(tokens=[first] + rest.tokens + completion.tokens,
                                token_logprobs=[None] + rest.token_logprobs + completion.token_logprobs,
                                top_logprobs=[None] + rest.top_logprobs + completion.top_logprobs,
                                text_offset=[0] + rest.text_offset + completion.text_offset)


def prompt_logprobs_payload(tokenizer: Tokenizer, entries: list[TokenLogprobs] | None, k: int) -> list | None:
    """vLLM's `prompt_logprobs`: None for the first prompt token, then per token {token id: {logprob, rank,
    decoded_token}} for the token and its `k` best alternatives (ranks 1 .. k). CPU-heavy (it detokenizes)."""
    if entries is None:
        return None
    out: list[dict | None] = [None]
    for entry in entries:
        item = {str(entry.token_id): {"logprob": entry.logprob, "rank": entry.rank,
                                      "decoded_token": token_text(tokenizer, entry.token_id)}}
        for rank, (token_id, logprob) in enumerate(entry.top[:k], start=1):
            item.setdefault(str(token_id), {"logprob": logprob, "rank": rank,
                                            "decoded_token": token_text(tokenizer, token_id)})
        out.append(item)
    return out


def chat_logprobs(tokenizer: Tokenizer, entries: list[TokenLogprobs]) -> p.ChatLogprobs:
    def item(token_id: int, logprob: float) -> dict:
        text = token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(tokenizer.token_bytes(token_id))}

    return p.ChatLogprobs(content=[
        p.ChatTokenLogprob(**item(e.token_id, e.logprob), top_logprobs=[p.TopLogprob(**item(t, lp)) for t, lp in e.top])
        for e in entries
    ])


def logprobs_payload(tokenizer: Tokenizer, entries: list[TokenLogprobs], chat: bool, offset: int,
                     echoed: tuple[Prompt, list[TokenLogprobs] | None] | None = None, k: int = 0) -> dict:
    """A streamed event's `logprobs` object (`echoed`: the prompt and its log-probabilities, before the
    entries, with `k` alternatives). CPU-heavy (it detokenizes): run it off the event loop."""
    if chat:
        return chat_logprobs(tokenizer, entries).model_dump()
    out = completion_logprobs(tokenizer, entries, offset)
    return (echo_logprobs(tokenizer, *echoed, out, k) if echoed is not None else out).model_dump()


def request_error(delta: SampleDelta) -> APIError:
    """A sample that ended in error: the engine's failure is a 500 without details, an engine that hung or
    had already stopped is a 503; a request the engine refused (it can never fit, say) is a 400 with the
    engine's reason."""
    if delta.error in (ENGINE_HUNG, ENGINE_STOPPED, ENGINE_WORKER_LOST):
        return APIError(503, delta.error)
    if delta.error is None or delta.error in (ENGINE_DIED, STEP_FAILED, ENGINE_FAILED):
        return APIError(500, ENGINE_FAILED)
    if delta.error in REQUEST_FAILURES:  # this request's own part of a step failed; the others went on
        return APIError(500, delta.error)
    return APIError(400, delta.error)


def finish_reason(delta: SampleDelta) -> str | None:
    if delta.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
        return delta.finish_reason.value
    return None


class Collected:
    """Accumulates a job's deltas for a non-streaming response."""

    def __init__(self, job: Job) -> None:
        count = len(job.prompts) * job.params.n
        self.text = [""] * count
        self.logprobs: list[list[TokenLogprobs]] = [[] for _ in range(count)]
        self.prompt_logprobs: list[list[TokenLogprobs] | None] = [None] * count
        self.finish: list[str | None] = [None] * count
        self.num_output_tokens = 0
        self.num_reasoning_tokens: int | None = None  # with SamplingParams.reasoning: the samples' blocks'

    def add(self, index: int, delta: SampleDelta) -> None:
        if delta.finish_reason is FinishReason.ERROR:
            raise request_error(delta)
        self.text[index] += delta.text
        self.logprobs[index].extend(delta.logprobs)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs[index] = delta.prompt_logprobs
        if delta.finished:
            self.finish[index] = finish_reason(delta)
            self.num_output_tokens += delta.num_output_tokens
            if delta.num_reasoning_tokens is not None:
                self.num_reasoning_tokens = (self.num_reasoning_tokens or 0) + delta.num_reasoning_tokens


async def collect(engine: AsyncLLMEngine, job: Job, on_delta=None) -> Collected:
    result = Collected(job)
    async for index, delta in run_job(engine, job, on_delta):
        result.add(index, delta)
    return result


def usage(job: Job, num_output_tokens: int, num_reasoning_tokens: int | None = None) -> p.Usage:
    """`num_reasoning_tokens`: of the output, in reasoning blocks (None: the model has none)."""
    details = None if num_reasoning_tokens is None else p.CompletionTokensDetails(
        reasoning_tokens=num_reasoning_tokens)
    return p.Usage(prompt_tokens=job.num_prompt_tokens, completion_tokens=num_output_tokens,
                   total_tokens=job.num_prompt_tokens + num_output_tokens, completion_tokens_details=details)


def completion_response(job: Job, result: Collected, tokenizer: Tokenizer, echo: bool) -> p.CompletionResponse:
    choices = []
    for index, text in enumerate(result.text):
        prompt = job.prompts[index // job.params.n]
        prefix = prompt.text if echo else ""
        logprobs = None
        if job.num_top_logprobs is not None:
            logprobs = completion_logprobs(tokenizer, result.logprobs[index], len(prefix))
            if echo:
                logprobs = echo_logprobs(tokenizer, prompt, result.prompt_logprobs[index], logprobs,
                                         job.num_top_logprobs)
        scored = None
        if job.num_prompt_logprobs is not None:
            scored = prompt_logprobs_payload(tokenizer, result.prompt_logprobs[index], job.num_prompt_logprobs)
        choices.append(p.CompletionChoice(index=index, text=prefix + text, logprobs=logprobs,
                                          finish_reason=result.finish[index], prompt_logprobs=scored))
    return p.CompletionResponse(id=job.request_id, model=job.model_name, choices=choices,
                                usage=usage(job, result.num_output_tokens))


def assistant_message(text: str, finish: str | None, tools: ToolUse | None,
                      reasoning: str | None = None) -> tuple[p.AssistantMessage, str | None]:
    """The reply's message and finish reason: with tools, the calls the text (the reply after its reasoning)
    holds are parsed out of it (`finish_reason` "tool_calls" when the model stopped after making some)."""
    if tools is None:
        return p.AssistantMessage(content=text, reasoning_content=reasoning), finish
    content, calls = parse_tool_calls(text, tools.format, tools.definitions)
    if not calls:
        return p.AssistantMessage(content=text, reasoning_content=reasoning), finish
    message = p.AssistantMessage(content=content, reasoning_content=reasoning,
                                 tool_calls=[p.ToolCall(**call.to_openai()) for call in calls])
    return message, "tool_calls" if finish == "stop" else finish


def chat_response(job: Job, result: Collected, tokenizer: Tokenizer, tools: ToolUse | None = None,
                  reasoning: Reasoning | HarmonyReasoning | None = None) -> p.ChatCompletionResponse:
    choices = []
    for i, text in enumerate(result.text):
        thought = None
        if reasoning is not None:
            thought, text = reasoning.whole(text)
        message, finish = assistant_message(text, result.finish[i], tools, thought)
        choices.append(p.ChatChoice(index=i, message=message, finish_reason=finish,
                                    logprobs=chat_logprobs(tokenizer, result.logprobs[i])
                                    if job.num_top_logprobs is not None else None))
    scored = None  # every choice has the same prompt: the first's
    if job.num_prompt_logprobs is not None:
        scored = prompt_logprobs_payload(tokenizer, result.prompt_logprobs[0], job.num_prompt_logprobs)
    return p.ChatCompletionResponse(id=job.request_id, model=job.model_name, choices=choices,
                                    usage=usage(job, result.num_output_tokens, result.num_reasoning_tokens),
                                    prompt_logprobs=scored)


def tool_stream_piece(stream: ToolCallStream, text: str, finished: bool, first_index: int) -> tuple[str, list[dict]]:
    """The content and the `delta.tool_calls` entries (numbered from `first_index`) that a choice's new
    text releases; at the end, everything held back."""
    piece = stream.push(text)
    content, calls = piece.content, list(piece.calls)
    if finished:
        rest = stream.finish()
        content, calls = content + rest.content, calls + list(rest.calls)
    return content, [{"index": first_index + k, **call.to_openai()} for k, call in enumerate(calls)]


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def stream_events(engine: AsyncLLMEngine, job: Job, tokenizer: Tokenizer, chat: bool, echo: bool,
                        include_usage: bool, on_delta=None, interval: int = 1, tools: ToolUse | None = None,
                        reasoning: Reasoning | HarmonyReasoning | None = None) -> AsyncIterator[str]:
    """Server-sent events for a streaming completion or chat completion, ending with `[DONE]`; an event
    carries up to `interval` tokens of a sample (see `run_job`). With `tools`, a chat choice's text goes
    through a ToolCallStream: what may begin a tool call is held back until it is decided, and each call
    goes out whole, as one `delta.tool_calls` entry, once its text is complete. With `reasoning`, a chat
    choice's reasoning goes out as `delta.reasoning_content` and only the text after it is content."""
    created = int(time.time())
    kind = "chat.completion.chunk" if chat else "text_completion"
    base = {"id": job.request_id, "object": kind, "created": created, "model": job.model_name}
    started: set[int] = set()
    offsets: dict[int, int] = {}
    tool_streams: dict[int, ToolCallStream] = {}
    num_calls: dict[int, int] = {}  # choice -> tool calls sent
    splits: dict[int, ReasoningSplit | HarmonySplit] = {}
    num_reasoning_tokens: int | None = None  # with SamplingParams.reasoning: the samples' blocks'
    num_output_tokens = 0
    async for index, delta in run_job(engine, job, on_delta, interval):
        if delta.finish_reason is FinishReason.ERROR:
            error = request_error(delta)
            yield sse_error(error.status, error.message)
            break
        choice: dict = {"index": index}
        text = delta.text
        echoed = None  # the first event of an echoed choice: its prompt, and with logprobs their values
        offset = offsets.get(index, 0)  # the text offset of the delta's first token
        scored = None  # vLLM's prompt_logprobs, on a choice's first event
        if index not in started:
            started.add(index)
            if job.num_prompt_logprobs is not None and delta.prompt_logprobs is not None:
                scored = await asyncio.to_thread(prompt_logprobs_payload, tokenizer, delta.prompt_logprobs,
                                                 job.num_prompt_logprobs)
            if chat:
                extra = {"prompt_logprobs": scored} if scored is not None else {}
                yield sse({**base, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                                "logprobs": None, "finish_reason": None}], **extra})
            elif echo:
                prompt = job.prompts[index // job.params.n]
                text = prompt.text + text
                offset = len(prompt.text)  # the completion's tokens start after the prompt's text
                echoed = (prompt, delta.prompt_logprobs)
        logprobs = None
        if job.num_top_logprobs is not None and (delta.logprobs or echoed is not None):
            # Detokenizing each token and its alternatives is CPU work for the event loop's other streams
            # to wait on: a worker thread does it, awaited here, so the events keep their order.
            logprobs = await asyncio.to_thread(logprobs_payload, tokenizer, delta.logprobs, chat, offset, echoed,
                                               job.num_top_logprobs)
        offsets[index] = offsets.get(index, 0) + len(text)
        if delta.finished:
            num_output_tokens += delta.num_output_tokens
            if delta.num_reasoning_tokens is not None:
                num_reasoning_tokens = (num_reasoning_tokens or 0) + delta.num_reasoning_tokens
        thought = ""
        if chat and reasoning is not None:
            split = splits.setdefault(index, reasoning.split())
            thought, text = split.push(text)
            if delta.finished:
                more_thought, more_text = split.finish()
                thought, text = thought + more_thought, text + more_text
            thought = thought if reasoning.include else ""
        calls: list[dict] = []
        if chat and tools is not None:
            stream_of = tool_streams.setdefault(index, ToolCallStream(tools.format, tools.definitions))
            text, calls = tool_stream_piece(stream_of, text, delta.finished, num_calls.get(index, 0))
            num_calls[index] = num_calls.get(index, 0) + len(calls)
        if not (text or thought or calls or delta.finished or logprobs is not None) and (chat or scored is None):
            continue
        if scored is not None and not chat:
            choice["prompt_logprobs"] = scored
        if chat:
            choice["delta"] = {"reasoning_content": thought} if thought else {}
            if text:
                choice["delta"]["content"] = text
            if calls:
                choice["delta"]["tool_calls"] = calls
        else:
            choice["text"] = text
        choice["logprobs"] = logprobs
        reason = finish_reason(delta) if delta.finished else None
        choice["finish_reason"] = "tool_calls" if reason == "stop" and num_calls.get(index) else reason
        yield sse({**base, "choices": [choice]})
    else:
        if include_usage:
            yield sse({**base, "choices": [], "usage": usage(job, num_output_tokens,
                                                             num_reasoning_tokens).model_dump(exclude_none=True)})
    yield "data: [DONE]\n\n"
