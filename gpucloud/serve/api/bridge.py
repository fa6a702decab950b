"""The engine's step loop in its own thread, and the asyncio queues that connect it to HTTP.

The event loop never runs model code: a handler `submit`s prompts (validated and queued by
the engine), then awaits `RequestOutput`s on an asyncio queue. The engine thread calls
`step` while there is work and hands each step's outputs to the event loop, with one
`call_soon_threadsafe` for all the steps the loop has not yet taken. Leaving a `Submission`
early (client gone, drain timeout) aborts its unfinished requests, which frees their KV
blocks at the engine's next step.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace

from gpucloud.serve.engine import LLMEngine
from gpucloud.serve.outputs import RequestOutput
from gpucloud.serve.params import SamplingParams

log = logging.getLogger(__name__)

_IDLE_WAIT = 0.5  # seconds between heartbeats while there is nothing to do


class EngineDead(Exception):
    """The engine thread stopped on an error; no request can finish."""


@dataclass(slots=True)
class RequestTiming:
    """One finished request, for the latency histograms."""

    arrival: float
    first_token: float | None
    finished: float
    num_output_tokens: int
    finish_reasons: list[str]


@dataclass(slots=True, eq=False)
class Submission:
    """The engine requests behind one HTTP request (one per prompt), sharing one queue."""

    bridge: EngineBridge
    request_ids: list[str]
    n: int  # completions per prompt
    queue: asyncio.Queue
    arrival: float = field(default_factory=time.monotonic)
    first_token: dict[str, float] = field(default_factory=dict)
    num_tokens: dict[str, int] = field(default_factory=dict)
    finals: dict[str, RequestOutput] = field(default_factory=dict)
    reported: set[str] = field(default_factory=set)

    async def batches(self) -> AsyncIterator[list[tuple[int, RequestOutput]]]:
        """(prompt index, output) pairs as the engine produces them, until every prompt is
        done (aborted ones end with finish_reason "abort"): at each wake-up, all that is
        queued, so a reader behind the engine catches up in one go (one write of a stream).
        Raises EngineDead, after the outputs before it, if the engine thread died."""
        index = {rid: i for i, rid in enumerate(self.request_ids)}
        queue = self.queue
        try:
            while len(self.finals) < len(self.request_ids):
                items = [await queue.get()]
                while not queue.empty():
                    items.append(queue.get_nowait())
                batch, error = [], None
                for out in items:
                    if isinstance(out, BaseException):
                        error = out
                        break
                    self._observe(out)
                    batch.append((index[out.request_id], out))
                if batch:
                    yield batch
                if error is not None:
                    raise EngineDead("the engine stopped on an error") from error
        finally:
            self.close()

    async def final(self) -> list[RequestOutput]:
        """The finished output of every prompt, in prompt order."""
        async for _ in self.batches():
            pass
        return [self.finals[rid] for rid in self.request_ids]

    def close(self) -> None:
        """Abort what has not finished and count it as aborted; idempotent. A reader still
        waiting on `batches()` receives the engine's final "abort" outputs."""
        for rid in self.request_ids:
            if rid not in self.finals and rid not in self.reported:
                self.bridge.abort(rid)
                self._report(rid, time.monotonic(), ["abort"] * self.n)
        self.bridge.release(self)

    def _observe(self, out: RequestOutput) -> None:
        now = time.monotonic()
        rid = out.request_id
        self.num_tokens[rid] = sum(len(c.token_ids) for c in out.outputs)
        if rid not in self.first_token and self.num_tokens[rid]:
            self.first_token[rid] = now
        if out.finished:
            self.finals[rid] = out
            self._report(rid, now, [c.finish_reason or "abort" for c in out.outputs])

    def _report(self, rid: str, now: float, reasons: list[str]) -> None:
        if rid in self.reported:
            return
        self.reported.add(rid)
        timing = RequestTiming(
            self.arrival, self.first_token.get(rid), now, self.num_tokens.get(rid, 0), reasons
        )
        self.bridge.on_finish(timing)


class EngineBridge:
    """Owns the engine thread. `submit`, `abort` and `release` run on the event loop."""

    def __init__(self, engine: LLMEngine, on_finish: Callable[[RequestTiming], None]):
        self.engine = engine
        self.on_finish = on_finish
        self._queues: dict[str, asyncio.Queue] = {}
        self._open: set[Submission] = set()
        self._wake = threading.Event()
        self._pending: list[list[RequestOutput]] = []  # steps' outputs the loop has not taken
        self._pending_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._counter = 0
        self.last_turn = time.monotonic()
        self.error: BaseException | None = None

    # ---- lifecycle -----------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()

    def healthy(self, stall_after: float) -> bool:
        """The thread is alive, has not failed and finished a turn within `stall_after` s."""
        return (
            self._thread is not None
            and self._thread.is_alive()
            and self.error is None
            and time.monotonic() - self.last_turn < stall_after
        )

    @property
    def num_open(self) -> int:
        """HTTP requests still waiting for outputs."""
        return len(self._open)

    # ---- requests (event loop) -------------------------------------------------------
    def submit(
        self,
        prompts: list[str | list[int]],
        params: SamplingParams,
        lora: str | None = None,
        priority: int = 0,
    ) -> Submission:
        """Queue one engine request per prompt, on LoRA adapter `lora` if named, with
        `priority`. Raises the engine's UserError/CapacityError (nothing stays queued then)
        or EngineDead."""
        if self.error is not None:
            raise EngineDead("the engine stopped on an error")
        self._counter += 1
        ids = [f"r{self._counter}-{i}" for i in range(len(prompts))]
        sub = Submission(self, ids, params.n, asyncio.Queue())
        added: list[str] = []
        try:
            for rid, prompt in zip(ids, prompts, strict=True):
                self._queues[rid] = sub.queue
                self.engine.add_request(prompt, replace(params), rid, lora_request=lora,
                                        priority=priority)  # fmt: skip
                added.append(rid)
        except BaseException:
            for rid in ids:
                self._queues.pop(rid, None)
            for rid in added:
                self.engine.abort_request(rid)
            self._wake.set()
            raise
        self._open.add(sub)
        self._wake.set()
        return sub

    def abort(self, request_id: str) -> None:
        """Stop a request; its final output (finish_reason "abort") still reaches its queue."""
        if request_id in self._queues:
            self.engine.abort_request(request_id)
            self._wake.set()

    def release(self, sub: Submission) -> None:
        self._open.discard(sub)

    def abort_all(self) -> None:
        for sub in list(self._open):
            sub.close()

    # ---- the engine thread -----------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stop.is_set():
                self.last_turn = time.monotonic()
                if not engine.has_unfinished():
                    self._wake.wait(_IDLE_WAIT)
                    self._wake.clear()  # checked again right after: a wake-up is never lost
                    continue
                outputs = engine.step()
                if outputs:
                    self._hand_over(outputs)
        except BaseException as e:
            log.exception("the engine loop stopped")
            self.error = e
            self._loop.call_soon_threadsafe(self._fail_all, e)

    def _hand_over(self, outputs: list[RequestOutput]) -> None:
        """Queue a step's outputs for the event loop, waking it only if it has not yet been
        woken for earlier ones: a loop that is behind delivers several steps in one turn
        (and its streams write them in one go) instead of one callback per step."""
        with self._pending_lock:
            self._pending.append(outputs)
            if len(self._pending) > 1:
                return
        self._loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self._pending_lock:
            steps, self._pending = self._pending, []
        for outputs in steps:
            self._route(outputs)

    def _route(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            queue = self._queues.get(out.request_id)
            if queue is None:
                continue
            if out.finished:
                del self._queues[out.request_id]
            queue.put_nowait(out)

    def _fail_all(self, error: BaseException) -> None:
        for queue in set(self._queues.values()):
            queue.put_nowait(error)
        self._queues.clear()
