"""/api/v1/nodes."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path

from gpucloud.control.deps import Caller, Db, Wake
from gpucloud.control.schemas import NodePublic
from gpucloud.control.services import nodes as service

router = APIRouter(tags=["nodes"])
NodeName = Annotated[str, Path(max_length=63)]


@router.get("/nodes", response_model=list[NodePublic])
def list_nodes(db: Db, who: Caller) -> list[NodePublic]:
    return service.list_(db, who)


@router.post("/nodes/{name}/cordon", response_model=NodePublic, dependencies=[Wake])
def cordon(name: NodeName, db: Db, who: Caller) -> NodePublic:
    """Take no new work on the node; what runs there keeps running."""
    return service.set_state(db, who, name, "cordon")


@router.post("/nodes/{name}/drain", response_model=NodePublic, dependencies=[Wake])
def drain(name: NodeName, db: Db, who: Caller) -> NodePublic:
    """Take no new work on the node, move its replicas elsewhere, let its jobs finish."""
    return service.set_state(db, who, name, "drain")


@router.post("/nodes/{name}/uncordon", response_model=NodePublic, dependencies=[Wake])
def uncordon(name: NodeName, db: Db, who: Caller) -> NodePublic:
    """Let the node take new work again (after a cordon or a drain)."""
    return service.set_state(db, who, name, "uncordon")
