"""API keys against a real server, on SQLite and PostgreSQL: several named keys per tenant,
listed without secrets, revoked (401 at once on /api/v1 and on the /v1 gateway, whose
route cache must not let it through), rotated with a grace period, audited, stored as
hashes only."""

from __future__ import annotations

import hashlib
import itertools
import time

import httpx
import pytest
from sqlalchemy import create_engine, text

from gpucloud.control.db import normalize_url
from gpucloud.control.errors import AuthError, ConflictError, ForbiddenError
from gpucloud.errors import NotFoundError, UserError

from .conftest import wait_for

_names = itertools.count()


def _team(server) -> tuple[str, str]:
    """A new tenant: its name and its admin's key."""
    name = f"keys-{next(_names)}"
    return name, server.client().post("/tenants", {"name": name})["api_key"]


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _rest(server, key: str) -> int:
    return httpx.get(server.url + "/api/v1/me", headers=_auth(key)).status_code


def _gateway(server, key: str) -> int:
    """The /v1 gateway's status for `key`: 404 (no such deployment) once the key passed,
    401 when it did not. Each call also refreshes the gateway's cached route."""
    r = httpx.post(
        server.url + "/v1/chat/completions",
        json={"model": "absent", "messages": [{"role": "user", "content": "hi"}]},
        headers=_auth(key),
    )
    assert r.status_code in (401, 404), r.text
    return r.status_code


def _works(server, key: str) -> bool:
    rest, gateway = _rest(server, key), _gateway(server, key)
    assert (rest == 200) == (gateway == 404), (rest, gateway)
    return rest == 200


def test_keys_are_created_listed_revoked_and_rotated(shared_server):
    s = shared_server
    tenant, admin_key = _team(s)
    team = s.client(admin_key)
    keys = f"/tenants/{tenant}/keys"
    ci = team.post(keys, {"name": "ci"})
    laptop = team.post(keys, {"name": "laptop"})
    assert (ci["user"], ci["tenant"]) == ("admin", tenant)
    assert ci["api_key"].startswith(ci["prefix"]) and ci["api_key"] != laptop["api_key"]

    r = httpx.get(s.url + "/api/v1" + keys, headers=_auth(admin_key))
    listed = r.json()
    assert [(k["name"], k["prefix"]) for k in listed] == [
        ("admin", admin_key[:10]),
        ("ci", ci["prefix"]),
        ("laptop", laptop["prefix"]),
    ]
    assert all("api_key" not in k and k["expires_at"] is None for k in listed)
    for secret in (admin_key, ci["api_key"], laptop["api_key"]):
        assert secret not in r.text and secret[10:] not in r.text

    # warm the gateway's route for ci, then revoke: refused at once on both APIs
    assert _works(s, ci["api_key"]) and _works(s, laptop["api_key"])
    revoked = team.delete(f"{keys}/ci")
    assert [k["prefix"] for k in revoked] == [ci["prefix"]] and revoked[0]["revoked_at"]
    assert _gateway(s, ci["api_key"]) == 401 and _rest(s, ci["api_key"]) == 401
    models = httpx.get(s.url + "/v1/models", headers=_auth(ci["api_key"]))
    assert models.status_code == 401
    assert _works(s, laptop["api_key"])
    assert [k["name"] for k in team.get(keys)] == ["admin", "laptop"]
    wait_for(lambda: team.get(keys)[1]["last_used_at"])  # recorded after the response

    # rotate: both work during the grace period, only the new one after it
    new = team.post(f"{keys}/laptop/rotate", {"grace_seconds": 1})
    assert new["name"] == "laptop" and new["prefix"] != laptop["prefix"]
    old_listed, new_listed = team.get(keys)[1:]
    assert (old_listed["prefix"], new_listed["prefix"]) == (laptop["prefix"], new["prefix"])
    assert old_listed["expires_at"] and new_listed["expires_at"] is None
    assert _works(s, new["api_key"])
    seen = []  # (time before the request, gateway status) while the old key runs out
    while not seen or seen[-1][1] != 401:
        seen.append((time.time(), _gateway(s, laptop["api_key"])))
        time.sleep(0.05)
    assert seen[0][1] == 404  # it worked during the grace period
    # the gateway never let it through once its grace period was over, cached route or not
    assert all(status == 401 for at, status in seen if at > old_listed["expires_at"])
    assert _rest(s, laptop["api_key"]) == 401 and _works(s, new["api_key"])
    assert [k["prefix"] for k in team.get(keys)] == [admin_key[:10], new["prefix"]]

    entries = [(e["action"], e["target"]) for e in team.get("/audit")]
    for action, name in [("key.create", "ci"), ("key.create", "laptop"), ("key.revoke", "ci"),
                         ("key.rotate", "laptop")]:  # fmt: skip
        assert (action, f"tenant/{tenant}/key/{name}") in entries

    engine = create_engine(normalize_url(s.db_url))
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT * FROM api_keys")).all()
    engine.dispose()
    stored = repr(rows)
    for secret in (admin_key, ci["api_key"], laptop["api_key"], new["api_key"]):
        assert secret not in stored and secret[10:] not in stored
        assert hashlib.sha256(secret.encode()).hexdigest() in stored


def test_who_may_manage_keys(shared_server):
    s = shared_server
    tenant, admin_key = _team(s)
    team = s.client(admin_key)
    keys = f"/tenants/{tenant}/keys"
    member = s.client(team.post("/users", {"name": "mo", "role": "member"})["api_key"])
    with pytest.raises(ForbiddenError, match="needs admin"):
        member.get(keys)
    with pytest.raises(ForbiddenError):
        member.post(keys, {"name": "mine"})
    other, other_key = _team(s)
    with pytest.raises(NotFoundError, match=f"no tenant '{tenant}'"):
        s.client(other_key).get(keys)
    with pytest.raises(NotFoundError):
        s.client(other_key).delete(f"{keys}/admin")

    # an operator manages any tenant's keys; a new key acts as that tenant's admin
    by_operator = s.client().post(keys, {"name": "ops"})
    assert by_operator["user"] == "admin" and _works(s, by_operator["api_key"])
    as_member = team.post(keys, {"name": "bot", "user": "mo"})
    assert s.client(as_member["api_key"]).get("/me")["role"] == "member"
    assert [k["name"] for k in team.get(keys)] == ["admin", "bot", "mo", "ops"]
    ops = s.client(by_operator["api_key"])
    ops.delete(f"{keys}/ops")  # a key may revoke itself, and is refused from then on
    with pytest.raises(AuthError, match="invalid or revoked"):
        ops.get("/me")
    entry = next(e for e in s.client().get("/audit") if e["target"] == f"tenant/{tenant}/key/ops")
    assert (entry["action"], entry["tenant"], entry["user"]) == ("key.revoke", tenant, "admin")


def test_bad_key_requests_say_what_is_wrong(shared_server):
    s = shared_server
    tenant, admin_key = _team(s)
    team = s.client(admin_key)
    keys = f"/tenants/{tenant}/keys"
    team.post(keys, {"name": "ci"})
    for call, error, says in [
        (lambda: team.post(keys, {"name": "ci"}), ConflictError, "already has a key named 'ci'"),
        (lambda: team.post(keys, {"name": "no spaces"}), UserError, "name: String should match"),
        (lambda: team.post(keys, {"name": "x", "user": "ghost"}), NotFoundError,
         "no user 'ghost' in tenant .* \\(users: admin\\)"),
        (lambda: team.delete(f"{keys}/nope"), NotFoundError,
         "no key 'nope' .* \\(keys: admin, ci\\)"),
        (lambda: team.post(f"{keys}/ci/rotate", {"grace_seconds": -1}), UserError,
         "grace_seconds: Input should be greater than or equal to 0"),
        (lambda: team.post("/users", {"name": "ci"}), ConflictError, "has a key named 'ci'"),
    ]:  # fmt: skip
        with pytest.raises(error, match=says):
            call()
    # rotating with no body takes the default grace period: a day
    rotated = team.post(f"{keys}/ci/rotate")
    old = next(k for k in team.get(keys) if k["name"] == "ci" and k["expires_at"])
    assert 86000 < old["expires_at"] - rotated["created_at"] <= 86400
