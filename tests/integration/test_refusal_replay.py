"""A read of the same bytes as the last request refused from a known refusal is answered
without parsing them again (``ClientConnection._replay``). It must answer exactly what
parsing them would: the same status, fields and body, the same access-log line, the same
counting (none), and no replay at all once the refusal ended, the table was reloaded or
the bytes differ in any way.

Differential: the same seeded random sequences of requests, each written on its own,
go to two real gateways side by side on one keep-alive connection each, one with the
replay on and one with it off; every answer and every access-log line must agree. Real
gateways, real upstream, loopback."""

from __future__ import annotations

import asyncio
import logging
import random
import re
import uuid
from pathlib import Path

from tests.support.gateway import running_gateway

RULES = """\
rules:
  - id: per-key
    identity: api_key
    limits: {us: 2/3600}
  - id: per-ip
    identity: ip
    limits: {us: 1000/3600}
ceilings:
  - id: per-address
    identity: ip
    limits: {us: 40/3600}
"""


class Conn:
    """One keep-alive client connection; each request's bytes go in one write, and the
    answer is read whole before the next is sent."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, port: int, source: str = "127.0.0.1") -> Conn:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
        return cls(reader, writer)

    async def exchange(self, data: bytes, answers: int = 1, head_only: bool = False) -> list:
        self.writer.write(data)
        await self.writer.drain()
        return [await self._answer(head_only) for _ in range(answers)]

    async def _answer(self, head_only: bool) -> tuple[str, list[tuple[str, str]], bytes]:
        head = await asyncio.wait_for(self.reader.readuntil(b"\r\n\r\n"), 10)
        lines = head.decode("latin-1").split("\r\n")[:-2]
        split = (line.partition(":") for line in lines[1:])
        fields = [(name.strip().lower(), value.strip()) for name, _, value in split]
        length = int(dict(fields).get("content-length", "0"))
        body = b"" if head_only else await self.reader.readexactly(length)
        return lines[0], fields, body

    async def close(self) -> None:
        self.writer.close()


def _request(kind: str, key: str) -> tuple[bytes, int, bool]:
    """The bytes of one request of ``kind`` for API key ``key``, how many answers they
    bring, and whether they are HEAD requests."""
    base = f"Host: a\r\nx-api-key: {key}\r\n"
    if kind == "get":
        return f"GET /x HTTP/1.1\r\n{base}\r\n".encode(), 1, False
    if kind == "padded":  # the same identity as "get": trailing whitespace is not part of it
        return f"GET /x HTTP/1.1\r\nHost: a\r\nx-api-key: {key} \t\r\n\r\n".encode(), 1, False
    if kind == "head":
        return f"HEAD /x HTTP/1.1\r\n{base}\r\n".encode(), 1, True
    if kind == "query":
        return f"GET /x?a=1 HTTP/1.1\r\n{base}\r\n".encode(), 1, False
    if kind == "rid":
        return f"GET /x HTTP/1.1\r\n{base}X-Request-Id: client-id-1\r\n\r\n".encode(), 1, False
    if kind == "bad-rid":  # not accepted: the gateway makes one
        return f"GET /x HTTP/1.1\r\n{base}X-Request-Id: \r\n\r\n".encode(), 1, False
    if kind == "body":
        return f"POST /x HTTP/1.1\r\n{base}Content-Length: 3\r\n\r\nabc".encode(), 1, False
    if kind == "other-path":
        return f"GET /y HTTP/1.1\r\n{base}\r\n".encode(), 1, False
    if kind == "pipelined":
        one = f"GET /x HTTP/1.1\r\n{base}\r\n".encode()
        return one + one, 2, False
    raise AssertionError(kind)


KINDS = ("get", "get", "get", "padded", "head", "query", "rid", "bad-rid", "body",
         "other-path", "pipelined")  # fmt: skip
_RID = re.compile(r"rid=(\S+)")
_VOLATILE_LOG = re.compile(r" (dur_ms|upstream_ms|time|start_us)=\S+")


def _normal_answer(answer: tuple[str, list[tuple[str, str]], bytes]) -> tuple:
    status, fields, body = answer
    kept = []
    for name, value in fields:
        if name == "date":
            continue
        if name == "x-request-id" and value != "client-id-1":
            value = "generated" if re.fullmatch(r"[0-9a-f]{32}", value) else value
        if name in ("retry-after", "ratelimit"):  # whole seconds that may tick between
            value = re.sub(r"\d+", "N", value)
        kept.append((name, value))
    # (the upstream echoes what it got, the gateway's request id included; a 429 body's
    # wait is whole seconds that may tick between the two gateways, as retry-after)
    body = re.sub(rb"retry in \d+ seconds", b"retry in N seconds", body)
    return status, kept, re.sub(rb"[0-9a-f]{32}", b"generated", body)


def _normal_line(line: str) -> str:
    line = _VOLATILE_LOG.sub("", line)
    rid = _RID.search(line)
    if rid and rid.group(1) != "client-id-1":
        assert re.fullmatch(r"[0-9a-f]{32}", rid.group(1)), line
        line = _RID.sub("rid=generated", line)
    return line


def _access_lines(caplog, port_gateway) -> list[str]:
    port_gateway.gateway.access_log.flush()
    lines = []
    for record in caplog.records:
        if record.name == "gateway.access":
            lines.extend(record.getMessage().split("\n"))
    caplog.clear()
    return lines


async def test_replayed_refusals_answer_as_parsed_ones(tmp_path: Path, upstream):
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    async with (
        running_gateway(upstream, rules=[str(rules)]) as on,
        running_gateway(upstream, rules=[str(rules)]) as off,
    ):
        off.proxy.plane.replay_refusals = False
        ports = [int(gw.url.rsplit(":", 1)[1]) for gw in (on, off)]
        for seed in range(12):
            rng = random.Random(seed)
            key = uuid.uuid4().hex
            conns = [await Conn.open(port) for port in ports]
            for _ in range(rng.randint(4, 14)):
                data, count, head_only = _request(rng.choice(KINDS), key)
                got = [
                    [_normal_answer(a) for a in await c.exchange(data, count, head_only)]
                    for c in conns
                ]
                assert got[0] == got[1], (seed, data)
            for c in conns:
                await c.close()
        assert on.proxy.plane.replayed > 0  # the sequences did take the replay
        assert off.proxy.plane.replayed == 0


async def test_replayed_refusals_log_the_same_lines(tmp_path: Path, upstream, caplog):
    """Each gateway alone, the same sequence: the access-log lines agree line by line."""
    caplog.set_level(logging.INFO, logger="gateway.access")
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    logged: list[list[str]] = []
    replayed = []
    for replay in (True, False):
        async with running_gateway(upstream, rules=[str(rules)], access_log="plain") as gw:
            gw.proxy.plane.replay_refusals = replay
            caplog.clear()
            port = int(gw.url.rsplit(":", 1)[1])
            for seed in range(6):
                rng = random.Random(seed)
                conn = await Conn.open(port)
                for _ in range(12):
                    data, count, head_only = _request(rng.choice(KINDS), f"key-{seed}")
                    await conn.exchange(data, count, head_only)
                await conn.close()
            logged.append([_normal_line(x) for x in _access_lines(caplog, gw)])
            replayed.append(gw.proxy.plane.replayed)
    assert replayed[0] > 0 and replayed[1] == 0
    assert logged[0] == logged[1]
    assert sum(" 429 " in line for line in logged[0]) >= 10


async def test_a_flood_of_one_request_is_answered_without_counting(tmp_path: Path, upstream):
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    async with running_gateway(upstream, rules=[str(rules)]) as gw:
        port = int(gw.url.rsplit(":", 1)[1])
        backend = gw.gateway.limiter.backend("us")
        conn = await Conn.open(port)
        data, _, _ = _request("get", "flood")
        statuses = [(await conn.exchange(data))[0][0] for _ in range(3)]
        calls = backend.calls
        ids = set()
        for _ in range(50):
            status, fields, body = (await conn.exchange(data))[0]
            assert status == "HTTP/1.1 429 Too Many Requests"
            assert dict(fields)["ratelimit"].startswith('"per-key";r=0;t=')
            assert b"rate limit" in body.lower()
            ids.add(dict(fields)["x-request-id"])
        await conn.close()
        assert statuses[-1].startswith("HTTP/1.1 429")
        assert backend.calls == calls  # none of the 50 asked the counters
        assert gw.proxy.plane.replayed >= 49
        assert len(ids) == 50  # each answer its own request id
        metrics = gw.metrics.registry.get_sample_value
        limited = {"region": "us", "rule": "per-key", "identity": "api_key", "decision": "limited"}
        assert metrics("gateway_requests_total", limited) == 51


async def test_a_reload_or_an_ended_refusal_is_parsed_again(tmp_path: Path, upstream):
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    async with running_gateway(upstream, rules=[str(rules)]) as gw:
        port = int(gw.url.rsplit(":", 1)[1])
        conn = await Conn.open(port)
        data, _, _ = _request("get", "reloaded")
        statuses = [(await conn.exchange(data))[0][0].split()[1] for _ in range(5)]
        assert statuses == ["200", "200", "429", "429", "429"]
        replayed = gw.proxy.plane.replayed
        assert replayed >= 1
        # a higher limit: the very same bytes are now served
        rules.write_text(RULES.replace("2/3600", "50/3600"))
        assert gw.rules.reload("test")
        assert (await conn.exchange(data))[0][0].split()[1] == "200"
        assert gw.proxy.plane.replayed == replayed
        await conn.close()

        # a refusal that ends: one per 3 s (the three exchanges fit in it on a slow
        # machine too), then the same bytes are served again once it has passed (asked
        # until then: a replayed refusal uses no quota; one that never ended stays 429)
        rules.write_text(RULES.replace("2/3600", "1/3"))
        assert gw.rules.reload("test")
        conn = await Conn.open(port)
        data, _, _ = _request("get", "one-per-3s")
        first = [(await conn.exchange(data))[0][0].split()[1] for _ in range(3)]
        assert first == ["200", "429", "429"]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 15
        while (status := (await conn.exchange(data))[0][0].split()[1]) == "429":
            assert loop.time() < deadline, "the refusal did not end with its window"
            await asyncio.sleep(0.2)
        assert status == "200"
        await conn.close()


async def test_other_bytes_on_the_connection_are_parsed(tmp_path: Path, upstream):
    """After a replayable refusal, a request that differs in one byte (another key) is
    decided on its own, and a request split over two reads is parsed as ever."""
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    async with running_gateway(upstream, rules=[str(rules)]) as gw:
        port = int(gw.url.rsplit(":", 1)[1])
        conn = await Conn.open(port)
        refused, _, _ = _request("get", "key-a")
        for _ in range(4):
            await conn.exchange(refused)
        other, _, _ = _request("get", "key-b")
        assert (await conn.exchange(other))[0][0].split()[1] == "200"
        conn.writer.write(refused[:10])
        await conn.writer.drain()
        await asyncio.sleep(0.05)
        status = (await conn.exchange(refused[10:]))[0][0].split()[1]
        assert status == "429"
        await conn.close()


async def _statuses_after(port: int, steps: list[tuple[bytes, int]]) -> tuple[list[str], bool]:
    """The status lines of each step's answers, and whether the connection was closed
    at the end (read returns nothing within a second)."""
    conn = await Conn.open(port)
    statuses = []
    for data, answers in steps:
        try:
            got = await conn.exchange(data, answers)
        except (asyncio.IncompleteReadError, ConnectionError):
            statuses.append("closed")
            break
        statuses.extend(status for status, _, _ in got)
    try:
        closed = await asyncio.wait_for(conn.reader.read(1), 1) == b""
    except TimeoutError:
        closed = False
    await conn.close()
    return statuses, closed


async def test_what_a_pipeline_or_a_split_read_leaves_is_never_replayed(tmp_path: Path, upstream):
    """Review findings: a refused request started from the pipeline (its bytes came in an
    earlier read) must not make the next read a replay of it, nor may a read that began
    inside a request: both gateways, replay on and off, answer alike."""
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    key_a, _, _ = _request("get", "key-a")
    key_b, _, _ = _request("get", "key-b")
    ok = b"GET /ok HTTP/1.1\r\nHost: a\r\n\r\n"
    pipelined = [(key_a, 1)] * 3 + [(key_b + key_a, 2)] + [(ok, 1)] * 3
    split = [(key_a, 1)] * 3 + [(key_a[:10], 0), (key_a[10:] + ok, 2), (key_a[10:] + ok, 1)]
    async with (
        running_gateway(upstream, rules=[str(rules)]) as on,
        running_gateway(upstream, rules=[str(rules)]) as off,
    ):
        off.proxy.plane.replay_refusals = False
        for steps in (pipelined, split):
            got = [await _statuses_after(int(gw.url.rsplit(":", 1)[1]), steps) for gw in (on, off)]
            assert got[0] == got[1], steps
        statuses, _ = await _statuses_after(int(on.url.rsplit(":", 1)[1]), pipelined)
        assert [s.split()[1] for s in statuses[-3:]] == ["200", "200", "200"]


async def test_a_long_read_is_not_kept(tmp_path: Path, upstream):
    """A refused request padded to a long read (llhttp skips CR/LF between requests) is
    answered as ever, but its bytes are not kept: an idle connection holds little."""
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    async with running_gateway(upstream, rules=[str(rules)]) as gw:
        port = int(gw.url.rsplit(":", 1)[1])
        conn = await Conn.open(port)
        data, _, _ = _request("get", "padded-read")
        padded = b"\r\n" * 3000 + data
        statuses = [(await conn.exchange(padded))[0][0].split()[1] for _ in range(6)]
        assert statuses == ["200", "200", "429", "429", "429", "429"]
        assert gw.proxy.plane.replayed == 0
        await conn.close()


async def test_a_connection_idles_out_after_an_answer_given_from_the_head(tmp_path: Path, upstream):
    """Review finding (older than the replay): a request answered from its head (/ok, a
    refusal, parsed or replayed) left its connection without any deadline."""
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    async with running_gateway(
        upstream, rules=[str(rules)], client_idle_timeout=0.4, body_read_timeout=0.3
    ) as gw:
        port = int(gw.url.rsplit(":", 1)[1])
        refused, _, _ = _request("get", "idle-key")
        ok = b"GET /ok HTTP/1.1\r\nHost: a\r\n\r\n"
        for steps in ([(ok, 1)], [(refused, 1)] * 3, [(refused, 1)] * 5):
            conn = await Conn.open(port)
            for data, answers in steps:
                await conn.exchange(data, answers)
            closed = await asyncio.wait_for(conn.reader.read(1), 5)
            assert closed == b"", steps
            await conn.close()
        assert gw.proxy.plane.replayed > 0


async def test_a_stop_closes_a_connection_whose_answered_body_ends_meanwhile(upstream):
    """Review finding: a request answered from its head (/ok) whose body is still being
    read when the gateway begins to stop; once the body ends the connection is idle, and
    is closed then (not kept until the stop's grace period runs out)."""
    async with running_gateway(upstream) as gw:
        port = int(gw.url.rsplit(":", 1)[1])
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /ok HTTP/1.1\r\nHost: a\r\nContent-Length: 10\r\n\r\n12345")
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 200")
        loop = asyncio.get_running_loop()
        started = loop.time()
        stopping = asyncio.ensure_future(gw.proxy.stop(5))
        await asyncio.sleep(0.2)
        writer.write(b"67890")  # the rest of the body: the message is whole now
        await writer.drain()
        await stopping
        assert loop.time() - started < 2.5  # not the 5 s grace
        writer.close()
