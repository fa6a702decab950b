"""What the scheduler knows: nodes, tenants, jobs, allocations, and the indexes over them.

`ClusterState` is plain bookkeeping with no clock: every method that changes it takes `now`
from the caller. It keeps, incrementally, what a scheduling pass needs in O(1) or O(log n):
free whole GPUs per pool (GPU type) bucketed by node, GPU usage per tenant and type,
running jobs sorted by estimated end, and pending queues sorted by a policy's key.
"""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum

from gpucloud import hardware
from gpucloud.errors import CapacityError, ConfigError, NotFoundError, UserError, unknown_name

MILLI = 1000  # a whole GPU, in the units of a fractional request (Alibaba's gpu_milli)


class JobState(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


# The lifecycle in one table. RUNNING -> PENDING is a preemption: the job requeues.
TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.PENDING: frozenset({JobState.RUNNING, JobState.CANCELLED}),
    JobState.RUNNING: frozenset(
        {JobState.PENDING, JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED}
    ),
    JobState.SUCCEEDED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.CANCELLED: frozenset(),
}


@dataclass(slots=True, eq=False)
class Node:
    """A machine with `num_gpus` accelerators of one type.

    GPUs `[i*domain_size, (i+1)*domain_size)` share one NVLink/HCCS domain (8 = one 1x8
    domain, 4 = two 2x4 domains). `free_milli[g]` is how much of GPU g is free (1000 = all).
    `cpu_milli` and `memory_mib` are the node's host resources for jobs that request them
    (0 = not tracked: the node never runs out); `free_cpu` and `free_memory` what is left.
    """

    name: str
    gpu_type: str
    num_gpus: int
    domain_size: int = 0  # 0 = the catalog's link domain for this GPU type
    rack: str = "rack-0"
    cpu_milli: int = 0
    memory_mib: int = 0
    free_milli: list[int] = field(default_factory=list)
    free_cpu: int = 0
    free_memory: int = 0
    index: int = -1  # position in ClusterState.node_list, set by add_node
    cordoned: bool = False  # runs what it has, takes nothing new (ClusterState.cordon)

    def __post_init__(self) -> None:
        if self.num_gpus < 1:
            raise ConfigError(f"node {self.name}: num_gpus must be >= 1, got {self.num_gpus}")
        if self.cpu_milli < 0 or self.memory_mib < 0:
            raise ConfigError(f"node {self.name}: cpu_milli and memory_mib must be >= 0")
        self.gpu_type, link_domain = _accelerator(self.gpu_type)
        if self.domain_size <= 0:
            self.domain_size = min(link_domain, self.num_gpus)
        if self.num_gpus % self.domain_size:
            raise ConfigError(
                f"node {self.name}: {self.num_gpus} GPUs do not split into link domains of "
                f"{self.domain_size}"
            )
        self.free_milli = [MILLI] * self.num_gpus
        self.free_cpu, self.free_memory = self.cpu_milli, self.memory_mib

    @property
    def free_whole(self) -> int:
        return sum(1 for m in self.free_milli if m == MILLI)

    def hosts(self, job: Job, gpus: int) -> bool:
        """Whether this node has the host resources for `gpus` of `job`'s GPUs (and is not
        one the job avoids)."""
        if self.name in job.avoid_nodes:
            return False
        if not (self.cpu_milli or self.memory_mib) or not (job.cpu_milli or job.memory_mib):
            return True
        cpu, memory = job.host_share(gpus)
        return (not self.cpu_milli or cpu <= self.free_cpu) and (
            not self.memory_mib or memory <= self.free_memory
        )


@dataclass(slots=True, eq=False)
class Tenant:
    """A team sharing the cluster, like a Kueue ClusterQueue.

    `quota` is the guaranteed number of GPUs per GPU type (a type missing from the dict has
    quota 0). A tenant may use more only if `borrow` is set: up to `borrow_limit` GPUs over
    quota per type (None = no limit), taken from idle quota of its cohort. `weight` scales
    its fair share.
    """

    name: str
    quota: dict[str, float] = field(default_factory=dict)
    weight: float = 1.0
    cohort: str = "default"
    borrow: bool = True
    borrow_limit: float | None = None

    def __post_init__(self) -> None:
        if self.weight <= 0:
            raise ConfigError(f"tenant {self.name}: weight must be > 0, got {self.weight}")
        self.quota = {_accelerator(t)[0]: float(q) for t, q in self.quota.items()}
        if any(q < 0 for q in self.quota.values()):
            raise ConfigError(f"tenant {self.name}: quotas must be >= 0")


@dataclass(frozen=True, slots=True)
class Allocation:
    """Where a job runs: GPU indices on each node, all of one GPU type.

    `milli` is the share of each listed GPU (1000 for whole GPUs).
    """

    gpu_type: str
    parts: tuple[tuple[str, tuple[int, ...]], ...]
    milli: int = MILLI

    @property
    def num_gpus(self) -> int:
        return sum(len(g) for _, g in self.parts)

    @property
    def gpus(self) -> float:
        """GPUs held, a share of one GPU counted as that share."""
        return self.num_gpus * self.milli / MILLI

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.parts)


@dataclass(slots=True, eq=False)
class Job:
    """A gang request: `num_gpus` GPUs, all at once or not at all, possibly across nodes.

    `gpu_types` lists acceptable types in order of preference (empty = any type).
    `gpu_milli` < 1000 asks for a fraction of one shared GPU (then num_gpus must be 1).
    `estimate` is the user's duration estimate (None = unknown); `duration` is the true run
    time and is read only by the simulator. With a `checkpoint_interval`, a preempted job
    keeps the work up to its last checkpoint; without one it loses the whole run.
    `cpu_milli` and `memory_mib` are host resources it needs besides GPUs (0 = none), held
    on each node in proportion to the job's GPUs there.
    """

    id: str
    tenant: str = "default"
    num_gpus: int = 1
    gpu_milli: int = MILLI
    gpu_types: tuple[str, ...] = ()
    priority: int = 0
    preemptible: bool = True
    submit_time: float = 0.0
    estimate: float | None = None
    duration: float | None = None
    checkpoint_interval: float | None = None
    cpu_milli: int = 0
    memory_mib: int = 0
    avoid_nodes: frozenset[str] = frozenset()
    """Nodes this job must not be placed on (a training job's straggling node)."""
    # Runtime bookkeeping, owned by ClusterState.
    state: JobState = JobState.PENDING
    seq: int = -1  # arrival order, set by submit
    allocation: Allocation | None = None
    start_time: float | None = None  # of the current run
    first_start: float | None = None
    end_time: float | None = None
    progress: float = 0.0  # seconds of work kept (checkpointed) from earlier runs
    attained: float = 0.0  # GPU-seconds received, lost work included
    preemptions: int = 0
    lost_gpu_seconds: float = 0.0

    def __post_init__(self) -> None:
        if self.num_gpus < 1:
            raise UserError(f"job {self.id}: num_gpus must be >= 1, got {self.num_gpus}")
        if not 0 < self.gpu_milli <= MILLI:
            raise UserError(f"job {self.id}: gpu_milli must be in 1..1000, got {self.gpu_milli}")
        if self.gpu_milli < MILLI and self.num_gpus != 1:
            raise UserError(f"job {self.id}: a fractional GPU request must ask for 1 GPU")
        for v, what in ((self.estimate, "estimate"), (self.duration, "duration")):
            if v is not None and (v < 0 or math.isnan(v)):
                raise UserError(f"job {self.id}: {what} must be >= 0 seconds, got {v}")
        if self.checkpoint_interval is not None and self.checkpoint_interval <= 0:
            raise UserError(f"job {self.id}: checkpoint_interval must be > 0 seconds")
        if self.cpu_milli < 0 or self.memory_mib < 0:
            raise UserError(f"job {self.id}: cpu_milli and memory_mib must be >= 0")
        if self.gpu_types:
            self.gpu_types = tuple(_accelerator(t)[0] for t in self.gpu_types)

    def reset(self) -> None:
        """Back to a job just made: the bookkeeping an earlier ClusterState wrote is gone.
        The control plane submits the same pending jobs to each pass's new state; resetting
        one costs a fifth of building it again (fields and checks)."""
        self.state = JobState.PENDING
        self.seq = -1
        self.allocation = None
        self.start_time = self.first_start = self.end_time = None
        self.progress = self.attained = self.lost_gpu_seconds = 0.0
        self.preemptions = 0

    @property
    def gpus(self) -> float:
        """GPUs this job occupies, fractional for shared-GPU requests."""
        return self.num_gpus * self.gpu_milli / MILLI

    def host_share(self, gpus: int) -> tuple[int, int]:
        """(CPU milli-cores, memory MiB) the job holds on a node with `gpus` of its GPUs:
        its requests split in proportion, rounded up."""
        if gpus >= self.num_gpus:
            return self.cpu_milli, self.memory_mib
        n = self.num_gpus
        return -(-self.cpu_milli * gpus // n), -(-self.memory_mib * gpus // n)

    def attained_at(self, now: float) -> float:
        """GPU-seconds received up to `now`, the current run included."""
        if self.start_time is None:
            return self.attained
        return self.attained + self.gpus * (now - self.start_time)

    @property
    def run_time(self) -> float:
        """Seconds of useful work done so far, the current run excluded."""
        return max((self.attained - self.lost_gpu_seconds) / self.gpus, 0.0)

    def remaining_estimate(self, default: float) -> float:
        """Seconds of work left as the scheduler believes it (never the true duration)."""
        est = self.estimate if self.estimate is not None else default
        return max(est - self.progress, 0.0)


@functools.cache
def _accelerator(gpu_type: str) -> tuple[str, int]:
    """(catalog name, link domain) of `gpu_type`; raises as hardware.get does. Cached: the
    control plane builds a state of thousands of jobs and nodes per pass, and a catalog
    lookup normalizes every catalog name (prices, which may change, are not kept here)."""
    acc = hardware.get(gpu_type)
    return acc.name, acc.link_domain


class SortedQueue:
    """Pending jobs sorted by a key that does not change while a job waits.

    With `group`, jobs are also kept in one sorted list per group (e.g. per tenant).
    """

    __slots__ = ("key", "group", "entries", "groups", "_keys")

    def __init__(
        self,
        key: Callable[[Job], tuple],
        jobs: Iterable[Job],
        group: Callable[[Job], Hashable] | None = None,
    ) -> None:
        self.key = key
        self.group = group
        self._keys: dict[str, tuple] = {}
        self.entries: list[tuple] = []
        self.groups: dict[Hashable, list[tuple]] = {}
        for job in jobs:
            k = self._keys[job.id] = (*key(job), job.seq)
            self.entries.append((*k, job))
            if group is not None:
                self.groups.setdefault(group(job), []).append((*k, job))
        # Sorted once, as `add` would have kept them (keys end with the unique seq): adding
        # one by one costs a bisection in Python per job, and the control plane's first
        # pass over a queue of 10,000 builds every queue its policy reads.
        self.entries.sort(key=_entry_key)
        for entries in self.groups.values():
            entries.sort(key=_entry_key)

    def add(self, job: Job) -> None:
        k = (*self.key(job), job.seq)
        self._keys[job.id] = k
        bisect.insort(self.entries, (*k, job), key=_entry_key)
        if self.group is not None:
            bisect.insort(self.groups.setdefault(self.group(job), []), (*k, job), key=_entry_key)

    def remove(self, job: Job) -> None:
        k = self._keys.pop(job.id)
        del self.entries[bisect.bisect_left(self.entries, k, key=_entry_key)]
        if self.group is not None:
            g = self.groups[self.group(job)]
            del g[bisect.bisect_left(g, k, key=_entry_key)]

    def __iter__(self) -> Iterator[Job]:
        """The jobs in order; safe while jobs start or requeue. It copies the queue in
        chunks, resuming after the last key seen, so a pass that looks at the first few
        jobs of a long queue costs little."""
        pos, chunk = 0, 128
        while True:
            part = self.entries[pos : pos + chunk]
            if not part:
                return
            for e in part:
                yield e[-1]
            pos = bisect.bisect_right(self.entries, part[-1][:-1], key=_entry_key)
            chunk *= 2

    def head(self) -> Iterator[Job]:
        """The jobs in order, without a copy: only while nothing starts or requeues."""
        return (e[-1] for e in self.entries)

    def __len__(self) -> int:
        return len(self.entries)


def _entry_key(entry: tuple) -> tuple:
    return entry[:-1]


class Pool:
    """Free capacity of one GPU type: nodes bucketed by their number of free whole GPUs,
    and free whole GPUs per rack. Cordoned nodes are in none of these indexes."""

    __slots__ = ("gpu_type", "total", "free_whole", "buckets", "shared", "max_node", "racks")

    def __init__(self, gpu_type: str) -> None:
        self.gpu_type = gpu_type
        self.total = 0
        self.free_whole = 0
        self.max_node = 0
        self.buckets: list[dict[int, None]] = [{}]  # ordered sets of node indices
        # GPUs partly used by fractional jobs, sorted: (free milli, node index, GPU index)
        self.shared: list[tuple[int, int, int]] = []
        self.racks: dict[str, int] = {}  # rack -> free whole GPUs


class ClusterState:
    """Nodes, tenants and jobs, with the incremental indexes a scheduling pass reads.

    Unknown duration estimates count as `default_estimate` seconds when the scheduler
    plans a reservation.
    """

    def __init__(self, default_estimate: float = 3600.0) -> None:
        self.default_estimate = default_estimate
        self.node_list: list[Node] = []
        self.nodes: dict[str, Node] = {}
        self.tenants: dict[str, Tenant] = {}
        self.jobs: dict[str, Job] = {}
        self.pending: dict[str, Job] = {}
        self.running: dict[str, Job] = {}
        self.pools: dict[str, Pool] = {}
        self.usage: dict[str, dict[str, float]] = {}  # tenant -> gpu type -> GPUs in use
        self.by_end: dict[str, list[tuple[float, int, Job]]] = {}  # gpu type -> running
        self._queues: dict[Hashable, SortedQueue] = {}
        self.arrived: list[Job] = []  # every submitted job, in arrival (seq) order
        # incremental bookkeeping a policy keeps over this state (e.g. the due-time guard's
        # virtual FIFO), created on the policy's first pass
        self.extras: dict[Hashable, object] = {}
        # over jobs that ended normally: what users estimated, and what they really ran
        # (seconds; an unknown estimate counts as default_estimate)
        self.ended_estimate = 0.0
        self.ended_runtime = 0.0
        self.ended: list[Job] = []  # jobs that ran to their end, in the order they ended
        self._end_key: dict[str, tuple[float, int]] = {}
        self._seq = 0
        # (gpu types, GPUs) -> whether a pool it may use is that large: pools only grow
        # (add_node), and the control plane submits a queue of thousands per pass
        self._fits: dict[tuple[tuple[str, ...], int], bool] = {}

    # --- topology -------------------------------------------------------------------
    def add_node(self, node: Node) -> Node:
        if node.name in self.nodes:
            raise ConfigError(f"node {node.name} is already in the cluster")
        node.index = len(self.node_list)
        self.node_list.append(node)
        self.nodes[node.name] = node
        pool = self.pools.get(node.gpu_type)
        if pool is None:
            pool = self.pools[node.gpu_type] = Pool(node.gpu_type)
            self.by_end[node.gpu_type] = []
        while len(pool.buckets) <= node.num_gpus:
            pool.buckets.append({})
        pool.max_node = max(pool.max_node, node.num_gpus)
        pool.total += node.num_gpus
        self._fits.clear()
        pool.free_whole += node.num_gpus
        pool.buckets[node.num_gpus][node.index] = None
        pool.racks[node.rack] = pool.racks.get(node.rack, 0) + node.num_gpus
        return node

    def cordon(self, name: str) -> None:
        """Take no new work on node `name`: its free GPUs leave the pool's free indexes (and
        GPUs freed later stay out), while the jobs running there go on."""
        node = self._node(name)
        if node.cordoned:
            return
        pool = self.pools[node.gpu_type]
        del pool.buckets[node.free_whole][node.index]
        pool.free_whole -= node.free_whole
        pool.racks[node.rack] -= node.free_whole
        for g, milli in enumerate(node.free_milli):
            if 0 < milli < MILLI:
                del pool.shared[bisect.bisect_left(pool.shared, (milli, node.index, g))]
        node.cordoned = True

    def uncordon(self, name: str) -> None:
        """Give node `name`'s free GPUs back to the pool."""
        node = self._node(name)
        if not node.cordoned:
            return
        node.cordoned = False
        pool = self.pools[node.gpu_type]
        pool.buckets[node.free_whole][node.index] = None
        pool.free_whole += node.free_whole
        pool.racks[node.rack] += node.free_whole
        for g, milli in enumerate(node.free_milli):
            if 0 < milli < MILLI:
                bisect.insort(pool.shared, (milli, node.index, g))

    def _node(self, name: str) -> Node:
        try:
            return self.nodes[name]
        except KeyError:
            raise unknown_name("node", name, self.nodes) from None

    def add_tenant(self, tenant: Tenant) -> Tenant:
        self.tenants[tenant.name] = tenant
        self.usage.setdefault(tenant.name, {})
        return tenant

    def capacity(self, gpu_type: str | None = None) -> int:
        if gpu_type is None:
            return sum(p.total for p in self.pools.values())
        pool = self.pools.get(gpu_type)
        return pool.total if pool else 0

    def pool_types(self, job: Job) -> list[str]:
        """The pools `job` may run in, in its order of preference."""
        if not job.gpu_types:
            return list(self.pools)
        return [t for t in job.gpu_types if t in self.pools]

    def hostable(self, job: Job) -> bool:
        """Whether the empty cluster could host `job`'s CPU and memory: one node of a pool
        it may use, if it fits in one; else whole nodes that host their share, enough of
        them. GPU counts alone are `submit`'s check."""
        if not (job.cpu_milli or job.memory_mib):
            return True
        for t in self.pool_types(job):
            nodes = [n for n in self.node_list if n.gpu_type == t]
            if job.num_gpus <= self.pools[t].max_node:
                if any(n.num_gpus >= job.num_gpus and n.hosts(job, job.num_gpus) for n in nodes):
                    return True
            elif sum(n.num_gpus for n in nodes if n.hosts(job, n.num_gpus)) >= job.num_gpus:
                return True
        return False

    # --- lifecycle --------------------------------------------------------------------
    def submit(self, job: Job) -> Job:
        """Add a pending job. Raises CapacityError if no pool could ever hold it."""
        if job.id in self.jobs:
            raise UserError(f"job {job.id} was already submitted")
        shape = (job.gpu_types, job.num_gpus)
        fits = self._fits.get(shape)
        if fits is None:
            fits = self._fits[shape] = any(
                self.pools[t].total >= job.num_gpus for t in self.pool_types(job)
            )
        if not fits:
            wanted = ", ".join(job.gpu_types) or "any type"
            raise CapacityError(
                f"job {job.id} asks for {job.num_gpus} GPUs of {wanted}; the largest pool "
                f"it may use has {max((self.capacity(t) for t in self.pool_types(job)), default=0)}"
            )
        job.seq = self._seq
        self._seq += 1
        self.jobs[job.id] = job
        self.arrived.append(job)
        self.usage.setdefault(job.tenant, {})
        self._enqueue(job)
        return job

    def start(self, job: Job, alloc: Allocation, now: float) -> None:
        """Run a pending job on `alloc` (which the placement found free). Raises
        CapacityError, changing nothing, if part of `alloc` is not free."""
        for name, gpus in alloc.parts:
            node = self.nodes[name]
            if not node.hosts(job, len(gpus)):
                raise CapacityError(f"node {name} lacks the CPU or memory job {job.id} asks for")
            for g in gpus:
                if node.free_milli[g] < alloc.milli:
                    raise CapacityError(f"GPU {g} of {name} is not free for job {job.id}")
        self._transition(job, JobState.RUNNING)
        self._dequeue(job)
        pool = self.pools[alloc.gpu_type]
        for name, gpus in alloc.parts:
            node = self.nodes[name]
            before = node.free_whole
            for g in gpus:
                self._set_free(pool, node, g, node.free_milli[g] - alloc.milli)
            self._rebucket(pool, node, before)
            cpu, memory = job.host_share(len(gpus))
            node.free_cpu -= cpu
            node.free_memory -= memory
        job.allocation = alloc
        job.start_time = now
        if job.first_start is None:
            job.first_start = now
        use = self.usage[job.tenant]
        use[alloc.gpu_type] = use.get(alloc.gpu_type, 0.0) + job.gpus
        end = now + job.remaining_estimate(self.default_estimate)
        self._end_key[job.id] = (end, job.seq)
        bisect.insort(self.by_end[alloc.gpu_type], (end, job.seq, job), key=lambda e: e[:2])
        self.running[job.id] = job

    def preempt(self, job: Job, now: float) -> float:
        """Stop a running job and requeue it. Returns the GPU-seconds of work lost."""
        if job.start_time is None:
            raise UserError(f"job {job.id} is {job.state}; only a running job can be preempted")
        ran = now - job.start_time
        kept = 0.0
        if job.checkpoint_interval:
            kept = math.floor(ran / job.checkpoint_interval) * job.checkpoint_interval
        lost = (ran - kept) * job.gpus
        self._stop(job, now, JobState.PENDING)
        job.progress += kept
        job.preemptions += 1
        job.lost_gpu_seconds += lost
        self._enqueue(job)
        return lost

    def finish(self, job: Job, now: float, state: JobState = JobState.SUCCEEDED) -> None:
        """A running job ended (its process exited, or in simulation its duration ran out)."""
        self._stop(job, now, state)
        job.end_time = now
        self.ended_estimate += job.estimate if job.estimate is not None else self.default_estimate
        self.ended_runtime += job.run_time
        self.ended.append(job)

    def cancel(self, job: Job, now: float) -> None:
        if job.state is JobState.RUNNING:
            self._stop(job, now, JobState.CANCELLED)
        else:
            self._transition(job, JobState.CANCELLED)
            self._dequeue(job)
        job.end_time = now

    def update(self, job: Job, estimate: float | None, avoid_nodes: frozenset[str]) -> None:
        """Change a pending job's estimate and the nodes it avoids in place: it leaves its
        queues and comes back, its arrival order (seq) unchanged, since queue keys may read
        both. The control plane's jobs change these when a run ends (a node to avoid, a new
        time limit) and come back pending under the same id."""
        if job.state is not JobState.PENDING:
            raise UserError(f"job {job.id} is {job.state}; only a pending job can be updated")
        self._dequeue(job)
        job.estimate, job.avoid_nodes = estimate, avoid_nodes
        self._enqueue(job)

    def forget(self, job: Job, now: float) -> None:
        """Take `job` out of the state for good: cancelled if it has not ended, and its id
        free for a job submitted later. It stays in `arrived` (and `ended`), the record a
        policy's bookkeeping (the virtual FIFO) reads by arrival index. For a state that
        lives as long as the control plane, whose jobs leave and may come back (a job held
        by a budget, then released)."""
        if job.state in (JobState.PENDING, JobState.RUNNING):
            self.cancel(job, now)
        del self.jobs[job.id]

    @property
    def estimate_calibration(self) -> float:
        """Observed run time per second of estimate over the jobs that ended (1.0 before
        any): users' estimates are often biased, and this rescales them."""
        return self.ended_runtime / self.ended_estimate if self.ended_estimate > 0 else 1.0

    def get(self, job_id: str) -> Job:
        try:
            return self.jobs[job_id]
        except KeyError:
            raise NotFoundError(f"no job {job_id!r}") from None

    # --- queues -------------------------------------------------------------------------
    def queue(
        self,
        name: Hashable,
        key: Callable[[Job], tuple],
        group: Callable[[Job], Hashable] | None = None,
    ) -> SortedQueue:
        """The pending jobs sorted by `key` (then arrival), kept up to date from now on.

        `key` must not change while a job is pending (it may change across a preemption).
        The first call for a `name` sorts the pending jobs; later ones cost nothing.
        """
        q = self._queues.get(name)
        if q is None:
            q = self._queues[name] = SortedQueue(key, self.pending.values(), group)
        return q

    def free_gpus(self, gpu_type: str) -> int:
        return self.pools[gpu_type].free_whole

    def nodes_with_free(self, gpu_type: str, k: int) -> dict[int, None]:
        """Indices of nodes of `gpu_type` with exactly `k` free whole GPUs."""
        return self.pools[gpu_type].buckets[k]

    # --- internals ----------------------------------------------------------------------
    def _transition(self, job: Job, to: JobState) -> None:
        if to not in TRANSITIONS[job.state]:
            raise UserError(f"job {job.id} cannot go from {job.state} to {to}")
        job.state = to

    def _enqueue(self, job: Job) -> None:
        self.pending[job.id] = job
        for q in self._queues.values():
            q.add(job)

    def _dequeue(self, job: Job) -> None:
        del self.pending[job.id]
        for q in self._queues.values():
            q.remove(job)

    def _stop(self, job: Job, now: float, to: JobState) -> None:
        self._transition(job, to)
        alloc = job.allocation
        assert alloc is not None and job.start_time is not None
        pool = self.pools[alloc.gpu_type]
        for name, gpus in alloc.parts:
            node = self.nodes[name]
            before = node.free_whole
            for g in gpus:
                self._set_free(pool, node, g, node.free_milli[g] + alloc.milli)
            self._rebucket(pool, node, before)
            cpu, memory = job.host_share(len(gpus))
            node.free_cpu += cpu
            node.free_memory += memory
        job.attained += job.gpus * (now - job.start_time)
        use = self.usage[job.tenant]
        use[alloc.gpu_type] -= job.gpus
        end = self._end_key.pop(job.id)
        ends = self.by_end[alloc.gpu_type]
        del ends[bisect.bisect_left(ends, end, key=lambda e: e[:2])]
        del self.running[job.id]
        job.allocation = None
        job.start_time = None

    @staticmethod
    def _set_free(pool: Pool, node: Node, gpu: int, milli: int) -> None:
        old = node.free_milli[gpu]
        node.free_milli[gpu] = milli
        if node.cordoned:
            return  # a cordoned node is in no free index
        if 0 < old < MILLI:
            del pool.shared[bisect.bisect_left(pool.shared, (old, node.index, gpu))]
        if 0 < milli < MILLI:
            bisect.insort(pool.shared, (milli, node.index, gpu))

    @staticmethod
    def _rebucket(pool: Pool, node: Node, before: int) -> None:
        after = node.free_whole
        if after != before and not node.cordoned:
            del pool.buckets[before][node.index]
            pool.buckets[after][node.index] = None
            pool.free_whole += after - before
            pool.racks[node.rack] += after - before
