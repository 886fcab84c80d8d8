"""Layer 1, the model definition: the Llama-family decoder, its weights, tokenizer and chat template.

`load` and `LoadedModel` are imported on first use: the loader pulls in the checkpoint readers (gguf,
safetensors, tokenizers), which the decoder and the kernels do not need (a GPU check runs without them).
"""

from typing import TYPE_CHECKING, Any

from model.attention_metadata import AttentionMetadata
from model.config import ModelConfig
from model.errors import ModelLoadError
from model.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from model.loader import LoadedModel, load

__all__ = ["AttentionMetadata", "LlamaForCausalLM", "LoadedModel", "ModelConfig", "ModelLoadError", "load"]


def __getattr__(name: str) -> Any:
    if name in ("load", "LoadedModel"):
        from model import loader

        return getattr(loader, name)
    raise AttributeError(f"module 'model' has no attribute {name!r}")
