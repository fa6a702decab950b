"""Request and response bodies of the REST API (pydantic), one family per resource.

Specs forbid unknown keys, so a typo in a job file is an error that names the key.
"""

from __future__ import annotations

import shlex
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StringConstraints,
    field_validator,
    model_validator,
)

from gpucloud import hardware, storage
from gpucloud.control.auth import LAST_USE_RESOLUTION
from gpucloud.control.lifecycle import PRIORITIES, Role
from gpucloud.control.model_ref import ModelRef
from gpucloud.control.priority import PriorityClass
from gpucloud.durations import parse_duration
from gpucloud.errors import NotFoundError

Name = Annotated[
    str,
    StringConstraints(
        strip_whitespace=True, min_length=1, max_length=63, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
    ),
]
Priority = Literal["low", "normal", "high"]
DEFAULT_KEY_GRACE = 86400.0  # seconds a rotated key keeps working unless the call says
MAX_KEY_GRACE = 30 * 86400.0
# Host resources a workload requests; 0 requests none. Stored as millicores and MiB.
Cpus = Annotated[float, Field(ge=0, le=65536, description="CPU cores, e.g. 0.5 or 16")]
MemoryGiB = Annotated[float, Field(ge=0, le=1048576, description="host memory in GiB")]
assert set(PRIORITIES) == {"low", "normal", "high"}
MAX_TIME_LIMIT = 366 * 86400.0


def _seconds(value: Any) -> Any:
    """A duration as people type it ("90m", "2h", "7d") or a number of seconds."""
    if isinstance(value, str) and (seconds := parse_duration(value)) is not None:
        return seconds
    if isinstance(value, str):
        raise ValueError(f"{value!r} is not a duration: use seconds or e.g. 90s, 45m, 12h, 7d")
    return value


# How long each run of a job may last; past it the job is stopped (SIGTERM, then SIGKILL
# after the grace period) and fails. The scheduler takes it as the job's estimate.
TimeLimit = Annotated[
    float,
    BeforeValidator(_seconds),
    Field(ge=1, le=MAX_TIME_LIMIT, description="seconds, or a duration like 45m, 12h, 7d"),
]


def _idle_seconds(value: Any) -> Any:
    return 0.0 if isinstance(value, str) and value.strip() in ("0", "never") else _seconds(value)


# How long a deployment may go without a request, or an interactive job's accelerators may
# sit idle, before it is reclaimed (control/idle.py); 0 ("never"): not reclaimed.
IdleTtl = Annotated[
    float,
    BeforeValidator(_idle_seconds),
    Field(ge=0, le=MAX_TIME_LIMIT, description="seconds, a duration like 30m or 2h, or 0: never"),
]


# A job's GPUs: a whole number, or a share of one GPU that it shares with other jobs. Shares
# come in steps of GPU_SHARE_STEP milli-GPUs (0.05, 0.1, ... 0.95): 1/20 of a GPU is the
# least a workload is worth placing on one, and the step keeps shares exact in milli-GPUs.
GPU_SHARE_STEP = 50
GPU_SHARES = "a whole number of GPUs, or a share of one GPU from 0.05 to 0.95 in steps of 0.05"


def _gpus(value: float) -> int | float:
    """Whole GPUs as an int; a share of one GPU as it was given, if it is an allowed one."""
    if value >= 1 and value == int(value):
        return int(value)
    share = GPU_SHARE_STEP / 1000 <= value < 1  # also keeps value * 1000 finite
    milli = round(value * 1000) if share else 0
    if not share or milli % GPU_SHARE_STEP or abs(milli - value * 1000) > 1e-6:
        raise ValueError(f"{value:g} GPUs: give {GPU_SHARES}")
    return value


Gpus = Annotated[
    float,
    Field(le=4096, description=f"{GPU_SHARES}, e.g. 8 or 0.5"),
    AfterValidator(_gpus),
]


def gpu_milli(gpus: float) -> tuple[int, int]:
    """(GPUs, milli-GPU of each) of a validated `Gpus`: (1, 500) for half a GPU."""
    return (1, round(gpus * 1000)) if gpus < 1 else (int(gpus), 1000)


def gpus_of(milli: int) -> int | float:
    """`milli` milli-GPUs as GPUs: an int when whole, as the API shows them."""
    return milli // 1000 if milli % 1000 == 0 else milli / 1000


def _no_nul(value: str) -> str:
    if "\x00" in value:
        raise ValueError("must not contain a NUL byte: no process can be given one")
    return value


def _for_a_process(max_length: int, min_length: int = 0) -> type[str]:
    """A string a workload's process is started with (command, argument, path, environment
    value): refused at submit if no exec call could carry it, instead of failing every start."""
    length = StringConstraints(min_length=min_length, max_length=max_length)
    return Annotated[str, length, AfterValidator(_no_nul)]  # type: ignore[return-value]


Command = _for_a_process(65536, min_length=1)
Arg = _for_a_process(4096)  # an argument, a path or an environment value
FilePath = _for_a_process(4096, min_length=1)
EnvVars = dict[
    Annotated[str, StringConstraints(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", max_length=128)],
    Arg,
]


# Free-form tags of a job; showback groups by them and a budget may cover one.
Labels = Annotated[
    dict[
        Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._/-]*$", max_length=63)],
        Annotated[str, StringConstraints(pattern=r"^[^=,\x00]*$", max_length=63)],
    ],
    Field(max_length=16),
]


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _gpu_type(value: str | None) -> str | None:
    try:
        return None if value is None else hardware.get(value).name
    except NotFoundError as e:  # a validation error (422) on the field, not a missing object
        raise ValueError(str(e)) from None


class JobSpec(_Spec):
    """What `gpucloud job submit job.yaml` sends."""

    name: Name
    command: Command | list[Arg] | None = None
    train: FilePath | None = Field(
        default=None, description="a `gpucloud train` config file; run with --nproc-per-node=gpus"
    )
    model: ModelRef | None = Field(
        default=None,
        description="train jobs: a registered model to start from (its directory becomes the "
        "config's model.path, so the config names no model.preset)",
    )
    gpus: Gpus = 1
    gpu_type: str | None = Field(default=None, description="a catalog name; any type if unset")
    cpus: Cpus = 0
    memory_gib: MemoryGiB = 0
    priority: Priority = "normal"
    preemptible: bool = False
    max_retries: int = Field(default=0, ge=0, le=100)
    env: EnvVars = Field(default_factory=dict)
    workdir: Arg | None = None
    checkpoint_dir: Arg | None = None
    time_limit: TimeLimit | None = None
    labels: Labels = Field(
        default_factory=dict, description="tags such as team or project: showback and budgets"
    )
    interactive: bool = Field(
        default=False,
        description="a notebook or dev box: stopped (SIGTERM) once its accelerators sit idle "
        "for its idle_ttl",
    )
    idle_ttl: IdleTtl | None = Field(
        default=None, description="interactive jobs: idle time before it is stopped"
    )

    _check_type = field_validator("gpu_type")(_gpu_type)

    @field_validator("command")
    @classmethod
    def _join(cls, v: str | list[str] | None) -> str | None:
        if isinstance(v, list):
            if not v or any(not a for a in v):
                raise ValueError("command list must be non-empty words")
            return shlex.join(v)
        return v

    @model_validator(mode="after")
    def _one_entry_point(self) -> JobSpec:
        if (self.command is None) == (self.train is None):
            raise ValueError("give exactly one of 'command' or 'train'")
        if self.model is not None and self.train is None:
            raise ValueError("'model' is the model a 'train' job starts from: give 'train'")
        if self.idle_ttl is not None and not self.interactive:
            raise ValueError("idle_ttl is for interactive jobs: add 'interactive: true'")
        return self


class JobEventPublic(BaseModel):
    at: float
    from_state: str | None
    to_state: str
    reason: str | None


class JobPublic(BaseModel):
    id: int
    tenant: str
    name: str
    command: str | None
    train: str | None
    model: str | None = Field(default=None, description="the registered model it starts from")
    gpus: int | float  # a float for a share of one GPU
    gpu_type: str | None
    cpus: float
    memory_gib: float
    priority: str
    preemptible: bool
    max_retries: int
    env: dict[str, str]
    workdir: str | None
    checkpoint_dir: str | None
    time_limit: float | None = None  # seconds each run may last
    labels: dict[str, str] = {}
    interactive: bool = False
    idle_ttl: float | None = None  # its own; else its tenant's or the cluster's applies
    idle: str | None = Field(default=None, description="an idle warning: when it is stopped")
    warnings: list[str] = Field(default=[], description="e.g. a budget past its soft threshold")
    state: str
    attempts: int
    preemptions: int
    requeues: int = 0  # attempts its platform lost (a node died): they used no retry
    exit_code: int | None
    reason: str | None
    node: str | None  # its first node (the rendezvous master of a multi-node job)
    devices: list[int]
    # every node of a running job with its devices there: [{"node": ..., "devices": [...]}]
    placement: list[dict[str, Any]] = []
    submitted_at: float
    started_at: float | None
    finished_at: float | None
    events: list[JobEventPublic] = []


class RateLimit(_Spec):
    """Per-minute limits on the /v1 gateway (token buckets, see control/ratelimit.py)."""

    requests_per_minute: int | None = Field(default=None, ge=1, le=100_000_000)
    tokens_per_minute: int | None = Field(
        default=None, ge=1, le=100_000_000_000, description="prompt and completion tokens"
    )


WarmPool = Annotated[
    int,
    Field(
        ge=0,
        le=64,
        description="replicas started with their weights loaded but not routed, promoted first "
        "on a scale-up (from zero too); they hold GPUs, so they count against quota and budget",
    ),
]


class Autoscale(_Spec):
    """Replicas that follow the load through the /v1 gateway (see control/autoscaler.py)."""

    min_replicas: int = Field(
        default=1, ge=0, le=256, description="0: scaled to zero when idle, started on a request"
    )
    max_replicas: int = Field(ge=1, le=256)
    target_in_flight: float = Field(
        default=4.0, gt=0, le=10_000, description="requests in flight per replica to aim for"
    )
    scale_down_delay: float = Field(
        default=60.0, ge=0, le=86_400, description="seconds the load must stay lower first"
    )
    max_cold_wait: float = Field(
        default=120.0,
        ge=0,
        le=3600,
        description="seconds a request waits in the gateway for a replica to start when none "
        "is ready (then 503 with Retry-After)",
    )

    @model_validator(mode="after")
    def _ordered(self) -> Autoscale:
        if self.max_replicas < self.min_replicas:
            raise ValueError("max_replicas must be >= min_replicas")
        return self


def _path_or_object_storage(value: str) -> str:
    if storage.is_url(value) and not value.startswith(storage.OBJECT_STORAGE):
        raise ValueError(f"{value!r}: use a path or an s3://BUCKET/PREFIX URL")
    return value


def _one_model(spec: Any) -> Any:
    if (spec.model_dir is None) == (spec.model is None):
        raise ValueError("give exactly one of model_dir (a path or URL) and model (NAME:VERSION)")
    return spec


def _named_by_the_deployment(args: list[str]) -> list[str]:
    if any(a.split("=")[0] == "--served-model-name" for a in args):
        raise ValueError(
            "--served-model-name is the deployment's name (clients of the /v1 gateway "
            "send it as 'model'): name the deployment instead"
        )
    return args


class DeploymentSpec(_Spec):
    """What `gpucloud deploy create` sends: replicas of `gpucloud serve MODEL_DIR`."""

    name: Name
    model_dir: FilePath | None = Field(
        default=None,
        description="a dir on the node (in your area or an export) or an s3://BUCKET/PREFIX URL",
    )
    model: ModelRef | None = Field(default=None, description="a registered model, not model_dir")
    engine_args: list[Arg] = Field(
        default_factory=list, description="extra flags for `gpucloud serve`"
    )
    command: Command | None = Field(
        default=None,
        description="run this server instead of `gpucloud serve`; `{port}` and `{model_dir}` "
        "are filled in, and it must answer GET /ready (its liveness probe too, unless it "
        "answers GET /health)",
    )
    replicas: int = Field(default=1, ge=0, le=256)
    autoscale: Autoscale | None = Field(
        default=None, description="let the load set replicas (then within min..max)"
    )
    warm_pool: WarmPool = 0
    gpus_per_replica: Annotated[Gpus, Field(le=64)] = 1
    gpu_type: str | None = None
    cpus: Cpus = Field(default=0, description="CPU cores per replica")
    memory_gib: MemoryGiB = Field(default=0, description="host memory per replica, GiB")
    priority: Priority = "high"
    preemptible: bool = False
    env: EnvVars = Field(default_factory=dict)
    batch_in_flight: int = Field(
        default=2,
        ge=1,
        le=10_000,
        description="batch-class requests let in at once per ready replica; the rest wait "
        "in the gateway, so interactive ones keep their latency",
    )
    labels: Labels = Field(
        default_factory=dict, description="tags such as team or project: showback and budgets"
    )
    idle_ttl: IdleTtl | None = Field(
        default=None,
        description="scaled to zero after this long without a request (the next one starts "
        "it again); default: the tenant's, else the cluster's",
    )

    _check_type = field_validator("gpu_type")(_gpu_type)

    _check_model_dir = field_validator("model_dir")(_path_or_object_storage)
    _check_engine_args = field_validator("engine_args")(_named_by_the_deployment)
    _one_model = model_validator(mode="after")(_one_model)


class DeploymentScale(_Spec):
    replicas: int = Field(ge=0, le=256)


class DeploymentUpdate(_Spec):
    """What `gpucloud deploy update` changes (a field left out stays as it is)."""

    warm_pool: WarmPool | None = None


class CanaryGuard(_Spec):
    """When the control plane rolls a canary back by itself: over the last `window`
    seconds, once the canary has served `min_requests`, its error rate (5xx answers and
    failed connections) exceeds the stable version's by more than `max_error_rate_increase`,
    or its p99 time to first token is more than `max_ttft_ratio` times the stable's; or it
    never gets going: its replicas restarted `max_restarts` times, or none was ready
    `ready_within` seconds after the rollout."""

    window: float = Field(default=60.0, gt=0, le=86_400, description="seconds observed")
    min_requests: int = Field(
        default=20, ge=1, le=1_000_000, description="canary requests in the window to judge"
    )
    max_error_rate_increase: float = Field(
        default=0.05, ge=0, le=1, description="canary error rate minus stable's, at most"
    )
    max_ttft_ratio: float = Field(
        default=2.0, ge=1, le=1000, description="canary p99 TTFT over stable's, at most"
    )
    max_restarts: int = Field(
        default=3,
        ge=1,
        le=1000,
        description="restarts of its replicas (exits, failed probes, not ready in time) that "
        "roll it back, whatever its requests",
    )
    ready_within: float = Field(
        default=300.0,
        gt=0,
        le=86_400,
        description="seconds after the rollout by which one of its replicas must be ready",
    )


class EvalGate(_Spec):
    """The task file (by its sha256) whose stored results gate a canary's promotion."""

    task: str = Field(min_length=1, max_length=255, description="its name, for messages")
    task_hash: str = Field(pattern=r"^sha256:[0-9a-f]{64}$")


class RolloutSpec(_Spec):
    """What `gpucloud deploy rollout` sends: a new version beside the stable one."""

    model_dir: FilePath | None = Field(
        default=None,
        description="a dir on the node (in your area or an export) or an s3://BUCKET/PREFIX URL",
    )
    model: ModelRef | None = Field(default=None, description="a registered model, not model_dir")
    engine_args: list[Arg] = Field(
        default_factory=list, description="extra flags for `gpucloud serve`"
    )
    command: Command | None = Field(
        default=None, description="run this server instead, as for a deployment"
    )
    canary: float = Field(
        default=10.0, gt=0, le=100, description="percent of the requests the new version takes"
    )
    guard: CanaryGuard | None = Field(
        default_factory=CanaryGuard, description="automatic rollback; null: none"
    )
    require_eval: EvalGate | None = Field(
        default=None,
        description="promotion needs a stored result of `model` on this task file that is not "
        "worse than the stable version's (its model must be registered too)",
    )

    _check_model_dir = field_validator("model_dir")(_path_or_object_storage)
    _check_engine_args = field_validator("engine_args")(_named_by_the_deployment)
    _one_model = model_validator(mode="after")(_one_model)

    @model_validator(mode="after")
    def _gated_model_is_registered(self) -> RolloutSpec:
        if self.require_eval is not None and self.model is None:
            raise ValueError("require_eval compares registered models' results: give model")
        return self


class VersionPublic(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    number: int
    model_dir: str
    engine_args: list[str]
    command: str | None
    state: str
    percent: float = Field(description="its share of the requests now")
    guard: CanaryGuard | None
    created_at: float
    ended_at: float | None
    reason: str | None = Field(description="why it ended (a rollback's cause)")
    model_ref: str | None = Field(default=None, description="the registered model it serves")
    require_eval: EvalGate | None = None


class TrafficEvent(BaseModel):
    at: float
    action: str = Field(description="create, rollout, promote, rollback")
    user: str | None = Field(description="who; null: the control plane itself")
    traffic: dict[str, float] = Field(description="version number -> percent of requests")
    reason: str | None


class DeploymentHistory(BaseModel):
    name: str
    versions: list[VersionPublic]
    events: list[TrafficEvent]


class ReplicaPublic(BaseModel):
    id: int
    index: int
    state: str
    node: str | None
    devices: list[int]
    port: int | None
    url: str | None
    restarts: int
    exit_code: int | None
    reason: str | None = Field(description="why it last failed (a probe, an exit, a start)")
    started_at: float | None
    ready_at: float | None
    version: int = Field(description="the deployment version it serves")


class DeploymentPublic(BaseModel):
    id: int
    tenant: str
    name: str
    model_dir: str
    engine_args: list[str]
    command: str | None
    replicas: int = Field(description="replicas its stable version routes")
    routed_replicas: int = Field(
        description="replicas its served versions route: the stable version's and its canary's"
    )
    ready_replicas: int = Field(description="of those, the READY ones (draining ones excluded)")
    warm_pool: int = 0
    warm_replicas: int = Field(default=0, description="WARM ones: loaded, not routed")
    restarts: int = Field(description="restarts of its live replicas, all causes")
    autoscale: Autoscale | None
    gpus_per_replica: int | float  # a float for a share of one GPU
    gpu_type: str | None
    cpus: float  # per replica
    memory_gib: float
    priority: str
    preemptible: bool
    batch_in_flight: int
    state: str
    created_at: float
    labels: dict[str, str] = {}
    idle_ttl: float | None = None  # its own; else its tenant's or the cluster's applies
    idle: str | None = Field(
        default=None, description="an idle warning, or that it was scaled to zero while idle"
    )
    version: int = Field(description="its stable version")
    model: str | None = Field(default=None, description="the registered model stable serves")
    canary: VersionPublic | None = Field(description="the version rolled out beside it, if any")
    replica_list: list[ReplicaPublic] = []


class TenantCreate(_Spec):
    name: Name
    weight: float = Field(default=1.0, gt=0, le=1000)
    network: Literal["host", "isolated"] = Field(
        default="host",
        description="isolated: each of its jobs gets its own network namespace, loopback only",
    )


class QuotaSet(_Spec):
    gpus: int = Field(ge=0, le=1_000_000)


class CohortSet(_Spec):
    cohort: Name | None = Field(
        description="tenants of a cohort lend each other idle quota; null: no borrowing"
    )


class QuotaPublic(BaseModel):
    gpu_type: str
    gpus: int


class TenantPublic(BaseModel):
    id: int
    name: str
    is_operator: bool
    weight: float
    network: str
    created_at: float
    quotas: list[QuotaPublic]
    rate_limit: RateLimit | None = None
    cohort: str | None = None
    idle_ttl: float | None = None  # its workloads' default idle TTL; None: the cluster's


class TenantIdleTtl(_Spec):
    """The default idle TTL of a tenant's deployments and interactive jobs."""

    idle_ttl: IdleTtl | None = Field(description="None: the cluster's default")


class TenantCreated(TenantPublic):
    api_key: str = Field(description="the tenant's first admin key; shown only this once")


class UserCreate(_Spec):
    name: Name
    role: Role = Role.MEMBER


class UserCreated(BaseModel):
    id: int
    tenant: str
    name: str
    role: str
    api_key: str = Field(description="shown only this once")


class KeyCreate(_Spec):
    name: Name
    user: Name | None = Field(
        default=None,
        description="the user the key acts as (its role); by default you, or the tenant's "
        "first admin when you manage another tenant",
    )
    priority_class: PriorityClass = Field(
        default="interactive",
        description="batch: its /v1 requests wait while interactive ones are served",
    )
    rate_limit: RateLimit | None = None


class KeyUpdate(_Spec):
    """Change a key's class or limits (fields left out stay as they are)."""

    priority_class: PriorityClass | None = None
    rate_limit: RateLimit | None = Field(default=None, description="{} removes the limits")


class KeyRotate(_Spec):
    grace_seconds: float = Field(
        default=DEFAULT_KEY_GRACE,
        ge=0,
        le=MAX_KEY_GRACE,
        allow_inf_nan=False,
        description="how long the old key keeps working (0: not at all)",
    )


class KeyPublic(BaseModel):
    """A key as listings show it: never the secret, only its first characters."""

    id: int
    name: str
    prefix: str
    tenant: str
    user: str
    created_at: float
    last_used_at: float | None = Field(description=f"to within {LAST_USE_RESOLUTION:g} s")
    expires_at: float | None = Field(description="when a rotated key stops working")
    revoked_at: float | None
    priority_class: str = "interactive"
    rate_limit: RateLimit | None = None


class KeyCreated(KeyPublic):
    api_key: str = Field(description="shown only this once")


class Me(BaseModel):
    tenant: str
    user: str
    role: str
    is_operator: bool


class NodePublic(BaseModel):
    id: int
    name: str
    gpu_type: str
    gpus: int
    gpus_allocated: int | float  # a float when jobs hold shares of GPUs
    cpus: float  # 0 = not tracked
    cpus_allocated: float
    memory_gib: float
    memory_gib_allocated: float
    link_domain: int
    backend: str
    labels: dict[str, str]
    state: str
    reason: str | None = None  # why it is down, in its executor's words
    state_since: float | None = None
    address: str
    heartbeat_at: float


class UsageLine(BaseModel):
    tenant: str
    kind: Literal["job", "deployment"]
    id: int
    name: str
    gpu_type: str
    gpu_hours: float
    cost: float


class UsageReport(BaseModel):
    since: float | None
    until: float
    tenants: dict[str, dict[str, float]] = Field(
        description="per tenant: gpu_hours and cost (USD, from the hardware catalog's prices)"
    )
    lines: list[UsageLine]


class AuditPublic(BaseModel):
    at: float
    tenant: str | None
    user: str | None
    action: str
    target: str
    detail: dict
