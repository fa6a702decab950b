"""Calls bounded in time (executors.bounded): what the Ray executor makes every call that
needs its head through."""

from __future__ import annotations

import threading

import pytest

from gpucloud.control.executors.bounded import Bounded, Unresponsive

from .conftest import wait_for


def test_a_late_call_is_given_up_and_later_ones_fail_at_once_until_it_returns() -> None:
    head = Bounded("the head", timeout=0.2)
    answer = threading.Event()
    with pytest.raises(Unresponsive, match=r"^the head did not answer within 0.2 s$"):
        head(answer.wait)
    calls = []
    with pytest.raises(Unresponsive, match=r"^the head has not answered for 0 s$"):
        head(calls.append, 1)
    assert calls == []  # not started: nothing piles up behind the late call
    answer.set()  # the late call returns: calls go through again
    assert wait_for(lambda: _answer(head, sum, [1, 2]), timeout=5) == 3


def test_a_calls_own_errors_reach_the_caller() -> None:
    head = Bounded("the head", timeout=5)
    with pytest.raises(TimeoutError, match="its own"):
        head(_raise, TimeoutError("its own"))
    with pytest.raises(KeyError):
        head({}.__getitem__, "x")


def _raise(e: Exception) -> None:
    raise e


def _answer(head: Bounded, fn, *args):
    try:
        return head(fn, *args)
    except Unresponsive:
        return None
