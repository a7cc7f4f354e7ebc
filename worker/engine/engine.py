"""The engine: one thread owns the model, the cache and the scheduler, and runs the step loop.

    caller (asyncio or plain thread)                 step thread
    --------------------------------                 -----------
    generate(request): validate, tokenize  --add-->  queue -> scheduler.add
      (tokenize in a prepare thread)
    abort(request_id)                      --abort-> queue -> scheduler.finish (frees its cache)
    <-- GenerationOutput pieces (call_soon_threadsafe) --  schedule -> run model -> sample -> stream

Invariants: only the step thread touches the scheduler, the cache and the sequences; the caller
threads only enqueue commands and read a stats snapshot. A request that can never fit is refused in
the caller before it is queued. A failed step fails the requests it was running (their streams raise
GenerationError) and frees their cache; the others keep going. `close()` stops the thread within a
bound and fails whatever was still in flight with EngineClosedError.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, NamedTuple

import structlog
import torch

from kvpact.shared.errors import RequestError
from kvpact.shared.handshake import WorkerLoad
from kvpact.shared.limits import check_completion_budget, excerpt
from kvpact.shared.realized import RealizedCache
from kvpact.worker.engine.cpu_share import CpuShare
from kvpact.worker.engine.engine_observer import EngineObserver, FinishedRequest
from kvpact.worker.engine.model_runner import ModelRunner
from kvpact.worker.engine.output_stream import OutputStream, RequestStreams, Sink
from kvpact.worker.engine.request import (
    ChatMessage,
    EngineClosedError,
    EngineOverloadedError,
    FinishReason,
    GenerationError,
    GenerationOutput,
    GenerationRequest,
    GenerationResult,
)
from kvpact.worker.engine.sequence import Sequence
from kvpact.worker.scheduler.base import Scheduler
from kvpact.worker.startup.device import bind_thread
from kvpact.worker.tokenizer import Tokenizer

if TYPE_CHECKING:
    from kvpact.worker.engine.grammar import GrammarCompiler, GrammarState

DEFAULT_MAX_TOKENS = 256
CLOSE_TIMEOUT_S = 30.0
TPS_WINDOW_S = 5.0
DEFAULT_MAX_WAITING = 256  # requests accepted but not yet running, beyond which new ones are refused
PREPARE_THREADS = 2  # prompts rendered and tokenized at once (the tokenizer is native code)


class Prepared(NamedTuple):
    """A request made ready off the step thread: its prompt's token ids, its max_tokens and its compiled
    grammar (an xgrammar CompiledGrammar; None without response_format)."""

    prompt_ids: list[int]
    max_tokens: int
    grammar: Any


def _grammar_state(compiled: Any) -> GrammarState | None:
    if compiled is None:
        return None
    from kvpact.worker.engine.grammar import GrammarState

    return GrammarState(compiled)


class Engine:
    def __init__(
        self,
        runner: ModelRunner,
        scheduler: Scheduler,
        tokenizer: Tokenizer,
        *,
        realized: RealizedCache,
        model_name: str,
        max_model_len: int,
        vocab_size: int,
        log: Any = None,
        observer: EngineObserver | None = None,
        cpu_share: CpuShare | None = None,
    ) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.realized = realized
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.log = log or structlog.get_logger("worker.engine")
        self.observer = observer  # per-request events (worker/metrics.py); set before the first request
        self.cpu_share = cpu_share  # the step thread applies its thread count (None: torch's default)
        self._commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._requests: dict[str, RequestStreams] = {}  # step thread only
        self._live: set[str] = set()  # request ids queued or running; guarded by _lock
        self._lock = threading.Lock()
        self._seq_ids = itertools.count()
        self._closed = threading.Event()
        self._generated: deque[tuple[float, int]] = deque()  # (time, tokens) per step, for tokens/s
        self._counts = (0, 0)  # (running, waiting) after the last step
        # Requests accepted but not running yet (being tokenized, queued, or waiting in the scheduler)
        # are capped: past it a new request is refused at once (the worker's --max-waiting).
        self.max_waiting = DEFAULT_MAX_WAITING
        self._num_preparing = 0  # guarded by _lock
        # Called from the step thread, once, if the engine stops on an internal error (the worker exits).
        self.on_fatal: Callable[[str], object] | None = None
        self._grammars: GrammarCompiler | None = None  # built on first use; see _grammar_compiler
        self._grammar_lock = threading.Lock()
        # Renders and tokenizes prompts for generate(), off the caller's event loop.
        self._preparer = ThreadPoolExecutor(max_workers=PREPARE_THREADS, thread_name_prefix="kvpact-prepare")
        self._thread = threading.Thread(target=self._loop, name="kvpact-engine", daemon=True)
        self._thread.start()

    # ---- caller side ----

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[GenerationOutput]:
        """Stream the request's pieces; the last has finish_reason and usage. Raises RequestError before
        the first piece for a request that can never be served, GenerationError if the engine fails
        it. Stopping the iteration early (or cancelling the task) aborts it and frees its cache."""
        loop = asyncio.get_running_loop()
        pieces: asyncio.Queue[GenerationOutput | BaseException] = asyncio.Queue()

        def sink(item: GenerationOutput | BaseException) -> None:
            try:
                loop.call_soon_threadsafe(pieces.put_nowait, item)
            except RuntimeError:  # the caller's event loop is gone: nobody is listening
                self.abort(request.request_id)

        # Rendering and tokenizing run in a thread: a large prompt must not stall the worker's event
        # loop (heartbeats, Stats, every other stream).
        try:
            with self._lock:
                self._check_room()
                self._num_preparing += 1
            try:
                prepared = await loop.run_in_executor(self._preparer, self._prepare, request)
            except RuntimeError as exc:  # the preparer was shut down: the engine is closing
                if not self._closed.is_set():
                    raise
                raise EngineClosedError("the engine is closed") from exc
            finally:
                with self._lock:
                    self._num_preparing -= 1
            self._enqueue(request, prepared, sink)
        except (RequestError, EngineClosedError, EngineOverloadedError):
            self._rejected()
            raise
        finished = False
        try:
            while not finished:
                item = await pieces.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.usage is not None  # the request's last piece (all n completions ended)
                yield item
        finally:
            if not finished:
                self.abort(request.request_id)

    def submit(self, request: GenerationRequest, sink: Sink) -> None:
        """Validate and tokenize in the calling thread, then queue. `sink` is called from the step
        thread with each piece, or once with an exception."""
        try:
            self._enqueue(request, self._prepare(request), sink)
        except (RequestError, EngineClosedError, EngineOverloadedError):
            self._rejected()
            raise

    def _rejected(self) -> None:
        if self.observer is not None:
            self.observer.request_rejected()

    def _enqueue(self, request: GenerationRequest, prepared: Prepared, sink: Sink) -> None:
        prompt_ids, max_tokens, compiled = prepared
        eos = frozenset() if request.ignore_eos else self.tokenizer.eos_token_ids
        streams = RequestStreams(sink)
        for index in range(request.n):
            seq = Sequence.create(
                seq_id=next(self._seq_ids),
                request_id=request.request_id,
                prompt_token_ids=prompt_ids,
                sampling=request.sampling,
                max_tokens=max_tokens,
                stop_token_ids=frozenset(request.stop_token_ids) | eos,
                device=self.runner.device,
                min_tokens=request.min_tokens,
                grammar=_grammar_state(compiled),
                index=index,
            )
            OutputStream(seq, self.tokenizer, request.stop, streams)
        with self._lock:  # with close() under the same lock, a queued add is always drained
            if self._closed.is_set():
                raise EngineClosedError("the engine is closed")
            self._check_room()
            if request.request_id in self._live:
                raise RequestError(
                    f"request_id {excerpt(request.request_id)} is already in flight; send a new request_id "
                    "(or none: the server assigns one)"
                )
            self._live.add(request.request_id)
            self._commands.put(("add", streams))

    def _check_room(self) -> None:
        """Under _lock: refuse a new request when max_waiting requests are already accepted and not
        running (those being tokenized count too)."""
        # Running: what the last step ran, or what the batch will take at once (a burst arrives before
        # any step has counted it), so a burst is not refused early by a stale count.
        in_flight = len(self._live) + self._num_preparing
        running = max(self._counts[0], min(in_flight, self.scheduler.max_num_seqs))
        waiting = in_flight - running
        if waiting >= self.max_waiting:
            raise EngineOverloadedError(
                f"{waiting} requests are already waiting for a place in the batch (--max-waiting "
                f"{self.max_waiting}); retry later, or send fewer requests at once"
            )

    def num_in_flight(self) -> int:
        """Requests accepted and not finished (being tokenized, queued, waiting or running)."""
        with self._lock:
            return len(self._live) + self._num_preparing

    def abort(self, request_id: str) -> bool:
        """True if the request was queued or running (it ends with finish_reason ABORT)."""
        with self._lock:
            found = request_id in self._live
        if found:
            self._commands.put(("abort", request_id))
        return found

    def stats(self) -> WorkerLoad:
        """A snapshot of the load, as the router sees it (EAGER: blocks are slots, one per sequence);
        tokens_per_second is over the last TPS_WINDOW_S seconds."""
        now = time.monotonic()
        with self._lock:
            window = [(t, n) for t, n in self._generated if now - t <= TPS_WINDOW_S]
            running, waiting = self._counts
        tps = sum(n for _, n in window) / (now - window[0][0]) if len(window) > 1 else 0.0
        return WorkerLoad(
            num_running=running,
            num_waiting=waiting,
            num_free_blocks=self.scheduler.num_free_blocks,
            num_total_blocks=self.scheduler.num_total_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            tokens_per_second=tps,
            kernel_compiles_after_ready=self.runner.kernel_compiles_after_ready(),
        )

    def close(self) -> None:
        """Stop the step loop (after the step in progress) and fail what is still in flight. Idempotent."""
        with self._lock:
            if self._closed.is_set():
                return
            self._closed.set()
        self._commands.put(("wake", None))
        self._preparer.shutdown(wait=False, cancel_futures=True)
        self._thread.join(timeout=CLOSE_TIMEOUT_S)
        if self._thread.is_alive():
            self.log.warning("engine step thread did not stop in time", timeout_s=CLOSE_TIMEOUT_S)

    def run(
        self, requests: Iterable[GenerationRequest], timeout: float | None = None
    ) -> list[GenerationResult]:
        """Synchronous helper for tests and benchmarks: submit all, wait for all, in request order."""
        return [GenerationResult.join(outputs) for outputs in self._run(requests, timeout)]

    def run_choices(
        self, requests: Iterable[GenerationRequest], timeout: float | None = None
    ) -> list[list[GenerationResult]]:
        """As run(), for requests with n >= 1 completions: each request's results in index order."""
        return [GenerationResult.join_choices(outputs) for outputs in self._run(requests, timeout)]

    def _run(
        self, requests: Iterable[GenerationRequest], timeout: float | None
    ) -> list[list[GenerationOutput]]:
        requests = list(requests)
        outputs: dict[str, list[GenerationOutput]] = {r.request_id: [] for r in requests}
        errors: list[BaseException] = []
        remaining = threading.Semaphore(0)

        def sink_for(rid: str) -> Sink:
            def sink(item: GenerationOutput | BaseException) -> None:
                if isinstance(item, BaseException):
                    errors.append(item)
                    remaining.release()
                    return
                outputs[rid].append(item)
                if item.usage is not None:
                    remaining.release()

            return sink

        for r in requests:
            self.submit(r, sink_for(r.request_id))
        deadline = None if timeout is None else time.monotonic() + timeout
        for _ in requests:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not remaining.acquire(timeout=left):
                raise TimeoutError(f"requests did not finish within {timeout} s")
        if errors:
            raise errors[0]
        return [outputs[r.request_id] for r in requests]

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _grammar_compiler(self) -> GrammarCompiler:
        """Built on the first response_format request (it reads the whole vocabulary, about a second)."""
        with self._grammar_lock:
            if self._grammars is None:
                from kvpact.worker.engine.grammar import GrammarCompiler

                try:
                    self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size)
                except Exception as e:  # xgrammar could not read this model's vocabulary
                    self.log.exception("grammar compiler could not be built")
                    raise RequestError(
                        "response_format cannot be enforced with this model's tokenizer "
                        f"({type(e).__name__}: {e}); send the request without response_format"
                    ) from e
            return self._grammars

    def _prepare(self, request: GenerationRequest) -> Prepared:
        """Validate, tokenize and compile the request's grammar (in a prepare thread or the caller's,
        never the step thread)."""
        request.validate()
        prompt = request.prompt
        messages = [m for m in prompt if isinstance(m, ChatMessage)] if isinstance(prompt, tuple) else []
        token_ids = (
            [t for t in prompt if isinstance(t, int) and not isinstance(t, bool)] if messages == [] else []
        )
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif len(messages) == len(prompt):
            ids = self.tokenizer.encode_chat([{"role": m.role, "content": m.content} for m in messages])
        elif len(token_ids) == len(prompt):
            ids = token_ids
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise RequestError(f"prompt token ids must be in [0, {self.vocab_size}), got {bad[:5]}")
        else:
            raise RequestError("a prompt tuple must hold only ChatMessage or only int token ids")
        bad_stop = [t for t in request.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad_stop:
            raise RequestError(f"stop_token_ids must be in [0, {self.vocab_size}), got {bad_stop[:5]}")
        n, limit = len(ids), self.max_model_len
        if n == 0:
            raise RequestError("the prompt is empty after tokenization")
        if n >= limit:
            raise RequestError(
                f"the prompt has {n} tokens but max_model_len is {limit}, which leaves no room to generate; "
                "shorten the prompt (or start the worker with a larger --max-model-len)"
            )
        max_tokens = (
            request.max_tokens if request.max_tokens is not None else min(DEFAULT_MAX_TOKENS, limit - n)
        )
        if request.n > self.scheduler.max_num_seqs:
            raise RequestError(
                f"n ({request.n}) is more than the {self.scheduler.max_num_seqs} sequences this worker runs "
                "at once (--max-num-seqs); lower n"
            )
        check_completion_budget(request.n, max_tokens)
        if request.min_tokens > max_tokens:
            raise RequestError(
                f"min_tokens ({request.min_tokens}) must be <= max_tokens ({max_tokens}, "
                + ("as sent" if request.max_tokens is not None else "the default for this prompt")
                + "); lower min_tokens or raise max_tokens"
            )
        if n + max_tokens > limit:
            raise RequestError(
                f"the prompt ({n} tokens) plus max_tokens ({max_tokens}) is {n + max_tokens} tokens, "
                "more than "
                f"max_model_len {limit}; lower max_tokens to at most {limit - n}"
            )
        compiled = None
        if request.response_format is not None:
            compiled = self._grammar_compiler().compile(request.response_format)
        return Prepared(ids, max_tokens, compiled)

    # ---- step thread ----

    def _loop(self) -> None:
        with torch.inference_mode():
            try:
                bind_thread(self.runner.device)  # Triton launches on this thread's current CUDA device
            except Exception as e:
                self._stop_on_error(e)
            while not self._closed.is_set():
                try:
                    if self.cpu_share is not None:  # idle: its share goes to the other workers here
                        self.cpu_share.apply(busy=self.scheduler.has_work())
                    self._drain(block=not self.scheduler.has_work())
                    if not self._closed.is_set() and self.scheduler.has_work():
                        self._step()
                except Exception as e:  # a bug outside the model call: nothing's state can be trusted
                    self._stop_on_error(e)
        self._fail(list(self._requests.values()), EngineClosedError("the engine was closed"))
        self._drain(block=False)

    def _stop_on_error(self, e: Exception) -> None:
        self.log.exception("engine step failed; the engine stops and fails every request")
        with self._lock:
            self._closed.set()  # new requests get EngineClosedError (UNAVAILABLE)
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
        if self._closed.is_set():
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
        with self._lock:  # before any piece goes out: whoever saw a piece sees at least this step's counts
            self._counts = (len(self.scheduler.running), len(self.scheduler.waiting))
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
        with self._lock:
            self._generated.append((now, len(result.seqs)))
            while self._generated and now - self._generated[0][0] > TPS_WINDOW_S:
                self._generated.popleft()
            self._counts = (len(self.scheduler.running), len(self.scheduler.waiting))

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
        with self._lock:
            self._live.discard(request_id)
            self._counts = (len(self.scheduler.running), len(self.scheduler.waiting))
