"""worker.model: config parsing, and parity of the flat-batch decoder with transformers (float32).

Tolerance: prefill logits within 1e-4 absolute of transformers' (measured ~5e-6 on logits of std ~1.6;
the two differ only in matmul blocking: fused q/k/v and gate/up here). Greedy tokens must be equal.
"""

import json
import subprocess
import sys

import pytest
import torch

from kvpact.shared.errors import ModelLoadError
from kvpact.worker.loader import load_model
from kvpact.worker.model import ModelConfig, build_model
from kvpact.worker.model.rope import RotaryEmbedding, apply_rotary, rope_inv_freq
from tests.factories.tiny_models import (
    ContiguousAttention,
    greedy_generate,
    make_tiny_llama,
    make_tiny_qwen2,
    tiny_hf_model,
    transformers_greedy,
)

LOGITS_ATOL = 1e-4
PROMPTS = [[1, 317, 334, 81, 14, 378, 333, 3, 309, 250, 227, 223, 365], [5, 200, 17], [42] * 7 + [300, 301]]

VARIANTS = {
    "llama": ("llama", {}),
    "llama-tied-bias": ("llama", {"tie_word_embeddings": True, "attention_bias": True, "seed": 1}),
    "llama-mqa-3layers": ("llama", {"num_kv_heads": 1, "num_layers": 3, "seed": 2}),
    "llama-head64": (
        "llama",
        {"hidden_size": 128, "num_heads": 2, "num_kv_heads": 1, "head_dim": 64, "seed": 3},
    ),
    "llama-rope-linear": (
        "llama",
        {"rope_scaling": {"rope_type": "linear", "factor": 4.0}, "rope_theta": 500.0},
    ),
    "llama-rope-llama3": (
        "llama",
        {
            "rope_theta": 50000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    "qwen2": ("qwen2", {}),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(request, tmp_path_factory):
    """(our loaded model, the transformers model with the same weights)."""
    architecture, kwargs = VARIANTS[request.param]
    make = make_tiny_qwen2 if architecture == "qwen2" else make_tiny_llama
    directory = make(tmp_path_factory.mktemp(request.param), **kwargs)
    return load_model(directory).model, tiny_hf_model(architecture, **kwargs)


@torch.inference_mode()
def test_prefill_logits_match_transformers(pair):
    ours, hf = pair
    prompt = PROMPTS[0]
    hidden = ours(
        torch.tensor(prompt), torch.arange(len(prompt)), ContiguousAttention().step([0], [len(prompt)])
    )
    logits = ours.compute_logits(hidden)
    expected = hf(torch.tensor([prompt])).logits[0]
    assert logits.dtype == torch.float32 and logits.shape == expected.shape
    torch.testing.assert_close(logits, expected, atol=LOGITS_ATOL, rtol=0)


def test_batched_greedy_matches_transformers(pair):
    ours, hf = pair
    got = greedy_generate(ours, PROMPTS, max_new_tokens=24)
    assert got == [transformers_greedy(hf, p, 24) for p in PROMPTS]


@torch.inference_mode()
def test_mixed_prefill_and_decode_step_equals_separate_runs():
    """One step holding sequence 0's decode token and sequence 1's whole prompt gives the same
    hidden states as running them apart (nothing leaks between rows of the flat batch)."""
    model = _tiny_model()
    a, b = PROMPTS[0], PROMPTS[1]
    attn = ContiguousAttention()
    model(torch.tensor(a[:-1]), torch.arange(len(a) - 1), attn.step([0], [len(a) - 1]))
    mixed = model(
        torch.tensor([a[-1], *b]), torch.tensor([len(a) - 1, *range(len(b))]), attn.step([0, 1], [1, len(b)])
    )
    alone_a = model(torch.tensor(a), torch.arange(len(a)), ContiguousAttention().step([0], [len(a)]))
    alone_b = model(torch.tensor(b), torch.arange(len(b)), ContiguousAttention().step([0], [len(b)]))
    torch.testing.assert_close(mixed[0], alone_a[-1], atol=1e-5, rtol=0)
    torch.testing.assert_close(mixed[1:], alone_b, atol=1e-5, rtol=0)


@torch.inference_mode()
def test_attention_step_receives_documented_shapes():
    model = _tiny_model()
    c = model.config
    seen = []

    class Recorder(ContiguousAttention):
        def forward(self, layer_idx, q, k, v):
            seen.append(
                (
                    layer_idx,
                    q.shape,
                    k.shape,
                    v.shape,
                    # each token's [heads, head_dim] contiguous (tokens may be strided: views)
                    all(t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in (q, k, v)),
                )
            )
            return super().forward(layer_idx, q, k, v)

    model(torch.tensor([3, 4, 5]), torch.arange(3), Recorder().step([0], [3]))
    assert seen == [
        (
            i,
            (3, c.num_heads, c.head_dim),
            (3, c.num_kv_heads, c.head_dim),
            (3, c.num_kv_heads, c.head_dim),
            True,
        )
        for i in range(c.num_layers)
    ]
    assert c.attention_scale == c.head_dim**-0.5


@torch.inference_mode()
def test_bfloat16_model_runs_close_to_float32():
    model32 = _tiny_model()
    model16 = build_model(model32.config, "cpu", torch.bfloat16)
    model16.load_state_dict(model32.state_dict())
    prompt = torch.tensor(PROMPTS[0])
    pos = torch.arange(len(prompt))
    logits32 = model32.compute_logits(model32(prompt, pos, ContiguousAttention().step([0], [len(prompt)])))
    logits16 = model16.compute_logits(model16(prompt, pos, ContiguousAttention().step([0], [len(prompt)])))
    assert logits16.dtype == torch.float32
    assert (logits16 - logits32).abs().max() < 0.1 * logits32.abs().max()


_MODEL_CACHE = {}


def _tiny_model():
    if "m" not in _MODEL_CACHE:
        import tempfile

        with tempfile.TemporaryDirectory() as d:
            _MODEL_CACHE["m"] = load_model(make_tiny_llama(d, seed=7)).model
    return _MODEL_CACHE["m"]


# --- config ------------------------------------------------------------------------------------------

LLAMA_V5 = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
    "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0},
    "bos_token_id": 1,
    "eos_token_id": 2,
    "dtype": "bfloat16",
}


def test_config_from_transformers5_llama():
    c = ModelConfig.from_hf_dict(LLAMA_V5)
    assert (c.architecture, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (
        "LlamaForCausalLM",
        30,
        9,
        3,
        64,
    )
    assert (c.rope_theta, c.rope_scaling, c.tie_word_embeddings) == (100000.0, None, True)
    assert (c.bos_token_id, c.eos_token_ids, c.dtype, c.sliding_window) == (1, (2,), "bfloat16", None)
    assert (c.attention_bias, c.attention_out_bias) == (False, False)


def test_config_from_transformers4_spelling_with_llama3_scaling_and_eos_list():
    d = {
        **LLAMA_V5,
        "rope_theta": 500000.0,
        "eos_token_id": [128001, 128009],
        "torch_dtype": "bfloat16",
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    }
    del d["rope_parameters"], d["dtype"]
    c = ModelConfig.from_hf_dict(d)
    assert c.rope_theta == 500000.0 and c.eos_token_ids == (128001, 128009)
    assert c.rope_scaling == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }


def test_config_mistral_reports_sliding_window_and_qwen2_has_qkv_bias():
    mistral = ModelConfig.from_hf_dict(
        {**LLAMA_V5, "architectures": ["MistralForCausalLM"], "sliding_window": 4096}
    )
    assert mistral.sliding_window == 4096 and not mistral.attention_bias
    qwen = ModelConfig.from_hf_dict(
        {
            **LLAMA_V5,
            "architectures": ["Qwen2ForCausalLM"],
            "sliding_window": 4096,
            "use_sliding_window": False,
        }
    )
    assert qwen.sliding_window is None and (qwen.attention_bias, qwen.attention_out_bias) == (True, False)
    llama_bias = ModelConfig.from_hf_dict({**LLAMA_V5, "attention_bias": True})
    assert (llama_bias.attention_bias, llama_bias.attention_out_bias) == (True, True)


def test_config_without_architectures_uses_model_type():
    d = {k: v for k, v in LLAMA_V5.items() if k != "architectures"}
    assert ModelConfig.from_hf_dict({**d, "model_type": "qwen2"}).architecture == "Qwen2ForCausalLM"


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"architectures": ["GPT2LMHeadModel"]},
            "unsupported model architecture GPT2LMHeadModel; kvpact supports "
            "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM",
        ),
        (
            {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
            "RoPE scaling type 'yarn' is not supported; kvpact supports default, linear, llama3",
        ),
        (
            {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}},
            "RoPE scaling 'llama3' lacks low_freq_factor, high_freq_factor, original_max_position_embeddings",
        ),
        ({"num_key_value_heads": 4}, "num_attention_heads (9) is not a multiple of num_key_value_heads (4)"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"vocab_size": None}, "required field 'vocab_size' is missing"),
    ],
)
def test_config_errors_name_the_problem(change, message):
    with pytest.raises(ModelLoadError) as e:
        ModelConfig.from_hf_dict({**LLAMA_V5, **change}, source="m/config.json")
    assert str(e.value).startswith("m/config.json: ") and message in str(e.value)


def test_rope_linear_divides_frequencies_and_llama3_keeps_high_ones():
    plain = rope_inv_freq(64, 10000.0, None)
    torch.testing.assert_close(rope_inv_freq(64, 10000.0, {"rope_type": "linear", "factor": 4.0}), plain / 4)
    llama3 = rope_inv_freq(
        64,
        10000.0,
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128,
        },
    )
    assert llama3[0] == plain[0] and llama3[-1] == plain[-1] / 8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_is_bit_identical_to_rotate_half(dtype):
    """The per-step layout (cos twice, sin negated on the first half; a roll instead of chunk + cat) gives
    exactly the textbook `x1 * cos - x2 * sin, x2 * cos + x1 * sin`, with cos/sin cast to x's dtype."""
    torch.manual_seed(0)
    x = torch.randn(5, 7, 16).to(dtype)[:, 1:6]  # strided tokens, as views of the fused projection are
    positions = torch.tensor([0, 3, 17, 255, 4096])
    rotary = RotaryEmbedding(16, 10000.0, None)
    freqs = positions.float()[:, None] * rope_inv_freq(16, 10000.0, None)[None, :]
    c, s = freqs.cos().to(dtype)[:, None, :], freqs.sin().to(dtype)[:, None, :]
    x1, x2 = x.chunk(2, dim=-1)
    expected = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    got = apply_rotary(x, *rotary.cos_sin(positions, dtype))
    assert got.dtype == dtype and got.is_contiguous()
    assert torch.equal(got, expected)


# --- startup ------------------------------------------------------------------------------------------

LOAD_AND_LIST_IMPORTS = (
    "import json, sys\n"
    "from kvpact.worker.loader import load_model\n"
    "load_model(sys.argv[1])\n"
    "print(json.dumps(sorted(m for m in ('sympy', 'torch._dynamo') if m in sys.modules)))"
)


def test_loading_a_model_imports_neither_sympy_nor_dynamo(tmp_path):
    """A worker's start pays for neither: nn.Embedding's init on the meta device imported torch._dynamo
    (1.4-1.9 s) and Module.to_empty imports sympy (0.5 s); the loader builds without both."""
    directory = make_tiny_llama(tmp_path, seed=7)
    out = subprocess.run(
        [sys.executable, "-c", LOAD_AND_LIST_IMPORTS, str(directory)],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    assert json.loads(out.stdout.splitlines()[-1]) == []  # the last line: the loader logs before it
