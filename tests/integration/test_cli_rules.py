"""`gateway rules check` and `gateway rules explain` as a user runs them."""

from __future__ import annotations

import subprocess
import sys

from tests.support.gateway import ROOT


def gateway(*args, env=None):
    import os

    return subprocess.run(
        [sys.executable, "-m", "gateway", *args],
        cwd=ROOT,
        text=True,
        capture_output=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


def test_rules_check_accepts_the_default_table_and_names_problems():
    ok = gateway("rules", "check", "rules")
    assert ok.returncode == 0
    assert "ok: 30 rules" in ok.stdout
    bad = gateway("rules", "check", "tests/fixtures/rules/bad/unreachable.yaml")
    assert bad.returncode == 1
    assert "unreachable.yaml: rule 'repos-one' (#2), field 'match'" in bad.stderr
    assert "taken first by rule 'repos'" in bad.stderr
    two = gateway(
        "rules",
        "check",
        "tests/fixtures/rules/bad/bad_regex.yaml",
        "tests/fixtures/rules/bad/bad_limit.yaml",
    )
    assert two.returncode == 1 and "2 problem(s)" in two.stderr
    assert "'match.regex'" in two.stderr and "'limits.us'" in two.stderr


def test_rules_explain_shows_rule_identity_limits_and_why_not(tmp_path):
    secret = "explain-secret-0123456789"
    out = gateway(
        "rules",
        "explain",
        "POST",
        "/runs//query",
        "-H",
        "x-api-key: sk-RAW-KEY-1",
        env={"GATEWAY_IDENTITY_SECRET": secret},
    )
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "normalised from /runs//query" in text
    assert "= runs-query-api-key: MATCHES" in text
    assert "limit in eu: 15/10" in text and "limit in us: 15/10" in text
    assert "- runs-batch: skipped, does not match (POST on path /runs/batch)" in text
    assert "sk-RAW-KEY-1" not in text  # only the keyed hash is shown
    from gateway.policy.model import IdentityKind
    from gateway.ratelimit.identity import IdentityHasher

    assert IdentityHasher(secret.encode()).digest(IdentityKind.API_KEY, "sk-RAW-KEY-1") in text
    user = gateway("rules", "explain", "GET", "/commits/x", "-H", "x-user-id: u1", "--region", "eu")
    assert "- commits-api-key: skipped, identity api_key cannot be formed" in user.stdout
    assert "= commits-user: MATCHES" in user.stdout and "limit in eu: 2000/60" in user.stdout
    refused = gateway("rules", "explain", "GET", "/a;b")
    assert refused.returncode == 2 and "path parameters" in refused.stderr
