"""Running the Batch API's batches: each line of a batch's input sent through the gateway
as a batch-class request of the batch's creator (gateway.relay_line), so lines take the
same deployments' batch slots as batch keys' requests do and leave interactive requests
their latency.

A batch is a task in the control plane's event loop: load (its input's lines, the ones
already answered) -> send the others, at most LINES_IN_FLIGHT at once -> write its output
and error files. Each answer is recorded in the store (a BatchLine row) as it comes, so a
control plane that restarts (even after SIGKILL) resumes its batches and sends only the
lines with no answer yet: the ones in flight when it stopped are sent again, no other.

A line of a deployment scaled to zero waits for a replica to start (it counts as load), as
a request does. A line answered 503 (no ready replica yet, or the deployment's batch slots
busy for long) is sent again after RETRY_DELAY for as long as its batch runs; one answered
502 (its replica failed) at most MAX_ATTEMPTS times in all. Every other answer is final:
2xx to the output file, the rest to the error file, in OpenAI's output line shape. A batch
cancelled or past its completion window stops: its lines waiting (for a replica, a batch
slot, a retry) are left unanswered, the ones at a replica finish, and its files are written.

Control planes sharing a database run each batch once: one runs it under a lease (the
batch's row names it and when the lease ends), renewed every third of
`Settings.batch_lease`; another takes over a batch whose lease ran out (its owner died or
hangs) and resumes it as a restart does. An owner whose lease ran out locally sends no new
line, and stops the batch once it sees another control plane holds it. The owner is named
by its node and home, so the same control plane restarted takes its batches back at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from sqlalchemy import delete, or_, select, update
from sqlalchemy.exc import IntegrityError
from starlette.responses import Response

from gpucloud.control import batch_input
from gpucloud.control.auth import Principal
from gpucloud.control.config import Settings
from gpucloud.control.db import Store
from gpucloud.control.gateway import Gateway
from gpucloud.control.lifecycle import BATCH_RUNNING, BatchStatus, Role
from gpucloud.control.models import Batch, BatchFile, BatchLine, Tenant, User
from gpucloud.control.priority import BATCH
from gpucloud.control.services import batch_files
from gpucloud.control.services.batches import move

log = logging.getLogger(__name__)

LINES_IN_FLIGHT = 4  # a batch's lines sent at once (its deployment's batch slots bound them too)
RETRY_DELAY = 1.0  # seconds before a line answered 503 or 502 is sent again
MAX_ATTEMPTS = 3  # sends of a line whose replica failed (502)
POLL = 1.0  # seconds between looks at the store for batches to run (at most)


@dataclass(slots=True)
class Work:
    """What a batch's task needs, read once when it starts."""

    batch_id: str
    status: BatchStatus
    owner: Principal
    lines: list[batch_input.Line]
    done: set[int]  # indexes of the lines already answered


class BatchRunner:
    def __init__(self, store: Store, settings: Settings, gateway: Gateway) -> None:
        self.store, self.settings, self.gateway = store, settings, gateway
        self.owner = f"{settings.node_name}:{settings.home}"  # the name its leases carry
        self._tasks: dict[str, asyncio.Task] = {}
        # Set when a batch must stop (cancelled, expired): its lines' waits end.
        self._stops: dict[str, asyncio.Event] = {}
        self._held_until: dict[str, float] = {}  # batch id -> its lease's end (monotonic)
        self._woken: asyncio.Event | None = None  # made in the loop run() runs in
        self._loop: asyncio.AbstractEventLoop | None = None

    def wake(self) -> None:
        """Look at the store now (a batch was created or cancelled); from any thread."""
        if self._loop is not None and self._woken is not None:
            self._loop.call_soon_threadsafe(self._woken.set)

    async def run(self) -> None:
        """Claim (or renew) the batches to run and start a task for each, until cancelled
        (with them)."""
        self._woken, self._loop = asyncio.Event(), asyncio.get_running_loop()
        lease = self.settings.batch_lease
        try:
            while True:
                self._woken.clear()
                claimed_at = time.monotonic()
                try:
                    held = await asyncio.to_thread(_claim, self.store, self.owner, lease)
                except Exception:
                    log.exception("cannot claim the batches to run")
                else:
                    self._steer(held, claimed_at + lease)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._woken.wait(), min(POLL, lease / 3))
        finally:
            for task in self._tasks.values():
                task.cancel()
            await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    def _steer(self, held: dict[str, tuple[str, float]], until: float) -> None:
        """Run the batches this control plane holds (`held`: id -> status, expiry) until
        `until` (monotonic); stop the ones it holds no more."""
        for batch_id, (status, expires_at) in held.items():
            self._held_until[batch_id] = until
            stop = self._stops.setdefault(batch_id, asyncio.Event())
            if status == BatchStatus.CANCELLING or time.time() >= expires_at:
                stop.set()
            if batch_id not in self._tasks:
                self._start(batch_id)
        for batch_id in set(self._tasks) - set(held):
            log.warning("batch %s is no longer this control plane's to run", batch_id)
            self._tasks[batch_id].cancel()

    def _start(self, batch_id: str) -> None:
        task = asyncio.create_task(self._run(batch_id), name=f"batch {batch_id}")
        self._tasks[batch_id] = task

        def ended(task: asyncio.Task) -> None:
            del self._tasks[batch_id]  # still running in the store: the next look restarts it
            self._stops.pop(batch_id, None)
            self._held_until.pop(batch_id, None)
            if not task.cancelled() and task.exception() is not None:
                log.error("batch %s stopped", batch_id, exc_info=task.exception())

        task.add_done_callback(ended)

    def _holds(self, batch_id: str) -> bool:
        """Whether this control plane's lease on the batch is good (it lapses if the
        renewal is late: another control plane may have taken the batch)."""
        return time.monotonic() < self._held_until.get(batch_id, 0.0)

    async def _held(self, batch_id: str) -> None:
        """Return once this control plane's lease on the batch is good."""
        while not self._holds(batch_id):
            await asyncio.sleep(0.1)

    async def _run(self, batch_id: str) -> None:
        """load -> send the lines not answered yet -> write the batch's files."""
        work = await asyncio.to_thread(_load, self.store, self.settings, batch_id)
        if work is None:
            return
        if work.status == BatchStatus.VALIDATING:
            await asyncio.to_thread(_advance, self.store, batch_id, BatchStatus.IN_PROGRESS)
        if work.status in (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS):
            await self._send_all(work)
        await asyncio.to_thread(_finish, self.store, self.settings, work, self.owner)

    async def _send_all(self, work: Work) -> None:
        slots = asyncio.Semaphore(LINES_IN_FLIGHT)
        async with asyncio.TaskGroup() as group:
            for index, line in enumerate(work.lines):
                if index in work.done:
                    continue
                await slots.acquire()
                if self._stops[work.batch_id].is_set():
                    slots.release()
                    break
                group.create_task(self._send(work, index, line, slots))

    async def _send(
        self, work: Work, index: int, line: batch_input.Line, slots: asyncio.Semaphore
    ) -> None:
        stop = self._stops[work.batch_id]
        try:
            attempts = 0
            while True:
                await self._held(work.batch_id)
                answer = await self.gateway.relay_line(
                    work.owner, line.url, line.body, stop, partial(self._holds, work.batch_id)
                )
                status = answer.status_code
                if stop.is_set() and status in (499, 503):
                    return  # not sent: left unanswered, the error file says why
                if status == 499:
                    continue  # the lease lapsed while it waited: sent once it is renewed
                attempts += 1
                if status != 503 and (status != 502 or attempts >= MAX_ATTEMPTS):
                    break
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), RETRY_DELAY)
                if stop.is_set():
                    return
            result = _output_line(line.custom_id, answer)
            ok = 200 <= status < 300
            await asyncio.to_thread(_record, self.store, work.batch_id, index, ok, result)
        finally:
            slots.release()


def _claim(store: Store, owner: str, lease: float) -> dict[str, tuple[str, float]]:
    """Take the running batches nobody holds (or whose lease ran out) and renew `owner`'s
    own, for `lease` seconds; the ones it holds now: id -> (status, expires_at). The
    claim is one conditional UPDATE: of two control planes, one gets each batch."""
    now = time.time()
    free = Batch.status.in_(BATCH_RUNNING) & or_(
        Batch.lease_owner.is_(None), Batch.lease_owner == owner, Batch.lease_expires_at < now
    )
    with store.reading() as s:  # most passes find nothing: no write then
        wanted = list(s.scalars(select(Batch.id).where(free)))
    if not wanted:
        return {}
    with store.transaction() as s:
        s.execute(
            update(Batch)
            .where(Batch.id.in_(wanted), free)
            .values(lease_owner=owner, lease_expires_at=now + lease)
        )
        held = s.execute(
            select(Batch.id, Batch.status, Batch.expires_at).where(
                Batch.id.in_(wanted), Batch.lease_owner == owner
            )
        )
        return {batch_id: (status, expires_at) for batch_id, status, expires_at in held}


def _load(store: Store, settings: Settings, batch_id: str) -> Work | None:
    """The batch's work; None (and the batch failed) if its input file cannot be read."""
    with store.reading() as s:
        batch = s.get(Batch, batch_id)
        source = s.get(BatchFile, batch.input_file_id)
        owner = _owner(s.get(Tenant, batch.tenant_id), s.get(User, batch.user_id))
        done = set(s.scalars(select(BatchLine.line).where(BatchLine.batch_id == batch_id)))
    try:
        data = batch_files.path(settings, source).read_bytes() if source else None
    except OSError:
        data = None
    if data is None:
        _fail(
            store, batch_id, "input_file_missing", f"the input file {batch.input_file_id} is gone"
        )
        return None
    lines = batch_input.parse(data, batch.endpoint)  # checked when the batch was made
    return Work(batch_id, BatchStatus(batch.status), owner, lines, done)


def _owner(tenant: Tenant, user: User) -> Principal:
    """The batch's creator as the gateway's caller: batch class, and no key, so no key's or
    tenant's rate limits (OpenAI counts batch requests apart from the others)."""
    return Principal(tenant.id, tenant.name, user.id, user.name, Role(user.role),
                     tenant.is_operator, 0, None, None, priority_class=BATCH)  # fmt: skip


def _advance(store: Store, batch_id: str, to: BatchStatus) -> None:
    with store.transaction() as s:
        batch = s.get(Batch, batch_id)
        if batch.status != BatchStatus.CANCELLING:  # a cancel that came meanwhile stands
            move(batch, to)


def _fail(store: Store, batch_id: str, code: str, message: str) -> None:
    with store.transaction() as s:
        batch = s.get(Batch, batch_id)
        batch.errors = [{"code": code, "message": message, "line": None, "param": None}]
        move(batch, BatchStatus.FAILED)


def _record(store: Store, batch_id: str, index: int, ok: bool, result: str) -> None:
    """Keep one line's answer (once: a line answered already, here or by the control plane
    that held the batch before, keeps its first answer)."""
    with contextlib.suppress(IntegrityError), store.transaction() as s:
        if s.get(BatchLine, (batch_id, index)) is not None:
            return
        s.add(BatchLine(batch_id=batch_id, line=index, ok=ok, result=result))
        s.flush()  # the other's answer came first: IntegrityError, nothing kept
        s.execute(
            update(Batch)
            .where(Batch.id == batch_id)
            .values(completed=Batch.completed + int(ok), failed=Batch.failed + int(not ok))
        )


def _finish(store: Store, settings: Settings, work: Work, owner: str) -> None:
    """Write the batch's output and error files and end it: cancelled, expired, or (every
    line answered) completed. A batch with lines unanswered and time left stays running,
    and one another control plane holds now is its to end."""
    with store.transaction() as s:
        batch = s.get(Batch, work.batch_id)
        if batch.lease_owner != owner:
            return
        answers = {i: (ok, r) for i, ok, r in s.execute(
            select(BatchLine.line, BatchLine.ok, BatchLine.result)
            .where(BatchLine.batch_id == work.batch_id)
        )}  # fmt: skip
        if batch.status == BatchStatus.CANCELLING:
            final, unanswered = BatchStatus.CANCELLED, "batch_cancelled"
        elif len(answers) < len(work.lines):
            if time.time() < batch.expires_at:
                return
            final, unanswered = BatchStatus.EXPIRED, "batch_expired"
        else:
            final, unanswered = BatchStatus.COMPLETED, ""
            if batch.status == BatchStatus.IN_PROGRESS:
                move(batch, BatchStatus.FINALIZING)
    outputs, errors = [], []
    for index, line in enumerate(work.lines):
        ok, result = answers.get(index, (False, None))
        (outputs if ok else errors).append(result or _unanswered_line(line.custom_id, unanswered))
    staged = {
        name: _stage(settings, batch.tenant_id, lines)
        for name, lines in (("output", outputs), ("error", errors))
        if lines
    }
    with store.transaction() as s:
        batch = s.get(Batch, work.batch_id)
        if batch.lease_owner != owner or batch.status not in BATCH_RUNNING:
            for path in staged.values():
                path.unlink()
            return
        for name, path in staged.items():
            f = batch_files.keep(s, settings, batch.tenant_id, path,
                                 f"{batch.id}_{name}.jsonl", batch_files.OUTPUT)  # fmt: skip
            setattr(batch, f"{name}_file_id", f.id)
        move(batch, final)
        s.execute(delete(BatchLine).where(BatchLine.batch_id == batch.id))


def _stage(settings: Settings, tenant_id: int, lines: list[str]) -> Path:
    path = batch_files.staging_path(settings, tenant_id)
    path.write_text("".join(line + "\n" for line in lines))
    return path


def _output_line(custom_id: str, answer: Response) -> str:
    """A line of the output (or error) file: OpenAI's shape, the answer's body as JSON."""
    try:
        body = json.loads(answer.body)
    except ValueError:
        body = {"error": {"message": answer.body.decode("utf-8", "replace"), "type": "api_error"}}
    request_id = answer.headers.get("x-request-id") or batch_files.new_id("req_")
    response = {"status_code": answer.status_code, "request_id": request_id, "body": body}
    line = {"id": batch_files.new_id("batch_req_"), "custom_id": custom_id, "response": response,
            "error": None}  # fmt: skip
    return json.dumps(line)


def _unanswered_line(custom_id: str, code: str) -> str:
    why = {"batch_cancelled": "the batch was cancelled", "batch_expired": "the batch expired"}
    error = {"code": code, "message": f"{why[code]} before this request was sent"}
    line = {"id": batch_files.new_id("batch_req_"), "custom_id": custom_id, "response": None,
            "error": error}  # fmt: skip
    return json.dumps(line)
