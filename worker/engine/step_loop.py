"""The step loop: one thread owns the model runner, the cache and the scheduler, and steps them.

Commands arrive on a queue ("add" a tokenized request's streams, "abort" a request id); the thread
drains them between steps, then schedules, runs the model, samples and hands each piece to its
request's sink. Invariant: only the step thread changes the scheduler, the cache, the sequences and
their streams. Other threads put commands, share `InFlight` under its lock, and `load()` reads the
scheduler's counters. A failed model step fails the requests it ran (GenerationError) and frees
their cache; the others keep going. An error outside the model call stops the loop and fails
everything. `stop()` then `join()` end the thread within CLOSE_TIMEOUT_S, failing what was still in
flight with EngineClosedError.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvpact.shared.handshake import WorkerLoad
from kvpact.worker.engine.accelerator import bind_thread
from kvpact.worker.engine.cpu_share import CpuShare
from kvpact.worker.engine.engine_observer import EngineObserver, FinishedRequest
from kvpact.worker.engine.model_runner import ModelRunner
from kvpact.worker.engine.output_stream import OutputStream, RequestStreams
from kvpact.worker.engine.request import EngineClosedError, FinishReason, GenerationError
from kvpact.worker.engine.sequence import Sequence
from kvpact.worker.scheduler.base import Scheduler

CLOSE_TIMEOUT_S = 30.0
TPS_WINDOW_S = 5.0


@dataclass(slots=True)
class InFlight:
    """The requests accepted and not finished, as both sides see them; every field guarded by `lock`.

    The caller side counts the requests it is still preparing and adds an id when it queues its "add"
    (in the same critical section as its admission check); the step thread removes the id when the
    request ends, before its last piece goes out, and publishes its batch counts after each step."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    request_ids: set[str] = field(default_factory=set)  # queued or running
    num_preparing: int = 0  # being validated and tokenized (the caller side's)
    num_running: int = 0  # the scheduler's, after the last step
    num_waiting: int = 0
    generated: deque[tuple[float, int]] = field(default_factory=deque)  # (time, tokens) per step

    def __len__(self) -> int:
        """Requests accepted and not finished (being prepared, queued, waiting or running)."""
        return len(self.request_ids) + self.num_preparing


class StepLoop:
    def __init__(
        self,
        runner: ModelRunner,
        scheduler: Scheduler,
        *,
        log: Any,
        observer: EngineObserver | None = None,
        cpu_share: CpuShare | None = None,
    ) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.log = log
        self.observer = observer  # per-request events (worker/metrics.py); set before the first request
        self.cpu_share = cpu_share  # the step thread applies its thread count (None: torch's default)
        # Called from the step thread, once, if the loop stops on an internal error (the worker exits).
        self.on_fatal: Callable[[str], object] | None = None
        self.in_flight = InFlight()
        self.closed = threading.Event()  # set under in_flight.lock
        self._commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._requests: dict[str, RequestStreams] = {}  # step thread only
        self._thread = threading.Thread(target=self._loop, name="kvpact-engine", daemon=True)
        self._thread.start()

    # ---- any thread ----

    def add(self, request: RequestStreams) -> None:
        """Queue a request. The caller holds in_flight.lock, has seen `closed` unset and added the
        request's id, so a close() that follows still drains it (and fails it)."""
        self._commands.put(("add", request))

    def abort(self, request_id: str) -> None:
        """Queue an abort; a request that finished meanwhile is left alone."""
        self._commands.put(("abort", request_id))

    def load(self) -> WorkerLoad:
        """A snapshot of the load, as the router sees it (EAGER: blocks are slots, one per sequence);
        tokens_per_second is over the last TPS_WINDOW_S seconds."""
        now = time.monotonic()
        with self.in_flight.lock:
            window = [(t, n) for t, n in self.in_flight.generated if now - t <= TPS_WINDOW_S]
            running, waiting = self.in_flight.num_running, self.in_flight.num_waiting
        tps = sum(n for _, n in window) / (now - window[0][0]) if len(window) > 1 else 0.0
        return WorkerLoad(
            num_running=running,
            num_waiting=waiting,
            num_free_blocks=self.scheduler.num_free_blocks,
            num_total_blocks=self.scheduler.num_total_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            tokens_per_second=tps,
            kernel_compiles_after_ready=self.runner.kernel_compiles_after_ready(),
            eager_steps_under_graphs=self.runner.eager_steps_under_graphs(),
            prefix_cache_queries=self.scheduler.num_prefix_queries,
            prefix_cache_hits=self.scheduler.num_prefix_hits,
        )

    def stop(self) -> bool:
        """Ask the thread to stop after the step in progress (it fails what is still in flight); False
        if it was already stopped or stopping."""
        with self.in_flight.lock:
            if self.closed.is_set():
                return False
            self.closed.set()
        self._commands.put(("wake", None))
        return True

    def join(self) -> None:
        self._thread.join(timeout=CLOSE_TIMEOUT_S)
        if self._thread.is_alive():
            self.log.warning("engine step thread did not stop in time", timeout_s=CLOSE_TIMEOUT_S)

    # ---- step thread ----

    def _loop(self) -> None:
        with torch.inference_mode():
            try:
                bind_thread(self.runner.device)  # Triton launches on this thread's current CUDA device
            except Exception as e:
                self._stop_on_error(e)
            while not self.closed.is_set():
                try:
                    if self.cpu_share is not None:  # idle: its share goes to the other workers here
                        self.cpu_share.apply(busy=self.scheduler.has_work())
                    self._drain(block=not self.scheduler.has_work())
                    if not self.closed.is_set() and self.scheduler.has_work():
                        self._step()
                except Exception as e:  # a bug outside the model call: nothing's state can be trusted
                    self._stop_on_error(e)
        self._fail(list(self._requests.values()), EngineClosedError("the engine was closed"))
        self._drain(block=False)

    def _stop_on_error(self, e: Exception) -> None:
        self.log.exception("engine step failed; the engine stops and fails every request")
        with self.in_flight.lock:
            self.closed.set()  # new requests get EngineClosedError (UNAVAILABLE)
        self._fail(list(self._requests.values()), e)
        if self.on_fatal is not None:
            self.on_fatal(f"the engine failed: {type(e).__name__}: {e}")

    def _drain(self, block: bool) -> None:
        try:
            cmd, arg = self._commands.get() if block else self._commands.get_nowait()
            while True:
                if cmd == "add":
                    self._add(arg)
                elif cmd == "abort":
                    self._abort(arg)
                cmd, arg = self._commands.get_nowait()
        except queue.Empty:
            pass

    def _add(self, request: RequestStreams) -> None:
        if self.closed.is_set():
            self._release_id(request.request_id)
            request.fail(EngineClosedError("the engine was closed"))
            return
        self._requests[request.request_id] = request
        self.scheduler.add_group([s.seq for s in request.streams])

    def _abort(self, request_id: str) -> None:
        request = self._requests.get(request_id)
        if request is None:
            return  # it finished meanwhile
        live = [s for s in request.streams if not s.seq.is_finished]
        for stream in live:  # index order: index 0 (which may hold pending forks) first
            self.scheduler.finish(stream.seq)
        self._forget(request)
        self._observe_finish(request, FinishReason.ABORT.value, time.monotonic())
        for stream in live:
            stream.finish_early(FinishReason.ABORT)

    def _stream(self, seq: Sequence) -> OutputStream:
        return self._requests[seq.request_id].streams[seq.index]

    def _step(self) -> None:
        out = self.scheduler.schedule()
        if not out.chunks:
            raise RuntimeError(
                f"the scheduler found nothing to run with {len(self.scheduler.waiting)} waiting and "
                f"{len(self.scheduler.running)} running"
            )
        if self.observer is not None:
            scheduled_at = time.monotonic()
            for chunk in out.chunks:
                stream = self._stream(chunk.seq)
                if stream.scheduled_s is None:
                    stream.scheduled_s = scheduled_at
        try:
            result = self.runner.run(out.chunks)
        except Exception as e:
            self.log.exception("model step failed", request_ids=[c.seq.request_id for c in out.chunks])
            failed = dict.fromkeys(c.seq.request_id for c in out.chunks)
            self._fail([self._requests[rid] for rid in failed], e)
            return
        self.scheduler.on_step_done(out)
        with self.in_flight.lock:  # before any piece goes out: whoever saw a piece sees this step's counts
            self._publish_counts()
        now = time.monotonic()
        sampled = zip(result.seqs, result.token_ids, result.logprobs, result.top_logprobs, strict=True)
        for seq, token_id, logprob, top in sampled:
            request = self._requests.get(seq.request_id)
            if request is None:
                continue  # another of its completions failed it in this loop
            stream = request.streams[seq.index]
            try:
                piece = stream.on_token(token_id, logprob, top)
            except Exception as e:  # e.g. the detokenizer: only this request is affected
                self.log.exception("output processing failed", request_id=seq.request_id)
                self._fail([request], e)
                continue
            if self.observer is not None and seq.index == 0:
                self._observe_token(stream, now)
            if piece.finish_reason is not None:  # free its cache before anyone sees the piece
                self.scheduler.finish(seq)
            if piece.usage is not None:  # the request's last piece
                self._forget(request)
                self._observe_finish(request, piece.finish_reason.value if piece.finish_reason else "", now)
            stream.sink(piece)
        with self.in_flight.lock:
            generated = self.in_flight.generated
            generated.append((now, len(result.seqs)))
            while generated and now - generated[0][0] > TPS_WINDOW_S:
                generated.popleft()
            self._publish_counts()

    def _publish_counts(self) -> None:
        """Under in_flight.lock."""
        self.in_flight.num_running = len(self.scheduler.running)
        self.in_flight.num_waiting = len(self.scheduler.waiting)

    def _forget(self, request: RequestStreams) -> None:
        """Every sequence of the request is finished (cache freed): forget it (the caller emits its last
        piece)."""
        del self._requests[request.request_id]
        self._release_id(request.request_id)

    def _fail(self, requests: list[RequestStreams], error: BaseException) -> None:
        for request in requests:
            try:
                for stream in request.streams:  # index order, as in _abort
                    self.scheduler.finish(stream.seq)
            except Exception:  # noqa: BLE001 - the scheduler may be the broken part; still fail the stream
                pass
            self._requests.pop(request.request_id, None)
            self._release_id(request.request_id)
            self._observe_finish(request, "error", time.monotonic())
            if not isinstance(error, GenerationError):
                error = GenerationError(f"generation failed: {type(error).__name__}: {error}")
            request.fail(error)

    def _observe_token(self, stream: OutputStream, now: float) -> None:
        assert self.observer is not None
        if stream.last_token_s is None:
            self.observer.first_token(now - stream.arrival_s)
        else:
            self.observer.next_token(now - stream.last_token_s)
        stream.last_token_s = now

    def _observe_finish(self, request: RequestStreams, outcome: str, now: float) -> None:
        if self.observer is None:
            return
        stream = request.streams[0]
        usage = request.usage()
        queued = None if stream.scheduled_s is None else stream.scheduled_s - stream.arrival_s
        self.observer.request_finished(
            FinishedRequest(
                outcome=outcome,
                num_prompt_tokens=usage.prompt_tokens,
                num_generated_tokens=usage.completion_tokens,
                num_cached_tokens=usage.cached_prompt_tokens,
                queued_s=queued,
                duration_s=now - stream.arrival_s,
            )
        )

    def _release_id(self, request_id: str) -> None:
        with self.in_flight.lock:
            self.in_flight.request_ids.discard(request_id)
            self._publish_counts()
