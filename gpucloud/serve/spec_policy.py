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
pause before its first probe. A draft model's probe runs the draft over every token it
has not seen (the whole prompt, the first time): until the engine's record can tell, one
sequence probes per step; while it says guessing does not pay, probes are rationed to
`PROBE_SHARE` of the tokens the target computes (in draft-cost units). So on text that no
proposer predicts, speculation costs a few probes per engine while it learns, and then at
most that share.
"""

from __future__ import annotations

from dataclasses import dataclass

ROW_COST = 0.1  # a verified row's cost, as a share of a decode step's (an estimate)
DECAY = 0.8  # weight of a verification's outcome one verification later
EVIDENCE = 2.0  # decayed verifications the engine's record needs to set a new sequence's start
PROBE_SHARE = 0.02  # of the target's tokens, what rationed probes may cost
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
        self.draft_cost = draft_cost
        self.allowance = 0.0  # what rationed probes may still cost, in target tokens
        self.steps = 0
        self._explored = -1  # the step of the last probe made before the record could tell

    def earn(self, tokens: int) -> None:
        """A step computed `tokens` tokens of the target: rationed probes may cost a share."""
        self.allowance += PROBE_SHARE * tokens
        self.steps += 1

    @property
    def paying(self) -> bool | None:
        """Whether the engine's recent guesses pay; None while they are too few to tell."""
        r = self.recent
        return None if r.accepted + r.rejected < EVIDENCE else bool(self.best(r.acceptance))

    def start(self) -> GuessState:
        """A new sequence's state, from the engine's recent verifications."""
        r, paying = self.recent, self.paying
        if paying is None:
            return GuessState()
        if paying:
            return GuessState(r.accepted, r.rejected, probe=False)
        return GuessState(r.accepted, r.rejected, pause=PAUSES[-1], misses=len(PAUSES))

    def guesses(self, state: GuessState, unseen: int = 0) -> int:
        """How many tokens to guess this step (0: decode plainly), `unseen` the tokens the
        draft model has yet to read; counts down a pause."""
        if state.pause > 0:
            state.pause -= 1
            return 0
        if not state.probe:
            return self.best(state.acceptance)
        if not self.draft_cost:  # prompt lookup: a probe costs one verified row
            return 1
        paying = self.paying
        if paying is None:  # exploring: one sequence's probe per step
            if self._explored == self.steps:
                return 0
            self._explored = self.steps
        elif not paying:  # rationed
            cost = self.draft_cost * (unseen + 1)
            if cost > self.allowance:
                return 0
            self.allowance -= cost
        return 1

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
