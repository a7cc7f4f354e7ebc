"""What a pre-load plan reads of a model, read once: its config, its weights' element count, its
identity digests (the fingerprint's model, tokenizer and chat template) and how its decoder projections
are stored (the quant-kernels check: worker/startup/checks.py).

NOTE: a GGUF file's header (metadata and tensor directory) is parsed once here, about 0.15 s for the
default model, where the plan used to parse it for the config, the weight estimate and the fingerprint
in turn; a tensor-parallel plan hands the one header to every rank (worker/parallel/ranks.py). No tensor
data is read. The header is a plain dataclass: it travels pickled to the other ranks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from kvpact.worker.loader.fingerprint import ModelDigests, gguf_digests, hf_digests
from kvpact.worker.loader.gguf_file import GGUFFile
from kvpact.worker.loader.hf import read_hf_config, safetensors_files, safetensors_numel
from kvpact.worker.loader.load import resolve_model_path
from kvpact.worker.model import ModelConfig

_PROJECTION = re.compile(r"blk\.\d+\.(attn_(q|k|v|output)|ffn_(gate|up|down))\.weight")  # GGUF names


@dataclass(frozen=True, slots=True)
class ModelHeader:
    path: Path  # the model's directory or GGUF file, resolved (the default model's for None)
    config: ModelConfig
    weight_numel: int  # tied embeddings counted once (a tied GGUF stores no output.weight)
    digests: ModelDigests
    # the decoder projections' storage: their GGUF tensor types ("Q4_1"), or ("safetensors",)
    projection_storage: tuple[str, ...]
    projection_numel: int = 0  # the decoder projections' elements (GGUF; 0 for safetensors)
    head_storage: str = ""  # the LM head's GGUF tensor type (output.weight, else the tied token_embd.weight)
    head_numel: int = 0

    def weight_bytes(self, dtype: torch.dtype) -> int:
        """Bytes the weights take once loaded in `dtype`."""
        return self.weight_numel * torch.empty((), dtype=dtype).element_size()


def read_model_header(path: str | Path | None) -> ModelHeader:
    """The header of the model at `path` (None: the default model); ModelLoadError when it cannot be read."""
    source = resolve_model_path(path)
    if source.is_dir():
        config = read_hf_config(source)
        counts = safetensors_numel(safetensors_files(source))
        if config.tie_word_embeddings:
            counts.pop("lm_head.weight", None)
        return ModelHeader(source, config, sum(counts.values()), hf_digests(source), ("safetensors",))
    gguf = GGUFFile(source)
    config = ModelConfig.from_hf_dict(gguf.config_dict(), source=str(source))
    projections = [t for t in gguf.contents.tensors if _PROJECTION.fullmatch(t.name)]
    by_name = {t.name: t for t in gguf.contents.tensors}
    head = by_name.get("output.weight") or by_name.get("token_embd.weight")
    return ModelHeader(
        source,
        config,
        gguf.weight_numel(),
        gguf_digests(source, gguf.contents),
        tuple(sorted({t.qtype.name for t in projections})),
        projection_numel=sum(t.num_elements for t in projections),
        head_storage=head.qtype.name if head is not None else "",
        head_numel=head.num_elements if head is not None else 0,
    )
