"""The realized-config fingerprint (worker/loader/fingerprint.py): stable, sensitive to the config, the
tensor headers, the tokenizer and the template, and computed without reading tensor data (a file whose
data is rewritten or cut off after its header still fingerprints, and its model digest ignores the data)."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvpact.shared.errors import ModelLoadError
from kvpact.shared.fingerprint import Fingerprint, mismatch
from kvpact.worker.loader.fingerprint import model_digests
from tests.factories.tiny_models import make_tiny_gguf


def fingerprint(path: Path) -> Fingerprint:
    return model_digests(path).fingerprint(
        dtype="float32", cache_dtype="float32", max_model_len=256, block_size=16, tensor_parallel_size=1
    )


def copy_model(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def header_length(file: Path) -> int:
    (length,) = struct.unpack("<Q", file.read_bytes()[:8])
    return int(length)


def test_the_same_files_fingerprint_alike_wherever_they_are(tiny_llama, tmp_path):
    first = fingerprint(tiny_llama)
    assert first == fingerprint(tiny_llama)  # stable across runs
    assert first == fingerprint(copy_model(tiny_llama, tmp_path / "elsewhere"))  # names, not paths
    assert first.model.startswith("sha256:") and len(first.model) == len("sha256:") + 64
    assert first.chat_template.startswith("sha256:")


def test_tensor_data_is_never_read_but_a_weight_header_changes_the_model(tiny_llama, tmp_path):
    base = fingerprint(tiny_llama)
    model = copy_model(tiny_llama, tmp_path / "data")
    (weights,) = sorted(model.glob("*.safetensors"))
    raw = bytearray(weights.read_bytes())
    start = 8 + header_length(weights)
    raw[start:] = bytes(b ^ 0xFF for b in raw[start:])  # every weight value changed, the header kept
    weights.write_bytes(bytes(raw))
    assert fingerprint(model).model == base.model  # the data was not part of it: never read

    truncated = copy_model(tiny_llama, tmp_path / "truncated")
    (cut,) = sorted(truncated.glob("*.safetensors"))
    cut.write_bytes(cut.read_bytes()[: 8 + header_length(cut) + 10])  # the data cut short
    assert fingerprint(truncated).model != base.model  # its size differs, and it still fingerprints

    header = copy_model(tiny_llama, tmp_path / "header")
    (file,) = sorted(header.glob("*.safetensors"))
    tensors = load_file(str(file))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].to(torch.float16)  # one tensor's dtype in the header
    save_file(tensors, str(file), metadata={"format": "pt"})
    changed = fingerprint(header)
    assert changed.model != base.model
    assert (changed.tokenizer, changed.chat_template) == (base.tokenizer, base.chat_template)


def test_the_tokenizer_and_the_template_are_their_own_fields(tiny_llama, tmp_path):
    base = fingerprint(tiny_llama)
    model = copy_model(tiny_llama, tmp_path / "template")
    (model / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    other = fingerprint(model)
    assert (other.model, other.tokenizer) == (base.model, base.tokenizer)
    assert other.chat_template != base.chat_template
    reason = mismatch(other, "w-0", base, ["model", "chat-template"])
    assert (
        f"chat-template {other.chat_template[:19]} here, {base.chat_template[:19]} on worker 'w-0'" in reason
    )
    assert "model sha256" not in reason  # only the field that differs is named
    assert mismatch(other, "w-0", base, ["model", "tokenizer"]) == ""


def test_a_config_change_changes_the_model(tiny_llama, tmp_path):
    model = copy_model(tiny_llama, tmp_path / "config")
    config = json.loads((model / "config.json").read_text())
    config["rope_theta"] = 1234.0
    (model / "config.json").write_text(json.dumps(config))
    assert fingerprint(model).model != fingerprint(tiny_llama).model


def test_a_gguf_fingerprints_from_its_header(tmp_path):
    file = make_tiny_gguf(tmp_path / "tiny.gguf", max_position_embeddings=256)
    base = fingerprint(file)
    assert base == fingerprint(file)
    data = tmp_path / "data" / "tiny.gguf"
    data.parent.mkdir()
    raw = bytearray(file.read_bytes())
    raw[-64:] = bytes(64)  # the last tensor's last values
    data.write_bytes(bytes(raw))
    assert fingerprint(data) == base  # the data is not part of it
    other = make_tiny_gguf(tmp_path / "long" / "tiny.gguf", max_position_embeddings=512)
    assert fingerprint(other).model != base.model  # a metadata value (its context length)


def test_a_garbled_safetensors_header_is_named(tiny_llama, tmp_path):
    model = copy_model(tiny_llama, tmp_path / "garbled")
    (file,) = sorted(model.glob("*.safetensors"))
    file.write_bytes(b"\xff" * 16)
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: not a readable safetensors file"):
        fingerprint(model)
