"""Which server each rank of a training run sits on, and so which rings share a server's NICs.

The runtime builds one (pp, dp, tp) device mesh (train/parallel.py) and the launcher numbers
ranks server by server, so rank (p·dp + d)·tp + t sits on server ⌊rank / gpus_per_node⌋. A
tensor-parallel group is tp neighbouring GPUs of one server; counting the (stage,
data-parallel rank) pairs as slots s = p·dp + d, each server holds gpus_per_node / tp
consecutive slots, tp GPUs each. A data-parallel group is one stage p at one t: its dp slots,
each at that t. So every group of slots stands for tp rings over the same servers, and a
server whose slots belong to a group spread over several servers sends tp of that group's
rings over its NICs, all syncing at once: with tp = 8 on 8-GPU servers every GPU of a server
is in a different data-parallel ring and each gets an eighth of the NICs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from gpucloud.planner.setup import TrainSetup


@dataclass(frozen=True)
class Span:
    """Where one ring's ranks sit, and who else sends over the same NICs."""

    members: int  # the most of its ranks on one server
    servers: int  # servers it spans
    sharing: int  # rings leaving its busiest server at once, itself included (1 inside one)


def slots_per_server(setup: TrainSetup) -> int:
    return setup.gpus_per_node // setup.tp


def data_parallel_groups(setup: TrainSetup) -> list[range]:
    """Each stage's data-parallel ranks, as slots."""
    return [range(p * setup.dp, (p + 1) * setup.dp) for p in range(setup.pp)]


def expert_replica_groups(setup: TrainSetup) -> list[range]:
    """The slots holding the same experts: every ep-th data-parallel rank of a stage."""
    return [range(p * setup.dp + e, (p + 1) * setup.dp, setup.ep)
            for p in range(setup.pp) for e in range(setup.ep)]  # fmt: skip


def expert_groups(setup: TrainSetup) -> list[range]:
    """The ep neighbouring data-parallel ranks that split one layer's experts, as slots."""
    return [range(g, g + setup.ep) for g in range(0, setup.pp * setup.dp, setup.ep)]


def shares_on_servers(setup: TrainSetup, group: range) -> Counter:
    """How many of the group's slots each server it touches holds."""
    return Counter(s // slots_per_server(setup) for s in group)


def spans(setup: TrainSetup, groups: Iterable[range]) -> set[Span]:
    """Where the rings of `groups` (one kind of group: all sync at once) sit."""
    shares = [shares_on_servers(setup, g) for g in groups]
    leaving = Counter(n for servers in shares if len(servers) > 1 for n in servers)
    return {
        Span(
            members=max(servers.values()),
            servers=len(servers),
            sharing=setup.tp * max(leaving[n] for n in servers) if len(servers) > 1 else 1,
        )
        for servers in shares
    }
