"""A model's fingerprint (shared/fingerprint.py) from its files, reading no tensor data.

NOTE: what is read: config.json (+ generation_config.json), the tokenizer files and, of each safetensors
file, its 8-byte length and JSON header; of a GGUF file, its header (metadata and tensor directory; the
data stays mapped, unread). So two checkpoints with the same config and tensor headers but other weight
values fingerprint alike: the fingerprint catches a different model, size, dtype, tokenizer or template,
not a retrained one. A GGUF file is fingerprinted itself (never its conversion cache), so a worker with
a warm cache and one without agree.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpact.shared.errors import ModelLoadError
from kvpact.shared.fingerprint import NO_CHAT_TEMPLATE, Fingerprint
from kvpact.worker.loader.gguf_reader import GGUFContents, GGUFFormatError
from kvpact.worker.loader.hf import read_json, safetensors_files
from kvpact.worker.tokenizer.tokenizer import chat_template_text

MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit on a header


@dataclass(frozen=True, slots=True)
class ModelDigests:
    """The identity part of a fingerprint: what the model's files say, before any plan's numbers."""

    model: str
    tokenizer: str
    chat_template: str

    def fingerprint(
        self, *, dtype: str, cache_dtype: str, max_model_len: int, block_size: int, tensor_parallel_size: int
    ) -> Fingerprint:
        """With the plan's numbers: the dtypes it runs (torch's names without "torch.") and its sizes."""
        return Fingerprint(
            self.model,
            self.tokenizer,
            self.chat_template,
            max_model_len,
            block_size,
            tensor_parallel_size,
            dtype=dtype,
            cache_dtype=cache_dtype,
        )


def model_digests(source: Path) -> ModelDigests:
    """The digests of the model at `source` (a Hugging Face directory or a GGUF file)."""
    return hf_digests(source) if source.is_dir() else gguf_digests(source, _contents(source))


def _digest(*parts: bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))  # framed: no two part lists hash alike
        h.update(part)
    return "sha256:" + h.hexdigest()


def _canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def hf_digests(directory: Path) -> ModelDigests:
    parts = [_canonical(read_json(directory / "config.json"))]
    generation = directory / "generation_config.json"
    if generation.is_file():
        parts.append(_canonical(read_json(generation)))
    for file in safetensors_files(directory):
        parts += [file.name.encode(), str(file.stat().st_size).encode(), _safetensors_header(file)]
    config_file = directory / "tokenizer_config.json"
    config = read_json(config_file) if config_file.is_file() else {}
    template = chat_template_text(directory, config)
    tokenizer_file = directory / "tokenizer.json"
    tokenizer = tokenizer_file.read_bytes() if tokenizer_file.is_file() else b""
    settings = {k: v for k, v in config.items() if k != "chat_template"}
    return ModelDigests(
        _digest(*parts),
        _digest(tokenizer, _canonical(settings)),
        NO_CHAT_TEMPLATE if template is None else _digest(template.encode()),
    )


def _safetensors_header(file: Path) -> bytes:
    """The JSON header (names, dtypes, shapes, offsets) without the tensor data after it."""
    with open(file, "rb") as f:
        head = f.read(8)
        (length,) = struct.unpack("<Q", head) if len(head) == 8 else (-1,)
        header = f.read(length) if 0 < length <= MAX_HEADER_BYTES else b""
    if len(header) != length or not header.startswith(b"{"):
        raise ModelLoadError(
            f"{file}: not a readable safetensors file (its header is cut short or garbled); it is corrupt "
            "or truncated — download it again"
        )
    return header


def _contents(file: Path) -> GGUFContents:
    try:
        return GGUFContents(file)
    except (GGUFFormatError, OSError) as e:
        raise ModelLoadError(
            f"{file}: not a readable GGUF file: {e}; it is corrupt or truncated — download it again"
        ) from e


def gguf_digests(file: Path, contents: GGUFContents) -> ModelDigests:
    """`contents`: the file's parsed header (parsed once by the caller: worker/loader/header.py)."""
    metadata = contents.metadata
    template = metadata.get("tokenizer.chat_template")
    config = {k: v for k, v in metadata.items() if not k.startswith("tokenizer.")}
    vocabulary = {
        k: v for k, v in metadata.items() if k.startswith("tokenizer.") and k != "tokenizer.chat_template"
    }
    tensors = [(t.name, list(t.shape), t.qtype.name, t.offset) for t in contents.tensors]
    model = _digest(
        _canonical(config), file.name.encode(), str(file.stat().st_size).encode(), _canonical(tensors)
    )
    return ModelDigests(
        model,
        _digest(_canonical(vocabulary)),
        NO_CHAT_TEMPLATE if not isinstance(template, str) else _digest(template.encode()),
    )
