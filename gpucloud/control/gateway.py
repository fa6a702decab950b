"""The OpenAI-compatible gateway: `/v1` on the control plane, routed to deployments.

A client points an OpenAI SDK at the control plane (`base_url = URL + "/v1"`, `api_key` =
a tenant's key) and names one of its tenant's deployments as the `model`. The gateway picks
a READY replica of that deployment, of the version traffic.py picks when the deployment
has a canary beside its stable version (routing.py: among that version's replicas, the one
that served the same prompt prefix, unless it has too many requests in flight through this
gateway), and relays the request and the response as they come, so streams stay streams
and a client that goes away closes the replica's request too. A replica that refuses the
connection, or answers 503 because it drains, is skipped for the next one; one that fails
mid-stream ends the stream with an error event. Errors have OpenAI's shape,
`{"error": {"message", "type", "param", "code"}}`.

Before a request goes anywhere it passes its tenant's and its key's rate limits
(ratelimit.py: 429 with Retry-After), and a `batch` key's request waits for one of its
deployment's batch slots (priority.py), so that batch floods leave interactive requests
their latency; its stream is relayed in gulps (BATCH_RELAY_REST), so that relaying them
costs the event loop those requests share little. Each request's way to its first token is
timed phase by phase (gateway_timing.py: a histogram, and a Server-Timing header).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import threading
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

import httpx
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from sqlalchemy import select
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool

from gpucloud.control.auth import Principal, authenticate, hash_key, record_use, use_is_stale
from gpucloud.control.db import Store
from gpucloud.control.errors import AuthError
from gpucloud.control.gateway_timing import Timing
from gpucloud.control.lifecycle import SERVED_VERSIONS, ReplicaState, VersionState
from gpucloud.control.metrics import Metrics
from gpucloud.control.models import Deployment, DeploymentVersion, Replica
from gpucloud.control.priority import (
    BATCH,
    ENGINE_PRIORITY,
    INTERACTIVE,
    BatchGate,
    QueueTimeout,
    with_priority,
)
from gpucloud.control.ratelimit import Limit, Limited, RateLimiter, estimate_tokens
from gpucloud.control.replica_stats import ReplicaStats
from gpucloud.control.routing import Balancer, prefix_key
from gpucloud.control.schemas import Autoscale
from gpucloud.control.services.deployments import ACTIVE
from gpucloud.control.traffic import Canary, Splitter
from gpucloud.http_body import PARSED

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1", tags=["OpenAI gateway"])
T = TypeVar("T")

# Seconds a route (key -> tenant -> deployment -> READY replicas) is reused: a new deployment
# or a replica that became ready is seen within this long. A replica that died in between
# refuses the connection, and the request goes to the next one. Keys are not left to this
# delay: revoking or rotating one drops every route (`forget_routes`), and a route ends no
# later than its key's grace period.
ROUTE_TTL = 1.0
# Seconds after which a route in use is read again in the background, while requests go on
# using it: a key that sends requests more often than this never waits for the store. A
# request that read it (in a worker thread, beside the reconciler's) waited 40-50 ms in the
# slowest 1% of benchmarks/gateway_priority.py, the most of their time to a first token.
ROUTE_REFRESH = ROUTE_TTL / 2
_MAX_ROUTES = 10_000
# Response headers worth relaying; hop-by-hop ones (length, encoding) are the server's.
_RELAYED = ("content-type", "retry-after", "x-request-id")
# Seconds a batch request may wait for a slot before it is answered 503.
BATCH_WAIT = 600.0
COLD_POLL = 0.1  # seconds between looks for a started replica while a request waits
# Seconds a batch stream's relay rests without reading after each piece it passes on. The
# replica sends an event per token, and relaying each one alone (a read, a write to the
# client: two system calls and the whole ASGI send path) is most of what the gateway's
# event loop does under a batch flood, the interactive requests' loop too. Resting, the
# events gather in the socket; one read takes them all, and they go on in one write. Short:
# a stream's end is read up to this late, and its batch slot given back as late (50 ms
# cost a fifth of the batch throughput of benchmarks/gateway_priority.py; 20 ms none).
BATCH_RELAY_REST = 0.02
_NO_ANSWER = 599  # the status a replica's stats record when its connection failed


class GatewayError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        kind: str,
        code: str | None = None,
        retry_after: float | None = None,  # seconds; a 503 says 1 unless told
    ):
        super().__init__(message)
        self.status, self.kind, self.code = status, kind, code
        self.retry_after = 1.0 if retry_after is None and status == 503 else retry_after

    def response(self, param: str | None = None) -> JSONResponse:
        body = {"message": str(self), "type": self.kind, "param": param, "code": self.code}
        headers = None
        if self.retry_after is not None:
            headers = {"Retry-After": str(max(1, math.ceil(self.retry_after)))}
        return JSONResponse({"error": body}, status_code=self.status, headers=headers)


@dataclass(frozen=True, slots=True)
class Target:
    tenant: str
    deployment: str
    replicas: list[tuple[int, str]]  # (replica id, base URL) of the READY ones, if any
    deployment_id: int = 0
    batch_in_flight: int = 2  # per ready replica
    priority_class: str = INTERACTIVE  # the caller key's
    cold_wait: float = 0.0  # seconds a request may wait for a replica when none is ready
    # The rate limits the caller's requests draw from: (whose, their id, the limit).
    limits: tuple[tuple[str, int, Limit], ...] = ()
    canary: Canary | None = None  # a version beside the stable one, and its share


@dataclass(frozen=True, slots=True)
class _Relay:
    """One request on its way to a replica: what to send, and what to call as it goes."""

    request: Request
    path: str
    raw: bytes
    target: Target
    first: Callable[[], None]  # its first token came (or it failed)
    release: Callable[[], None]  # it is over
    settle: Callable[[bytes], None] | None  # gets a whole answer's body
    rest: float  # seconds between a batch stream's gulps (0: event by event)
    timing: Timing


class Gateway:
    def __init__(self, store: Store, metrics: Metrics) -> None:
        self.store = store
        self.metrics = metrics
        self.balancer = Balancer()
        self.splitter = Splitter()
        self.replica_stats = ReplicaStats()  # for the automatic rollback of canaries
        self.limiter = RateLimiter()
        self.batch_gates: dict[int, BatchGate] = defaultdict(BatchGate)  # by deployment id
        # Requests waiting for a replica to start, by deployment id: load for the autoscaler.
        self.cold_waiting: dict[int, int] = defaultdict(int)
        # When each deployment was last asked for (time.time()): idle reclaim reads it.
        self.last_request: dict[int, float] = {}
        self.wake: Callable[[], None] = lambda: None  # the reconciler's, set by the app
        self.http: httpx.AsyncClient | None = None  # opened by the app's lifespan
        # (key hash, model) -> (read at, reusable until: monotonic; the route or its error)
        self._routes: dict[tuple[str, str], tuple[float, float, Target | Exception]] = {}
        self._refreshing: dict[tuple[str, str], asyncio.Task] = {}
        # Bumped by forget_routes: a route read from the store before then is not kept.
        self._generation = 0
        self._routes_lock = threading.Lock()  # forget_routes runs in a worker thread

    def open(self) -> httpx.AsyncClient:
        # No read timeout: a long completion sends its headers only when it is done.
        timeout = httpx.Timeout(None, connect=5.0)
        self.http = httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=None))
        return self.http

    async def route(self, key: str, model: str) -> Target:
        """The caller's deployment `model` and its READY replicas, as the store said at most
        `ROUTE_TTL` seconds ago: the hot path reads no database (a miss reads it in a
        worker thread; a route older than ROUTE_REFRESH is read again in the background).
        Raises AuthError or GatewayError, also remembered for that long."""
        now = time.monotonic()
        slot = (hash_key(key), model)
        hit = self._routes.get(slot)
        if hit is None or hit[1] <= now:
            found = await self._read_route(slot, key, model)
        else:
            found = hit[2]
            if now - hit[0] > ROUTE_REFRESH and slot not in self._refreshing:
                refresh = asyncio.create_task(self._read_route(slot, key, model))
                self._refreshing[slot] = refresh
                refresh.add_done_callback(partial(self._refreshed, slot))
        if isinstance(found, Exception):
            raise found
        return found

    def _refreshed(self, slot: tuple[str, str], refresh: asyncio.Task) -> None:
        del self._refreshing[slot]
        if not refresh.cancelled() and refresh.exception() is not None:
            log.warning("reading a route again failed: %r", refresh.exception())

    async def _read_route(self, slot: tuple[str, str], key: str, model: str) -> Target | Exception:
        """Read the route of `key` to `model` from the store and remember it, unless routes
        were forgotten meanwhile."""
        now = time.monotonic()
        generation = self._generation
        found, key_expires_at = await run_in_threadpool(self._resolve, key, model)
        with self._routes_lock:
            if len(self._routes) > _MAX_ROUTES:
                self._routes.clear()
            if generation == self._generation:
                self._routes[slot] = (now, _reuse_until(now, key_expires_at), found)
        return found

    def forget_routes(self) -> None:
        """Drop every remembered route, and any being read now: the next request of each
        key reads the store (after a key was revoked or rotated)."""
        with self._routes_lock:
            self._generation += 1
            self._routes.clear()

    def _resolve(self, key: str, model: str) -> tuple[Target | Exception, float | None]:
        """The route, or the error to answer; and when the key stops working (None: it
        does not expire)."""
        try:
            who = self._authenticated(key)
        except AuthError as e:
            return e, None
        try:
            return self._lookup(who, model), who.key_expires_at
        except GatewayError as e:
            return e, who.key_expires_at

    def _authenticated(self, key: str | None) -> Principal:
        """The key's principal, its use recorded when due (after the read, so no
        transaction is open)."""
        with self.store.reading() as s:
            who = authenticate(s, key)
        if use_is_stale(who):
            record_use(self.store, who.key_id)
        return who

    def _lookup(self, who: Principal, model: str) -> Target:
        with self.store.reading() as s:
            deployments = {
                name: (dep_id, batch, autoscale, reclaimed)
                for name, dep_id, batch, autoscale, reclaimed in s.execute(
                    select(
                        Deployment.name,
                        Deployment.id,
                        Deployment.batch_in_flight,
                        Deployment.autoscale,
                        Deployment.reclaimed_replicas,
                    ).where(Deployment.tenant_id == who.tenant_id, Deployment.state == ACTIVE)
                )
            }
            if model not in deployments:
                yours = ", ".join(sorted(deployments)) or "none"
                raise GatewayError(
                    404,
                    f"no deployment {model!r} in tenant {who.tenant_name} (yours: {yours})",
                    "invalid_request_error",
                    "model_not_found",
                )
            dep_id, batch_in_flight, autoscale, reclaimed = deployments[model]
            ready = s.execute(
                select(Replica.id, Replica.url, DeploymentVersion.state, DeploymentVersion.percent)
                .join(DeploymentVersion, Replica.version_id == DeploymentVersion.id)
                .where(
                    Replica.deployment_id == dep_id,
                    Replica.state == ReplicaState.READY,
                    DeploymentVersion.state.in_(SERVED_VERSIONS),  # an ended one drains
                )
                .order_by(Replica.version_id, Replica.index)
            ).all()
        replicas = [(rid, url) for rid, url, _, _ in ready]
        on_canary = {
            rid: percent for rid, _, state, percent in ready if state == VersionState.CANARY
        }
        canary = Canary(max(on_canary.values()), frozenset(on_canary)) if on_canary else None
        limits = (
            (f"tenant {who.tenant_name}", who.tenant_id, Limit.of(who.tenant_limit)),
            ("your key", who.key_id, Limit.of(who.key_limit)),
        )
        cold_wait = Autoscale(**autoscale).max_cold_wait if autoscale else 0.0
        if reclaimed is not None and not autoscale:  # scaled to zero while idle: wake it
            cold_wait = Autoscale.model_fields["max_cold_wait"].default
        return Target(who.tenant_name, model, replicas, dep_id, batch_in_flight,
                      who.priority_class, cold_wait,
                      tuple(x for x in limits if x[2] != Limit()), canary)  # fmt: skip

    def models(self, key: str | None) -> list[tuple[str, float]]:
        who = self._authenticated(key)
        with self.store.reading() as s:
            return list(
                s.execute(
                    select(Deployment.name, Deployment.created_at)
                    .where(Deployment.tenant_id == who.tenant_id, Deployment.state == ACTIVE)
                    .order_by(Deployment.name)
                ).all()
            )

    async def relay(self, request: Request, path: str) -> Response:
        """Admit the request (key, deployment, rate limits, priority), then forward it."""
        arrived = time.monotonic()
        try:
            raw, body, target = await self._admitted(request)
            self.last_request[target.deployment_id] = time.time()
            tokens = estimate_tokens(path, body)
            self.limiter.admit(list(target.limits), tokens)
            if not target.replicas and target.cold_wait:
                again = partial(self.route, request.state.route_key, target.deployment)
                target = await _unless_client_leaves(request, self._replica_started(target, again))
        except _ClientLeft:
            self._count(target, 499)
            return Response(status_code=499)
        except AuthError as e:
            return GatewayError(401, str(e), "authentication_error").response()
        except GatewayError as e:
            return e.response("model" if e.code == "model_not_found" else None)
        except Limited as e:
            self._count(target, 429)
            limited = GatewayError(429, str(e), e.kind, "rate_limit_exceeded", e.retry_after)
            return limited.response()
        if not target.replicas:
            self._count(target, 503)
            message = f"deployment {target.deployment!r} has no ready replica yet"
            if target.cold_wait:
                message += f" (waited {target.cold_wait:g} s for one to start)"
            return GatewayError(503, message, "service_unavailable").response()
        release = await self._slot(request, target)
        if isinstance(release, Response):
            return release
        timing = self._timing(target, arrived)
        settle = self._settle(target, tokens) if any(
            lim.tokens_per_minute for _, _, lim in target.limits
        ) else None  # fmt: skip
        user = body.get("user") if isinstance(body, dict) else None  # sticks to a version
        raw = with_priority(raw, body, target.priority_class)
        first = lambda: None  # noqa: E731
        if target.priority_class == INTERACTIVE:  # batch ones wait while it waits
            first = self.batch_gates[target.deployment_id].hold()
        return await self._forward(
            request, path, raw, target, timing, release, settle, user, prefix_key(body), first
        )

    async def _admitted(self, request: Request) -> tuple[bytes, dict, Target]:
        """The request's body (raw and parsed) and its route. Raises AuthError, GatewayError."""
        key = _key(request)
        if key is None:
            raise AuthError("missing API key: send 'Authorization: Bearer KEY'")
        raw = await request.body()  # its size and JSON checked already (http_body)
        body = getattr(request.state, PARSED, None)
        model = _model(body)
        request.state.route_key = key  # for another look while a replica starts
        return raw, body, await self.route(key, model)

    async def _replica_started(
        self, target: Target, again: Callable[[], Awaitable[Target]]
    ) -> Target:
        """The route (read `again`) once a replica of `target`'s deployment is READY, or
        after its max_cold_wait seconds (still with none). Meanwhile the request counts as
        load, so the autoscaler starts a replica of a deployment scaled to zero."""
        dep_id = target.deployment_id
        self.cold_waiting[dep_id] += 1
        self.wake()
        deadline = time.monotonic() + target.cold_wait
        try:
            while not target.replicas and time.monotonic() < deadline:
                await asyncio.sleep(COLD_POLL)
                target = await again()
        finally:
            self.cold_waiting[dep_id] -= 1
        return target

    async def _slot(self, request: Request, target: Target) -> Callable[[], None] | Response:
        """What to call once the request is done: a batch request first waits for one of
        its deployment's batch slots (the answer instead if it waited too long or left)."""
        if target.priority_class != BATCH:
            return lambda: None
        gate = self.batch_gates[target.deployment_id]
        limit = target.batch_in_flight * len(target.replicas)
        waiting = self.metrics.gateway_batch_waiting.labels(target.tenant, target.deployment)
        waiting.inc()
        try:
            await _unless_client_leaves(request, gate.enter(limit, BATCH_WAIT))
        except QueueTimeout:
            self._count(target, 503)
            message = (
                f"deployment {target.deployment!r} is busy: batch requests wait at most "
                f"{BATCH_WAIT:g} s for a slot"
            )
            return GatewayError(503, message, "service_unavailable").response()
        except _ClientLeft:
            self._count(target, 499)
            return Response(status_code=499)
        finally:
            waiting.dec()
        return gate.leave

    def _timing(self, target: Target, arrived: float) -> Timing:
        """The request's phases from `arrived` (monotonic) on, its admission ending now."""
        timing = Timing(self.metrics.gateway_phase, target.tenant, target.deployment,
                        target.priority_class, arrived)  # fmt: skip
        timing.end("admit")
        return timing

    def _settle(self, target: Target, charged: int) -> Callable[[bytes], None]:
        """Charge the tokens a whole answer used (its `usage`) instead of the estimate."""

        def settle(answer: bytes) -> None:
            try:
                used = json.loads(answer)["usage"]["total_tokens"]
            except (ValueError, KeyError, TypeError):
                return  # no usage reported (an error): the estimate stands
            if isinstance(used, int):
                self.limiter.settle(list(target.limits), charged, used)

        return settle

    async def _forward(
        self,
        request: Request,
        path: str,
        raw: bytes,
        target: Target,
        timing: Timing,
        release: Callable[[], None],
        settle: Callable[[bytes], None] | None,
        user: object = None,
        prefix: bytes | None = None,
        first: Callable[[], None] = lambda: None,
    ) -> Response:
        """Relay to the replicas in the balancer's order (within the version the splitter
        picks first; the owner of the prompt's `prefix` first) until one takes the request;
        `first` runs once its first token came (or it failed), `release` once it is over,
        `settle` gets a whole answer's body."""
        groups = self.splitter.groups(target.deployment_id, target.replicas, target.canary, user)
        order = [r for group in groups for r in self.balancer.order(group, prefix)]
        rest = BATCH_RELAY_REST if target.priority_class == BATCH else 0.0
        relay = _Relay(request, path, raw, target, first, release, settle, rest, timing)
        answer = None
        try:
            for i, (rid, url) in enumerate(order):
                answer = await self._attempt(relay, rid, url, last=i == len(order) - 1)
                if answer is not None:
                    return answer
        finally:
            if not isinstance(answer, StreamingResponse):  # a stream's end does it
                first()
                release()
        self._count(target, 503)
        message = f"no replica of deployment {target.deployment!r} accepts connections"
        return GatewayError(503, message, "service_unavailable").response()

    async def _attempt(self, relay: _Relay, rid: int, url: str, last: bool) -> Response | None:
        """Send the request to replica `rid`: the answer to give the client, or None when
        the next replica may take it (this one is draining, refused the connection, or
        went away before its answer: nothing reached the client yet)."""
        assert self.http is not None
        target = relay.target
        forward = self.http.build_request("POST", url + relay.path, content=relay.raw,
                                          headers={"content-type": "application/json"})  # fmt: skip
        self.balancer.in_flight[rid] += 1
        sent = time.monotonic()
        streaming = False  # then the stream's end takes the request off the replica
        try:
            upstream = await _unless_client_leaves(
                relay.request, self.http.send(forward, stream=True)
            )
            if upstream.status_code == 503 and not last:
                await upstream.aclose()  # draining (scaled down, or stopping): the next one
                return None
            relay.timing.end("upstream")
            self._count(target, upstream.status_code)
            headers = {k: v for k, v in upstream.headers.items() if k.lower() in _RELAYED}
            headers["server-timing"] = relay.timing.header()
            if not upstream.headers.get("content-type", "").startswith("text/event-stream"):
                return await self._whole(relay, upstream, rid, sent, headers)
            streaming = True
            return self._stream(relay, upstream, rid, sent, headers)
        except httpx.ConnectError:
            self._observe(rid, sent, _NO_ANSWER)
            return None
        except httpx.TransportError as e:
            self._observe(rid, sent, _NO_ANSWER)
            if not last:  # a whole answer is relayed once read: the client got nothing yet
                log.warning("replica %d failed mid-request (%s): retrying", rid, e)
                return None
            self._count(target, 502)
            return GatewayError(502, f"replica failed: {e}", "api_error").response()
        except httpx.HTTPError as e:
            self._count(target, 502)
            return GatewayError(502, f"replica failed: {e}", "api_error").response()
        except _ClientLeft:  # its connection closed: the replica aborts
            self._count(target, 499)
            return Response(status_code=499)
        finally:
            if not streaming:
                self.balancer.in_flight[rid] -= 1

    async def _whole(
        self, relay: _Relay, upstream: httpx.Response, rid: int, sent: float, headers: dict
    ) -> Response:
        """A whole answer (its headers came once it was done), read and relayed."""
        try:
            answer = await upstream.aread()
        finally:
            await upstream.aclose()
        self._observe(rid, sent, upstream.status_code)
        relay.first()
        if relay.settle is not None and upstream.status_code == 200:
            relay.settle(answer)
        return Response(answer, upstream.status_code, headers)

    def _stream(
        self, relay: _Relay, upstream: httpx.Response, rid: int, sent: float, headers: dict
    ) -> StreamingResponse:
        """A stream relayed event by event (batch-class ones in gulps); a client that hangs
        up cancels the relay, and closing upstream aborts it."""

        async def done() -> None:
            await upstream.aclose()
            self.balancer.in_flight[rid] -= 1
            relay.first()
            relay.release()

        def first_chunk() -> None:
            relay.timing.end("first_chunk")
            self._observe(rid, sent, upstream.status_code)
            relay.first()

        events = _events(upstream, rid, relay.rest)
        chunks = _on_first_chunk(events, first_chunk, partial(relay.timing.end, "first_write"),
                                 relay.first)  # fmt: skip
        return StreamingResponse(chunks, upstream.status_code, headers,
                                 background=BackgroundTask(done))  # fmt: skip

    def _observe(self, rid: int, sent: float, status: int) -> None:
        """One answer of replica `rid` to a request sent at `sent` (monotonic), for the
        rollback guard: its first token came now."""
        self.replica_stats.observe(rid, time.time(), status, time.monotonic() - sent)

    def drained(self, replica_id: int, since: float) -> bool:
        """Whether a replica out of the routes since `since` (wall clock) can get no new
        request (every route read before then has expired) and has none in flight here."""
        return time.time() - since > ROUTE_TTL and not self.balancer.in_flight.get(replica_id)

    async def relay_line(
        self,
        who: Principal,
        path: str,
        body: dict,
        stop: asyncio.Event,
        still_mine: Callable[[], bool] = lambda: True,
    ) -> Response:
        """One line of a Batch API job (batch_runner.py) as `who` (its creator, a batch-class
        caller of no key): it waits for a replica of a deployment scaled to zero (counted as
        load, so one starts) and for one of its deployment's batch slots as batch keys'
        requests do, and is forwarded as any request is. The answer is whole (lines do not
        stream); a 503 says no replica takes it now. `stop` set (the batch cancelled or
        expired) ends those waits with a 499; a line sent to a replica finishes. A line
        whose slot came once `still_mine()` says no (the batch's lease lapsed meanwhile) is
        not sent either: 499."""
        waits = _no_client(path, stop)
        arrived = time.monotonic()
        try:
            target = await run_in_threadpool(self._lookup, who, _model(body))
            self.last_request[target.deployment_id] = time.time()  # in use: not idle
            if not target.replicas and target.cold_wait:
                again = partial(run_in_threadpool, self._lookup, who, target.deployment)
                target = await _unless_client_leaves(waits, self._replica_started(target, again))
        except GatewayError as e:
            return e.response("model" if e.code == "model_not_found" else None)
        except _ClientLeft:
            return Response(status_code=499)
        if not target.replicas:
            message = f"deployment {target.deployment!r} has no ready replica yet"
            return GatewayError(503, message, "service_unavailable").response()
        release = await self._slot(waits, target)
        if isinstance(release, Response):
            return release
        if not still_mine():
            release()
            return Response(status_code=499)
        raw = json.dumps({**body, "priority": ENGINE_PRIORITY[BATCH]}).encode()
        user, prefix = body.get("user"), prefix_key(body)
        request = _no_client(path)
        timing = self._timing(target, arrived)
        return await self._forward(request, path, raw, target, timing, release, None, user,
                                   prefix)  # fmt: skip

    def _count(self, target: Target, status: int) -> None:
        self.metrics.gateway_requests.labels(target.tenant, target.deployment, str(status)).inc()


def _reuse_until(now: float, key_expires_at: float | None) -> float:
    """Until when (monotonic) a route read at `now` may be reused: ROUTE_TTL, and never
    past the end of its key's grace period (wall clock)."""
    until = now + ROUTE_TTL
    if key_expires_at is not None:
        until = min(until, now + key_expires_at - time.time())
    return until


async def _events(upstream: httpx.Response, rid: int, rest: float = 0.0) -> AsyncIterator[bytes]:
    """The replica's server-sent events, whole ones only, as they come; or, with `rest`,
    in gulps: after passing some on, rest that long, gather what came meanwhile (the
    events of the read that ends the rest, which the HTTP parser hands over one by one,
    without waiting) and pass it on with the next event to come (or at the end). When the
    replica fails mid-stream (it died, its connection broke) an error event in OpenAI's
    shape ends the stream, where the client would otherwise see it cut off: what it got so
    far is not a whole answer."""
    loop = asyncio.get_running_loop()
    pending = b""
    gather_until = 0.0  # loop time: the events before then go on with a later one
    try:
        async for chunk in upstream.aiter_raw():
            pending += chunk
            if rest and loop.time() < gather_until:
                continue
            end = pending.rfind(b"\n\n") + 2
            if end >= 2:
                yield pending[:end]
                pending = pending[end:]
                if rest:
                    await asyncio.sleep(rest)
                    gather_until = loop.time() + rest / 10
    except httpx.TransportError as e:
        log.warning("replica %d failed mid-stream (%s): the stream ends with an error", rid, e)
        end = pending.rfind(b"\n\n") + 2
        whole = pending[:end] if end >= 2 else b""  # the events gathered
        message = f"replica failed mid-stream ({e or type(e).__name__}): the answer is incomplete"
        error = {"message": message, "type": "api_error", "param": None, "code": "replica_failed"}
        yield whole + b"data: " + json.dumps({"error": error}).encode() + b"\n\n"
        return
    if pending:
        yield pending


class _ClientLeft(Exception):
    pass


async def _on_first_chunk(
    chunks: AsyncIterator[bytes],
    first: Callable[[], None],
    written: Callable[[], None],
    last: Callable[[], None],
):
    """`chunks`, calling `first` when the first one comes, `written` once it was sent on
    (the next one is asked for then), and `last` when they end (also when the client went
    away)."""
    try:
        chunks = aiter(chunks)
        async for chunk in chunks:
            first()
            yield chunk
            written()
            break
        async for chunk in chunks:
            yield chunk
    finally:
        last()


async def _unless_client_leaves(request: Request, call: Awaitable[T]) -> T:
    """`call`'s result, or _ClientLeft (and `call` cancelled, closing its connection) if
    the client disconnects first: a replica stops generating a whole answer nobody waits
    for. The body must have been read already."""
    work = asyncio.ensure_future(call)
    left = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait((work, left), return_when=asyncio.FIRST_COMPLETED)
    finally:
        left.cancel()
    if not work.done():
        work.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await work
        raise _ClientLeft
    return work.result()


def _no_client(path: str, stop: asyncio.Event | None = None) -> Request:
    """A request made by the control plane itself: it "leaves" once `stop` is set (never
    without one)."""

    async def receive() -> dict:
        await (stop or asyncio.Event()).wait()
        return {"type": "http.disconnect"}

    return Request({"type": "http", "method": "POST", "path": path, "headers": []}, receive)


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _model(body: object) -> str:
    """The deployment a request body (its JSON value, parsed by http_body) names."""
    model = body.get("model") if isinstance(body, dict) else None
    if not isinstance(model, str) or not model:
        raise GatewayError(
            400, "'model' must name one of your deployments", "invalid_request_error"
        )
    return model


def _key(request: Request) -> str | None:
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        return None
    return key.strip() or None


def _gateway(request: Request) -> Gateway:
    return request.app.state.gateway


@router.post("/completions")
async def completions(request: Request) -> Response:
    """OpenAI completions, relayed to a replica of the deployment named by `model`."""
    return await _gateway(request).relay(request, "/v1/completions")


@router.post("/chat/completions")
async def chat_completions(request: Request) -> Response:
    """OpenAI chat completions, relayed to a replica of the deployment named by `model`."""
    return await _gateway(request).relay(request, "/v1/chat/completions")


@router.post("/tokenize")
async def tokenize(request: Request) -> Response:
    """vLLM's tokenize (outside /v1 on a replica), relayed to the deployment named by
    `model`: a client cuts a text in the deployment's own tokens."""
    return await _gateway(request).relay(request, "/tokenize")


@router.post("/detokenize")
async def detokenize(request: Request) -> Response:
    """vLLM's detokenize, relayed to the deployment named by `model`."""
    return await _gateway(request).relay(request, "/detokenize")


@router.get("/models")
async def models(request: Request) -> Response:
    """The caller's deployments, as OpenAI models."""
    try:
        rows = await run_in_threadpool(_gateway(request).models, _key(request))
    except AuthError as e:
        return GatewayError(401, str(e), "authentication_error").response()
    data = [
        {"id": name, "object": "model", "created": int(created), "owned_by": "gpucloud"}
        for name, created in rows
    ]
    return JSONResponse({"object": "list", "data": data})
