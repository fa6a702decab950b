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
    # The registered model a train job starts from ("NAME:VERSION") and its files, which
    # its run gets as model.path (services/registry.py).
    model_ref: Mapped[str | None] = mapped_column(String(80), nullable=True)
    model_dir: Mapped[str | None] = mapped_column(Text, nullable=True)
    gpus: Mapped[int] = mapped_column(Integer)
    # The share of its one GPU a fractional job asks for (then gpus is 1); 1000 = whole GPUs.
    gpu_milli: Mapped[int] = mapped_column(Integer, default=1000, server_default="1000")
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
    # A train job's steps x the planner's step time (run_estimate.py), for the scheduler
    planned_seconds: Mapped[float | None] = mapped_column(Float, nullable=True)
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
    # Node names the scheduler must not place it on (a training run's straggling nodes);
    # NULL, not [], when none: the scheduler's pass reads it for every pending job.
    avoid_nodes: Mapped[list[str] | None] = mapped_column(JSON(none_as_null=True), nullable=True)
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
    # The share of its one GPU each replica asks for (then gpus_per_replica is 1), as jobs'
    gpu_milli: Mapped[int] = mapped_column(Integer, default=1000, server_default="1000")
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
    # The registered model it serves (a model_versions id, and "NAME:VERSION":
    # services/registry.py), if it was named so; and the eval its promotion requires
    # ({"task", "task_hash"}), if any.
    model_version_id: Mapped[int | None] = mapped_column(Integer, nullable=True)
    model_ref: Mapped[str | None] = mapped_column(String(80), nullable=True)
    require_eval: Mapped[dict[str, Any] | None] = mapped_column(
        JSON(none_as_null=True), nullable=True
    )


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
    gpus: Mapped[float] = mapped_column(Float)  # a fractional job's share counts as such
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


class BatchFile(Base):
    """A file of OpenAI's Files API (/v1/files): a Batch API job's JSONL input, or its
    output and error lines. The bytes live under the control plane's home
    (services/batches.py says where), never in a tenant's area."""

    __tablename__ = "batch_files"
    id: Mapped[str] = mapped_column(String(40), primary_key=True)  # file-<random hex>
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"), index=True)
    filename: Mapped[str] = mapped_column(String(255))
    purpose: Mapped[str] = mapped_column(String(32))  # batch | batch_output
    bytes: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[float] = mapped_column(Float)


class Batch(Base):
    """A job of OpenAI's Batch API: its input file's lines, sent one by one through the
    gateway as batch-class requests (batch_runner.py)."""

    __tablename__ = "batches"
    id: Mapped[str] = mapped_column(String(40), primary_key=True)  # batch_<random hex>
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"), index=True)
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id"))
    endpoint: Mapped[str] = mapped_column(String(64))
    input_file_id: Mapped[str] = mapped_column(String(40))
    completion_window: Mapped[str] = mapped_column(String(16))
    status: Mapped[str] = mapped_column(String(16), index=True)  # batches.BatchStatus
    metadata_: Mapped[dict[str, str] | None] = mapped_column(
        "metadata", JSON(none_as_null=True), nullable=True
    )
    output_file_id: Mapped[str | None] = mapped_column(String(40), nullable=True)
    error_file_id: Mapped[str | None] = mapped_column(String(40), nullable=True)
    total: Mapped[int] = mapped_column(Integer)  # lines of the input file
    completed: Mapped[int] = mapped_column(Integer, default=0)  # lines answered 2xx
    failed: Mapped[int] = mapped_column(Integer, default=0)  # lines answered otherwise
    # Why it failed as a whole: OpenAI's errors.data entries ({"code", "message", ...}).
    errors: Mapped[list[dict[str, Any]] | None] = mapped_column(
        JSON(none_as_null=True), nullable=True
    )
    created_at: Mapped[float] = mapped_column(Float)
    expires_at: Mapped[float] = mapped_column(Float)
    # When it entered each status (None: not yet), as OpenAI's batch object reports them.
    in_progress_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    finalizing_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    completed_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    failed_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    expired_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    cancelling_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    cancelled_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    # The control plane running it (its lease, renewed while it runs: batch_runner.py), and
    # until when (wall clock) no other may take it over.
    lease_owner: Mapped[str | None] = mapped_column(String(255), nullable=True)
    lease_expires_at: Mapped[float | None] = mapped_column(Float, nullable=True)


class ReplicaSample(Base):
    """One answer of a replica of a guarded canary's deployment to the gateway
    (replica_stats.py): what the automatic rollback judges, kept so that a control plane
    that restarts does not start its window empty. Rows older than the window go."""

    __tablename__ = "replica_samples"
    id: Mapped[int] = mapped_column(primary_key=True)
    replica_id: Mapped[int] = mapped_column(Integer, index=True)  # no FK: it goes by age
    at: Mapped[float] = mapped_column(Float)  # wall clock, when its first token came
    error: Mapped[bool] = mapped_column(Boolean)
    ttft: Mapped[float | None] = mapped_column(Float, nullable=True)  # seconds; None: error


class BatchLine(Base):
    """The answer to one finished line of a running batch, in OpenAI's output line shape
    (JSON text): what makes a restarted control plane skip the line. The rows go once
    the batch's output and error files are written."""

    __tablename__ = "batch_lines"
    batch_id: Mapped[str] = mapped_column(ForeignKey("batches.id"), primary_key=True)
    line: Mapped[int] = mapped_column(Integer, primary_key=True)  # 0-based, in the input
    ok: Mapped[bool] = mapped_column(Boolean)  # to the output file (else the error file)
    result: Mapped[str] = mapped_column(Text)


class ModelVersion(Base):
    """Version `number` of a tenant's model `name`: where its files are (`uri`, a path or an
    s3:// URL: the weights stay there), their content hash, and what produced it.

    `files` maps each hashed file to its digest; `hash_kind` says what the digests are:
    "sha256" of the bytes, the objects' "etag", or a hash the caller "given". The lineage
    fields are those the caller knew: a registered base version, the base model as the
    training config named it, the dataset and its hash, the resolved training config, the
    run (its run dir) and the checkpoint step.
    """

    __tablename__ = "model_versions"
    __table_args__ = (
        UniqueConstraint("tenant_id", "name", "number"),
        UniqueConstraint("tenant_id", "name", "content_hash"),
    )
    id: Mapped[int] = mapped_column(primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"), index=True)
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id"))
    name: Mapped[str] = mapped_column(String(63))
    number: Mapped[int] = mapped_column(Integer)
    uri: Mapped[str] = mapped_column(Text)
    content_hash: Mapped[str] = mapped_column(String(80))
    hash_kind: Mapped[str] = mapped_column(String(16))
    files: Mapped[dict[str, str]] = mapped_column(JSON)
    base_id: Mapped[int | None] = mapped_column(ForeignKey("model_versions.id"), nullable=True)
    base_model: Mapped[str | None] = mapped_column(Text, nullable=True)
    dataset: Mapped[str | None] = mapped_column(Text, nullable=True)
    dataset_hash: Mapped[str | None] = mapped_column(String(80), nullable=True)
    train_config: Mapped[dict[str, Any] | None] = mapped_column(
        JSON(none_as_null=True), nullable=True
    )
    run: Mapped[str | None] = mapped_column(Text, nullable=True)
    step: Mapped[int | None] = mapped_column(Integer, nullable=True)
    created_at: Mapped[float] = mapped_column(Float)


class ModelEval(Base):
    """A model version's score on one task file (its sha256): the result of `gpucloud eval`
    whole, per-item records included, which `eval compare` resamples. Evaluating again on
    the same file replaces it."""

    __tablename__ = "model_evals"
    __table_args__ = (UniqueConstraint("version_id", "task_hash"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    version_id: Mapped[int] = mapped_column(ForeignKey("model_versions.id"), index=True)
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id"))
    task: Mapped[str] = mapped_column(String(255))
    task_hash: Mapped[str] = mapped_column(String(80))
    kind: Mapped[str] = mapped_column(String(32))
    metric: Mapped[str] = mapped_column(String(32))
    score: Mapped[float] = mapped_column(Float)
    ci_low: Mapped[float] = mapped_column(Float)
    ci_high: Mapped[float] = mapped_column(Float)
    n: Mapped[int] = mapped_column(Integer)
    result: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[float] = mapped_column(Float)
