"""A rule's refusal answer (issue 26 item 5): its status (429 or 503) and its detail text
are the rule file's to choose; a repeat answered from memory answers the same."""

from __future__ import annotations

import aiohttp
import pytest

from gateway.policy.loader import RuleLoadError, load_rules
from tests.support.gateway import running_gateway

RULES = """\
rules:
  - id: busy
    match: {prefix: /busy}
    identity: ip
    limits: {us: 1/60}
    refusal: {status: 503, detail: "overloaded ({rule}); come back in {retry_after} s"}
  - id: plain
    identity: ip
    limits: {us: 1/60}
"""


async def test_a_rule_chooses_its_refusals_status_and_detail(tmp_path, upstream):
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    async with running_gateway(upstream, rules=[str(rules)]) as gw, aiohttp.ClientSession() as h:
        async with h.get(gw.url + "/busy") as r:
            assert r.status == 200
        for _ in range(3):  # the first refusal, then repeats answered from memory
            async with h.get(gw.url + "/busy") as r:
                assert r.status == 503
                wait = int(r.headers["Retry-After"])
                assert (await r.json()) == {"detail": f"overloaded (busy); come back in {wait} s"}
                assert r.headers["RateLimit"].startswith('"busy";r=0;')
        async with h.get(gw.url + "/x") as r:
            assert r.status == 200
        async with h.get(gw.url + "/x") as r:  # the default answer elsewhere
            assert r.status == 429
            assert "rate limit exceeded for rule 'plain'" in (await r.json())["detail"]


@pytest.mark.parametrize(
    "refusal",
    [
        "{status: 500}",
        "{status: true}",
        "{detail: 7}",
        "{other: 1}",
        "503",
        '{detail: "' + "x" * 501 + '"}',
        '{detail: "tab\\there"}',
    ],
)
def test_bad_refusal_settings_are_refused_with_the_field_named(tmp_path, refusal):
    path = tmp_path / "rules.yaml"
    path.write_text(
        f"rules:\n  - id: r\n    identity: ip\n    limits: {{us: 1/60}}\n    refusal: {refusal}\n"
    )
    with pytest.raises(RuleLoadError) as err:
        load_rules([str(path)], frozenset({"us", "eu", "us2"}))
    assert "refusal" in str(err.value)
