"""A refusal that any repeat is sure to get is answered from memory (no counter call):
with ceilings too, kept under the policy that refused. The repeat's answer must be the one
its own decision would give: same status, same RateLimit-Policy, the refusing policy's
state counting down. Real gateway, real upstream on loopback."""

from __future__ import annotations

import asyncio
import uuid

from tests.support.gateway import running_gateway

RULES = """\
rules:
  - id: per-key
    identity: api_key
    limits: {us: 2/60}
  - id: per-ip
    identity: ip
    limits: {us: 1000/60}
ceilings:
  - id: per-address
    identity: ip
    limits: {us: 6/60}
  - id: uploads
    match: {prefix: /upload}
    identity: ip
    limits: {us: 1000/60}
"""


async def _get(port: int, path: str, key: str | None, source: str = "127.0.0.1"):
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
    head = f"GET {path} HTTP/1.1\r\nHost: a\r\n"
    if key is not None:
        head += f"x-api-key: {key}\r\n"
    writer.write((head + "Connection: close\r\n\r\n").encode())
    reply = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    lines = reply.partition(b"\r\n\r\n")[0].decode("latin-1").split("\r\n")
    fields = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        fields[name.strip().lower()] = value.strip()
    return int(lines[0].split()[1]), fields


class Decisions:
    """The in-process counters' calls (the backend's own count: its classes are compiled,
    so nothing can be wrapped around them)."""

    def __init__(self, limiter) -> None:
        self.backend = limiter.backend("us")
        self.start = self.backend.calls

    @property
    def calls(self) -> int:
        return self.backend.calls - self.start


async def test_a_key_over_its_rule_is_refused_from_memory_with_its_own_answer(tmp_path, upstream):
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    async with running_gateway(upstream, rules=[str(rules)]) as gw:
        port = int(gw.url.rsplit(":", 1)[1])
        counted = Decisions(gw.proxy.gateway.limiter)
        answers = [await _get(port, "/x", "k1") for _ in range(5)]
        assert [status for status, _ in answers] == [200, 200, 429, 429, 429]
        assert counted.calls == 3  # the first refusal asked the counters, its repeats not
        policies = {fields["ratelimit-policy"] for _, fields in answers}
        assert policies == {'"per-key";q=2;w=60, "per-address";q=6;w=60'}
        for _, fields in answers[2:]:  # a refusal states the policy that refused
            assert fields["ratelimit"].startswith('"per-key";r=0;t=')
            assert int(fields["retry-after"]) >= 1
        # the refused requests used up none of the ceiling: 3 more keys are served
        for key in ("k2", "k3", "k4"):
            assert (await _get(port, "/x", key))[0] == 200


async def test_key_spraying_past_the_ceiling_is_refused_from_memory(tmp_path, upstream):
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    async with running_gateway(upstream, rules=[str(rules)]) as gw:
        port = int(gw.url.rsplit(":", 1)[1])
        counted = Decisions(gw.proxy.gateway.limiter)
        statuses = []
        answers = []
        for _ in range(20):
            status, fields = await _get(port, "/x", uuid.uuid4().hex, source="127.0.0.2")
            statuses.append(status)
            answers.append(fields)
        assert statuses == [200] * 6 + [429] * 14
        assert counted.calls == 7  # a fresh key each time: the ceiling's refusal is kept
        for fields in answers[6:]:
            assert fields["ratelimit-policy"] == '"per-key";q=2;w=60, "per-address";q=6;w=60'
            assert fields["ratelimit"].startswith('"per-address";r=0;t=')
        # another address is served; the same address on a path with another ceiling set
        # gets its own decision (its answer lists its own policies)
        assert (await _get(port, "/x", uuid.uuid4().hex, source="127.0.0.3"))[0] == 200
        status, fields = await _get(port, "/upload", uuid.uuid4().hex, source="127.0.0.2")
        assert status == 429
        assert fields["ratelimit-policy"] == (
            '"per-key";q=2;w=60, "per-address";q=6;w=60, "uploads";q=1000;w=60'
        )
        assert counted.calls == 9
