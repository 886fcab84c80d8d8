"""Layer 1, the model definition: the Llama-family decoder, its weights, tokenizer and chat template."""

from model.attention_metadata import AttentionMetadata
from model.config import ModelConfig
from model.errors import ModelLoadError
from model.llama import LlamaForCausalLM
from model.loader import LoadedModel, load

__all__ = ["AttentionMetadata", "LlamaForCausalLM", "LoadedModel", "ModelConfig", "ModelLoadError", "load"]
