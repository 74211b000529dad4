from __future__ import annotations

import pytest

from gateway.policy import model
from gateway.policy.loader import RuleLoadError, load_rules_from_texts
from gateway.policy.matcher import select
from gateway.policy.model import IdentityKind

TEXT = """
rules:
  - {id: trial, match: {prefix: /a}, identity: ip, shadow: true, limits: {default: 1/1}}
  - {id: a-key, match: {prefix: /a}, identity: api_key, limits: {default: 5/1}}
  - {id: a-user, match: {prefix: /a}, identity: user_ip, limits: {us: 5/1}}
  - {id: rest, identity: ip, limits: {default: 9/1}}
"""


def lookup(api_key=None, user=None):
    def key_for(kind: IdentityKind):
        return {
            IdentityKind.IP: "ip-hash",
            IdentityKind.API_KEY: api_key,
            IdentityKind.USER_IP: user,
        }[kind]

    return key_for


def test_first_formable_rule_wins_and_shadows_are_collected():
    table = load_rules_from_texts([("t.yaml", TEXT)])
    chosen = select(table, "us", "GET", "/a/b", lookup(api_key="k"))
    assert chosen.rule.id == "a-key" and chosen.identity == "k"
    assert [(r.id, key) for r, key in chosen.shadows] == [("trial", "ip-hash")]
    assert select(table, "us", "GET", "/a", lookup(user="u")).rule.id == "a-user"
    # a-user has no limit in eu: it does not apply there
    assert select(table, "eu", "GET", "/a", lookup(user="u")).rule.id == "rest"
    assert select(table, "us", "GET", "/ab", lookup(api_key="k")).rule.id == "rest"


def test_match_cache_gives_the_same_answers_and_stays_bounded():
    # The real bound (a Final constant: the compiled module reads it as a constant, so
    # it cannot be patched), passed twice over.
    bound = model.MATCH_CACHE_ENTRIES
    table = load_rules_from_texts([("t.yaml", TEXT)])
    for n in range(2 * bound + 10):
        path = f"/a/{n}" if n % 2 else f"/z/{n}"
        first = select(table, "us", "GET", path, lookup(api_key="k"))
        again = select(table, "us", "GET", path, lookup())
        assert first.rule.id == ("a-key" if n % 2 else "rest")
        assert again.rule.id == "rest"  # same path, other headers: not a cached rule
        assert len(table.match_cache) <= bound


RUN = "0b6f2a4c-1d2e-4f00-8a9b-0123456789ab"


def test_uuid_spellings_any_common_reader_accepts_stay_in_the_uuid_rule():
    # Regression: these spellings, all read by uuid.UUID() as one id, used to leave the
    # run-lookup rule (found by tests/unit/test_matcher_property.py).
    table = load_rules_from_texts(
        [("t.yaml", "rules:\n"
          "  - {id: run, match: {template: '/runs/{uuid}'}, identity: ip, limits: {us: 1/1}}\n"
          "  - {id: rest, identity: ip, limits: {us: 9/1}}\n")]
    )  # fmt: skip
    plain = RUN.replace("-", "")
    spellings = [
        f"%7Burn:uuid:{RUN}%7D",  # braces around the prefix
        f"uuid:urn:{RUN}",  # prefixes in either order
        f"urn:urn:{RUN}",
        f"{plain[:10]}urn:{plain[10:]}",  # uuid.UUID deletes "urn:" wherever it is
        "+" + plain[1:],  # int(..., 16) reads a sign, "0x" and "_" separators
        "0X" + plain[2:],
        f"{plain[:4]}_{plain[4:31]}",
        "%EF%BC%90" + plain[1:],  # a fullwidth 0: a Unicode decimal digit
        f"%7B%7B{RUN}%7D",
        # Paths match whatever their case (so /RUNS/... is counted by its rule): "URN:"
        # folds to "urn:". uuid.UUID() refuses it, so the upstream answers it 404, and
        # counting it by the run rule takes nothing from anyone.
        f"URN:{RUN}",
        f"{RUN.upper()}",
        # Spring reads a path variable with UUID.fromString after String.trim(): groups of
        # any length, '+' signs, Unicode digits, white space around (a security review
        # counted these by the looser default rule); ASP.NET's Guid.Parse trims too, and
        # reads "(...)" and "{0x...}" forms.
        f"{RUN}%20",
        f"%20%20{RUN}%C2%A0",
        RUN.lstrip("0") if RUN.startswith("0") else "1" + RUN[1:].replace("-", "-0", 1),
        "1-1-1-1-1",
        "+1-+2-3-4-5",
        "%EF%BC%A6-%D9%A0-1-1-1",  # a fullwidth F and an Arabic-Indic zero
        "7fffffffffffffff-1-1-1-1",
        f"%28{RUN}%29",
        "%7B0x1,0x2,0x3,%7B0x4,0x5,0x6,0x7,0x8,0x9,0xa,0xb%7D%7D",
    ]
    for spelling in spellings:
        path = f"/runs/{spelling}"
        assert select(table, "us", "GET", path, lookup()).rule.id == "run", spelling
    not_ids = ["stats", plain[:31], f"%7B{RUN}%7Dx", f"{RUN}/x", "%7B%7D", "1-1-1-1",
               "1-1-1-1-1-1", "8000000000000000-1-1-1-1", "g-1-1-1-1", "1-1-1-1-", "+-1-1-1-1",
               "%7B0x1,0x2,0x3,%7B0x4%7D%7D", f"x{RUN}"]  # fmt: skip
    for other in not_ids:
        assert select(table, "us", "GET", f"/runs/{other}", lookup()).rule.id == "rest", other


def test_rule_values_match_whatever_their_case_and_reachability_folds_too():
    table = load_rules_from_texts(
        [("t.yaml", "rules:\n"
          "  - {id: q, match: {path: /Runs/Query}, identity: ip, limits: {us: 1/1}}\n"
          "  - {id: t, match: {template: '/Repos/{o}/{int}'}, identity: ip, limits: {us: 1/1}}\n"
          "  - {id: r, match: {regex: '/CODES/[A-Z]+'}, identity: ip, limits: {us: 1/1}}\n"
          "  - {id: rest, identity: ip, limits: {us: 9/1}}\n")]
    )  # fmt: skip
    for path, rule in [("/runs/query", "q"), ("/RUNS/QUERY", "q"), ("/repos/Me/7", "t"),
                       ("/codes/abc", "r"), ("/Codes/ABC", "r"), ("/codes/1", "rest")]:  # fmt: skip
        assert select(table, "us", "GET", path, lookup()).rule.id == rule, path
    # a rule that differs from one before it only in case can never match: refused
    for first, second in [("prefix: /Runs", "prefix: /runs/query"), ("suffix: /X", "suffix: /x"),
                          ("path: /A", "path: /a")]:  # fmt: skip
        with pytest.raises(RuleLoadError, match="unreachable"):
            load_rules_from_texts(
                [("t.yaml", "rules:\n"
                  f"  - {{id: a, match: {{{first}}}, identity: ip, limits: {{us: 9/1}}}}\n"
                  f"  - {{id: b, match: {{{second}}}, identity: ip, limits: {{us: 1/1}}}}\n")]
            )  # fmt: skip
    # a case-sensitive regex group cannot be honoured on folded paths: refused, saying why
    with pytest.raises(RuleLoadError, match="case-sensitive group"):
        load_rules_from_texts(
            [("t.yaml", "rules:\n"
              "  - {id: a, match: {regex: '/f/(?-i:[A-Z]+)'}, identity: ip, limits: {us: 1/1}}\n")]
        )  # fmt: skip


def test_an_exemption_applies_only_to_the_path_as_written():
    # A security review: paths match whatever their case, so /OK matched the shipped
    # `health` exemption, and reached the upstream uncounted, without even the per-address
    # ceiling (an exemption skips ceilings). Folding may make a limit stricter, never an
    # exemption wider: each path form, the template's literals and a regex alike.
    from pathlib import Path

    from gateway.policy.loader import load_rules

    shipped = load_rules([Path(__file__).resolve().parents[2] / "rules"])
    assert select(shipped, "us", "GET", "/ok", lookup()).exempt
    for path in ["/OK", "/Ok", "/oK"]:
        chosen = select(shipped, "us", "GET", path, lookup(api_key="k"))
        assert chosen.rule is not None and chosen.rule.id == "default-api-key", path
        assert [c.id for c, _ in chosen.ceilings] == ["per-address"], path
    table = load_rules_from_texts(
        [("t.yaml", "rules:\n"
          "  - {id: p, match: {prefix: /Static}, unlimited: true}\n"
          "  - {id: t, match: {template: '/Files/{uuid}/Raw'}, unlimited: true}\n"
          "  - {id: r, match: {regex: '/Img/[a-z]+'}, unlimited: true}\n"
          "  - {id: rest, identity: ip, limits: {us: 9/1}}\n")]
    )  # fmt: skip
    exempt = ["/Static", "/Static/a/B", f"/Files/{RUN}/Raw", f"/Files/{RUN.upper()}/Raw", "/Img/ab"]
    counted = ["/static", "/STATIC/a", f"/files/{RUN}/raw", f"/Files/{RUN}/RAW", "/img/ab",
               "/Img/AB"]  # fmt: skip
    for path in exempt:
        assert select(table, "us", "GET", path, lookup()).exempt, path
    for path in counted:
        assert select(table, "us", "GET", path, lookup()).rule.id == "rest", path


def test_a_rule_after_an_exemption_is_reachable_by_the_other_cases():
    # An exemption applies to the path as written, so a later rule matching the same path
    # still takes its other spellings: not reported unreachable (and the file loads).
    table = load_rules_from_texts(
        [("t.yaml", "rules:\n"
          "  - {id: ok, match: {path: /ok}, unlimited: true}\n"
          "  - {id: ok-counted, match: {path: /ok}, identity: ip, limits: {us: 5/1}}\n"
          "  - {id: digits, match: {path: /1/2}, unlimited: true}\n"
          "  - {id: rest, identity: ip, limits: {us: 9/1}}\n")]
    )  # fmt: skip
    assert select(table, "us", "GET", "/OK", lookup()).rule.id == "ok-counted"
    assert select(table, "us", "GET", "/ok", lookup()).exempt
    with pytest.raises(RuleLoadError, match="unreachable"):
        load_rules_from_texts(
            [("t.yaml", "rules:\n"
              "  - {id: digits, match: {path: /1/2}, unlimited: true}\n"
              "  - {id: late, match: {path: /1/2}, identity: ip, limits: {us: 5/1}}\n")]
        )  # fmt: skip


def test_an_exemption_takes_only_canonical_ids_and_no_case_blind_regex():
    # A review: {uuid} reads every spelling any reader takes, which for a limit only makes
    # it stricter, but an exempt /files/{uuid} then exempted /files/1-1-1-1-1, which a
    # Python or Go upstream may route elsewhere. An exemption's {uuid} is 8-4-4-4-12 hex.
    table = load_rules_from_texts(
        [("t.yaml", "rules:\n"
          "  - {id: f, match: {template: '/files/{uuid}'}, unlimited: true}\n"
          "  - {id: rest, identity: ip, limits: {us: 9/1}}\n")]
    )  # fmt: skip
    assert select(table, "us", "GET", f"/files/{RUN}", lookup()).exempt
    assert select(table, "us", "GET", f"/files/{RUN.upper()}", lookup()).exempt
    for other in ["1-1-1-1-1", f"{RUN}%20", f"%7B{RUN}%7D", RUN.replace("-", "")]:
        assert select(table, "us", "GET", f"/files/{other}", lookup()).rule.id == "rest", other
    with pytest.raises(RuleLoadError, match="cannot ignore case"):
        load_rules_from_texts(
            [("t.yaml", "rules:\n  - {id: r, match: {regex: '(?i)/img/.*'}, unlimited: true}\n")]
        )
