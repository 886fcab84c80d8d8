"""Layer 3, runtime orchestration: continuous batching over a paged KV cache.

The names below are imported on first use, so `engine.config` or `engine.backends.torch_compiled` can be
imported without the tokenizer and checkpoint readers the full engine loads models with."""

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.llm import LLM
    from engine.llm_engine import LLMEngine
    from engine.outputs import CompletionOutput, RequestOutput, SampleDelta
    from engine.request import FinishReason
    from engine.sampling_params import SamplingParams

_HOMES = {"EngineConfig": "engine.config", "LLM": "engine.llm", "LLMEngine": "engine.llm_engine",
          "CompletionOutput": "engine.outputs", "RequestOutput": "engine.outputs", "SampleDelta": "engine.outputs",
          "FinishReason": "engine.request", "SamplingParams": "engine.sampling_params"}
__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
