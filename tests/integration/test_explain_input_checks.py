"""``gateway rules explain`` and the console's explain form refuse what the gateway would
never see: a region it does not know, a client address that is no address.

Explain used to add the ``--region`` it was given to the known regions, so ``--region
EU`` (a typo of ``eu``) printed "no rule matches: the request is not limited" and exit 0,
while ``gateway serve --region mars`` refuses the name; and it hashed ``--client-ip
notanip`` as if a TCP peer could have that address.
"""

from __future__ import annotations

import aiohttp
import pytest

from gateway.cli import main
from tests.integration.test_console import _console
from tests.integration.test_console import metrics as metrics  # the fixture
from tests.support.gateway import ROOT

RULES = str(ROOT / "rules")


def _explain(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["rules", "explain", "POST", "/runs/query", "-H", "x-api-key: k",
                 "--rules", RULES, *args])  # fmt: skip
    out, err = capsys.readouterr()
    return code, out, err


def test_a_region_that_differs_in_case_is_refused_with_the_right_spelling(capsys) -> None:
    code, out, err = _explain(capsys, "--region", "EU")
    assert (code, out) == (2, "")
    assert "unknown region 'EU'" in err and "known regions: eu, us, us2" in err
    assert "did you mean 'eu'?" in err
    assert "not limited" not in out + err
    code, out, _ = _explain(capsys, "--region", "eu")  # the right spelling: limited
    assert code == 0 and "= runs-query-api-key: MATCHES" in out
    assert "limit in eu: 15/10" in out


def test_an_unknown_region_is_refused_naming_the_known_ones(capsys) -> None:
    code, out, err = _explain(capsys, "--region", "mars")
    assert (code, out) == (2, "")
    assert "unknown region 'mars'; known regions: eu, us, us2" in err
    assert "did you mean" not in err


@pytest.mark.parametrize("address", ["999.1.1.1", "notanip", "[::1]", "10.0.0.1/8", ""])
def test_a_client_address_that_is_no_ip_address_is_refused(capsys, address: str) -> None:
    code, out, err = _explain(capsys, "--client-ip", address)
    assert (code, out) == (2, "")
    assert f"client address {address!r} is not an IP address" in err


@pytest.mark.parametrize("address", ["198.51.100.7", "2001:db8::7", "::ffff:198.51.100.7"])
def test_a_client_address_is_taken_in_either_family(capsys, address: str) -> None:
    code, out, err = _explain(capsys, "--client-ip", address, "--region", "us")
    assert code == 0, err
    assert "= runs-query-api-key: MATCHES" in out


async def test_the_console_refuses_them_with_a_4xx_detail(tmp_path, metrics) -> None:
    body = {"method": "GET", "path": "/q/1", "headers": "x-api-key: sk-live-1",
            "region": "eu", "client_ip": "198.51.100.1"}  # fmt: skip
    async with await _console(tmp_path, metrics) as url, aiohttp.ClientSession() as http:

        async def explain(**change: str) -> tuple[int, dict[str, str]]:
            async with http.post(url + "/console/api/explain", json={**body, **change}) as r:
                return r.status, await r.json()

        status, answer = await explain()
        assert status == 200 and "q-key: MATCHES" in answer["text"]
        status, answer = await explain(region="EU")
        assert status == 422 and "did you mean 'eu'?" in answer["detail"]
        assert "known regions: eu, us, us2" in answer["detail"]
        for address in ("999.1.1.1", "notanip"):
            status, answer = await explain(client_ip=address)
            assert status == 422, answer
            assert answer == {"detail": f"client address {address!r} is not an IP address "
                              "(give the TCP peer's address as the gateway sees it, e.g. "
                              "203.0.113.7 or 2001:db8::7)"}  # fmt: skip
        status, answer = await explain(client_ip=" 2001:db8::1 ")  # a form's blanks
        assert status == 200, answer
