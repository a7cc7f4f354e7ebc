"""The engine's caller side: validate, tokenize and admit requests, then hand them to the step loop.

    caller (asyncio or plain thread)                 step thread (step_loop.StepLoop)
    --------------------------------                 --------------------------------
    generate(request): validate, tokenize  --add-->  queue -> scheduler.add
      (tokenize in a prepare thread)
    abort(request_id)                      --abort-> queue -> scheduler.finish (frees its cache)
    <-- GenerationOutput pieces (LoopHandoff) -----------  schedule -> run model -> sample -> stream

Invariant: this side never touches the scheduler, the cache or the sequences once queued; it only
queues commands and reads the step loop's `InFlight` (under its lock) and load snapshot. A request
that can never fit is refused here, before it is queued (RequestError), and so is one past the
--max-waiting bound (EngineOverloadedError) or one sent to a closed engine (EngineClosedError).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import AsyncGenerator, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, NamedTuple

import structlog

from kvpact.shared.errors import RequestError
from kvpact.shared.handshake import WorkerLoad
from kvpact.shared.limits import check_completion_budget, excerpt
from kvpact.shared.realized import RealizedCache
from kvpact.worker.engine.cpu_share import CpuShare
from kvpact.worker.engine.engine_observer import EngineObserver
from kvpact.worker.engine.model_runner import ModelRunner
from kvpact.worker.engine.output_stream import OutputStream, RequestStreams, Sink
from kvpact.worker.engine.ready_pieces import LoopHandoff, ReadyPieces
from kvpact.worker.engine.request import (
    ChatMessage,
    EngineClosedError,
    EngineOverloadedError,
    GenerationOutput,
    GenerationRequest,
    GenerationResult,
    PromptEcho,
)
from kvpact.worker.engine.sequence import Sequence
from kvpact.worker.engine.step_loop import StepLoop
from kvpact.worker.scheduler.base import Scheduler
from kvpact.worker.tokenizer import Tokenizer

if TYPE_CHECKING:
    from kvpact.worker.engine.grammar import GrammarCompiler, GrammarState

DEFAULT_MAX_TOKENS = 256
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
        self.tokenizer = tokenizer
        self.realized = realized
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.log = log or structlog.get_logger("worker.engine")
        self.device = runner.device  # new sequences' tensors go here
        self.max_num_seqs = scheduler.max_num_seqs  # read once: the scheduler is the step thread's
        # Requests accepted but not running yet (being tokenized, queued, or waiting in the scheduler)
        # are capped: past it a new request is refused at once (the worker's --max-waiting).
        self.max_waiting = DEFAULT_MAX_WAITING
        self._seq_ids = itertools.count()
        self._grammars: GrammarCompiler | None = None  # built on first use; see _grammar_compiler
        self._grammar_lock = threading.Lock()
        # The last caller loop's handoff (a worker has one loop; a request keeps the one it started with)
        self._handoff: LoopHandoff | None = None
        # Renders and tokenizes prompts for generate(), off the caller's event loop.
        self._preparer = ThreadPoolExecutor(max_workers=PREPARE_THREADS, thread_name_prefix="kvpact-prepare")
        # Owns runner and scheduler from here on; set its observer and on_fatal before the first request.
        self.step_loop = StepLoop(runner, scheduler, log=self.log, observer=observer, cpu_share=cpu_share)
        self._in_flight = self.step_loop.in_flight

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[GenerationOutput]:
        """Stream the request's pieces; the last has finish_reason and usage. Raises RequestError before
        the first piece for a request that can never be served, GenerationError if the engine fails
        it. Stopping the iteration early (or cancelling the task) aborts it and frees its cache."""
        loop = asyncio.get_running_loop()
        handoff = self._handoff
        if handoff is None or handoff.loop is not loop:
            handoff = self._handoff = LoopHandoff(loop)
        pieces = ReadyPieces()  # merges what queued while the caller was writing

        def sink(item: GenerationOutput | BaseException) -> None:
            if not handoff.send(pieces, item):  # the caller's event loop is gone: nobody is listening
                self.abort(request.request_id)

        # Rendering and tokenizing run in a thread: a large prompt must not stall the worker's event
        # loop (heartbeats, Stats, every other stream).
        try:
            with self._in_flight.lock:
                self._check_room()
                self._in_flight.num_preparing += 1
            try:
                prepared = await loop.run_in_executor(self._preparer, self._prepare, request)
            except RuntimeError as exc:  # the preparer was shut down: the engine is closing
                if not self.step_loop.closed.is_set():
                    raise
                raise EngineClosedError("the engine is closed") from exc
            finally:
                with self._in_flight.lock:
                    self._in_flight.num_preparing -= 1
            self._enqueue(request, prepared, sink)
        except (RequestError, EngineClosedError, EngineOverloadedError):
            self._rejected()
            raise
        finished = False
        try:
            while not finished:
                item = await pieces.next()
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
        if self.step_loop.observer is not None:
            self.step_loop.observer.request_rejected()

    def _enqueue(self, request: GenerationRequest, prepared: Prepared, sink: Sink) -> None:
        prompt_ids, max_tokens, compiled = prepared
        eos = frozenset() if request.ignore_eos else self.tokenizer.eos_token_ids
        streams = RequestStreams(sink)
        echo = self._echo(request, prompt_ids) if request.echo else None
        for index in range(request.n):
            seq = Sequence.create(
                seq_id=next(self._seq_ids),
                request_id=request.request_id,
                prompt_token_ids=prompt_ids,
                sampling=request.sampling,
                max_tokens=max_tokens,
                stop_token_ids=frozenset(request.stop_token_ids) | eos,
                device=self.device,
                min_tokens=request.min_tokens,
                grammar=_grammar_state(compiled),
                index=index,
            )
            OutputStream(seq, self.tokenizer, request.stop, streams, echo)
        with self._in_flight.lock:  # with close() under the same lock, a queued add is always drained
            if self.step_loop.closed.is_set():
                raise EngineClosedError("the engine is closed")
            self._check_room()
            if request.request_id in self._in_flight.request_ids:
                raise RequestError(
                    f"request_id {excerpt(request.request_id)} is already in flight; send a new request_id "
                    "(or none: the server assigns one)"
                )
            self._in_flight.request_ids.add(request.request_id)
            self.step_loop.add(streams)

    def _check_room(self) -> None:
        """Under the in-flight lock: refuse a new request when max_waiting requests are already accepted
        and not running (those being tokenized count too)."""
        # Running: what the last step ran, or what the batch will take at once (a burst arrives before
        # any step has counted it), so a burst is not refused early by a stale count.
        in_flight = len(self._in_flight)
        running = max(self._in_flight.num_running, min(in_flight, self.max_num_seqs))
        waiting = in_flight - running
        if waiting >= self.max_waiting:
            raise EngineOverloadedError(
                f"{waiting} requests are already waiting for a place in the batch (--max-waiting "
                f"{self.max_waiting}); retry later, or send fewer requests at once"
            )

    def num_in_flight(self) -> int:
        """Requests accepted and not finished (being tokenized, queued, waiting or running)."""
        with self._in_flight.lock:
            return len(self._in_flight)

    def abort(self, request_id: str) -> bool:
        """True if the request was queued or running (it ends with finish_reason ABORT)."""
        with self._in_flight.lock:
            found = request_id in self._in_flight.request_ids
        if found:
            self.step_loop.abort(request_id)
        return found

    def stats(self) -> WorkerLoad:
        """A snapshot of the load, as the router sees it (StepLoop.load)."""
        return self.step_loop.load()

    def close(self) -> None:
        """Stop the step loop (after the step in progress) and fail what is still in flight. Idempotent."""
        if (
            self.step_loop.stop()
        ):  # `closed` first: a prepare the shutdown cuts short raises EngineClosedError
            self._preparer.shutdown(wait=False, cancel_futures=True)
            self.step_loop.join()
        ranks = self.step_loop.runner.ranks
        if ranks is not None:  # tensor parallel: the other ranks stop with the engine
            ranks.close()

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

    def _echo(self, request: GenerationRequest, prompt_ids: list[int]) -> PromptEcho:
        """The prompt as echoed (its logprobs come later, from the steps that compute it): a text prompt's
        own text, else its token ids decoded, special tokens shown."""
        prompt = request.prompt
        text = (
            prompt
            if isinstance(prompt, str)
            else self.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        )
        return PromptEcho(text, list(prompt_ids), self.tokenizer.token_texts(prompt_ids))

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
        bad_bias = [t for t in request.sampling.logit_bias if not 0 <= t < self.vocab_size]
        if bad_bias:
            raise RequestError(f"logit_bias token ids must be in [0, {self.vocab_size}), got {bad_bias[:5]}")
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
        if request.n > self.max_num_seqs:
            raise RequestError(
                f"n ({request.n}) is more than the {self.max_num_seqs} sequences this worker runs "
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
