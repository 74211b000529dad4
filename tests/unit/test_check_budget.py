"""The signature-check budget (identity.user.jwt.max_signature_checks_per_client and
max_signature_checks): what one client address, and all of them, may spend on checking
tokens in a second. Pure: a fake clock, no tokens."""

from __future__ import annotations

import math
from collections import defaultdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.identity.check_budget import CheckBudget

# One token costs at most this many checks (jwt.MAX_KEYS_TRIED): a check that starts
# with budget left may overshoot by one token's cost less one.
TOKEN_COST = 4

_steps = st.lists(
    st.tuples(
        st.sampled_from(["10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4", "10.0.0.5"]),
        st.integers(min_value=0, max_value=TOKEN_COST),  # checks one token cost
        st.floats(min_value=0, max_value=0.4),  # time since the step before
    ),
    max_size=300,
)


@settings(max_examples=300, deadline=None)
@given(
    per_client=st.integers(min_value=1, max_value=12),
    total=st.integers(min_value=1, max_value=30),
    steps=_steps,
)
def test_no_client_and_no_second_spends_past_its_budget(per_client, total, steps):
    """Whatever the order of clients and tokens: in every second, checks made for one
    address stay within its share plus one token, all checks within the total plus one
    token, and a client with share left is refused only when the total is spent."""
    budget = CheckBudget(per_client, total)
    now = 1000.0
    spent: dict[tuple[int, str], int] = defaultdict(int)
    spent_all: dict[int, int] = defaultdict(int)
    for client, cost, gap in steps:
        now += gap
        second = math.floor(now)
        if budget.allows(client, now):
            budget.spend(client, cost, now)
            spent[(second, client)] += cost
            spent_all[second] += cost
        else:
            assert spent[(second, client)] >= per_client or spent_all[second] >= total, (
                "refused with budget left"
            )
    for (_, _client), checks in spent.items():
        assert checks <= per_client + TOKEN_COST - 1
    for checks in spent_all.values():
        assert checks <= total + TOKEN_COST - 1


def test_the_share_starts_over_each_second_and_other_addresses_keep_theirs():
    budget = CheckBudget(per_client=3, total=100)
    for _ in range(3):
        assert budget.allows("a", 5.1)
        budget.spend("a", 1, 5.1)
    assert not budget.allows("a", 5.9)
    assert budget.allows("b", 5.9)  # another address: its own share
    assert budget.allows("a", 6.0)  # the next second


def test_many_addresses_together_are_held_to_the_total():
    budget = CheckBudget(per_client=4, total=10)
    for i in range(10):
        assert budget.allows(f"10.0.0.{i}", 7.5)
        budget.spend(f"10.0.0.{i}", 1, 7.5)
    assert not budget.allows("10.0.0.99", 7.6)  # a fresh address: the total is spent
    assert budget.allows("10.0.0.99", 8.0)


def test_what_it_remembers_is_bounded_by_one_seconds_spenders():
    budget = CheckBudget(per_client=1, total=5)
    for i in range(10_000):
        address = f"10.{i // 65536}.{i // 256 % 256}.{i % 256}"
        if budget.allows(address, 3.5):
            budget.spend(address, 1, 3.5)
    assert len(budget._by_client) <= 5
    budget.allows("x", 4.0)
    assert not budget._by_client  # a new second forgets the last one's


def test_checks_not_made_cost_nothing():
    budget = CheckBudget(per_client=1, total=1)
    budget.spend("a", 0, 1.0)  # a token answered from a cache: no check
    assert budget.allows("a", 1.0)


def test_a_budget_of_nothing_is_a_mistake():
    with pytest.raises(ValueError):
        CheckBudget(0, 10)
    with pytest.raises(ValueError):
        CheckBudget(10, 0)
