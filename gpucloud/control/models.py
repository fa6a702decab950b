"""The store's tables (SQLAlchemy 2). Times are float seconds since the epoch (UTC).

The schema is created and upgraded only by the Alembic migrations in `migrations/`;
these classes must match the head revision (tests/control/test_migrations.py checks it).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import JSON, Boolean, Float, ForeignKey, Integer, String, Text, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    pass


class Tenant(Base):
    __tablename__ = "tenants"
    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(63), unique=True)
    # Operators (the tenant `gpucloud up` bootstraps) manage tenants, quotas and nodes.
    is_operator: Mapped[bool] = mapped_column(Boolean, default=False)
    weight: Mapped[float] = mapped_column(Float, default=1.0)
    created_at: Mapped[float] = mapped_column(Float)
    # "host": its jobs share the node's network; "isolated": each job gets its own network
    # namespace with loopback only (replicas keep the host's: the gateway must reach them).
    network: Mapped[str] = mapped_column(String(16), default="host", server_default="host")
    # Requests and tokens per minute through the /v1 gateway (schemas.RateLimit); None: any.
    rate_limit: Mapped[dict[str, Any] | None] = mapped_column(
        JSON(none_as_null=True), nullable=True
    )
    # Tenants of one cohort lend each other idle quota, taken back by preempting the
    # borrowers' jobs when its owner needs it (as Kueue's cohorts); None: no borrowing.
    cohort: Mapped[str | None] = mapped_column(String(63), nullable=True)
    # Seconds its deployments and interactive jobs may sit idle (control/idle.py) unless
    # they set their own; None: the cluster's default.
    idle_ttl: Mapped[float | None] = mapped_column(Float, nullable=True)


class User(Base):
    __tablename__ = "users"
    __table_args__ = (UniqueConstraint("tenant_id", "name"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"), index=True)
    name: Mapped[str] = mapped_column(String(63))
    role: Mapped[str] = mapped_column(String(16))  # admin | member | viewer
    created_at: Mapped[float] = mapped_column(Float)


class ApiKey(Base):
    """A key acts as its user. Its name is unique among its tenant's live keys, except
    that a rotated key keeps its name while its grace period runs."""

    __tablename__ = "api_keys"
    id: Mapped[int] = mapped_column(primary_key=True)
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id"), index=True)
    name: Mapped[str] = mapped_column(String(63))
    prefix: Mapped[str] = mapped_column(String(16))  # shown in listings; the key is not kept
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)  # SHA-256, hex
    created_at: Mapped[float] = mapped_column(Float)
    last_used_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    expires_at: Mapped[float | None] = mapped_column(Float, nullable=True)  # end of a grace
    revoked_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    # How the /v1 gateway serves its requests (priority.PriorityClass), and its own limits.
    priority_class: Mapped[str] = mapped_column(
        String(16), default="interactive", server_default="interactive"
    )
    rate_limit: Mapped[dict[str, Any] | None] = mapped_column(
        JSON(none_as_null=True), nullable=True
    )


class Quota(Base):
    __tablename__ = "quotas"
    __table_args__ = (UniqueConstraint("tenant_id", "gpu_type"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"), index=True)
    gpu_type: Mapped[str] = mapped_column(String(32))
    gpus: Mapped[int] = mapped_column(Integer)


class Node(Base):
    __tablename__ = "nodes"
    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(63), unique=True)
    gpu_type: Mapped[str] = mapped_column(String(32))
    gpus: Mapped[int] = mapped_column(Integer)
    link_domain: Mapped[int] = mapped_column(Integer)  # GPUs per NVLink/HCCS domain
    # Host resources for workloads that request them; 0 = not tracked.
    cpu_milli: Mapped[int] = mapped_column(Integer, default=0)
    memory_mib: Mapped[int] = mapped_column(Integer, default=0)
    backend: Mapped[str] = mapped_column(String(16))  # hal backend name; cpu for virtual slots
    labels: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    address: Mapped[str] = mapped_column(String(255), default="127.0.0.1")  # workloads' host
    state: Mapped[str] = mapped_column(String(16))  # lifecycle.NodeState
    reason: Mapped[str | None] = mapped_column(Text, nullable=True)  # why it is in its state
    state_since: Mapped[float | None] = mapped_column(Float, nullable=True)
    heartbeat_at: Mapped[float] = mapped_column(Float)
    created_at: Mapped[float] = mapped_column(Float)


class Job(Base):
    __tablename__ = "jobs"
    id: Mapped[int] = mapped_column(primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"), index=True)
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id"))
    name: Mapped[str] = mapped_column(String(63))
    command: Mapped[str | None] = mapped_column(Text, nullable=True)
    train_config: Mapped[str | None] = mapped_column(Text, nullable=True)
    gpus: Mapped[int] = mapped_column(Integer)
    gpu_type: Mapped[str | None] = mapped_column(String(32), nullable=True)
    cpu_milli: Mapped[int] = mapped_column(Integer, default=0)  # for the whole job; 0 = none
    memory_mib: Mapped[int] = mapped_column(Integer, default=0)
    priority: Mapped[str] = mapped_column(String(16))
    preemptible: Mapped[bool] = mapped_column(Boolean)
    max_retries: Mapped[int] = mapped_column(Integer)
    env: Mapped[dict[str, str]] = mapped_column(JSON, default=dict)
    workdir: Mapped[str | None] = mapped_column(Text, nullable=True)
    checkpoint_dir: Mapped[str | None] = mapped_column(Text, nullable=True)
    time_limit: Mapped[float | None] = mapped_column(Float, nullable=True)  # s, each run
    # Free-form tags (team, project): showback groups by them, budgets may cover one.
    labels: Mapped[dict[str, str]] = mapped_column(JSON, default=dict, server_default="{}")
    state: Mapped[str] = mapped_column(String(16), index=True)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    preemptions: Mapped[int] = mapped_column(Integer, default=0)
    requeues: Mapped[int] = mapped_column(Integer, default=0)  # attempts the platform lost
    exit_code: Mapped[int | None] = mapped_column(Integer, nullable=True)
    reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    node_id: Mapped[int | None] = mapped_column(ForeignKey("nodes.id"), nullable=True)
    devices: Mapped[list[int]] = mapped_column(JSON, default=list)
    # The executor's token for the running workload (executors.base.Handle), and every
    # node's share of it: [{"node": name, "devices": [...]}]; node_id and devices above are
    # its first node's, for the views.
    handle: Mapped[str | None] = mapped_column(String(255), nullable=True)
    placement: Mapped[list[dict[str, Any]]] = mapped_column(JSON, default=list)
    log_path: Mapped[str | None] = mapped_column(Text, nullable=True)
    not_before: Mapped[float] = mapped_column(Float, default=0.0)  # retry backoff
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    # Why the control plane asked it to stop (a spent budget, idleness): its reason when it
    # ends; None for a user's cancel.
    stop_reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    # A notebook or dev box: stopped once its accelerators sit idle for its idle TTL
    # (its own, else its tenant's, else the cluster's; 0: never).
    interactive: Mapped[bool] = mapped_column(Boolean, default=False, server_default="0")
    idle_ttl: Mapped[float | None] = mapped_column(Float, nullable=True)
    idle_reclaim_at: Mapped[float | None] = mapped_column(Float, nullable=True)  # warned: when
    submitted_at: Mapped[float] = mapped_column(Float)
    started_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    finished_at: Mapped[float | None] = mapped_column(Float, nullable=True)


class JobEvent(Base):
    __tablename__ = "job_events"
    id: Mapped[int] = mapped_column(primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id"), index=True)
    at: Mapped[float] = mapped_column(Float)
    from_state: Mapped[str | None] = mapped_column(String(16), nullable=True)
    to_state: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str | None] = mapped_column(Text, nullable=True)


class Deployment(Base):
    __tablename__ = "deployments"
    id: Mapped[int] = mapped_column(primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"), index=True)
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id"))
    name: Mapped[str] = mapped_column(String(63))
    model_dir: Mapped[str] = mapped_column(Text)
    engine_args: Mapped[list[str]] = mapped_column(JSON, default=list)
    command: Mapped[str | None] = mapped_column(Text, nullable=True)  # custom server command
    replicas: Mapped[int] = mapped_column(Integer)
    # Autoscale fields (schemas.Autoscale) when the load sets `replicas`, else None.
    autoscale: Mapped[dict[str, Any] | None] = mapped_column(
        JSON(none_as_null=True),
        nullable=True,  # SQL NULL, not JSON 'null': filterable
    )
    gpus_per_replica: Mapped[int] = mapped_column(Integer)
    gpu_type: Mapped[str | None] = mapped_column(String(32), nullable=True)
    cpu_milli: Mapped[int] = mapped_column(Integer, default=0)  # per replica; 0 = none
    memory_mib: Mapped[int] = mapped_column(Integer, default=0)
    priority: Mapped[str] = mapped_column(String(16))
    preemptible: Mapped[bool] = mapped_column(Boolean)
    env: Mapped[dict[str, str]] = mapped_column(JSON, default=dict)
    # Batch-class requests the gateway lets in at once per ready replica (priority.py).
    batch_in_flight: Mapped[int] = mapped_column(Integer, default=2, server_default="2")
    state: Mapped[str] = mapped_column(String(16))  # active | deleting | deleted
    created_at: Mapped[float] = mapped_column(Float)
    labels: Mapped[dict[str, str]] = mapped_column(JSON, default=dict, server_default="{}")
    # Scaled to zero after this many seconds without a request (its own, else its tenant's,
    # else the cluster's; 0: never); idle_reclaim_at is set once warned, and
    # reclaimed_replicas (what it had) while scaled to zero, until a request wakes it.
    idle_ttl: Mapped[float | None] = mapped_column(Float, nullable=True)
    idle_reclaim_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    reclaimed_replicas: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # Replicas kept started beside the routed ones, not routed (control/warm_pool.py).
    warm_pool: Mapped[int] = mapped_column(Integer, default=0, server_default="0")


class DeploymentVersion(Base):
    """What a deployment's replicas serve: a model dir and engine settings, numbered from 1.

    One version is STABLE; a CANARY beside it takes `percent` of the requests until it is
    promoted (then the stable one is RETIRED) or rolled back (lifecycle.VersionState). The
    deployment's own model_dir, engine_args and command are its stable version's.
    """

    __tablename__ = "deployment_versions"
    __table_args__ = (UniqueConstraint("deployment_id", "number"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    deployment_id: Mapped[int] = mapped_column(ForeignKey("deployments.id"), index=True)
    number: Mapped[int] = mapped_column(Integer)
    model_dir: Mapped[str] = mapped_column(Text)
    engine_args: Mapped[list[str]] = mapped_column(JSON, default=list)
    command: Mapped[str | None] = mapped_column(Text, nullable=True)
    state: Mapped[str] = mapped_column(String(16))  # lifecycle.VersionState
    percent: Mapped[float] = mapped_column(Float)  # its share of the requests, while served
    # When the control plane rolls a canary back by itself (schemas.CanaryGuard), else None.
    guard: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True), nullable=True)
    created_at: Mapped[float] = mapped_column(Float)
    ended_at: Mapped[float | None] = mapped_column(Float, nullable=True)  # retired, rolled back
    reason: Mapped[str | None] = mapped_column(Text, nullable=True)  # why it ended


class Replica(Base):
    __tablename__ = "replicas"
    id: Mapped[int] = mapped_column(primary_key=True)
    deployment_id: Mapped[int] = mapped_column(ForeignKey("deployments.id"), index=True)
    version_id: Mapped[int] = mapped_column(ForeignKey("deployment_versions.id"))
    index: Mapped[int] = mapped_column(Integer)  # among its version's replicas
    state: Mapped[str] = mapped_column(String(16), index=True)
    node_id: Mapped[int | None] = mapped_column(ForeignKey("nodes.id"), nullable=True)
    devices: Mapped[list[int]] = mapped_column(JSON, default=list)
    port: Mapped[int | None] = mapped_column(Integer, nullable=True)
    url: Mapped[str | None] = mapped_column(String(255), nullable=True)  # http://node:port
    # The executor's token for the running workload (executors.base.Handle), and every
    # node's share of it: [{"node": name, "devices": [...]}]; node_id and devices above are
    # its first node's, for the views.
    handle: Mapped[str | None] = mapped_column(String(255), nullable=True)
    placement: Mapped[list[dict[str, Any]]] = mapped_column(JSON, default=list)
    log_path: Mapped[str | None] = mapped_column(Text, nullable=True)
    restarts: Mapped[int] = mapped_column(Integer, default=0)
    exit_code: Mapped[int | None] = mapped_column(Integer, nullable=True)
    reason: Mapped[str | None] = mapped_column(Text, nullable=True)  # why it last failed
    not_before: Mapped[float] = mapped_column(Float, default=0.0)
    created_at: Mapped[float] = mapped_column(Float)
    started_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    ready_at: Mapped[float | None] = mapped_column(Float, nullable=True)


class AuditEntry(Base):
    __tablename__ = "audit_log"
    id: Mapped[int] = mapped_column(primary_key=True)
    at: Mapped[float] = mapped_column(Float, index=True)
    tenant_id: Mapped[int | None] = mapped_column(ForeignKey("tenants.id"), nullable=True)
    user_id: Mapped[int | None] = mapped_column(ForeignKey("users.id"), nullable=True)
    action: Mapped[str] = mapped_column(String(64))
    target: Mapped[str] = mapped_column(String(128))
    detail: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)


class UsageRecord(Base):
    """One allocation interval: `gpus` GPUs of `gpu_type` held from started_at to ended_at."""

    __tablename__ = "usage"
    id: Mapped[int] = mapped_column(primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"), index=True)
    job_id: Mapped[int | None] = mapped_column(ForeignKey("jobs.id"), nullable=True)
    replica_id: Mapped[int | None] = mapped_column(ForeignKey("replicas.id"), nullable=True)
    gpu_type: Mapped[str] = mapped_column(String(32))
    gpus: Mapped[int] = mapped_column(Integer)
    started_at: Mapped[float] = mapped_column(Float, index=True)
    ended_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    node: Mapped[str | None] = mapped_column(String(63), nullable=True)  # its (first) node


class Price(Base):
    """What an hour of one `gpu_type` GPU costs from `effective_from` on, until the next
    version. `pool` narrows it to the nodes with one label ("key=value"); "" is every node
    of the type. Versions are only added: usage before a change keeps its old price."""

    __tablename__ = "prices"
    __table_args__ = (UniqueConstraint("gpu_type", "pool", "effective_from"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    gpu_type: Mapped[str] = mapped_column(String(32))
    pool: Mapped[str] = mapped_column(String(127), default="", server_default="")
    per_hour: Mapped[float] = mapped_column(Float)  # USD
    effective_from: Mapped[float] = mapped_column(Float)
    created_at: Mapped[float] = mapped_column(Float)


class Budget(Base):
    """A calendar month's (UTC) allowance of a tenant, or of one of its users ("" = all),
    or of its jobs with one label ("key=value"; "" = all), in GPU-hours or USD."""

    __tablename__ = "budgets"
    __table_args__ = (UniqueConstraint("tenant_id", "user", "label"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"), index=True)
    user: Mapped[str] = mapped_column(String(63), default="", server_default="")
    label: Mapped[str] = mapped_column(String(127), default="", server_default="")
    unit: Mapped[str] = mapped_column(String(16))  # gpu_hours | usd
    amount: Mapped[float] = mapped_column(Float)
    soft: Mapped[float] = mapped_column(Float)  # the fraction of amount that warns
    on_exhausted: Mapped[str] = mapped_column(String(16))  # queue | stop
    created_at: Mapped[float] = mapped_column(Float)
    # The months ("YYYY-MM") whose soft crossing and exhaustion were audited: once each.
    soft_audited: Mapped[str] = mapped_column(String(7), default="", server_default="")
    exhausted_audited: Mapped[str] = mapped_column(String(7), default="", server_default="")
