"""The command line: ``gateway serve``, ``gateway rules check|explain|simulate``,
``gateway deployments``."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from gateway import __version__

if TYPE_CHECKING:
    from gateway.explain import ReadRequest
    from gateway.identity.verified import VerifiedIdentities
    from gateway.policy.model import RuleTable
    from gateway.ratelimit.identity import IdentityHasher
    from gateway.settings import Settings

DESCRIPTION = """\
A rate-limiting gateway. It counts requests per identity (API key, user + client
address, or client address) in sliding windows, answers 429 with Retry-After and
RateLimit headers when a limit is reached, and streams everything else to the upstream.
"""

SERVE_EPILOG = """\
Every option can also be set with an environment variable GATEWAY_<NAME> (for example
GATEWAY_REDIS_URL, GATEWAY_TRUSTED_PROXIES=10.0.0.0/8,192.168.0.0/16) or in the YAML
config file under the same name with underscores (redis_url: ...). Precedence:
flag > environment > config file > default. Settings with no flag here (bounds and
timeouts such as max_body_bytes, upstream_timeout, memory_max_keys) are set the same
way. The config file alone takes 'regions', 'routes', 'store', 'control_plane',
'identity' and 'tls' sections. Every setting: README.md, "Configuration", and
docs/deployment.md; HTTPS: docs/tls.md.

Examples:
  gateway serve                                    # built-in upstreams, memory counters
  gateway serve --upstream http://127.0.0.1:2024    # sidecar in front of your API
  gateway serve --upstream http://api:2024 --redis-url redis://redis:6379/0 --workers 4
  gateway serve --upstream http://127.0.0.1:2024 --port 8443 \\
      --tls-cert /etc/gateway/tls/tls.crt --tls-key /etc/gateway/tls/tls.key
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gateway", description=DESCRIPTION, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True

    serve = commands.add_parser(
        "serve",
        help="run the gateway",
        description="Run the gateway until SIGTERM/SIGINT (SIGHUP reloads the rules and the\n"
        "TLS certificates).",
        epilog=SERVE_EPILOG,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    add = serve.add_argument
    add("--config", metavar="FILE", help="YAML config file (also GATEWAY_CONFIG)")
    add(
        "--rules",
        action="append",
        metavar="PATH",
        help="rule file or directory of *.yaml, repeatable (default: ./rules)",
    )
    add("--region", help="default region: us, eu or us2 (default: us)")
    add(
        "--redis-url",
        metavar="URL",
        help="counters for the default region: redis://, rediss://, unix://,\n"
        "redis+cluster://h:p[,h:p]; default: in-process memory",
    )
    add(
        "--upstream",
        metavar="URL",
        help="default upstream for paths no built-in upstream serves, e.g. http://127.0.0.1:2024",
    )
    embedded = serve.add_mutually_exclusive_group()
    embedded.add_argument(
        "--embedded",
        dest="embedded",
        action="store_const",
        const=True,
        help="also run the built-in Store and control plane\n"
        "(the default when no --upstream is given)",
    )
    embedded.add_argument(
        "--no-embedded",
        dest="embedded",
        action="store_const",
        const=False,
        help="do not run the built-in upstreams",
    )
    add(
        "--data-dir",
        metavar="DIR",
        help="where the built-in upstreams and secrets live (default: ./data)",
    )
    add(
        "--database-url",
        metavar="URL",
        help="postgresql://user@host:port/db: the built-in Store and control plane in "
        "PostgreSQL, shared by every gateway using it (default: SQLite files in --data-dir)",
    )
    add("--host", help="address to listen on (default: 127.0.0.1; 0.0.0.0 for all)")
    add("--port", type=int, help="port to listen on (default: 8080)")
    add("--admin-host", help="address of the metrics endpoint (default: 127.0.0.1)")
    add(
        "--admin-port",
        type=int,
        help="port of /metrics, /info and /console (default: 9090; with --workers the "
        "supervisor serves it once, for every worker)",
    )
    add(
        "--tls-cert",
        metavar="FILE",
        help="serve HTTPS on --port with this PEM certificate chain (leaf first), TLS 1.2+;\n"
        "plain HTTP there is answered 400. Reloaded when the file changes and on SIGHUP\n"
        "(also GATEWAY_TLS_CERT, or tls.cert in the config file, whose tls: section also\n"
        "takes client certificates and the admin port's own pair: docs/tls.md)",
    )
    add(
        "--tls-key",
        metavar="FILE",
        help="the certificate's PEM private key (also GATEWAY_TLS_KEY, or tls.key); an\n"
        "encrypted key's passphrase is read from GATEWAY_TLS_KEY_PASSPHRASE, never a flag",
    )
    add(
        "--workers",
        type=int,
        help="processes sharing the port via SO_REUSEPORT (needs Redis counters when > 1)",
    )
    add(
        "--trusted-proxy",
        dest="trusted_proxies",
        action="append",
        metavar="CIDR",
        help="peer networks whose X-Forwarded-For is believed, repeatable",
    )
    add("--access-log", choices=["plain", "json", "off"], help="access log format (default: plain)")
    add(
        "--access-log-file",
        metavar="PATH",
        help="where access lines go, nothing else (default: - for stdout); reopened after "
        "a rotation and on SIGUSR1",
    )
    add("--log-level", help="DEBUG, INFO, WARNING or ERROR (default: INFO)")
    add(
        "--log-format",
        choices=["text", "json"],
        help="the gateway's own logs on stderr: text (default) or JSON lines",
    )
    add(
        "--shutdown-timeout",
        type=float,
        metavar="SECONDS",
        help="how long SIGTERM waits for requests in flight (default: 30)",
    )
    add(
        "--redis-timeout-ms",
        type=float,
        metavar="MS",
        help="timeout of one counter-store call before failing open/closed (default: 50)",
    )
    serve.set_defaults(func=_serve)

    health = commands.add_parser(
        "health",
        help="probe this host's gateway (a container healthcheck): exit 0 when it answers",
        description="Ask this host's gateway for /ok (or /ready with --ready) and exit 0 if it\n"
        "answers 200, else 1 with what it saw. Reads the settings `gateway serve` reads\n"
        "(GATEWAY_* and the config file), so it follows the port wherever it is set and\n"
        "speaks HTTPS when the proxy port does (the certificate is not checked: this is\n"
        "its own loopback). With client certificates required it asks the admin port.",
        epilog="examples:\n  gateway health\n"
        "  gateway health --ready --config /etc/gateway/gateway.yaml",
        formatter_class=argparse.RawTextHelpFormatter,
    )
    health.add_argument("--config", metavar="FILE", help="YAML config file (also GATEWAY_CONFIG)")
    health.add_argument(
        "--ready",
        action="store_true",
        help="ask /ready (can it do its job: counter stores, databases, not draining) instead "
        "of /ok (the process answers)",
    )
    health.add_argument(
        "--timeout", type=float, default=2.0, metavar="SECONDS", help="(default: 2)"
    )
    health.set_defaults(func=_health)

    rules = commands.add_parser(
        "rules", help="check rule files, explain a request, replay traffic through a table"
    )
    rules_commands = rules.add_subparsers(dest="rules_command", metavar="SUBCOMMAND")
    rules_commands.required = True
    check = rules_commands.add_parser(
        "check", help="validate rule files", description="Validate rule files; exit 1 on errors."
    )
    check.add_argument("paths", nargs="+", metavar="PATH", help="rule file or directory")
    check.add_argument(
        "--region",
        action="append",
        dest="regions",
        metavar="NAME",
        help="a region this gateway serves (repeatable); one no rule or ceiling limits is an error",
    )
    check.set_defaults(func=_rules_check)

    explain = rules_commands.add_parser(
        "explain",
        help="which rule a request hits, and why",
        description="Show which rule a described request matches, its hashed identity, its "
        "limit in each region, and why each earlier rule did not match.",
        epilog="Example:\n  gateway rules explain POST /runs/query -H 'x-api-key: sk-123'",
        formatter_class=argparse.RawTextHelpFormatter,
    )
    explain.add_argument("method", help="HTTP method, e.g. GET")
    explain.add_argument("target", help="request path, e.g. /runs/query")
    explain.add_argument(
        "-H",
        "--header",
        action="append",
        default=[],
        metavar="'NAME: VALUE'",
        help="request header, repeatable",
    )
    explain.add_argument(
        "--client-ip",
        default="203.0.113.7",
        help="the TCP peer's address: the client, unless it is a trusted proxy\n"
        "(trusted_proxies), whose X-Forwarded-For then names the client",
    )
    explain.add_argument("--rules", action="append", metavar="PATH", help="rule files")
    explain.add_argument("--region", help="only this region")
    explain.add_argument(
        "--config",
        metavar="FILE",
        help="the gateway's config file (default: GATEWAY_CONFIG), read with the\n"
        "environment as 'gateway serve' reads them: verified identities (which consumer,\n"
        "tier and user the key and token below are counted as), trusted proxies, method\n"
        "overrides, header limits",
    )
    explain.add_argument("--api-key", metavar="KEY", help="the request's API key")
    explain.add_argument("--token", metavar="JWT", help="the request's bearer token")
    explain.set_defaults(func=_rules_explain)

    simulate = rules_commands.add_parser(
        "simulate",
        help="replay recorded traffic through a rule table",
        description="Replay the requests recorded in access logs (JSON, or plain lines that\n"
        "carry the identity components), each at its recorded time, through a rule table\n"
        "with in-process counters on a virtual clock (no sleeping, no Redis). Prints per\n"
        "rule: requests matched, limited, identities limited, the most limited identities\n"
        "(hashed, as logged) and when each was first limited; with --baseline, what changes.",
        epilog="Example:\n  gateway rules simulate --rules rules-new/ --baseline rules/ "
        "access.log.1 access.log",
        formatter_class=argparse.RawTextHelpFormatter,
    )
    simulate.add_argument("logs", nargs="+", metavar="ACCESS_LOG", help="access log file(s)")
    simulate.add_argument(
        "--rules",
        action="append",
        required=True,
        metavar="PATH",
        help="the table to try (file or directory, repeatable)",
    )
    simulate.add_argument(
        "--baseline",
        action="append",
        metavar="PATH",
        help="the table to compare with, e.g. the running one (repeatable)",
    )
    simulate.add_argument(
        "--region",
        action="append",
        dest="regions",
        metavar="NAME",
        help="extra region names configured for this gateway",
    )
    simulate.add_argument("--json", action="store_true", help="write the report as JSON")
    simulate.add_argument(
        "--top", type=int, default=10, metavar="N", help="identities listed per rule (10)"
    )
    simulate.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: when stderr is a terminal)",
    )
    simulate.add_argument(
        "--save",
        action="store_true",
        help="also keep the report as the last replay in the data dir (the admin console shows it)",
    )
    simulate.add_argument("--data-dir", metavar="DIR", help="(default: GATEWAY_DATA_DIR or ./data)")
    simulate.set_defaults(func=_rules_simulate)

    try:
        from gateway.client.cli import register
    except ImportError:  # pragma: no cover - the client is part of the package
        pass
    else:
        register(commands)
    from gateway.data_cli import register as register_data

    register_data(commands)
    # Hook (issue 12): `gateway store reindex`.
    from gateway.store_cli import register as register_store

    register_store(commands)
    # Issue 25: `gateway keys add|revoke`.
    from gateway.identity.cli import register as register_keys

    register_keys(commands)
    return parser


def _serve(args: argparse.Namespace) -> int:
    from gateway.launch import run
    from gateway.settings import SettingsError, load_settings

    flags: dict[str, Any] = {k: v for k, v in vars(args).items() if k not in ("func", "command")}
    config = flags.pop("config")
    try:
        settings = load_settings(flags, config_file=config)
        return run(settings)
    except SettingsError as exc:
        print(f"gateway: configuration error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        from gateway.policy.loader import RuleLoadError

        if isinstance(exc, RuleLoadError):
            print(f"gateway: the rules do not load:\n{exc}", file=sys.stderr)
            return 2
        from gateway.identity.jwks import JwksError
        from gateway.identity.keys import KeyFileError

        if isinstance(exc, KeyFileError | JwksError):
            print(f"gateway: the identity files do not load: {exc}", file=sys.stderr)
            return 2
        if isinstance(exc, OSError):
            print(f"gateway: cannot start: {exc}", file=sys.stderr)
            return 1
        raise


def _health(args: argparse.Namespace) -> int:
    from gateway.health import probe, target
    from gateway.settings import SettingsError, load_settings

    try:
        where = target(load_settings({}, config_file=args.config))
    except SettingsError as exc:
        print(f"gateway health: configuration error: {exc}", file=sys.stderr)
        return 2
    healthy, seen = probe(where, "/ready" if args.ready else "/ok", args.timeout)
    print(seen, file=sys.stdout if healthy else sys.stderr)
    return 0 if healthy else 1


def _rules_check(args: argparse.Namespace) -> int:
    from gateway.policy.loader import (
        DEFAULT_REGIONS,
        RuleLoadError,
        load_rules,
        unlimited_region_message,
    )

    named = list(dict.fromkeys(args.regions or ()))  # regions this gateway serves, as told
    try:
        table = load_rules(args.paths, DEFAULT_REGIONS | set(named))
    except RuleLoadError as exc:
        print(f"{len(exc.problems)} problem(s):", file=sys.stderr)
        for problem in exc.problems:
            print(f"  {problem}", file=sys.stderr)
        return 1
    # A region with no limits exempts every request served there. Named with --region
    # (the operator says the gateway serves it) that is the config gap a CI check must
    # stop: exit 1. The built-in us, eu and us2 are checked whether served or not, so
    # for them it is a warning (a table for us alone is fine where only us is served).
    unlimited = table.unlimited_regions(sorted(DEFAULT_REGIONS | set(named)))
    failed = [region for region in unlimited if region in named]
    if failed:
        print(f"{len(failed)} problem(s):", file=sys.stderr)
        for region in failed:
            print(f"  {unlimited_region_message(region, table)}", file=sys.stderr)
        return 1
    for region in unlimited:
        message = unlimited_region_message(region, table)
        print(f"warning: {message} (name it with --region to make this an error)",
              file=sys.stderr)  # fmt: skip
    print(f"ok: {table.size_text} from {', '.join(table.sources)} "
          f"(table {table.digest[:12]})")  # fmt: skip
    return 0


def _rules_explain(args: argparse.Namespace) -> int:
    from pathlib import Path

    from gateway.explain import explain
    from gateway.policy.loader import RuleLoadError
    from gateway.secrets import existing_identity_secret
    from gateway.settings import load_settings

    try:
        # As ``gateway serve`` reads them: the environment and the config file.
        settings = load_settings({}, config_file=args.config)
        verified = _explain_identities(settings)
        headers = list(args.header)
        if args.api_key:
            key_header = "x-api-key" if verified is None else verified.config.api_key.header
            headers.append(f"{key_header}: {args.api_key}")
        if args.token:
            if verified is None or verified.token_header is None:
                raise ValueError("--token needs --config (the identity.user.jwt it verifies with)")
            headers.append(f"{verified.token_header.decode()}: Bearer {args.token}")

        def reader(table: RuleTable, hasher: IdentityHasher) -> ReadRequest:
            from gateway.app import request_reader

            return request_reader(settings, table, hasher, verified)

        text = explain(
            rules=args.rules or list(settings.rules),
            method=args.method,
            target=args.target,
            headers=headers,
            client_ip=args.client_ip,
            region=args.region,
            reader=reader,
            regions=[r.name for r in settings.region_table()],
            secret=existing_identity_secret(settings.identity_secret, Path(settings.data_dir)),
        )
    except RuleLoadError as exc:
        print(f"the rules do not load:\n{exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"gateway rules explain: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"gateway rules explain: {exc}", file=sys.stderr)
        return 2
    print(text)
    return 0


def _explain_identities(settings: Settings) -> VerifiedIdentities | None:
    """The config file's verified identities, loaded as ``gateway serve`` loads them
    (None without an identity: section). ``ValueError`` says what is wrong."""
    import asyncio
    from pathlib import Path

    if not settings.identity:
        return None
    from gateway.identity.config import parse_identity_config
    from gateway.identity.jwt import JwtVerifier
    from gateway.identity.keys import KeySource
    from gateway.identity.verified import VerifiedIdentities

    base = Path(settings.config_file).parent if settings.config_file else Path.cwd()
    identity = parse_identity_config(settings.identity, base)
    keys = None if identity.api_key.keys is None else KeySource(identity.api_key.keys)
    tokens = None
    if identity.user.jwt is not None:
        tokens = JwtVerifier(identity.user.jwt)
        if identity.user.jwt.jwks_url is not None:

            async def fetch(verifier: JwtVerifier) -> None:
                try:
                    await verifier.start()
                finally:
                    await verifier.close()  # its HTTP session: nothing is fetched again

            asyncio.run(fetch(tokens))
    return VerifiedIdentities(identity, keys, tokens)


def _rules_simulate(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from gateway.policy.loader import DEFAULT_REGIONS, RuleLoadError, load_rules
    from gateway.replay.progress import Progress
    from gateway.replay.records import read_logs
    from gateway.replay.report import build_report, render_text
    from gateway.replay.saved import save_report
    from gateway.replay.simulate import replay

    regions = DEFAULT_REGIONS | set(args.regions or ())
    try:
        new = load_rules(args.rules, regions)
        old = load_rules(args.baseline, regions) if args.baseline else None
    except RuleLoadError as exc:
        print(f"the rules do not load:\n{exc}", file=sys.stderr)
        return 1
    if args.top < 0:
        print("gateway rules simulate: --top must be >= 0", file=sys.stderr)
        return 2
    show = sys.stderr.isatty() if args.progress is None else args.progress
    try:
        total = sum(Path(p).stat().st_size for p in args.logs)
        bar = Progress("reading ", total) if show else None
        reading = read_logs(args.logs, bar.update if bar else None)
    except OSError as exc:
        print(f"gateway rules simulate: cannot read {exc.filename}: {exc.strerror}",
              file=sys.stderr)  # fmt: skip
        return 2
    if bar:
        bar.close()
    tables = [new] if old is None else [new, old]
    bar = Progress("replaying", len(reading.requests)) if show else None
    results = replay(reading.requests, tables, bar.update if bar else None)
    if bar:
        bar.close()
    report = build_report(reading, results[0], results[1] if old else None, args.top)
    if args.save:
        data_dir = Path(args.data_dir or os.environ.get("GATEWAY_DATA_DIR") or "data")
        where = save_report(report, data_dir)
        print(f"report saved to {where}", file=sys.stderr)
    print(json.dumps(report, indent=2) if args.json else render_text(report))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    result = args.func(args)
    return int(result or 0)
