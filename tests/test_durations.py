"""Durations as people type them, and back."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gpucloud.durations import format_duration, parse_duration


def test_parse_reads_one_or_several_units():
    assert parse_duration("90s") == 90 and parse_duration("1h30m") == 5400
    assert parse_duration("1.5h") == 5400 and parse_duration(" 7d ") == 7 * 86400
    for text in ("2 hours", "h", "", "5", "1h 30m", "-1s"):
        assert parse_duration(text) is None, text


@given(st.integers(min_value=0, max_value=400 * 86400))
def test_format_reads_back_as_the_same_whole_seconds(seconds):
    assert parse_duration(format_duration(seconds)) == seconds
