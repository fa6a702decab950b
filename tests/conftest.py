"""Suite-wide ordering for `make test`, which runs test files on every core (pytest-xdist,
`--dist loadfile`: a file's tests stay together, in order, on one worker, so module-scoped
servers start once). Workers take files in collection order, so the longest files go first:
started last, one of them would leave the other workers idle at the end."""

from __future__ import annotations

import pytest

# The files that take a minute or more on 2 cores, longest first.
LONGEST_FIRST = (
    "tests/test_readme.py",
    "tests/train/test_distributed.py",
    "tests/control/test_ray_e2e.py",
    "tests/control/test_autoscaler.py",
    "tests/control/test_reconciler.py",
    "tests/serve/api/test_lm_eval.py",
    "tests/control/test_slurm_server.py",
)


def _rank(item: pytest.Item) -> int:
    path = item.nodeid.split("::", 1)[0]
    return LONGEST_FIRST.index(path) if path in LONGEST_FIRST else len(LONGEST_FIRST)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=_rank)  # stable: every file keeps its own order
