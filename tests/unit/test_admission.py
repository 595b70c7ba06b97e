"""`serve`'s admission (rollout/engines/embedded/admission.py): a budget of tokens in flight,
shared fairly between clients; past it, Overloaded (503 + Retry-After). The HTTP side is in
tests/unit/test_embedded_server_load.py."""

import pytest

from megatron_stepwise.rollout.engines.embedded.admission import WAITING_S, Admission, Overloaded


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_a_lone_client_gets_the_whole_budget_and_no_more():
    a = Admission(100, Clock())
    a.admit("A", 60)
    a.admit("A", 40)
    with pytest.raises(Overloaded, match=r"100 of 100 tokens in flight \(--max-tokens-in-flight\).*'A' holds 100"):
        a.admit("A", 1)
    a.release("A", 40)
    a.admit("A", 30)
    assert a.in_flight == 90 and a.stats()["refused_requests"] == 1


def test_a_newcomer_is_admitted_within_its_share_while_the_flooder_is_held_to_its_own():
    a = Admission(100, Clock())
    for _ in range(4):
        a.admit("flood", 25)
    a.admit("small", 10)  # share 50: admitted at once, though the budget is full
    with pytest.raises(Overloaded):
        a.admit("flood", 25)
    a.release("flood", 25)
    a.release("flood", 25)  # 50 + 10 in flight, nobody turned away: the room is anyone's
    a.admit("flood", 25)
    a.admit("small", 30)  # within its own share (50), though the room is gone
    with pytest.raises(Overloaded, match="fair share is 50"):
        a.admit("flood", 5)
    assert a.held == {"flood": 75, "small": 40}


def test_room_left_goes_to_nobody_beyond_their_share_while_another_client_waits():
    clock = Clock()
    a = Admission(100, clock)
    a.admit("A", 40)
    with pytest.raises(Overloaded):
        a.admit("B", 70)  # over B's share (50) and over the room left (60)
    with pytest.raises(Overloaded):
        a.admit("A", 20)  # room is left, but B waits: A keeps to its share of 50
    clock.now += WAITING_S + 1  # B gave up: A may use the room again
    a.admit("A", 20)


def test_admitted_tokens_never_pass_twice_the_budget():
    a = Admission(100, Clock())
    a.admit("flood", 100)
    admitted = 100
    for i in range(200):  # each newcomer is within its share of the shrinking fair share
        try:
            a.admit(f"client-{i}", 5)
            admitted += 5
        except Overloaded:
            pass
    assert a.in_flight == admitted and 150 < admitted <= 200


def test_a_request_larger_than_the_budget_runs_alone():
    a = Admission(100, Clock())
    a.admit("A", 5)
    with pytest.raises(Overloaded, match="more than the server's whole budget of 100"):
        a.admit("B", 150)
    a.release("A", 5)
    a.admit("B", 150)


def test_retry_after_follows_the_rate_tokens_finish_at():
    clock = Clock()
    a = Admission(100, clock)
    a.admit("A", 100)
    with pytest.raises(Overloaded) as first:
        a.admit("A", 50)
    assert first.value.retry_after == 1  # no rate measured yet
    for _ in range(3):  # 10 tokens a second
        a.admit("B", 10)
    for _ in range(3):
        clock.now += 1.0
        a.release("B", 10)
    with pytest.raises(Overloaded) as later:
        a.admit("A", 50)  # 50 tokens over the budget at 10 tokens/s
    assert later.value.retry_after == 5


def test_a_budget_below_one_is_refused_by_name():
    with pytest.raises(ValueError, match="max_tokens_in_flight must be >= 1"):
        Admission(0)
