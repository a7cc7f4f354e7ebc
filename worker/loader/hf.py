"""Hugging Face model directories: config.json + *.safetensors (one file, or shards listed in
model.safetensors.index.json). Tokenizer files are read by worker.tokenizer.Tokenizer.from_dir.

Every failure is a ModelLoadError naming the file and what is wrong with it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import safe_open

from kvpact.shared.errors import ModelLoadError
from kvpact.worker.model.config import ModelConfig

INDEX_FILE = "model.safetensors.index.json"


def read_json(file: Path) -> dict:
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise ModelLoadError(f"{file}: missing") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{file}: not valid JSON ({e}); the file is corrupt or truncated") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{file}: expected a JSON object, found {type(data).__name__}")
    return data


def read_hf_config(directory: Path) -> ModelConfig:
    """config.json parsed and checked; eos ids from generation_config.json are added when present."""
    file = directory / "config.json"
    if not file.is_file():
        ggufs = sorted(p.name for p in directory.glob("*.gguf"))
        hint = f" (for {ggufs[0]}, pass the .gguf file itself)" if ggufs else ""
        raise ModelLoadError(
            f"{directory}: no config.json; a model directory needs config.json and *.safetensors{hint}"
        )
    config = ModelConfig.from_hf_dict(read_json(file), source=str(file))
    generation = directory / "generation_config.json"
    if generation.is_file():
        extra = read_json(generation).get("eos_token_id")
        extra_ids = extra if isinstance(extra, list) else [] if extra is None else [extra]
        merged = tuple(dict.fromkeys([*config.eos_token_ids, *map(int, extra_ids)]))
        config = replace(config, eos_token_ids=merged)
    return config


def safetensors_files(directory: Path) -> list[Path]:
    """The weight files: the shards named by the index, else every *.safetensors in the directory."""
    index = directory / INDEX_FILE
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index}: has no weight_map")
        files = [directory / name for name in dict.fromkeys(weight_map.values())]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index}: lists shards that are missing: {', '.join(missing)}")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        others = sorted(p.name for p in directory.glob("*.bin")) + sorted(
            p.name for p in directory.glob("*.pt")
        )
        hint = f" (found {', '.join(others)}: convert them to safetensors)" if others else ""
        raise ModelLoadError(f"{directory}: no *.safetensors weight files{hint}")
    return files


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of every file, read lazily from a memory map."""
    for file in files:
        with _open(file) as f:
            for name in f.keys():
                try:
                    yield name, f.get_tensor(name)
                except Exception as e:
                    raise ModelLoadError(f"{file}: cannot read tensor {name!r}: {e}") from e


def safetensors_numel(files: list[Path]) -> dict[str, int]:
    """Element count per tensor name, from the headers only."""
    counts = {}
    for file in files:
        with _open(file) as f:
            for name in f.keys():
                counts[name] = int(torch.Size(f.get_slice(name).get_shape()).numel())
    return counts


def _open(file: Path):
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except Exception as e:  # SafetensorError, OSError: header unreadable, file truncated or not safetensors
        raise ModelLoadError(
            f"{file}: not a readable safetensors file ({e}); it is corrupt or truncated — download it again"
        ) from e
