"""The model registry: named models of a tenant, numbered versions of each, and their
evaluation results.

A version records where its files are (a path or an s3:// URL: the weights stay there),
their content hash and what produced it; the client computes the hashes, where it can read
the files (cli/model_registry.py). Registering content that the model has already (the same
content hash) returns that version instead of adding one. A tenant sees only its own
models; an operator lists every tenant's and reads any with `tenant`. References
(`NAME:VERSION`, `NAME` for the latest) resolve in the caller's own tenant: its workloads
are the ones that read the files.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from gpucloud.control.auth import Principal
from gpucloud.control.errors import ForbiddenError
from gpucloud.control.lifecycle import Role
from gpucloud.control.model_ref import parse_ref
from gpucloud.control.models import ModelEval, ModelVersion, Tenant
from gpucloud.control.registry_schemas import (
    EvalPublic,
    EvalSubmit,
    ModelHistory,
    ModelRegister,
    ModelSummary,
    ModelVersionPublic,
)
from gpucloud.control.schemas import DeploymentSpec, RolloutSpec
from gpucloud.control.services import audit
from gpucloud.errors import NotFoundError, UserError, unknown_name


def register(
    session: Session, who: Principal, name: str, spec: ModelRegister
) -> ModelVersionPublic:
    """Add version N+1 of `name`, or return the version with the same content (`created`
    false). Raises NotFoundError for an unknown `spec.base`."""
    who.require(Role.MEMBER)
    same = session.scalar(
        select(ModelVersion).where(
            ModelVersion.tenant_id == who.tenant_id,
            ModelVersion.name == name,
            ModelVersion.content_hash == spec.content_hash,
        )
    )
    if same is not None:
        return public(session, same, who.tenant_name, created=False)
    base = _base(session, who, spec)
    number = session.scalar(
        select(func.max(ModelVersion.number)).where(
            ModelVersion.tenant_id == who.tenant_id, ModelVersion.name == name
        )
    )
    v = ModelVersion(
        tenant_id=who.tenant_id,
        user_id=who.user_id,
        name=name,
        number=(number or 0) + 1,
        base_id=base.id if base else None,
        created_at=time.time(),
        **spec.model_dump(exclude={"base"}),
    )
    session.add(v)
    session.flush()
    audit.record(session, who, "model.register", f"model/{name}", version=v.number, uri=v.uri,
                 content_hash=v.content_hash)  # fmt: skip
    return public(session, v, who.tenant_name)


def resolve(session: Session, who: Principal, ref: str) -> ModelVersion:
    """The caller's version that `ref` names. Raises NotFoundError naming what exists."""
    name, number = parse_ref(ref)
    return _version(session, who.tenant_id, name, number)


def get(
    session: Session, who: Principal, name: str, version: str, tenant: str | None = None
) -> ModelVersionPublic:
    """Version `version` (a number or "latest") of `name`, with its eval results."""
    tenant_id, tenant_name = _tenant(session, who, tenant)
    v = _version(session, tenant_id, *parse_ref(f"{name}:{version}"))
    return public(session, v, tenant_name, evals=True)


def list_(session: Session, who: Principal) -> list[ModelSummary]:
    """Each model with its latest version: the caller's tenant's; an operator's, every one's."""
    q = select(ModelVersion, Tenant.name).join(Tenant, ModelVersion.tenant_id == Tenant.id)
    if not who.is_operator:
        q = q.where(ModelVersion.tenant_id == who.tenant_id)
    models: dict[tuple[str, str], list[ModelVersion]] = {}
    for v, tenant in session.execute(
        q.order_by(Tenant.name, ModelVersion.name, ModelVersion.number)
    ):
        models.setdefault((tenant, v.name), []).append(v)
    return [
        ModelSummary(tenant=tenant, name=name, versions=len(vs), latest=vs[-1].number,
                     uri=vs[-1].uri, created_at=vs[-1].created_at)
        for (tenant, name), vs in models.items()
    ]  # fmt: skip


def history(session: Session, who: Principal, name: str, tenant: str | None = None) -> ModelHistory:
    """Every version of `name`, oldest first, with its eval results, and the versions of
    other models they came from."""
    tenant_id, tenant_name = _tenant(session, who, tenant)
    rows = list(
        session.scalars(
            select(ModelVersion)
            .where(ModelVersion.tenant_id == tenant_id, ModelVersion.name == name)
            .order_by(ModelVersion.number)
        )
    )
    if not rows:
        raise _unknown(session, tenant_id, name)
    own = {v.id for v in rows}
    outside = {v.base_id for v in rows if v.base_id is not None and v.base_id not in own}
    bases = (
        session.scalars(select(ModelVersion).where(ModelVersion.id.in_(outside))) if outside else []
    )
    return ModelHistory(
        name=name,
        versions=[public(session, v, tenant_name, evals=True) for v in rows],
        bases=[public(session, b, tenant_name, evals=True) for b in bases],
    )


def record_eval(
    session: Session, who: Principal, name: str, version: str, result: EvalSubmit
) -> EvalPublic:
    """Store `result` on the version, replacing its earlier result on the same task file.
    Raises UserError when the result is not one `eval compare` can read."""
    who.require(Role.MEMBER)
    _check_result(result)
    v = _version(session, who.tenant_id, *parse_ref(f"{name}:{version}"))
    row = eval_of(session, v.id, result.task_hash)
    if row is None:
        row = ModelEval(version_id=v.id, task_hash=result.task_hash)
        session.add(row)
    row.user_id, row.created_at = who.user_id, time.time()
    row.task, row.kind, row.metric, row.n = result.task, result.kind, result.metric, result.n
    row.score, row.ci_low, row.ci_high = result.score, result.ci_low, result.ci_high
    row.result = result.model_dump()
    session.flush()
    audit.record(session, who, "model.eval", f"model/{name}", version=v.number, task=row.task,
                 task_hash=row.task_hash, metric=row.metric, score=row.score)  # fmt: skip
    return EvalPublic.model_validate(row)


def eval_of(session: Session, version_id: int, task_hash: str) -> ModelEval | None:
    return session.scalar(
        select(ModelEval).where(
            ModelEval.version_id == version_id, ModelEval.task_hash == task_hash
        )
    )


def ref_of(v: ModelVersion) -> str:
    return f"{v.name}:{v.number}"


def public(
    session: Session, v: ModelVersion, tenant: str, created: bool = True, evals: bool = False
) -> ModelVersionPublic:
    base = session.get(ModelVersion, v.base_id) if v.base_id is not None else None
    rows = (
        session.scalars(
            select(ModelEval).where(ModelEval.version_id == v.id).order_by(ModelEval.id)
        )
        if evals
        else []
    )
    return ModelVersionPublic(
        tenant=tenant, name=v.name, version=v.number, ref=ref_of(v), uri=v.uri,
        content_hash=v.content_hash, hash_kind=v.hash_kind, files=v.files,
        base=ref_of(base) if base else None, base_model=v.base_model, dataset=v.dataset,
        dataset_hash=v.dataset_hash, train_config=v.train_config, run=v.run, step=v.step,
        created_at=v.created_at, created=created,
        evals=[EvalPublic.model_validate(e) for e in rows],
    )  # fmt: skip


def _base(session: Session, who: Principal, spec: ModelRegister) -> ModelVersion | None:
    """The registered version it came from: `spec.base`, else the caller's newest version
    whose files are where its training started (`spec.base_model`), if any."""
    if spec.base is not None:
        return resolve(session, who, spec.base)
    if spec.base_model is None:
        return None
    return session.scalar(
        select(ModelVersion)
        .where(ModelVersion.tenant_id == who.tenant_id, ModelVersion.uri == spec.base_model)
        .order_by(ModelVersion.id.desc())
        .limit(1)
    )


def _version(session: Session, tenant_id: int, name: str, number: int | None) -> ModelVersion:
    q = select(ModelVersion).where(ModelVersion.tenant_id == tenant_id, ModelVersion.name == name)
    if number is None:
        v = session.scalar(q.order_by(ModelVersion.number.desc()).limit(1))
    else:
        v = session.scalar(q.where(ModelVersion.number == number))
    if v is not None:
        return v
    if number is None:
        raise _unknown(session, tenant_id, name)
    latest = session.scalar(select(func.max(ModelVersion.number)).where(
        ModelVersion.tenant_id == tenant_id, ModelVersion.name == name))  # fmt: skip
    if latest is None:
        raise _unknown(session, tenant_id, name)
    raise NotFoundError(f"model {name!r} has no version {number}: its versions are 1 to {latest}")


def _unknown(session: Session, tenant_id: int, name: str) -> NotFoundError:
    names = session.scalars(
        select(ModelVersion.name).where(ModelVersion.tenant_id == tenant_id).distinct()
    ).all()
    if not names:
        return NotFoundError(
            f"no model {name!r}: none is registered yet (gpucloud model register NAME DIR)"
        )
    return unknown_name("model", name, names)


def _tenant(session: Session, who: Principal, tenant: str | None) -> tuple[int, str]:
    """The tenant whose models a read names: the caller's, or for an operator any."""
    if tenant is None or tenant == who.tenant_name:
        return who.tenant_id, who.tenant_name
    if not who.is_operator:
        raise ForbiddenError("only the operator tenant reads another tenant's models")
    tenant_id = session.scalar(select(Tenant.id).where(Tenant.name == tenant))
    if tenant_id is None:
        raise NotFoundError(f"no tenant {tenant!r}")
    return tenant_id, tenant


def _check_result(result: EvalSubmit) -> None:
    """Refuse a result that `eval compare` could not read: every item must carry the numbers
    each metric of its task kind sums."""
    from gpucloud.eval.metrics import metric_for, metrics_of
    from gpucloud.eval.tasks import TaskKind

    if result.kind not in set(TaskKind):
        raise UserError(f"unknown task kind {result.kind!r}: use {', '.join(TaskKind)}")
    kind = TaskKind(result.kind)
    try:
        metric_for(kind, result.metric)
    except NotFoundError as e:  # a bad body, not a missing object
        raise UserError(str(e)) from None
    if len(result.items) != result.n:
        raise UserError(f"the result has {len(result.items)} items but n = {result.n}")
    keys = {k for m in metrics_of(kind) for k in (m.numerator, m.denominator) if k}
    for i, item in enumerate(result.items):
        bad = sorted(k for k in keys if not _number(item.get(k)))
        if bad:
            raise UserError(f"item {i} of the result has no number for {', '.join(bad)}")


def _number(x: object) -> bool:
    return isinstance(x, int | float) and math.isfinite(x)


@dataclass(frozen=True, slots=True)
class Served:
    """What a deployment version serves: a model dir (or URL), and the registered version
    it was named by, if it was."""

    model_dir: str
    version_id: int | None = None
    ref: str | None = None


def served_model(session: Session, who: Principal, spec: DeploymentSpec | RolloutSpec) -> Served:
    """The model of a deployment or rollout spec: its model_dir, or the dir of the
    registered version its `model` names. Raises NotFoundError for an unknown one."""
    if spec.model is None:
        assert spec.model_dir is not None  # the spec has exactly one of them
        return Served(spec.model_dir)
    v = resolve(session, who, spec.model)
    return Served(v.uri, v.id, ref_of(v))
