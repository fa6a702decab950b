"""Which READY replica of a deployment takes a request: the one whose prefix cache likely
holds the request's prompt prefix, unless that would overload it.

A replica's engine keeps the KV blocks of prompts it computed (prefix caching); a request
that starts like an earlier one skips computing that start, but only on the replica that
saw it. So requests are placed by consistent hashing of their prompt's start: each replica
gets a pseudo-random weight from (prefix, replica id), and the heaviest one is chosen
(rendezvous hashing), so a replica that comes or goes moves only the prefixes it owned.
The hash covers the first `PREFIX_CHARS` characters of the prompt, not its first KV
blocks' token ids: tokenizing in the gateway costs about 0.5 ms of the event loop per
1,000-character prompt (90 times the hash) and needs the deployment's model directory
on the control plane's machine, while the same leading characters give the same leading
tokens on every replica of the deployment.

Affinity is bounded by load ("consistent hashing with bounded loads", Mirrokni et al.):
a replica whose requests in flight, with this one, would exceed (1 + LOAD_SLACK) times the
mean (rounded up) is passed over for the next by weight. Requests without a prompt prefix,
and the replicas to try after the first, go by fewest requests in flight.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections import defaultdict

PREFIX_CHARS = 256  # about 4 KV blocks of 16 tokens of English text
LOAD_SLACK = 0.25  # ε: how far above the mean load affinity may push a replica


class Balancer:
    """Requests in flight per replica id (kept by the gateway), and the order to try a
    deployment's replicas in."""

    def __init__(self) -> None:
        self.in_flight: dict[int, int] = defaultdict(int)
        self._turn = itertools.count()

    def order(self, replicas: list[tuple[int, str]], prefix: bytes | None = None):
        """`replicas` (id, URL; not empty) in the order to try them: the owner of `prefix`
        that load allows first, then fewest requests in flight first (among equals, a turn
        that moves on each request)."""
        k = next(self._turn) % len(replicas)
        rotated = replicas[k:] + replicas[:k]
        by_load = sorted(rotated, key=lambda r: self.in_flight[r[0]])  # stable: keeps the turn
        if prefix is None or len(replicas) == 1:
            return by_load
        first = self._owner(replicas, prefix)
        return [first, *(r for r in by_load if r != first)]

    def _owner(self, replicas: list[tuple[int, str]], prefix: bytes) -> tuple[int, str]:
        """The heaviest replica for `prefix` among those under the load bound; the least
        loaded replica is always under it."""
        total = sum(self.in_flight[rid] for rid, _ in replicas)
        bound = math.ceil((1 + LOAD_SLACK) * (total + 1) / len(replicas))
        ranked = sorted(replicas, key=lambda r: weight(prefix, r[0]), reverse=True)
        return next(r for r in ranked if self.in_flight[r[0]] + 1 <= bound)


def weight(prefix: bytes, replica_id: int) -> int:
    """Replica `replica_id`'s rendezvous weight for `prefix`: the heaviest owns the prefix."""
    digest = hashlib.blake2b(prefix, digest_size=8, key=replica_id.to_bytes(8, "big"))
    return int.from_bytes(digest.digest(), "big")


def prefix_key(body: object) -> bytes | None:
    """The first PREFIX_CHARS characters of a completion's prompt (its first one, if it
    has several; token ids as decimal text) or of a chat's messages (role and text), or
    None when the body has neither."""
    if not isinstance(body, dict):
        return None
    chat = "messages" in body
    text = _chat_text(body["messages"]) if chat else _prompt_text(body.get("prompt"))
    return text[:PREFIX_CHARS].encode() if text else None


def _prompt_text(prompt: object) -> str | None:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of prompts: the first one's start
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return ",".join(map(str, prompt[:PREFIX_CHARS]))
    return None


def _chat_text(messages: object) -> str | None:
    if not isinstance(messages, list):
        return None
    parts: list[str] = []
    size = 0
    for m in messages:
        if size >= PREFIX_CHARS or not isinstance(m, dict):
            break
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(
                t for p in content if isinstance(p, dict) and isinstance(t := p.get("text"), str)
            )
        part = f"{m.get('role')}\n{content if isinstance(content, str) else ''}\n"
        parts.append(part)
        size += len(part)
    return "".join(parts)
