"""The canary's eval gate: a canary rolled out with `require_eval` is promoted only when its
registered model's stored result on that task file is not worse than the stable version's
on the same file, by `eval compare`'s paired bootstrap (gpucloud/eval/compare.py).

Both results are the ones stored on the model versions (`gpucloud eval NAME:VERSION --task
FILE`): the gate reads them, it runs no model.
"""

from __future__ import annotations

from sqlalchemy.orm import Session

from gpucloud.control.errors import ConflictError
from gpucloud.control.models import Deployment, DeploymentVersion
from gpucloud.control.services import registry


def check_comparable(dep: Deployment, stable: DeploymentVersion) -> None:
    """Raise ConflictError when the stable version has no registered model: no stored
    result could be compared with the canary's."""
    if stable.model_version_id is None:
        raise ConflictError(
            f"deployment {dep.name!r} serves {stable.model_dir} (version {stable.number}), not a "
            "registered model: a required eval has no stable result to compare with (deploy "
            "a registered NAME:VERSION first)"
        )


def check(
    session: Session, dep: Deployment, canary: DeploymentVersion, stable: DeploymentVersion
) -> dict | None:
    """The verdict of the canary's required eval (None when it requires none), without
    the per-item records. Raises ConflictError when a result is missing or the canary is
    worse."""
    gate = canary.require_eval
    if gate is None:
        return None
    from gpucloud.eval.compare import compare

    check_comparable(dep, stable)
    task = f"task {gate['task']} ({gate['task_hash'][:19]}…)"
    a = _stored(session, dep, stable, gate, task)
    b = _stored(session, dep, canary, gate, task)
    verdict = {k: v for k, v in compare(a, b, a["metric"]).items() if k != "higher_is_better"}
    if verdict["worse"]:
        raise ConflictError(
            f"cannot promote {dep.name!r}: canary {canary.model_ref} is worse than stable "
            f"{stable.model_ref} on {task}: {verdict['metric']} {verdict['b']:.4g} vs "
            f"{verdict['a']:.4g}, difference {verdict['difference']:.4g} (95% CI "
            f"{verdict['ci_low']:.4g} to {verdict['ci_high']:.4g}); roll it back"
        )
    return verdict


def _stored(session: Session, dep: Deployment, v: DeploymentVersion, gate: dict, task: str) -> dict:
    assert v.model_version_id is not None
    row = registry.eval_of(session, v.model_version_id, gate["task_hash"])
    if row is None:
        raise ConflictError(
            f"cannot promote {dep.name!r}: {v.model_ref} (version {v.number}) has no stored "
            f"result on {task}: run `gpucloud eval {v.model_ref} --task FILE` with that file"
        )
    return row.result
