"""Token buckets of the gateway's rate limits, and the batch gate of priority classes, on
a clock the test moves."""

from __future__ import annotations

import asyncio

import pytest

from gpucloud.control.priority import BatchGate, QueueTimeout
from gpucloud.control.ratelimit import Limit, Limited, RateLimiter, estimate_tokens


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_requests_burst_to_a_minutes_worth_then_go_at_the_rate():
    clock = Clock()
    limiter = RateLimiter(clock)
    owners = [("tenant t", 1, Limit(requests_per_minute=3))]
    for _ in range(3):
        limiter.admit(owners, tokens=0)
    with pytest.raises(Limited, match="tenant t: 3 requests per minute.*retry in 20 s") as e:
        limiter.admit(owners, tokens=0)
    assert e.value.kind == "requests" and e.value.retry_after == pytest.approx(20.0)
    clock.now = 19.0
    with pytest.raises(Limited):
        limiter.admit(owners, tokens=0)
    clock.now = 20.0  # one request's worth refilled
    limiter.admit(owners, tokens=0)
    clock.now = 1000.0  # never more than a minute's worth
    for _ in range(3):
        limiter.admit(owners, tokens=0)
    with pytest.raises(Limited):
        limiter.admit(owners, tokens=0)


def test_a_request_short_of_one_bucket_charges_none():
    limiter = RateLimiter(Clock())
    tenant = ("tenant t", 1, Limit(requests_per_minute=10, tokens_per_minute=100))
    key = ("your key", 7, Limit(tokens_per_minute=50))
    limiter.admit([key], tokens=40)
    with pytest.raises(Limited, match="your key: 50 tokens per minute") as e:
        limiter.admit([tenant, key], tokens=20)
    assert e.value.kind == "tokens"
    limiter.admit([tenant], tokens=100)  # the refused one took nothing from the tenant
    with pytest.raises(Limited, match="tenant t: 100 tokens"):
        limiter.admit([tenant], tokens=1)
    other_key = ("your key", 8, Limit(tokens_per_minute=50))
    with pytest.raises(Limited, match="tenant t"):  # the tenant's bucket is shared
        limiter.admit([tenant, other_key], tokens=1)


def test_tokens_are_settled_by_the_answers_usage():
    clock = Clock()
    limiter = RateLimiter(clock)
    owners = [("your key", 1, Limit(tokens_per_minute=120))]
    limiter.admit(owners, tokens=100)
    with pytest.raises(Limited):
        limiter.admit(owners, tokens=100)
    limiter.settle(owners, charged=100, used=10)  # 90 given back: 110 left
    limiter.admit(owners, tokens=100)
    limiter.settle(owners, charged=100, used=200)  # 100 more taken: 90 in debt
    with pytest.raises(Limited, match="retry in 50 s"):  # 90 of debt and 10 to spend: 100 at 2/s
        limiter.admit(owners, tokens=10)
    # a request costing more than a whole minute needs only a full bucket, not forever
    clock.now = 1000.0
    limiter.admit(owners, tokens=10_000)


def test_token_estimates():
    assert estimate_tokens("/v1/completions", {"prompt": "x" * 40, "max_tokens": 5}) == 15
    assert estimate_tokens("/v1/completions", {"prompt": "abc"}) == 1 + 16
    assert estimate_tokens("/v1/completions", {"prompt": "abcd", "max_tokens": 3, "n": 2}) == 7
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert estimate_tokens("/v1/chat/completions", chat) > 256


def test_batch_gate_lets_in_first_come_first_served_and_gives_up_cleanly():
    async def scenario() -> None:
        gate = BatchGate()
        await gate.enter(limit=1, timeout=1)
        order: list[str] = []

        async def waiter(name: str, timeout: float) -> None:
            try:
                await gate.enter(limit=1, timeout=timeout)
                order.append(name)
            except QueueTimeout:
                order.append(f"{name} gave up")

        first = asyncio.create_task(waiter("first", 10))
        await asyncio.sleep(0)
        quitter = asyncio.create_task(waiter("quitter", 0.01))
        await asyncio.sleep(0)
        second = asyncio.create_task(waiter("second", 10))
        left = asyncio.create_task(waiter("left", 10))
        await asyncio.sleep(0.05)
        assert (gate.in_flight, gate.waiting, order) == (1, 3, ["quitter gave up"])
        left.cancel()  # a client that went away
        await asyncio.gather(left, quitter, return_exceptions=True)
        assert gate.waiting == 2
        gate.leave()
        await first
        gate.leave()
        await second
        assert order == ["quitter gave up", "first", "second"] and gate.in_flight == 1
        gate.leave()
        assert (gate.in_flight, gate.waiting) == (0, 0)
        await gate.enter(limit=2, timeout=1)  # more replicas: more slots
        await gate.enter(limit=2, timeout=1)
        assert gate.in_flight == 2

    asyncio.run(scenario())


def test_batch_requests_wait_while_an_interactive_one_waits_for_its_first_token():
    async def scenario() -> None:
        gate = BatchGate()
        await gate.enter(limit=3, timeout=1)
        lift = gate.hold()  # an interactive request sent, no token yet
        other = gate.hold()
        batch = asyncio.create_task(gate.enter(limit=3, timeout=10))
        await asyncio.sleep(0.05)
        assert (gate.in_flight, gate.waiting) == (1, 1)  # a free slot, yet held
        lift()
        lift()  # once only: the other hold still stands
        await asyncio.sleep(0.05)
        assert (gate.in_flight, gate.waiting, gate.held) == (1, 1, 1)
        other()  # every first token came: the batch request goes in
        await batch
        assert (gate.in_flight, gate.waiting, gate.held) == (2, 0, 0)
        gate.leave()
        gate.leave()
        lift = gate.hold()  # none in flight: one goes in all the same, the next waits
        await gate.enter(limit=3, timeout=1)
        batch = asyncio.create_task(gate.enter(limit=3, timeout=10))
        await asyncio.sleep(0.05)
        assert (gate.in_flight, gate.waiting) == (1, 1)
        lift()
        await batch

    asyncio.run(scenario())
