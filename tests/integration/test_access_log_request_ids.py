"""The plain access log writes the gateway's own request ids without the check a client's
gets (they are 32 hex digits), and still checks and quotes every id a client sends: the
same lines as the check on every id would write, through the real data plane."""

from __future__ import annotations

import logging
import re

import aiohttp

from gateway.proxy.access_log import AccessRecord, plain_line
from gateway.proxy.request_id import new_request_id
from tests.support.gateway import running_gateway


def _lines(caplog, gw) -> list[str]:
    gw.gateway.access_log.flush()
    found = [
        line
        for record in caplog.records
        if record.name == "gateway.access"
        for line in record.getMessage().split("\n")
    ]
    caplog.clear()
    return found


async def test_own_ids_are_bare_and_a_clients_are_checked(upstream, caplog):
    caplog.set_level(logging.INFO, logger="gateway.access")
    sent = ['odd id "x"', "-", "plain-id-1", "{brace"]
    async with running_gateway(upstream, access_log="plain") as gw, aiohttp.ClientSession() as http:
        for rid in [None, *sent]:
            headers = {} if rid is None else {"X-Request-Id": rid}
            async with http.get(f"{gw.url}/echo/x", headers=headers) as r:
                assert r.status == 200
        lines = _lines(caplog, gw)
    assert len(lines) == 5
    own = re.search(r" rid=([0-9a-f]{32}) ", lines[0])
    assert own is not None, lines[0]
    assert ' rid="odd id \\"x\\"" ' in lines[1]  # quoted: JSON string literal
    assert ' rid="-" ' in lines[2]  # "-" would read back as "none"
    assert " rid=plain-id-1 " in lines[3]  # bare: written as it is
    assert ' rid="{brace" ' in lines[4]


def test_an_own_id_is_written_as_the_check_would_write_it():
    for _ in range(2000):
        rid = new_request_id()
        records = [
            AccessRecord("GET", "/x", 200, "us", "10.0.0.1", upstream="default",
                         request_id=rid, own_request_id=own)
            for own in (True, False)
        ]  # fmt: skip
        lines = {plain_line(r) for r in records}
        assert len(lines) == 1 and lines.pop().endswith(f" rid={rid}")
