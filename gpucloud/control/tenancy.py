"""Tenants as OS users: each tenant's workloads run as its own unprivileged uid, in its own
area $GPUCLOUD_HOME/tenants/<tenant>/ (0700, owned by that uid), the only part of the
control plane's home its sandbox shows.

A tenant's uid is the configured range's start plus the tenant's id; the control plane
makes it a system user (`useradd --system`) the first time a workload of the tenant runs.
Without root the control plane cannot switch users: it then runs only in single-tenant
mode, every workload as its own user (still sandboxed).

Paths a tenant names (a job's workdir and checkpoint_dir) must lie in its area or in a dir
the admin exported (`--export`): the sandbox binds them with the control plane's access.
"""

from __future__ import annotations

import os
import pwd
import subprocess
from pathlib import Path

from gpucloud import storage
from gpucloud.control.config import Settings
from gpucloud.control.sandbox import Identity
from gpucloud.errors import ConfigError, UserError


def check_mode(settings: Settings) -> None:
    """Refuse multi-tenant mode where workloads cannot get their tenant's user."""
    if os.geteuid() != 0 and not settings.single_tenant:
        raise ConfigError(
            "multi-tenant mode needs root (each tenant's workloads run as its own OS user): "
            "run as root, or pass --single-tenant to run every workload as this user"
        )


def identity(settings: Settings, tenant_id: int) -> Identity | None:
    """The OS user tenant `tenant_id`'s workloads run as (made if missing); None = the
    control plane's own user (not root: single-tenant mode)."""
    if os.geteuid() != 0:
        return None
    first, last = settings.tenant_uids
    uid = first if settings.single_tenant else first + tenant_id
    if uid > last:
        raise UserError(f"no uid left for tenant {tenant_id}: the range {first}-{last} is used up")
    return _system_user(uid)


def area(settings: Settings, tenant: str) -> Path:
    return settings.home / "tenants" / tenant


def prepare_area(settings: Settings, tenant: str, who: Identity | None) -> Path:
    """The tenant's area, made if missing: 0700 and owned by the tenant's user."""
    path = area(settings, tenant)
    path.parent.mkdir(mode=0o700, exist_ok=True)
    path.mkdir(mode=0o700, exist_ok=True)
    if who is not None:
        os.chown(path, who.uid, who.gid)
    return path


def writable_dirs(settings: Settings, tenant: str) -> tuple[Path, ...]:
    return (area(settings, tenant), *settings.exports)


def resolve(
    settings: Settings,
    tenant: str,
    value: str | None,
    field: str,
    start: str | None = None,
    urls: bool = False,
) -> str | None:
    """`value` as an absolute path: a relative one starts from `start` (default: the
    tenant's area). Raises UserError unless it lies in the area or an export. With `urls`,
    an object-storage URL passes as it is: the workload reaches it with the credentials
    of its own env, never the control plane's."""
    if value is None:
        return None
    if storage.is_url(value):
        if urls and value.startswith(storage.OBJECT_STORAGE):
            return value
        allowed = " or an s3://BUCKET/PREFIX URL" if urls else ""
        raise UserError(f"{field} {value!r}: use a path in your area{allowed}")
    own = area(settings, tenant)
    path = Path(os.path.normpath(Path(start or own) / value))  # "x/../.." stays checked
    allowed = [own, *settings.exports]
    if not any(path == a or path.is_relative_to(a) for a in allowed):
        where = ", ".join(str(a) for a in allowed)
        raise UserError(
            f"{field} {value!r} is outside your area: use a path relative to it, or under {where}"
        )
    return str(path)


def reachable(path: Path, who: Identity | None) -> bool:
    """Whether `who` could read `path` with its own permissions (every ancestor
    traversable, the path itself readable): only then may the sandbox bind it, for bwrap
    resolves bind sources as root."""
    if who is None:
        return os.access(path, os.R_OK)
    try:
        for p in [*reversed(path.parents), path]:
            st = p.stat()
            need = 0o4 if p == path else 0o1
            if st.st_uid == who.uid:
                bits = st.st_mode >> 6
            elif st.st_gid == who.gid:
                bits = st.st_mode >> 3
            else:
                bits = st.st_mode
            if not bits & need:
                return False
    except OSError:
        return False
    return True


def _system_user(uid: int) -> Identity:
    try:
        entry = pwd.getpwuid(uid)
    except KeyError:
        subprocess.run(  # a concurrent control plane may have made it: looked up again
            [
                "useradd",
                "--system",
                "--no-create-home",
                "--user-group",
                "--uid",
                str(uid),
                "--shell",
                "/usr/sbin/nologin",
                f"gpucloud-{uid}",
            ],
            capture_output=True,
            check=False,
        )
        try:
            entry = pwd.getpwuid(uid)
        except KeyError:
            return Identity(uid, uid)  # no useradd here: a numeric identity works as well
    return Identity(entry.pw_uid, entry.pw_gid)
