"""The Llama-family decoder (Llama / SmolLM2, Mistral, Qwen2) and its config. See llama.py for the
flat-batch forward contract."""

from kvpact.worker.model.config import SUPPORTED_ARCHITECTURES, SUPPORTED_ROPE_TYPES, ModelConfig
from kvpact.worker.model.llama import LlamaForCausalLM, build_model

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "SUPPORTED_ROPE_TYPES",
    "LlamaForCausalLM",
    "ModelConfig",
    "build_model",
]
