"""Layer 3, runtime orchestration: continuous batching over a paged KV cache."""

from engine.config import EngineConfig
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.outputs import CompletionOutput, RequestOutput, SampleDelta
from engine.request import FinishReason
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "FinishReason", "LLMEngine", "RequestOutput", "SampleDelta",
           "SamplingParams"]
