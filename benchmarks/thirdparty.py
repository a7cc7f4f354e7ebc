"""A third-party OpenAI benchmark client (guidellm, from PyPI) that the online suite runs against the
router's HTTP front, to check the suite's own client against someone else's.

    ensure_guidellm()        the `guidellm` executable of its own venv, or a sentence saying why not
    run_guidellm(...)        one fixed-concurrency run of given text requests: TTFT p50 and output tok/s
                             from its per-request records
    tokenizer_dir(model)     the folder with the model's tokenizer.json (guidellm's --processor)

The client is installed by the benchmark, never into the product's environment: a venv of its own under
$KVPACT_BENCH_CLIENTS_DIR, else <kvpact cache>/bench-clients ($KVPACT_CACHE_DIR or ~/.cache/kvpact), in
`guidellm-<GUIDELLM_VERSION>`, created once (`python -m venv`, `pip install guidellm==VERSION`) and reused
while its `.installed` marker is there. guidellm 0.2.1 is the newest that installs without a CUDA torch
(0.8 pulls torch and the CUDA wheels, 6 GB); aiperf does not resolve here. With
KVPACT_BENCH_CLIENT_INSTALL=0 nothing is installed: a missing client is reported, not fetched.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from statistics import median

from benchmarks.workloads import TextItem

GUIDELLM_VERSION = "0.2.1"
DIR_ENV, INSTALL_ENV = "KVPACT_BENCH_CLIENTS_DIR", "KVPACT_BENCH_CLIENT_INSTALL"
INSTALL_TIMEOUT_S = 900.0
RUN_TIMEOUT_S = 600.0
# guidellm's scheduler loop sleeps 100 us between polls by default (settings.default_async_loop_sleep):
# about a fifth of a core on a 2-core machine it shares with the server, and 10,000 wake-ups a second
# between the worker's OpenMP threads. 10 ms still refills its request queue long before a request ends.
LOOP_SLEEP_S = 0.01


def clients_root() -> Path:
    if os.environ.get(DIR_ENV):
        return Path(os.environ[DIR_ENV])
    from kvpact.worker.loader.cache import cache_root

    return cache_root() / "bench-clients"


def ensure_guidellm() -> Path | str:
    """The path of `guidellm` in its venv (installed now if missing and allowed), or why there is none."""
    venv = clients_root() / f"guidellm-{GUIDELLM_VERSION}"
    exe = venv / "bin" / "guidellm"
    if (venv / ".installed").exists() and exe.exists():
        return exe
    if os.environ.get(INSTALL_ENV, "1") == "0":
        why = f"{INSTALL_ENV}=0 forbids installing it"
        return f"guidellm {GUIDELLM_VERSION} is not installed in {venv}; {why}"
    shutil.rmtree(venv, ignore_errors=True)  # a half-made venv from an interrupted install
    venv.parent.mkdir(parents=True, exist_ok=True)
    steps = [
        [sys.executable, "-m", "venv", str(venv)],
        [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", f"guidellm=={GUIDELLM_VERSION}"],
    ]
    for argv in steps:
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as e:
            shutil.rmtree(venv, ignore_errors=True)
            return f"could not install guidellm {GUIDELLM_VERSION} into {venv}: {e}"
        if done.returncode != 0:
            shutil.rmtree(venv, ignore_errors=True)
            tail = " ".join(line for line in done.stderr.splitlines() if "is ignored" not in line)[-300:]
            return (
                f"could not install guidellm {GUIDELLM_VERSION} into {venv} (no network to PyPI?): "
                f"`{' '.join(argv[-3:])}` exited {done.returncode}: {tail}"
            )
    (venv / ".installed").write_text(GUIDELLM_VERSION + "\n")
    return exe


def tokenizer_dir(model: Path) -> Path | None:
    """`model` itself when it is a folder with tokenizer.json; for a GGUF file, its conversion-cache
    entry (worker/loader/cache.py writes tokenizer.json there when a worker first loads it)."""
    if model.is_dir():
        return model if (model / "tokenizer.json").exists() else None
    from kvpact.worker.loader.cache import cache_root, entry_dir

    entry = entry_dir(cache_root(), model)
    return entry if (entry / "tokenizer.json").exists() else None


@dataclass(frozen=True, slots=True)
class ClientFigures:
    """One client's run, counted the same way for every client: TTFT = first streamed token - request
    sent, its median over requests; output tok/s = the requests' output tokens (the server's usage) /
    (last token of any request - first request sent)."""

    requests: int
    prompt_tokens: float  # mean per request, as the server counted them (usage)
    ttft_p50_s: float
    output_tok_s: float
    in_flight: float  # sum of the requests' spans (sent -> last token) / wall: concurrency kept busy
    cpu_s: float = float("nan")  # CPU seconds the client itself used (guidellm's: with its start-up)
    reported_output_tok_s: float = float("nan")  # the client's own summary figure, for reference


def run_guidellm(
    exe: Path,
    http_address: str,
    processor: Path,
    items: Sequence[TextItem],
    concurrency: int,
    seed: int,
) -> ClientFigures:
    """guidellm at a fixed `concurrency` for `items`, in order (its --data: a JSONL file of them with
    their prompt and output token counts; exactly `max_tokens` out each: it sends ignore_eos). The
    figures are computed from its per-request records (see ClientFigures); its own summary
    `output_tokens_per_second` is a time-binned rate, kept as `reported_output_tok_s`. Raises
    RuntimeError with its output when it fails."""
    with tempfile.TemporaryDirectory(prefix="kvpact-guidellm-") as tmp:
        out = Path(tmp) / "benchmarks.json"
        data = Path(tmp) / "requests.jsonl"
        rows = [
            {"prompt": i.prompt, "prompt_tokens_count": i.prompt_tokens, "output_tokens_count": i.max_tokens}
            for i in items
        ]
        data.write_text("".join(json.dumps(row) + "\n" for row in rows))
        num_requests = len(items)
        argv = [str(exe), "benchmark", "--target", f"http://{http_address}", "--processor", str(processor)]
        argv += ["--data", str(data)]  # no --data-sampler: guidellm sends the rows in file order
        # --rate as a float: guidellm 0.2.1 calls float.is_integer() on it (an int has none on 3.11)
        argv += ["--rate-type", "concurrent", "--rate", f"{float(concurrency)}"]
        argv += ["--max-requests", str(num_requests)]
        argv += ["--random-seed", str(seed), "--output-path", str(out), "--disable-progress"]
        argv += ["--disable-console-outputs"]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        env.setdefault("GUIDELLM__DEFAULT_ASYNC_LOOP_SLEEP", str(LOOP_SLEEP_S))
        before = _children_cpu_s()
        try:
            done = subprocess.run(
                argv, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=env, cwd=tmp
            )
        except subprocess.TimeoutExpired as e:
            raise RuntimeError(f"guidellm ran past {RUN_TIMEOUT_S:g} s: {str(e.stderr or '')[-800:]}") from e
        if done.returncode != 0 or not out.exists():
            raise RuntimeError(f"guidellm exited {done.returncode}: {(done.stdout + done.stderr)[-1500:]}")
        bench = json.loads(out.read_text())["benchmarks"][0]
    return replace(figures(bench), cpu_s=_children_cpu_s() - before)


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # finished children, and what they waited for
    return usage.ru_utime + usage.ru_stime


def figures(bench: dict) -> ClientFigures:
    """ClientFigures from one entry of guidellm's `benchmarks` JSON (every request is in it: no
    --output-sampling)."""
    ok = bench["requests"]["successful"]
    if not ok or bench["request_totals"]["errored"]:
        errors = [r.get("error", "") for r in bench["requests"].get("errored", [])][:2]
        raise RuntimeError(f"guidellm: {len(ok)} requests succeeded, errors: {errors}")
    wall = max(r["last_token_time"] for r in ok) - min(r["start_time"] for r in ok)
    return ClientFigures(
        requests=len(ok),
        prompt_tokens=sum(r["prompt_tokens"] for r in ok) / len(ok),
        ttft_p50_s=median(r["first_token_time"] - r["start_time"] for r in ok),
        output_tok_s=sum(r["output_tokens"] for r in ok) / wall,
        in_flight=sum(r["last_token_time"] - r["start_time"] for r in ok) / wall,
        reported_output_tok_s=float(bench["metrics"]["output_tokens_per_second"]["successful"]["mean"]),
    )
