"""The price book: versions apply from their date, pools before the type's price, the
catalog's price before any version; intervals across a change are priced in pieces."""

from __future__ import annotations

import pytest

from gpucloud import hardware
from gpucloud.control.price_book import ALL_NODES, PriceBook

CATALOG = hardware.get("L4").price_per_hour
HOUR = 3600.0


def _book() -> PriceBook:
    book = PriceBook(node_labels={"a": {"pool": "spot"}, "b": {"rack": "1"}})
    book.add("L4", ALL_NODES, 10 * HOUR, 2.0)
    book.add("L4", ALL_NODES, 20 * HOUR, 3.0)
    book.add("L4", "pool=spot", 15 * HOUR, 0.5)
    return book


def test_a_version_holds_from_its_date_until_the_next():
    book = _book()
    assert book.per_hour("L4", "b", 0) == CATALOG  # before any version: the catalog's
    assert book.per_hour("L4", "b", 10 * HOUR) == 2.0
    assert book.per_hour("L4", "b", 19.9 * HOUR) == 2.0
    assert book.per_hour("L4", "b", 25 * HOUR) == 3.0


def test_a_pool_price_applies_to_its_nodes_from_its_date():
    book = _book()
    assert book.pool_of("L4", "a") == "pool=spot" and book.pool_of("L4", "b") == ALL_NODES
    assert book.per_hour("L4", "a", 12 * HOUR) == 2.0  # the pool has no price yet
    assert book.per_hour("L4", "a", 16 * HOUR) == 0.5
    assert book.per_hour("L4", None, 16 * HOUR) == 2.0


def test_an_interval_across_changes_is_priced_in_pieces():
    book = _book()
    # 2 GPUs, 9h..21h on node b: 1h catalog, 10h at 2.0, 1h at 3.0
    assert book.cost("L4", "b", 2, 9 * HOUR, 21 * HOUR) == pytest.approx(
        2 * (CATALOG + 10 * 2.0 + 3.0)
    )
    # node a: 5h at 2.0 (10..15), then the pool's 0.5 for 6h
    assert book.cost("L4", "a", 1, 10 * HOUR, 21 * HOUR) == pytest.approx(5 * 2.0 + 6 * 0.5)
    assert book.cost("L4", "a", 1, 5 * HOUR, 5 * HOUR) == 0.0
