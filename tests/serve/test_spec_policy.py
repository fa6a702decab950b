"""How many tokens a sequence guesses: as many as pay for themselves at its acceptance rate,
none when no number does, with probes after growing pauses."""

from __future__ import annotations

from gpucloud.serve.spec_policy import PAUSES, PROBE_SHARE, GuessPolicy, GuessState


def test_the_best_number_of_guesses_follows_acceptance_and_cost():
    free, costly = GuessPolicy(5, draft_cost=0.0), GuessPolicy(5, draft_cost=0.3)
    assert free.best(1.0) == costly.best(1.0) == 5  # every guess holds: guess all
    assert free.best(0.0) == costly.best(0.0) == 0  # none holds: a guess only costs
    assert free.best(0.6) > costly.best(0.6) > 0  # a dearer guess must hold more often
    assert costly.best(0.4) == 0
    assert GuessPolicy(5, draft_cost=1.0).best(1.0) == 0  # a draft as dear as the target


def test_a_stream_whose_guesses_fail_stops_guessing_and_probes_ever_more_rarely():
    policy, state = GuessPolicy(4, draft_cost=0.0), GuessState()  # prompt lookup
    guessed, steps = [], 200
    for _ in range(steps):
        k = policy.guesses(state)
        guessed.append(k)
        policy.observe(state, k, 0)
        policy.earn(1)
    tries = [i for i, k in enumerate(guessed) if k]
    assert all(guessed[i] == 1 for i in tries)  # probes of one token
    gaps = [b - a for a, b in zip(tries, tries[1:], strict=False)]
    assert gaps[: len(PAUSES)] == [p + 1 for p in PAUSES] and set(gaps[len(PAUSES) :]) == {65}
    assert len(tries) < steps / 30


def test_a_lucky_hit_among_misses_does_not_restore_full_guessing():
    policy, state = GuessPolicy(4, draft_cost=0.5), GuessState()
    for _ in range(10):
        policy.observe(state, 1, 0)
    state.pause = 0
    policy.observe(state, 1, 1)
    assert policy.guesses(state) <= 1


def test_a_stream_whose_guesses_hold_guesses_all_it_may():
    policy, state = GuessPolicy(4, draft_cost=0.5), GuessState()
    assert policy.guesses(state) == 1  # the first guess is a probe
    policy.observe(state, 1, 1)
    assert policy.guesses(state) == 4
    policy.observe(state, 4, 2)  # a miss among hits keeps it guessing
    assert policy.guesses(state) > 0


def test_exploring_probes_of_a_draft_model_go_one_sequence_per_step():
    policy = GuessPolicy(4, draft_cost=0.5)
    states = [policy.start() for _ in range(3)]  # nothing seen yet: probes first
    assert [policy.guesses(s) for s in states] == [1, 0, 0]
    policy.earn(3)
    assert [policy.guesses(s) for s in states[1:]] == [1, 0]


def test_a_new_sequence_starts_from_the_engines_recent_verifications():
    policy = GuessPolicy(4, draft_cost=0.5)
    assert policy.start().probe  # nothing seen yet: a one-token probe first
    policy.observe(GuessState(), 1, 0)
    assert policy.guesses(policy.start()) == 1  # too few seen yet: a probe still
    for _ in range(5):
        policy.observe(GuessState(), 1, 0)
    late = policy.start()  # recent guesses do not pay: its first probe waits the longest
    assert [policy.guesses(late) for _ in range(PAUSES[-1])] == [0] * PAUSES[-1]
    # and then for a share of the target's tokens that pays the draft's pass over its own
    unseen = 99
    assert policy.guesses(late, unseen) == 0
    policy.earn(int(0.5 * (unseen + 1) / PROBE_SHARE) - 1)
    assert policy.guesses(late, unseen) == 0
    policy.earn(1)
    assert policy.guesses(late, unseen) == 1
    for _ in range(10):
        policy.observe(GuessState(), 4, 4)
    assert policy.guesses(policy.start()) == 4  # they pay: it guesses all at once
