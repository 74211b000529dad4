"""A rule field's error says "required" only when the field is missing.

``id: A`` used to be refused with ``field 'id': required; lower-case letters...`` and
``identity: apikey`` with ``required; one of ..., not 'apikey'``: the field was there,
its value was wrong. A value given is now said to be wrong as such (``must be ..., not
<value>``, or ``empty`` for YAML's empty value), with the likely spelling when there is
one; "required" is for a field the rule lacks.
"""

from __future__ import annotations

import pytest

from gateway.policy.loader import RuleLoadError, RuleProblem, load_rules_from_texts

GOOD = {"id": "a", "identity": "ip", "limits": "{default: 5/10}"}


def _problems(fields: dict[str, str | None], extra: str = "") -> list[RuleProblem]:
    """The problems of a one-rule file with ``fields`` (None: the field left out)."""
    body = "".join(f"    {k}: {v}\n" for k, v in fields.items() if v is not None)
    text = "rules:\n  - " + body.lstrip() + extra
    with pytest.raises(RuleLoadError) as info:
        load_rules_from_texts([("rules.yaml", text)])
    return info.value.problems


def _only(problems: list[RuleProblem], field: str) -> str:
    (problem,) = [p for p in problems if p.field == field]
    return problem.message


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("id", "A", ["must be lower-case letters", "not 'A'", "did you mean 'a'?"]),
        ("id", "'-x'", ["must be lower-case letters", "not '-x'"]),
        ("id", "7.5", ["must be lower-case letters", "not 7.5"]),
        ("id", "''", ["not ''"]),
        ("id", "", ["empty: give lower-case letters"]),  # `id:` (YAML's null)
        ("identity", "apikey", ["must be one of ip, api_key", "not 'apikey'",
                                "did you mean 'api_key'?"]),
        ("identity", "IP", ["not 'IP'", "did you mean 'ip'?"]),
        ("identity", "[ip]", ["must be one of", "not ['ip']"]),
        ("identity", "", ["empty: give one of ip, api_key"]),
        ("limits", "5/10", ["must be a non-empty mapping of region", "not '5/10'"]),
        ("limits", "{}", ["must be a non-empty mapping", "not {}"]),
        ("limits", "", ["empty: give a non-empty mapping"]),
    ],
)  # fmt: skip
def test_a_field_given_with_a_wrong_value_is_never_required(
    field: str, value: str, words: list[str]
) -> None:
    message = _only(_problems({**GOOD, field: value}), field)
    assert "required" not in message, message
    for word in words:
        assert word in message, message


@pytest.mark.parametrize(
    ("field", "words"),
    [
        ("id", "required: lower-case letters, digits"),
        ("identity", "required: one of ip, api_key, user_ip, client_cert"),
        ("limits", "required: a mapping of region (or 'default') to 'count/seconds'"),
    ],
)
def test_a_missing_field_is_required(field: str, words: str) -> None:
    assert _only(_problems({**GOOD, field: None}), field).startswith(words)


def test_a_tiers_limits_given_wrong_are_named_by_the_tier_and_never_required() -> None:
    problems = _problems(
        {**GOOD, "identity": "api_key"}, "    tiers: {gold: 5/10, silver: {us: x}}\n"
    )
    gold = _only(problems, "tiers.gold")
    assert gold.startswith("must be a non-empty mapping of region") and "'5/10'" in gold
    assert "write 'count/seconds'" in _only(problems, "tiers.silver.us")


def test_no_message_for_a_present_field_says_required() -> None:
    """Every field of a rule given a value of the wrong kind: none is "required"."""
    rule = {
        "id": "[1]", "identity": "{a: b}", "limits": "[1]", "category": "[1]",
        "shadow": "maybe", "unlimited": "''", "failure_mode": "sometimes",
        "match": "7", "refusal": "{status: 404}",
    }  # fmt: skip
    problems = _problems(rule)
    assert {p.field for p in problems} >= {"id", "identity", "limits", "shadow", "failure_mode"}
    assert not [p for p in problems if "required" in p.message], problems
    for name in ("shadow", "unlimited", "failure_mode", "refusal.status"):
        for p in problems:
            if p.field == name:
                assert "None" not in p.message
