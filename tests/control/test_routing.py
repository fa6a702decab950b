"""Replica choice on its own: prompt prefixes stick to a replica, within a load bound."""

from __future__ import annotations

from collections import Counter

from gpucloud.control.routing import PREFIX_CHARS, Balancer, prefix_key

REPLICAS = [(11, "http://a"), (12, "http://b"), (13, "http://c")]
SYSTEM = "You are the support assistant of a bank. Answer in one sentence. " * 5


def first(balancer: Balancer, body: dict, replicas=REPLICAS) -> int:
    return balancer.order(replicas, prefix_key(body))[0][0]


def test_requests_sharing_a_prefix_go_to_one_replica():
    b = Balancer()
    owners = {first(b, {"prompt": SYSTEM + f"question {i}?"}) for i in range(20)}
    assert len(owners) == 1
    chats = {
        first(b, {"messages": [{"role": "system", "content": SYSTEM},
                               {"role": "user", "content": f"question {i}?"}]})
        for i in range(20)
    }  # fmt: skip
    assert len(chats) == 1


def test_different_prefixes_spread_over_the_replicas():
    b = Balancer()
    owners = Counter(first(b, {"prompt": f"system prompt {i}: " + SYSTEM}) for i in range(300))
    assert set(owners) == {11, 12, 13} and min(owners.values()) > 60


def test_a_replica_that_goes_away_moves_only_its_own_prefixes():
    b = Balancer()
    bodies = [{"prompt": f"{i} " + SYSTEM} for i in range(200)]
    before = [first(b, x) for x in bodies]
    after = [first(b, x, REPLICAS[:2]) for x in bodies]
    assert all(a == o for a, o in zip(after, before, strict=True) if o != 13)


def test_a_loaded_replica_is_skipped_until_the_others_catch_up():
    b = Balancer()
    body = {"prompt": SYSTEM}
    owner = first(b, body)
    b.in_flight[owner] = 2  # others idle: the mean with this request is 1, the bound 2
    assert first(b, body) != owner
    b.in_flight.update({rid: 1 for rid, _ in REPLICAS if rid != owner})
    assert first(b, body) == owner  # 4 + 1 in flight: the bound is 3


def test_without_a_prompt_the_least_loaded_replica_goes_first_and_the_rest_follow():
    b = Balancer()
    b.in_flight.update({11: 3, 12: 0, 13: 1})
    assert [rid for rid, _ in b.order(REPLICAS)] == [12, 13, 11]
    order = b.order(REPLICAS, prefix_key({"prompt": SYSTEM}))
    assert sorted(rid for rid, _ in order) == [11, 12, 13]


def test_prefix_key_of_each_prompt_shape():
    assert prefix_key({"prompt": "x" * 1000}) == b"x" * PREFIX_CHARS
    assert prefix_key({"prompt": ["ab", "cd"]}) == b"ab"
    assert prefix_key({"prompt": [1, 2, 3]}) == b"1,2,3"
    assert prefix_key({"prompt": [[4, 5], [6]]}) == b"4,5"
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    assert prefix_key(parts) == prefix_key({"messages": [{"role": "user", "content": "hi"}]})
    for bad in (None, [], {"prompt": 3}, {"messages": "x"}, {"prompt": [{"a": 1}]}, {}):
        assert prefix_key(bad) is None
