"""Every URL the gateway shows (start-up log, /info, database messages and errors) goes
through one function, ``gateway.urls.display_url``: never its user, password, query or
fragment, whatever the scheme, and a list of hosts (libpq's failover form, Redis
Cluster's and Sentinel's) is shown, not refused with an exception. Found by a review:
the PostgreSQL messages showed a password given as ``?password=`` (libpq's own form) and
failed with a ``ValueError`` on a multi-host URL; the counter store's and the upstreams'
were shown by two more helpers with rules of their own."""

from __future__ import annotations

import asyncio
import logging
import string
from pathlib import Path

import psycopg
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.app import log_startup, prepare_rules
from gateway.identity.config import IdentityConfigError, parse_identity_config
from gateway.identity.jwks_fetch import JwksFetcher, JwksFetchError
from gateway.metrics import Metrics
from gateway.proxy.routing import Router
from gateway.proxy.upstream_pool import Upstream
from gateway.settings import SettingsError, load_settings, upstream_url_problem
from gateway.upstreams.postgres.breaker import DatabaseBreaker
from gateway.upstreams.postgres.connection import unavailable
from gateway.upstreams.postgres.url import check_url
from gateway.upstreams.store.backend import describe
from gateway.upstreams.store.config import StoreConfig
from gateway.upstreams.store.index_config import IndexConfig
from gateway.urls import SHOWN_QUERY_KEYS, display_url
from tests.support.fuzz import fuzz

SECRET = "Zq7secretZq7"
# Characters a password may hold unencoded by mistake, each of which moves where a URL
# parser says the credentials end.
ODD = st.text(alphabet="/?#[],:@%\\ ", max_size=3)
SCHEMES = ["http", "https", "postgresql", "postgres", "redis", "rediss", "redis+cluster",
           "rediss+cluster", "redis+sentinel", "unix"]  # fmt: skip
HOST = st.sampled_from(["db.internal", "10.0.0.7", "[::1]", "[fd00::2]", "h-1"])
PORT = st.one_of(st.just(""), st.integers(1, 65535).map(lambda p: f":{p}"))
WORD = st.text(alphabet=string.ascii_letters + string.digits + "-._~", min_size=1, max_size=8)


@st.composite
def urls(draw: st.DrawFn) -> str:
    """A URL with the secret in one place a URL may carry one."""
    scheme = draw(st.sampled_from(SCHEMES))
    hosts = ",".join(draw(HOST) + draw(PORT) for _ in range(draw(st.integers(0, 3))))
    where = draw(st.sampled_from(["password", "user", "query", "query-only", "fragment"]))
    user = draw(WORD)
    odd = draw(ODD)
    secret = draw(st.sampled_from([SECRET, odd + SECRET, SECRET + odd]))
    userinfo = {"password": f"{user}:{secret}@", "user": f"{secret}@", "query": f"{user}@"}
    path = draw(st.sampled_from(["", "/", "/0", "/db", "/mymaster/0", "/run/redis.sock"]))
    key = draw(st.sampled_from(["password", "sslpassword", "token", "x"]))
    plain = draw(st.sampled_from(["", "?db=1"]))
    query = f"?{key}={SECRET}" if where.startswith("query") else plain
    fragment = f"#{SECRET}" if where == "fragment" else ""
    return f"{scheme}://{userinfo.get(where, '')}{hosts}{path}{query}{fragment}"


def _messages(url: str) -> list[str]:
    """What each place that names a configured URL says of ``url``."""
    said = [display_url(url), upstream_url_problem(url) or ""]
    for check in (
        lambda: check_url(url),
        lambda: parse_identity_config({"user": {"jwt": {"jwks_url": url, "issuer": "i",
                                                        "audience": "a"}}}, Path("/")),
        lambda: load_settings({"routes": {"/api": url}}, env={}),
        lambda: load_settings({"routes": {"api": url}}, env={}),
    ):  # fmt: skip
        try:
            check()
        except (ValueError, IdentityConfigError, SettingsError) as exc:
            said.append(str(exc))
    return said


@fuzz(300)
@given(url=urls())
def test_no_shown_url_holds_a_secret_and_none_raises(url: str) -> None:
    shown = display_url(url)
    for text in _messages(url):
        assert SECRET not in text, (url, text)
        assert text.isprintable()
    # of the query, only the values of the keys that say where a database is
    query = shown.partition("?")[2].partition("#")[0]
    for piece in query.split("&") if query else []:
        key, _, value = piece.partition("=")
        assert piece == "***" or value == "***" or key in SHOWN_QUERY_KEYS, shown


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql://gw:pw@db.internal:5432/gateway", "postgresql://***@db.internal:5432/gateway"),
        ("postgresql://gw@db/g", "postgresql://***@db/g"),
        ("postgresql://db/g?sslmode=require", "postgresql://db/g?sslmode=require"),
        ("postgresql:///db?host=/tmp&password=pw", "postgresql:///db?host=/tmp&password=***"),
        ("https://h/p?token=t&flag", "https://h/p?token=***&***"),
        ("redis://h\u2028x:6379/0", "redis://h?x:6379/0"),  # one log line stays one
        ("postgresql://gw:pw@h1:5432,h2:5433/db", "postgresql://***@h1:5432,h2:5433/db"),
        ("redis+cluster://:pw@h1:7000,[::1]:7001", "redis+cluster://***@h1:7000,[::1]:7001"),
        ("redis+sentinel://h1:26379,h2:26379/mymaster/0", "redis+sentinel://h1:26379,h2:26379/mymaster/0"),
        ("unix://:pw@/run/redis.sock?db=2", "unix://***@/run/redis.sock?db=2"),
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
        # a port that is not a number may be a password typed without its '@'
        ("https://user:pw/x", "(a URL that does not parse)"),
        ("redis+cluster://h1:7000,user:pw", "(a URL that does not parse)"),
        ("http://[::1/x", "(a URL that does not parse)"),
    ],
)  # fmt: skip
def test_shown_forms(url: str, shown: str) -> None:
    assert display_url(url) == shown


def test_the_start_up_log_shows_counter_and_upstream_urls_without_secrets(caplog) -> None:
    settings = load_settings({"redis_url": f"redis+cluster://:{SECRET}@h1:7000,h2:7001"}, env={})
    router = Router(
        [("/api", Upstream("route:/api", f"https://u:{SECRET}@api.internal/base?t={SECRET}"))],
        Upstream("default", "http://127.0.0.1:9000"),
    )
    with caplog.at_level(logging.INFO, logger="gateway"):
        log_startup(settings, prepare_rules(settings, Metrics()), router)
    text = caplog.text
    # the counter store as its own parser reads it: hosts, never the password
    assert "counters in redis+cluster://h1:7000,h2:7001" in text
    assert "route /api -> route:/api at https://***@api.internal/base?t=***" in text
    assert SECRET not in text
    assert SECRET not in repr(router.info())


def test_database_messages_never_show_a_password_and_take_multi_host_urls(caplog, tmp_path) -> None:
    url = f"postgresql://gw@h1:5432,h2:5433/gateway?password={SECRET}&sslpassword={SECRET}"
    assert check_url(url) == url  # libpq's failover form is a PostgreSQL URL
    breaker = DatabaseBreaker("store", url)
    cause = psycopg.OperationalError("connection failed: Connection refused")
    outage = unavailable("store", cause)
    outage.__cause__ = cause
    with caplog.at_level(logging.WARNING):
        breaker.failed(outage)
    shown = "postgresql://***@h1:5432,h2:5433/gateway?password=***&sslpassword=***"
    assert f"store database {shown} unavailable" in caplog.text
    assert SECRET not in caplog.text
    assert describe(StoreConfig(data_dir=tmp_path, database_url=url)) == f"PostgreSQL {shown}"
    for bad in (f"mysql://gw:{SECRET}@h1:1,h2:2/db", f"postgresql:///db?password={SECRET}"):
        with pytest.raises(SettingsError) as refused:
            load_settings({"database_url": bad}, env={})
        assert SECRET not in str(refused.value)


async def test_a_jwks_fetch_error_names_no_query_of_the_url():
    """aiohttp's own error text names the URL in its own spelling (no user, the query
    kept): every URL in it is replaced by the shown one, in the log and in /info."""

    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"NOT HTTP AT ALL\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(garbage, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    fetcher = JwksFetcher(f"http://u:{SECRET}@127.0.0.1:{port}/jwks?t={SECRET}#{SECRET}")
    try:
        with pytest.raises(JwksFetchError) as failed:
            await fetcher.fetch()
    finally:
        await fetcher.close()
        server.close()
        await server.wait_closed()
    text = str(failed.value)
    assert SECRET not in text, text
    assert f"http://***@127.0.0.1:{port}/jwks?t=***#***" in text


def test_a_store_index_url_in_info_holds_no_secret():
    config = IndexConfig.from_mapping(
        {"embed": "openai:test-embed", "dims": 8, "url": f"https://emb.internal/v1?key={SECRET}"},
        {},
    )
    assert config.describe()["url"] == "https://emb.internal/v1?key=***"
