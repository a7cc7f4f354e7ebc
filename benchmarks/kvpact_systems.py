"""kvpact as the offline and online suites run it: in-process, and as real processes (router + worker).

    open_engine(model, cache, ...)      an Engine built by worker/startup/engine_setup.py (a worker's way)
    share_weights(engine, source)       two in-process engines on one copy of the weights
    run_engine(engine, items)           every request submitted at once; wall time to the last token
    Cluster(model, cache, ...)          a `router` and `num_workers` (1) `worker` processes on 127.0.0.1 (free
                                        ports, logs in a temporary folder, stopped by pid); `start()` then
                                        `wait_ready()`,
                                        so several clusters can start at once
    stream_http(http_address, ...)      the same client over the OpenAI front: `concurrency` SSE streams of
                                        POST /v1/completions (token-id prompts, ignore_eos), closed loop
    stream(address, items)              an asyncio client (kvpact.client.AsyncClient, one channel) sending
                                        each request at its `arrival_s` (0: all at once) as token ids,
                                        greedy, ignore_eos, streaming; records when every token arrived

Both kvpact configurations get the same `--max-num-seqs` and `--max-model-len` (the eager cache on CPU
defaults to 8 slots, which would cap its batch, not measure it); the paged cache keeps its CPU default
budget (min(1 GiB, 10% of RAM)) and prefix caching.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from benchmarks.peers import Run
from benchmarks.workloads import TextItem, WorkItem
from kvpact.client import AsyncClient
from kvpact.deploy.processes import ProcessHandle, free_port, start_process, stop, wait_for_health
from kvpact.shared.features import FeatureIntents, FeatureMode
from kvpact.shared.intent import CacheDtype, PagedAttentionConfig, PagedAttentionMode, cache_intent
from kvpact.shared.spec import WorkerSpec
from kvpact.worker.engine.engine import Engine
from kvpact.worker.engine.fused_decode import fused_decode
from kvpact.worker.engine.request import GenerationRequest, SamplingParams
from kvpact.worker.startup.engine_setup import build_engine

MODES = {"paged": PagedAttentionMode.ON, "eager": PagedAttentionMode.OFF}
START_TIMEOUT_S = 300.0
RUN_TIMEOUT_S = 1800.0
HTTP_LISTENING = "router http listening on "
WARMUP = (WorkItem(tuple(range(100, 124)), 4), WorkItem(tuple(range(200, 208)), 4))


def open_engine(
    model: Path,
    cache: str,
    max_model_len: int,
    max_num_seqs: int,
    max_num_batched_tokens: int = 0,
    prompt_tokens_beside_decodes: int = 0,
    cache_dtype: CacheDtype = CacheDtype.AUTO,
    dtype: str = "auto",
    cpu_kernels: FeatureMode = FeatureMode.AUTO,
) -> Engine:
    """`cache`: "paged" (--paged-attn on) or "eager" (off); `max_num_batched_tokens`,
    `prompt_tokens_beside_decodes`, `cache_dtype` (paged), `dtype` and `cpu_kernels`: as the worker
    flags (0: the device default). The caller closes it (`with engine:`)."""
    spec = WorkerSpec(
        model=str(model), device="cpu", max_model_len=max_model_len, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        prompt_tokens_beside_decodes=prompt_tokens_beside_decodes, dtype=dtype,
        features=FeatureIntents(cpu_kernels=cpu_kernels),
    )  # fmt: skip
    settings = PagedAttentionConfig(cache_dtype=cache_dtype) if cache == "paged" else None
    engine = build_engine(replace(spec, cache=cache_intent(MODES[cache], settings)))
    run_engine(engine, [_fold(w, engine.vocab_size) for w in WARMUP])
    return engine


def share_weights(engine: Engine, source: Engine) -> None:
    """Point `engine`'s weights at `source`'s tensors (its own copy is freed), so that two in-process engines
    of one model differ only in their caches. Two copies of the same weights run the same matmuls at
    speeds up to 5% apart for the life of a process (docs/performance.md, "Scattered blocks prefetched"),
    which a paged / eager ratio would otherwise carry. Both engines idle; the C decode layers, which hold
    the weights' addresses, are gathered again."""
    model, theirs = engine.step_loop.runner.model, source.step_loop.runner.model
    for (name, mine), (other, their) in zip(model.named_parameters(), theirs.named_parameters(), strict=True):
        if (name, mine.shape, mine.dtype) != (other, their.shape, their.dtype):
            raise ValueError(f"share_weights: {name} {tuple(mine.shape)} is not {other} {tuple(their.shape)}")
        mine.data = their.data
    runner = engine.step_loop.runner
    if runner.fused is not None:  # with its Q4_1 panels where it had them (quant-kernels realized)
        runner.fused = fused_decode(model, runner.cache, quant=bool(runner.fused.q4_copies))


def _fold(item: WorkItem, vocab_size: int) -> WorkItem:
    return replace(item, prompt=tuple(t % vocab_size for t in item.prompt))


def greedy_request(request_id: str, prompt: Sequence[int], max_tokens: int) -> GenerationRequest:
    """The request every benchmark sends: greedy, ignore_eos, exactly `max_tokens` new tokens."""
    return GenerationRequest(
        request_id, tuple(prompt), SamplingParams(temperature=0), max_tokens=max_tokens, ignore_eos=True
    )


def run_engine(engine: Engine, items: Sequence[WorkItem], timeout_s: float = RUN_TIMEOUT_S) -> Run:
    requests = [
        greedy_request(f"r{n}-{time.monotonic_ns()}", item.prompt, item.max_tokens)
        for n, item in enumerate(items)
    ]
    started = time.perf_counter()
    results = engine.run(requests, timeout=timeout_s)
    wall = time.perf_counter() - started
    r = engine.realized
    settings = f"{r.kind.value} cache, backend {r.backend.value if r.backend else 'eager'}"
    return Run(wall, [tuple(res.token_ids) for res in results], settings)


@dataclass(slots=True)
class Cluster:
    """A router and its workers (`--paged-attn on|off`, no thread flags: each sizes its own CPU threads)
    as processes; `address` is the router's."""

    model: Path
    cache: str
    max_model_len: int
    max_num_seqs: int
    num_workers: int = 1
    http: bool = False  # also `--http-listen 127.0.0.1:0`; `http_address` is read back once ready
    worker_args: tuple[str, ...] = ()  # more worker flags (e.g. --max-num-batched-tokens N)
    address: str = ""
    http_address: str = ""
    handles: list[ProcessHandle] = field(default_factory=list)

    def start(self) -> Cluster:
        port = free_port()
        self.address = f"127.0.0.1:{port}"
        logs = tempfile.mkdtemp(prefix=f"kvpact-bench-{self.cache}-")
        python = sys.executable
        quiet = ["--log-format", "json", "--log-level", "WARNING"]
        router = [python, "-m", "kvpact.router", "--listen", self.address, *quiet]
        router += ["--expect-workers", str(self.num_workers)]
        if self.http:
            router += ["--http-listen", "127.0.0.1:0"]
        worker = [python, "-m", "kvpact.worker", "--router", self.address, "--model", str(self.model)]
        worker += ["--paged-attn", MODES[self.cache].value, "--device", "cpu"]
        worker += ["--max-model-len", str(self.max_model_len), "--max-num-seqs", str(self.max_num_seqs)]
        worker += list(self.worker_args)
        # die_with_parent: a benchmark killed mid-run (Ctrl-C twice, a timeout) leaves no process behind
        self.handles.append(start_process(router, name="router", log_dir=logs, die_with_parent=True))
        for n in range(self.num_workers):
            worker_id = self.cache if n == 0 else f"{self.cache}-{n + 1}"
            argv = [*worker, "--worker-id", worker_id, *quiet]
            self.handles.append(start_process(argv, name=worker_id, log_dir=logs, die_with_parent=True))
        return self

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        wait_for_health(self.address, timeout_s, watch=self.handles)
        if self.http:
            said = [ln for ln in self.handles[0].stdout().splitlines() if ln.startswith(HTTP_LISTENING)]
            if not said:
                raise RuntimeError(
                    f"the router did not print '{HTTP_LISTENING} ...':\n{self.handles[0].output()}"
                )
            self.http_address = said[0][len(HTTP_LISTENING) :].strip()
        asyncio.run(stream(self.address, list(WARMUP)))

    def stop(self) -> None:
        for handle in reversed(self.handles):  # the worker first, then its router
            stop(handle)


@dataclass(slots=True)
class Streamed:
    """One request through the router: when it was sent and when each token arrived (perf_counter)."""

    sent: float
    token_times: list[float]
    tokens: tuple[int, ...]

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.sent

    def inter_token(self) -> list[float]:
        """Gaps between consecutive tokens; tokens that arrive together in one message share the gap
        before it evenly (so coalescing neither hides nor adds latency)."""
        gaps: list[float] = []
        times = self.token_times
        i = 1
        while i < len(times):
            j = i
            while j + 1 < len(times) and times[j + 1] == times[i]:
                j += 1
            share = (times[i] - times[i - 1]) / (j - i + 1)
            gaps += [share] * (j - i + 1)
            i = j + 1
        return gaps


async def _one(client: AsyncClient, item: WorkItem, start: float) -> Streamed:
    delay = start + item.arrival_s - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    sent = time.perf_counter()
    times: list[float] = []
    tokens: list[int] = []
    stream = client.generate(list(item.prompt), max_tokens=item.max_tokens, temperature=0, ignore_eos=True)
    async for chunk in stream:
        if chunk.token_ids:
            now = time.perf_counter()
            times += [now] * len(chunk.token_ids)
            tokens += chunk.token_ids
    if len(tokens) != item.max_tokens:
        raise RuntimeError(f"asked for {item.max_tokens} tokens (ignore_eos), got {len(tokens)}")
    return Streamed(sent, times, tuple(tokens))


async def stream(address: str, items: Sequence[WorkItem], timeout_s: float = RUN_TIMEOUT_S) -> list[Streamed]:
    """Every item sent at `arrival_s` after the start; results in item order."""
    async with AsyncClient(address, timeout=timeout_s) as client:
        start = time.perf_counter()
        return list(await asyncio.gather(*(_one(client, item, start) for item in items)))


def stream_run(address: str, items: Sequence[WorkItem]) -> Run:
    """`stream` as an offline run: wall time from the first request sent to the last token."""
    streamed = asyncio.run(stream(address, items))
    wall = max(s.token_times[-1] for s in streamed) - min(s.sent for s in streamed)
    return Run(wall, [s.tokens for s in streamed], "router + worker processes, streaming client")


async def _one_http(client: Any, url: str, item: WorkItem | TextItem, body: dict[str, Any]) -> Streamed:
    prompt = item.prompt if isinstance(item, TextItem) else list(item.prompt)
    body = {"prompt": prompt, "max_tokens": item.max_tokens, **body}
    sent = time.perf_counter()
    times: list[float] = []
    completion_tokens = 0
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"POST {url}: HTTP {response.status_code}: {(await response.aread())[:400]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if event.get("choices") and event["choices"][0].get("text"):
                times.append(time.perf_counter())
            if event.get("usage"):
                completion_tokens = int(event["usage"]["completion_tokens"])
    if completion_tokens != item.max_tokens or not times:
        raise RuntimeError(f"asked for {item.max_tokens} tokens (ignore_eos), usage says {completion_tokens}")
    # one time per SSE event; the token count is the usage's (an event may carry several tokens)
    return Streamed(sent, times, tuple(range(completion_tokens)))


HTTP_BODY = {"temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


async def stream_http(
    http_address: str,
    items: Sequence[WorkItem | TextItem],
    concurrency: int,
    timeout_s: float = RUN_TIMEOUT_S,
    body: dict[str, Any] | None = None,
) -> list[Streamed]:
    """`items` in order through `concurrency` slots, each sending its next request when its last one
    ends (the load a fixed-concurrency benchmark client makes); results in completion order. `body`:
    the request's fields besides prompt and max_tokens (HTTP_BODY: greedy, ignore_eos, streamed with
    usage)."""
    import httpx

    url = f"http://{http_address}/v1/completions"
    queue = list(reversed(items))
    done: list[Streamed] = []
    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2)
    async with httpx.AsyncClient(limits=limits, timeout=timeout_s) as client:

        async def slot() -> None:
            while queue:
                done.append(await _one_http(client, url, queue.pop(), HTTP_BODY if body is None else body))

        await asyncio.gather(*(slot() for _ in range(concurrency)))
    return done
