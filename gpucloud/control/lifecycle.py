"""Lifecycles of jobs, replicas and nodes: the states and the allowed transitions, in tables.

A job runs PENDING -> RUNNING -> SUCCEEDED | FAILED | CANCELLED. A running job that is
preempted goes to PREEMPTED, one whose process failed (or could not even start) with retries
left to RETRYING; both go back to PENDING (RETRYING after its backoff), keeping the same job
id and event history.

A deployment version is STABLE or a CANARY while served, RETIRED or ROLLED_BACK after.

A replica runs PENDING -> STARTING -> READY. One whose health probes fail (or that is not
ready in time) is FAILED: out of the gateway's routes while its process is stopped; then,
like one whose process exited or could not start, RESTARTING until its backoff is over.
A replica of a deployment's warm pool (control/warm_pool.py) is WARM once ready: probed
like a READY one, holding its GPUs, but routed nothing until a scale-up promotes it to
READY; a scale-down may demote a READY one back to WARM.
"""

from __future__ import annotations

from enum import StrEnum

from gpucloud.errors import UserError


class JobState(StrEnum):
    PENDING = "PENDING"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    PREEMPTED = "PREEMPTED"
    RETRYING = "RETRYING"


JOB_TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.PENDING: frozenset({JobState.RUNNING, JobState.CANCELLED, JobState.FAILED}),
    JobState.RUNNING: frozenset(
        {
            JobState.SUCCEEDED,
            JobState.FAILED,
            JobState.CANCELLED,
            JobState.PREEMPTED,
            JobState.RETRYING,
        }
    ),
    JobState.PREEMPTED: frozenset({JobState.PENDING, JobState.CANCELLED}),
    JobState.RETRYING: frozenset({JobState.PENDING, JobState.CANCELLED}),
    JobState.SUCCEEDED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.CANCELLED: frozenset(),
}
FINISHED = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})


class ReplicaState(StrEnum):
    PENDING = "PENDING"  # waiting for GPUs
    STARTING = "STARTING"  # process started, /ready not answering yet
    READY = "READY"
    WARM = "WARM"  # ready, in the warm pool: not routed until a scale-up promotes it
    FAILED = "FAILED"  # unhealthy: routed no requests, its process being stopped
    RESTARTING = "RESTARTING"  # died; back to PENDING after a backoff
    STOPPED = "STOPPED"  # its deployment was deleted or scaled down


REPLICA_TRANSITIONS: dict[ReplicaState, frozenset[ReplicaState]] = {
    ReplicaState.PENDING: frozenset({ReplicaState.STARTING, ReplicaState.STOPPED}),
    ReplicaState.STARTING: frozenset(
        {
            ReplicaState.READY,
            ReplicaState.WARM,
            ReplicaState.FAILED,
            ReplicaState.RESTARTING,
            ReplicaState.STOPPED,
        }
    ),
    ReplicaState.READY: frozenset(
        {
            ReplicaState.WARM,
            ReplicaState.FAILED,
            ReplicaState.RESTARTING,
            ReplicaState.STOPPED,
            ReplicaState.STARTING,
        }
    ),
    ReplicaState.WARM: frozenset(
        {ReplicaState.READY, ReplicaState.FAILED, ReplicaState.RESTARTING, ReplicaState.STOPPED}
    ),
    ReplicaState.FAILED: frozenset({ReplicaState.RESTARTING, ReplicaState.STOPPED}),
    ReplicaState.RESTARTING: frozenset({ReplicaState.PENDING, ReplicaState.STOPPED}),
    ReplicaState.STOPPED: frozenset(),
}
REPLICA_HOLDS_GPUS = frozenset(
    {ReplicaState.STARTING, ReplicaState.READY, ReplicaState.WARM, ReplicaState.FAILED}
)


class VersionState(StrEnum):
    """A deployment version: the new one a rollout starts is a CANARY beside the STABLE one;
    promoted, it is STABLE and the old one RETIRED; rolled back, it is ROLLED_BACK. The
    replicas of an ended version drain: no new requests, then stopped once theirs are done."""

    STABLE = "stable"
    CANARY = "canary"
    RETIRED = "retired"
    ROLLED_BACK = "rolled_back"


VERSION_TRANSITIONS: dict[VersionState, frozenset[VersionState]] = {
    VersionState.CANARY: frozenset({VersionState.STABLE, VersionState.ROLLED_BACK}),
    VersionState.STABLE: frozenset({VersionState.RETIRED}),
    VersionState.RETIRED: frozenset(),
    VersionState.ROLLED_BACK: frozenset(),
}
SERVED_VERSIONS = frozenset({VersionState.STABLE, VersionState.CANARY})


class NodeState(StrEnum):
    READY = "ready"
    CORDONED = "cordoned"  # runs what it has, takes nothing new
    DRAINING = "draining"  # takes nothing new; its replicas move elsewhere, its jobs finish
    DOWN = "down"  # its executor reports it unhealthy, or stopped reporting it


class Role(StrEnum):
    ADMIN = "admin"
    MEMBER = "member"
    VIEWER = "viewer"


# Priority classes users name; the scheduler core compares the numbers.
PRIORITIES: dict[str, int] = {"low": 0, "normal": 100, "high": 1000}


def check_job_transition(job_id: int, src: str, dst: JobState) -> None:
    if dst not in JOB_TRANSITIONS[JobState(src)]:
        raise UserError(f"job {job_id} cannot go from {src} to {dst}")


def check_replica_transition(replica_id: int, src: str, dst: ReplicaState) -> None:
    if dst not in REPLICA_TRANSITIONS[ReplicaState(src)]:
        raise UserError(f"replica {replica_id} cannot go from {src} to {dst}")


def check_version_transition(number: int, src: str, dst: VersionState) -> None:
    if dst not in VERSION_TRANSITIONS[VersionState(src)]:
        raise UserError(f"version {number} cannot go from {src} to {dst}")


class BatchStatus(StrEnum):
    """A Batch API job's status, in OpenAI's words (batch_runner.py moves it on)."""

    VALIDATING = "validating"  # accepted (its input file checked), not started yet
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"  # every line answered: its output files being written
    COMPLETED = "completed"
    FAILED = "failed"
    EXPIRED = "expired"  # its completion window ended first
    CANCELLING = "cancelling"  # lines in flight finish, no new one starts
    CANCELLED = "cancelled"


BATCH_TRANSITIONS: dict[BatchStatus, frozenset[BatchStatus]] = {
    BatchStatus.VALIDATING: frozenset(
        {BatchStatus.IN_PROGRESS, BatchStatus.FAILED, BatchStatus.CANCELLING}
    ),
    BatchStatus.IN_PROGRESS: frozenset(
        {BatchStatus.FINALIZING, BatchStatus.CANCELLING, BatchStatus.EXPIRED, BatchStatus.FAILED}
    ),
    BatchStatus.FINALIZING: frozenset({BatchStatus.COMPLETED}),
    BatchStatus.CANCELLING: frozenset({BatchStatus.CANCELLED}),
    BatchStatus.COMPLETED: frozenset(),
    BatchStatus.FAILED: frozenset(),
    BatchStatus.EXPIRED: frozenset(),
    BatchStatus.CANCELLED: frozenset(),
}
BATCH_RUNNING = frozenset(s for s, nexts in BATCH_TRANSITIONS.items() if nexts)
