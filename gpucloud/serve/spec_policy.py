"""How many tokens a sequence guesses each step: as many as pay for themselves, or none.

A guess costs even when it fails: a forward of the draft model per guessed token (none for
prompt lookup) and one more row in the target's forward to verify it. Decoding reads every
weight once per forward, so a draft forward costs about the draft's share of the target's
weight bytes (`draft_cost`), and a verified row `ROW_COST` of a step. What guesses gain
depends on how often they hold: if each guess holds with probability a (once the guesses
before it held), k guesses give 1 + a + ... + a^k tokens per step instead of 1, for a step
costing 1 + k (draft_cost + ROW_COST). As SmartSpec (Liu et al., 2024, "goodput") does per
batch, each sequence keeps a decaying count of the guesses it had accepted and rejected, and
guesses the k with the most tokens per unit of cost; none when no k beats plain decoding.

A sequence that stops guessing probes again later, with one guess, after a pause that grows
with each probe that did not pay (`PAUSES`). A lucky hit among misses moves the estimate a
little, where a reset to full guessing would pay for a whole run of misses. A new sequence
starts from the engine's recent verifications (all sequences'): probing first when they
are too few (`EVIDENCE`), guessing at once when they pay, and otherwise waiting the longest
pause before its first probe. That matters for a draft model: its first probe runs the
draft over the whole prompt. So on text that no proposer predicts, speculation costs a
one-token probe every 64 steps per sequence, and a few probes per engine while it learns.
"""

from __future__ import annotations

from dataclasses import dataclass

ROW_COST = 0.1  # a verified row's cost, as a share of a decode step's (an estimate)
DECAY = 0.8  # weight of a verification's outcome one verification later
EVIDENCE = 4.0  # decayed verifications the engine's record needs to set a new sequence's start
PAUSES = (4, 16, 64)  # steps without guessing after 1, 2, 3+ probes in a row that did not pay


@dataclass(slots=True)
class GuessState:
    """One sequence's record: decayed counts of accepted guesses and of rejections (a
    verification rejects at most one guess: the rest are never judged), the steps left in
    its pause, whether its next guess is a probe, and the probes in a row that did not pay."""

    accepted: float = 0.0
    rejected: float = 0.0
    pause: int = 0
    probe: bool = True
    misses: int = 0

    @property
    def acceptance(self) -> float:
        seen = self.accepted + self.rejected
        return self.accepted / seen if seen else 0.0


class GuessPolicy:
    def __init__(self, max_guesses: int, draft_cost: float):
        self.max_guesses = max_guesses
        self.cost = draft_cost + ROW_COST  # of one more guessed token, in decode steps
        self.recent = GuessState()  # every sequence's verifications, decayed the same way

    def start(self) -> GuessState:
        """A new sequence's state, from the engine's recent verifications."""
        r = self.recent
        if r.accepted + r.rejected < EVIDENCE:
            return GuessState()
        if self.best(r.acceptance):
            return GuessState(r.accepted, r.rejected, probe=False)
        return GuessState(r.accepted, r.rejected, pause=PAUSES[-1], misses=len(PAUSES))

    def guesses(self, state: GuessState) -> int:
        """How many tokens to guess this step (0: decode plainly); counts down a pause."""
        if state.pause > 0:
            state.pause -= 1
            return 0
        return 1 if state.probe else self.best(state.acceptance)

    def best(self, acceptance: float) -> int:
        """The number of guesses with the most expected tokens per unit of step cost; 0 when
        none beats one token per plain step."""
        best, best_rate, tokens = 0, 1.0, 1.0
        for k in range(1, self.max_guesses + 1):
            tokens += acceptance**k
            rate = tokens / (1 + k * self.cost)
            if rate > best_rate:
                best, best_rate = k, rate
        return best

    def observe(self, state: GuessState, guessed: int, accepted: int) -> None:
        """Record a verification of `guessed` tokens of which the first `accepted` held."""
        if guessed == 0:
            return
        for record in (state, self.recent):
            record.accepted = DECAY * record.accepted + accepted
            record.rejected = DECAY * record.rejected + (accepted < guessed)
        state.probe = False
        if self.best(state.acceptance):
            state.misses = 0
            return
        state.pause = PAUSES[min(state.misses, len(PAUSES) - 1)]
        state.misses += 1
        state.probe = True
