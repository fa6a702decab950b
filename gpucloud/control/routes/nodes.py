"""/api/v1/nodes."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path

from gpucloud.control.deps import Caller, Db, Wake
from gpucloud.control.lifecycle import NodeState
from gpucloud.control.schemas import NodePublic
from gpucloud.control.services import nodes as service

router = APIRouter(tags=["nodes"])
NodeName = Annotated[str, Path(max_length=63)]


@router.get("/nodes", response_model=list[NodePublic])
def list_nodes(db: Db, who: Caller) -> list[NodePublic]:
    return service.list_(db, who)


@router.post("/nodes/{name}/cordon", response_model=NodePublic, dependencies=[Wake])
def cordon(name: NodeName, db: Db, who: Caller) -> NodePublic:
    return service.set_state(db, who, name, NodeState.CORDONED)


@router.post("/nodes/{name}/uncordon", response_model=NodePublic, dependencies=[Wake])
def uncordon(name: NodeName, db: Db, who: Caller) -> NodePublic:
    return service.set_state(db, who, name, NodeState.READY)
