"""What the engine reports after each step: deltas per sample, and finished results for the offline API."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.request import FinishReason, TokenLogprobs


@dataclass(frozen=True)
class SampleDelta:
    """New output of one sample (`index` of the request's n) since the last step."""

    request_id: str
    index: int
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprobs]
    num_prompt_tokens: int
    num_output_tokens: int  # so far, including these
    num_cached_tokens: int = 0
    finish_reason: FinishReason | None = None
    error: str | None = None
    # With SamplingParams.prompt_logprobs, on a sample's first delta: its prompt tokens' log-probabilities,
    # positions 1 .. P - 1 (the first token has none).
    prompt_logprobs: list[TokenLogprobs] | None = None
    # An embedding request's last delta: its pooled final hidden state [hidden] float32, unnormalized.
    embedding: torch.Tensor | None = None
    # With SamplingParams.reasoning: the output's tokens so far that are its reasoning block's, markers
    # counted (None without).
    num_reasoning_tokens: int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @classmethod
    def failure(cls, request_id: str, index: int, error: str) -> SampleDelta:
        """The last delta of a sample that ends with an error and no output."""
        return cls(request_id=request_id, index=index, token_ids=[], text="", logprobs=[], num_prompt_tokens=0,
                   num_output_tokens=0, finish_reason=FinishReason.ERROR, error=error)


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: FinishReason | None = None
    error: str | None = None

    def add(self, delta: SampleDelta) -> None:
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs:
            self.logprobs = (self.logprobs or []) + delta.logprobs
        if delta.finish_reason is not None:
            self.finish_reason, self.error = delta.finish_reason, delta.error


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    # SamplingParams.prompt_logprobs: prompt positions 1 .. P - 1 (None: not asked for, or not computed).
    prompt_logprobs: list[TokenLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)
