"""The `worker` command line: --help documents the policy and every reason; flags -> WorkerSpec."""

import subprocess
import sys

import pytest

from kvpact.shared.event_loop import DEFAULT_EVENT_LOOP
from kvpact.shared.features import FeatureIntents, FeatureMode
from kvpact.shared.intent import CacheDtype, PagedAttentionMode, PagedBackend
from kvpact.shared.spec import LayerPlacement
from kvpact.worker.cli import parse_args


def test_help_shows_the_policy_flag_and_every_reason():
    result = subprocess.run(
        [sys.executable, "-m", "kvpact.worker", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())  # argparse wraps lines
    assert "--paged-attn {auto,on,off}" in text
    for reason in (
        "CPU/MPS default",
        "no Triton",
        "Triton off CUDA",
        "compute capability >= 8.0",
        "head sizes 32, 64, 80, 96, 128, 256",
        "--pa-block-size 8, 16, 32, 64",
        "KV dtypes bfloat16, float16, float32",
        "mixed device map",
        "sliding window",
        "KV budget",
    ):
        assert reason in text, reason
    assert "--max-model-len 0 the model's max positions, capped at 2048" in text
    assert "eager: 8 slots; paged: 32 sequences" in text
    assert "min(1 GiB, 10% of system RAM)" in text
    assert "78 configuration cannot be honored" in text
    assert "kernel self-test the Triton paged kernels, run once at startup" in text
    assert "0.9 x the GPU memory free at startup, less the weights and activation headroom" in text
    assert "--pa-memory-fraction F KV cache budget: F x the memory free at startup" in text


@pytest.mark.parametrize(("mode", "required"), [("auto", False), ("on", True)])
def test_auto_and_on_carry_a_paged_config_that_says_whether_it_is_required(mode, required):
    options = parse_args(["--paged-attn", mode, "--pa-block-size", "32", "--pa-context-tokens", "4096"])
    cache = options.spec.cache
    assert cache.mode is PagedAttentionMode(mode)
    assert cache.paged is not None
    assert cache.required is required
    assert cache.paged.block_size == 32
    assert cache.paged.context_tokens == 4096
    assert cache.paged.memory_fraction is None and cache.paged.memory_bytes is None


def test_off_carries_no_paged_config():
    options = parse_args(["--paged-attn", "off"])
    assert options.spec.cache.mode is PagedAttentionMode.OFF
    assert options.spec.cache.paged is None


@pytest.mark.parametrize(
    ("argv", "flags"),
    [
        (["--pa-cache-dtype", "float32"], "--pa-cache-dtype sets"),
        (["--pa-block-size=16"], "--pa-block-size sets"),  # at its default value: still a requirement
        (["--pa-block", "32", "--pa-context-tokens", "64"], "--pa-block-size, --pa-context-tokens set"),
    ],
)
def test_paged_flags_with_paged_attn_off_exit_2_naming_them(argv, flags, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(["--paged-attn", "off", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"{flags} the paged KV cache, and --paged-attn off builds none" in err
    assert "or use --paged-attn auto or on" in err


def test_defaults():
    options = parse_args([])
    assert options.spec.cache.mode is PagedAttentionMode.AUTO
    assert options.spec.cache.paged is not None and not options.spec.cache.required
    assert options.spec.model == ""
    assert options.spec.device == "auto"
    assert (options.listen_host, options.listen_port) == ("127.0.0.1", 0)
    assert options.router is None
    assert options.router_timeout_s == 60.0
    assert options.worker_id  # hostname-pid
    assert options.advertise_host is None and options.labels == ()
    assert options.spec.threads is None  # unset: the worker's share of the machine
    assert options.event_loop == DEFAULT_EVENT_LOOP


def test_advertise_host_and_labels():
    options = parse_args(["--advertise-host", "10.0.0.7", "--label", "ray.node=ab12", "--label", "empty="])
    assert options.advertise_host == "10.0.0.7"
    assert options.labels == (("ray.node", "ab12"), ("empty", ""))


def test_every_flag_reaches_the_spec():
    options = parse_args(
        [
            "--model", "/models/x", "--model-name", "x", "--device", "cuda:1",
            "--device-map", "cuda:0=20,cpu=10", "--dtype", "bfloat16", "--max-model-len", "512",
            "--max-num-seqs", "4", "--max-num-batched-tokens", "256",
            "--paged-attn", "on", "--pa-memory-bytes", "1000000", "--pa-cache-dtype", "float16",
            "--pa-backend", "torch", "--prefix-caching", "off", "--cpu-kernels", "on",
            "--quant-kernels", "on", "--cuda-graphs", "off", "--listen", "0.0.0.0:7000",
            "--router", "10.0.0.1:50051", "--router-timeout", "5", "--worker-id", "w1", "--threads", "3",
        ]
    )  # fmt: skip
    spec = options.spec
    assert (spec.model, spec.device, spec.dtype) == ("/models/x", "cuda:1", "bfloat16")
    assert spec.device_map == (LayerPlacement("cuda:0", 20), LayerPlacement("cpu", 10))
    assert (spec.max_model_len, spec.max_num_seqs, spec.max_num_batched_tokens) == (512, 4, 256)
    assert spec.threads == 3
    paged = spec.cache.paged
    assert paged is not None and spec.cache.required
    assert paged.memory_bytes == 1_000_000
    assert paged.cache_dtype is CacheDtype.FLOAT16 and paged.backend is PagedBackend.TORCH
    assert spec.features == FeatureIntents(FeatureMode.OFF, FeatureMode.ON, FeatureMode.ON, FeatureMode.OFF)
    assert (options.listen_host, options.listen_port) == ("0.0.0.0", 7000)
    assert options.router == "10.0.0.1:50051"
    assert (options.router_timeout_s, options.worker_id, options.model_name) == (5.0, "w1", "x")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--pa-memory-fraction", "0.5", "--pa-context-tokens", "100"], "not allowed with argument"),
        (["--pa-memory-bytes", "10", "--pa-memory-fraction", "0.5"], "not allowed with argument"),
        (["--pa-memory-fraction", "1.5"], "--pa-memory-fraction must be in (0, 1]"),
        (["--paged-attn", "maybe"], "invalid choice"),
        (["--device-map", "cuda:0"], "--device-map expects DEVICE=NUM_LAYERS"),
        (["--device", "tpu"], "expected auto, cpu, cuda, cuda:N or mps"),
        (["--listen", "nowhere"], "expected HOST:PORT"),
        (["--pa-block-size", "0"], "expected a whole number > 0"),
        (["--max-model-len", "99999999999999999999"], "expected a whole number >= 0 and <= 4294967295"),
        (["--pa-context-tokens", str(2**64)], "expected a whole number > 0 and <= 18446744073709551615"),
        (
            ["--device-map", "foo=2"],
            "--device-map: unknown device 'foo' in 'foo=2'; use cpu, cuda, cuda:N or mps",
        ),
        (["--device-map", "cpu=99999999999"], "--device-map expects DEVICE=NUM_LAYERS"),
        (["--router-timeout", "0"], "expected a number of seconds > 0"),
        (["--router-timeout", "inf"], "expected a number of seconds > 0"),
        (["--router-timeout", "nan"], "expected a number of seconds > 0"),
        (["--label", "ray.node"], "expected KEY=VALUE, got 'ray.node'"),
        (["--no-kv-cache"], "unrecognized arguments: --no-kv-cache"),  # removed: it was always refused
        (["--threads", "0"], "argument --threads: expected a whole number > 0 and <= 4294967295, got '0'"),
        (["--event-loop", "tokio"], "argument --event-loop: invalid choice: 'tokio'"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_event_loop_uvloop_where_it_is_not_installed_exits_2_naming_the_flag(monkeypatch, capsys):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name: None if name == "uvloop" else real_find_spec(name)
    )
    assert parse_args(["--event-loop", "asyncio"]).event_loop == "asyncio"
    with pytest.raises(SystemExit) as exc:
        parse_args(["--event-loop", "uvloop"])
    assert exc.value.code == 2
    assert "--event-loop uvloop (the default): uvloop is not installed" in capsys.readouterr().err
