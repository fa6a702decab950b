"""Hypothesis strategies for the property tests of request schemas: any JSON value, any
text, and a valid-looking body with one key spoiled."""

from __future__ import annotations

from hypothesis import strategies as st

# Any JSON value, for a field to hold instead of the one it expects.
ANY_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=6,
)
# Text with every kind of code point, NUL and lone surrogates included.
TEXT = st.text(st.characters(codec=None), max_size=12)


def spoiled(body: dict, keys: list[str]) -> st.SearchStrategy[dict]:
    """`body` with one of `keys` set to any JSON value (maybe of the right type) or removed."""
    key = st.sampled_from(keys)
    changed = st.tuples(key, ANY_JSON).map(lambda kv: {**body, kv[0]: kv[1]})
    removed = key.map(lambda k: {n: v for n, v in body.items() if n != k})
    return changed | removed
