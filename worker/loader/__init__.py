"""Model loading: Hugging Face directories and GGUF files -> (model, config, tokenizer). See load.py."""

from kvpact.worker.loader.load import (
    DEFAULT_MODEL_FILE,
    LoadedModel,
    default_model_path,
    estimate_weight_bytes,
    load_model,
    model_name,
    read_model_config,
    resolve_dtype,
    resolve_model_path,
)

__all__ = [
    "DEFAULT_MODEL_FILE",
    "LoadedModel",
    "default_model_path",
    "estimate_weight_bytes",
    "load_model",
    "model_name",
    "read_model_config",
    "resolve_dtype",
    "resolve_model_path",
]
