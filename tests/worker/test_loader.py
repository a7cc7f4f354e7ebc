"""worker.loader: Hugging Face directories, GGUF files (round trip against the HF copy), the conversion
cache, fail-fast config reading, size estimates, and the errors a bad model path gets."""

import io
import json
import os
import shutil

import gguf
import pytest
import torch

from kvpact.shared.errors import ConfigError, ModelLoadError
from kvpact.worker.loader import estimate_weight_bytes, load_model, read_model_config, resolve_dtype
from kvpact.worker.loader.cache import entry_dir
from kvpact.worker.loader.gguf_reader import GGUFContents
from kvpact.worker.loader.progress import Progress
from tests.factories.tiny_models import (
    CHATML_TEMPLATE,
    ContiguousAttention,
    greedy_generate,
    make_tiny_gguf,
    make_tiny_llama,
    make_tiny_qwen2,
    tiny_hf_model,
    transformers_greedy,
)

TEXTS = [
    "Hello, world! How are you? 12 + 34 = 46",
    "日本語のテキスト 🙂🚀 café",
    "<|im_start|>user\nhi<|im_end|>\n",
]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def llama_gguf(tmp_path_factory):
    return make_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.f32.gguf")


def _state(loaded):
    return {k: v.clone() for k, v in loaded.model.state_dict().items()}


# --- Hugging Face directories ------------------------------------------------------------------------


def test_hf_directory_loads_model_config_and_tokenizer(llama_dir):
    loaded = load_model(llama_dir)
    assert loaded.name == llama_dir.name and loaded.source == llama_dir and loaded.dtype == torch.float32
    assert (loaded.config.num_layers, loaded.config.num_heads, loaded.config.num_kv_heads) == (2, 4, 2)
    assert loaded.config == read_model_config(llama_dir)
    assert loaded.tokenizer.eos_token_ids == {2} and loaded.tokenizer.bos_token_id == 1
    assert loaded.tokenizer.chat_template.source == CHATML_TEMPLATE
    assert not loaded.model.training


def test_sharded_safetensors_load_like_a_single_file(llama_dir, tmp_path):
    sharded = tmp_path / "sharded"
    tiny_hf_model("llama").save_pretrained(sharded, max_shard_size="20KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(llama_dir / name, sharded / name)
    assert (sharded / "model.safetensors.index.json").is_file()
    a, b = _state(load_model(llama_dir)), _state(load_model(sharded))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_bfloat16_checkpoint_loads_into_requested_dtypes(tmp_path):
    directory = make_tiny_llama(tmp_path, dtype=torch.bfloat16)
    assert read_model_config(directory).dtype == "bfloat16"
    assert load_model(directory).model.model.embed_tokens.weight.dtype == torch.float32
    assert load_model(directory, dtype="bf16").model.model.embed_tokens.weight.dtype == torch.bfloat16


def test_estimate_weight_bytes_counts_tied_embeddings_once(tmp_path):
    untied = make_tiny_llama(tmp_path / "untied")
    tied = make_tiny_llama(tmp_path / "tied", tie_word_embeddings=True)
    for directory in (untied, tied):
        numel = sum(p.numel() for p in load_model(directory).model.parameters())
        assert estimate_weight_bytes(directory) == 4 * numel
        assert estimate_weight_bytes(directory, dtype=torch.bfloat16) == 2 * numel


def test_resolve_dtype():
    assert resolve_dtype("cpu", None) is torch.float32
    assert resolve_dtype("cpu", "auto") is torch.float32
    assert resolve_dtype("cpu", "bf16") is torch.bfloat16
    with pytest.raises(ConfigError, match="dtype 'float8' is not one of auto"):
        resolve_dtype("cpu", "float8")


def test_resolve_dtype_on_cuda_follows_the_probed_compute_capability():
    # bf16 needs sm_80 natively (an emulated bf16 is slow and has no tensor cores for the kernels)
    assert resolve_dtype("cuda:0", "auto", (9, 0)) is torch.bfloat16  # H100 / H200
    assert resolve_dtype("cuda:1", None, (8, 0)) is torch.bfloat16  # A100
    assert resolve_dtype("cuda:0", "auto", (7, 5)) is torch.float16  # T4
    assert resolve_dtype("cuda:0", "float32", (7, 5)) is torch.float32  # asked for explicitly
    assert resolve_dtype("mps", "auto") is torch.float16


# --- errors ------------------------------------------------------------------------------------------


def _broken_copy(src, dst, edit):
    shutil.copytree(src, dst)
    edit(dst)
    return dst


def _set_config(**changes):
    def edit(d):
        config = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**config, **changes}))

    return edit


def _truncate(name, size):
    def edit(d):
        with open(d / name, "r+b") as f:
            f.truncate(size)

    return edit


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            _set_config(architectures=["GPT2LMHeadModel"], model_type="gpt2"),
            r"unsupported model architecture GPT2LMHeadModel; kvpact supports LlamaForCausalLM, "
            r"MistralForCausalLM, Qwen2ForCausalLM",
        ),
        (
            _set_config(rope_parameters={"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}),
            r"RoPE scaling type 'yarn' is not supported",
        ),
        (lambda d: (d / "config.json").write_text('{"hidden_size": 64,'), r"config\.json: not valid JSON"),
        (lambda d: (d / "config.json").unlink(), r"no config\.json"),
    ],
    ids=["architecture", "rope", "config-json", "no-config"],
)
def test_config_problems_fail_before_weights(llama_dir, tmp_path, edit, message):
    broken = _broken_copy(llama_dir, tmp_path / "m", edit)
    (broken / "model.safetensors").write_bytes(b"not read")  # proves the weights are never touched
    for call in (read_model_config, load_model):
        with pytest.raises(ModelLoadError, match=message):
            call(broken)


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            _truncate("model.safetensors", 4000),
            r"model\.safetensors: not a readable safetensors file .*corrupt or truncated",
        ),
        (_truncate("model.safetensors", 3), r"model\.safetensors: not a readable safetensors file"),
        (
            lambda d: (d / "model.safetensors").rename(d / "pytorch_model.bin"),
            r"no \*\.safetensors weight files \(found pytorch_model\.bin: convert them to safetensors\)",
        ),
        (lambda d: (d / "tokenizer.json").unlink(), r"no tokenizer\.json"),
        (lambda d: (d / "tokenizer.json").write_text("{"), r"tokenizer\.json: not a valid tokenizer file"),
        (_set_config(num_hidden_layers=3), r"missing weights for model\.layers\.2\."),
        (_set_config(intermediate_size=96), r"tensor 'model\.layers\.0\.mlp\.\w+_proj\.weight' has shape"),
    ],
    ids=[
        "truncated",
        "tiny-file",
        "bin-only",
        "no-tokenizer",
        "bad-tokenizer",
        "missing-layer",
        "wrong-shape",
    ],
)
def test_broken_directories_give_model_load_errors(llama_dir, tmp_path, edit, message):
    broken = _broken_copy(llama_dir, tmp_path / "m", edit)
    with pytest.raises(ModelLoadError, match=message):
        load_model(broken)


def test_missing_path_names_it(tmp_path):
    with pytest.raises(ModelLoadError, match=rf"model path {tmp_path}/nope does not exist"):
        read_model_config(tmp_path / "nope")
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nope.gguf")


@pytest.mark.parametrize(
    "size, message", [(10, "not a readable GGUF file"), (None, "truncated|not a readable GGUF")]
)
def test_corrupt_gguf_names_the_file(llama_gguf, tmp_path, size, message):
    bad = tmp_path / "bad.gguf"
    data = llama_gguf.read_bytes()
    bad.write_bytes(b"garbage!" * 4 if size == 10 else data[: len(data) - 5000])
    with pytest.raises(ModelLoadError, match=rf"{bad}: ({message})"):
        load_model(bad, cache_dir=tmp_path / "cache")


def test_unsupported_gguf_architecture(tmp_path):
    path = tmp_path / "phi.gguf"
    writer = gguf.GGUFWriter(str(path), "phi2")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(
        ModelLoadError, match="unsupported GGUF architecture 'phi2'; kvpact supports llama, qwen2"
    ):
        read_model_config(path)


# --- GGUF --------------------------------------------------------------------------------------------


def test_gguf_round_trip_equals_hf_directory(llama_dir, llama_gguf, tmp_path):
    hf, gg = load_model(llama_dir), load_model(llama_gguf, cache_dir=tmp_path)
    assert gg.name == "tiny-llama.f32" and gg.source == llama_gguf and not gg.cached
    a, b = _state(hf), _state(gg)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (gg.config.num_heads, gg.config.num_kv_heads, gg.config.head_dim) == (4, 2, 16)
    for text in TEXTS:
        assert gg.tokenizer.encode(text) == hf.tokenizer.encode(text)
    messages = [{"role": "user", "content": "Hi 🙂"}]
    assert gg.tokenizer.apply_chat_template(messages) == hf.tokenizer.apply_chat_template(messages)
    assert gg.tokenizer.eos_token_ids == {2} and gg.tokenizer.bos_token_id == 1


@pytest.mark.parametrize(
    "kwargs",
    [
        {"architecture": "qwen2"},
        {
            "tie_word_embeddings": True,
            "num_kv_heads": 1,
            "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        },
    ],
)
def test_gguf_round_trip_qwen2_and_tied_mqa_linear_rope(tmp_path, kwargs):
    architecture = kwargs.get("architecture", "llama")
    hf_kwargs = {k: v for k, v in kwargs.items() if k != "architecture"}
    make = make_tiny_qwen2 if architecture == "qwen2" else make_tiny_llama
    hf = load_model(make(tmp_path / "hf", **hf_kwargs))
    gg = load_model(make_tiny_gguf(tmp_path / "m.gguf", **kwargs), cache_dir=tmp_path / "cache")
    assert gg.config == hf.config.__class__(
        **{
            **_fields(hf.config),
            "dtype": "float32",
            "max_position_embeddings": gg.config.max_position_embeddings,
        }
    )
    a, b = _state(hf), _state(gg)
    assert all(torch.equal(a[k], b[k]) for k in a)


def _fields(config):
    return {f: getattr(config, f) for f in config.__slots__}


@pytest.mark.parametrize("file_type, atol", [("f16", 0.05), ("q8_0", 0.2)])
def test_quantized_gguf_is_close_to_the_original(llama_dir, tmp_path, file_type, atol):
    hf = load_model(llama_dir)
    gg = load_model(make_tiny_gguf(tmp_path / f"m.{file_type}.gguf", file_type=file_type), cache_dir=tmp_path)
    prompt = torch.tensor([1, 300, 17, 42, 99])
    with torch.inference_mode():
        logits = [
            m.model.compute_logits(m.model(prompt, torch.arange(5), ContiguousAttention().step([0], [5])))
            for m in (hf, gg)
        ]
    assert (logits[0] - logits[1]).abs().max() < atol * logits[0].abs().max()


def test_gguf_conversion_is_cached_and_keyed_by_file(llama_gguf, tmp_path):
    cache = tmp_path / "cache"
    first = load_model(llama_gguf, cache_dir=cache)
    entry = entry_dir(cache, llama_gguf)
    assert sorted(p.name for p in entry.iterdir()) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert [p.name for p in (cache / "gguf").iterdir()] == [entry.name]  # no temporary left behind
    second = load_model(llama_gguf, cache_dir=cache)
    assert (first.cached, second.cached) == (False, True)
    assert read_model_config(llama_gguf, cache_dir=cache) == first.config
    os.utime(llama_gguf, ns=(1, 1))  # a changed file gets a new entry
    assert entry_dir(cache, llama_gguf) != entry and not load_model(llama_gguf, cache_dir=cache).cached


def test_gguf_loads_without_a_writable_cache(llama_gguf, llama_dir, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the cache directory should be")
    loaded = load_model(llama_gguf, cache_dir=blocker)
    assert not loaded.cached
    assert loaded.tokenizer.encode(TEXTS[1]) == load_model(llama_dir).tokenizer.encode(TEXTS[1])
    assert greedy_generate(loaded.model, [[1, 2, 3]], 8) == greedy_generate(
        load_model(llama_dir).model, [[1, 2, 3]], 8
    )


def test_gguf_estimate_and_env_cache_dir(llama_gguf, llama_dir, tmp_path, monkeypatch):
    assert estimate_weight_bytes(llama_gguf) == estimate_weight_bytes(llama_dir)
    monkeypatch.setenv("KVPACT_CACHE_DIR", str(tmp_path / "env-cache"))
    load_model(llama_gguf)
    assert entry_dir(tmp_path / "env-cache", llama_gguf).is_dir()


# --- the default model -------------------------------------------------------------------------------


def test_default_model_config_without_loading_weights(tmp_path):
    c = read_model_config(None, cache_dir=tmp_path)
    assert (c.architecture, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (
        "LlamaForCausalLM",
        30,
        9,
        3,
        64,
    )
    assert (c.hidden_size, c.intermediate_size, c.vocab_size, c.rope_theta) == (576, 1536, 49152, 100000.0)
    assert (c.tie_word_embeddings, c.bos_token_id, c.eos_token_ids) == (True, 1, (2,))
    assert estimate_weight_bytes(None) == 134_515_008 * 4


@pytest.mark.slow
def test_default_model_greedy_matches_transformers(tmp_path):
    """~50 s on 2 CPU cores: converts the SmolLM2 GGUF (~4 s), loads it again from the cache (~1.5 s), then
    transformers loads the same GGUF (~20 s) as the float32 reference."""
    from transformers import AutoModelForCausalLM

    first = load_model(None, cache_dir=tmp_path)
    loaded = load_model(None, cache_dir=tmp_path)
    assert (first.cached, loaded.cached) == (False, True)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = loaded.tokenizer.encode_chat(messages)
    ours = greedy_generate(loaded.model, [prompt], 16)[0]
    hf = AutoModelForCausalLM.from_pretrained(
        str(loaded.source.parent), gguf_file=loaded.source.name, dtype=torch.float32
    ).eval()
    assert ours == transformers_greedy(hf, prompt, 16)
    assert "Paris" in loaded.tokenizer.decode(ours)


def test_own_gguf_reader_agrees_with_the_gguf_package(tmp_path):
    path = make_tiny_gguf(tmp_path / "m.gguf", file_type="q8_0", tie_word_embeddings=True)
    ours, theirs = GGUFContents(path), gguf.GGUFReader(path)
    assert ours.metadata.keys() == {k for k in theirs.fields if not k.startswith("GGUF.")}
    for key, value in ours.metadata.items():
        assert value == theirs.fields[key].contents(), key
    assert [(t.name, t.shape, t.qtype, t.offset, t.num_bytes) for t in ours.tensors] == [
        (t.name, tuple(int(d) for d in reversed(t.shape)), t.tensor_type, t.data_offset, t.n_bytes)
        for t in theirs.tensors
    ]
    for info, t in zip(ours.tensors, theirs.tensors, strict=True):
        expected = gguf.quants.dequantize(t.data, t.tensor_type).reshape(info.shape)
        assert (ours.tensor(info) == expected).all(), info.name


def test_directory_holding_a_gguf_points_at_the_file(llama_gguf):
    with pytest.raises(
        ModelLoadError,
        match=r"no config\.json; .* \(for tiny-llama\.f32\.gguf, pass the \.gguf file itself\)",
    ):
        read_model_config(llama_gguf.parent)


def test_progress_is_shown_only_on_a_terminal():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    shown, hidden = Terminal(), io.StringIO()
    for stream in (shown, hidden):
        progress = Progress("loading m", total=4, stream=stream)
        for _ in range(4):
            progress.step()
        progress.close()
    assert shown.getvalue().endswith("\rloading m: 100% (4/4)\n") and hidden.getvalue() == ""
