"""Bad rule files are refused with errors naming the file, the rule and the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.policy.loader import RuleLoadError, load_rules, load_rules_from_texts
from gateway.policy.model import IdentityKind

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "rules"
ROOT = Path(__file__).resolve().parents[2]

# file name -> (rule label expected in the error, field, words in the message)
BAD = {
    "unknown_key.yaml": ("'a' (#1)", None, "unknown key(s) ['burst']"),
    "unknown_match_key.yaml": ("'a' (#1)", "match", "unknown key(s) ['pth']"),
    "duplicate_id.yaml": ("'a' (#2)", "id", "duplicate rule id"),
    "bad_limit.yaml": ("'a' (#1)", "limits.us", "seconds must be"),
    "bad_limit_format.yaml": ("'a' (#1)", "limits.us", "write 'count/seconds'"),
    "unknown_region.yaml": ("'a' (#1)", "limits.mars", "unknown region 'mars'"),
    "bad_regex.yaml": ("'a' (#1)", "match.regex", "bad regular expression"),
    "unreachable.yaml": ("'repos-one' (#2)", "match", "unreachable"),
    "bad_identity.yaml": ("'a' (#1)", "identity", "one of ip, api_key, user_ip"),
    "bad_method.yaml": ("'a' (#1)", "match.methods", "unknown method(s) ['FETCH']"),
    "two_path_forms.yaml": ("'a' (#1)", "match", "give one path form"),
    "bad_template.yaml": ("'a' (#1)", "match.template", "unknown parameter type 'ulid'"),
    "bad_id.yaml": ("#1", "id", "lower-case letters"),
    "bad_failure_mode.yaml": ("'a' (#1)", "failure_mode", "'open' or 'closed'"),
    "not_yaml.yaml": (None, None, "not valid YAML"),
    "no_rules_list.yaml": (None, None, "unknown top-level key(s)"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_file_is_refused_with_file_rule_and_field(name):
    rule, field, words = BAD[name]
    with pytest.raises(RuleLoadError) as info:
        load_rules([FIXTURES / "bad" / name])
    problems = info.value.problems
    assert problems, "a refused file must say why"
    first = problems[0]
    assert first.file.endswith(name)
    assert first.rule == rule
    assert first.field == field
    assert words in first.message
    assert name in str(info.value)


def test_every_bad_fixture_is_covered():
    on_disk = {p.name for p in (FIXTURES / "bad").glob("*.yaml")}
    assert on_disk == set(BAD)


def test_default_table_loads_with_every_row():
    table = load_rules([ROOT / "rules"])
    ids = [r.id for r in table.rules]
    assert len(ids) == len(set(ids)) == 30
    # /public/download and /runs/stats must come before the two defaults.
    assert ids.index("public-download") < ids.index("default-api-key")
    assert ids.index("runs-stats") < ids.index("default-api-key")
    assert ids[-1] == "catch-all"


def test_us2_takes_us_values_unless_named():
    table = load_rules([ROOT / "rules"])
    commits = table.by_id("commits-api-key")
    assert commits is not None
    assert [str(s) for s in commits.limits_for("us2")] == ["10000/60"]
    assert [str(s) for s in commits.limits_for("eu")] == ["2000/60"]
    text = "rules:\n  - {id: a, identity: ip, limits: {us: 5/10, us2: 7/10, eu: 6/10}}\n"
    named = load_rules_from_texts([("x.yaml", text)]).rules[0]
    assert [str(s) for s in named.limits_for("us2")] == ["7/10"]


def test_good_fixture_features():
    table = load_rules([FIXTURES / "good" / "multi.yaml"])
    burst = table.by_id("burst-and-sustained")
    assert burst is not None and [str(s) for s in burst.limits_for("eu")] == ["5/1", "100/60"]
    shadow = table.by_id("shadow-things")
    assert shadow is not None and shadow.shadow
    run = table.by_id("run-by-id")
    assert run is not None and run.identity is IdentityKind.IP
    assert run.matches("GET", "/runs/123e4567-e89b-12d3-a456-426614174000")
    assert not run.matches("GET", "/runs/not-a-uuid")
    assert not run.matches("GET", "/runs/123e4567-e89b-12d3-a456-426614174000/x")


def test_several_files_load_in_name_order(tmp_path):
    (tmp_path / "20-late.yaml").write_text(
        "rules:\n  - {id: late, identity: ip, limits: {us: 1/1}}\n"
    )
    (tmp_path / "10-early.yaml").write_text(
        "rules:\n  - {id: early, match: {path: /x}, identity: ip, limits: {us: 1/1}}\n"
    )
    table = load_rules([tmp_path])
    assert [r.id for r in table.rules] == ["early", "late"]


def test_unreachable_across_files_names_both(tmp_path):
    (tmp_path / "a.yaml").write_text("rules:\n  - {id: all, identity: ip, limits: {us: 1/1}}\n")
    (tmp_path / "b.yaml").write_text(
        "rules:\n  - {id: never, match: {path: /x}, identity: ip, limits: {us: 1/1}}\n"
    )
    with pytest.raises(RuleLoadError) as info:
        load_rules([tmp_path])
    assert "'all'" in str(info.value) and "b.yaml" in str(info.value)


def test_missing_path_is_an_error(tmp_path):
    with pytest.raises(RuleLoadError, match="no such file"):
        load_rules([tmp_path / "nope.yaml"])
