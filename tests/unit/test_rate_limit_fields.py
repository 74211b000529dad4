"""``Decision.header_fields`` against the fields written plainly (draft-ietf-httpapi-
ratelimit-headers-11): its kept policy items and table of decimal forms (issue 27) must
write exactly what formatting each report anew writes, for any reports, before and after
a rule's count or window changes under the same name (a reload)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.ratelimit.decision import (
    MAX_POLICY_ITEMS,
    Decision,
    LimitReport,
    Outcome,
    decimal,
    policy_item,
)


def plain_fields(decision: Decision) -> list[tuple[str, str]]:
    """The fields as the draft reads them, with no shortcut."""
    reports = decision.reports
    if not reports:
        return []
    policy = ", ".join(f'"{r.name}";q={r.count};w={r.seconds}' for r in reports)
    if decision.outcome is Outcome.LIMITED:
        reports = tuple(r for r in reports if r.exceeded and not r.shadow) or reports
    state = ", ".join(f'"{r.name}";r={r.remaining};t={r.reset_seconds}' for r in reports)
    return [("RateLimit-Policy", policy), ("RateLimit", state)]


numbers = st.one_of(st.integers(-2, 2_100), st.integers(-5, 10**12))
reports = st.builds(
    LimitReport,
    name=st.sampled_from(["per-key", "per-address", "auth-api-key", "a-10s"]),
    rule_id=st.just("r"),
    count=numbers,
    seconds=numbers,
    remaining=numbers,
    reset_seconds=numbers,
    exceeded=st.booleans(),
    shadow=st.booleans(),
)


@settings(max_examples=500)
@given(
    st.lists(st.lists(reports, max_size=3), min_size=1, max_size=4),
    st.sampled_from(list(Outcome)),
)
def test_fields_are_the_plainly_written_ones(rounds, outcome):
    # Several decisions in a row: the same names come back with other counts and windows.
    for found in rounds:
        decision = Decision(outcome, reports=tuple(found))
        assert decision.header_fields() == plain_fields(decision)


@given(numbers)
def test_decimal_is_str(n):
    assert decimal(n) == str(n)


def test_kept_policy_items_are_bounded():
    for n in range(MAX_POLICY_ITEMS + 10):
        report = LimitReport(f"rule-{n}", "r", 5, 60, 1, 1, False, False)
        assert policy_item(report) == f'"rule-{n}";q=5;w=60'
    from gateway.ratelimit import decision

    assert len(decision._POLICY_ITEMS) <= MAX_POLICY_ITEMS
