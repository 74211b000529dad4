"""``gateway data copy``: move the built-in upstreams' data from SQLite to PostgreSQL."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from gateway.urls import display_url


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``data`` and its ``copy`` subcommand."""
    data = subparsers.add_parser("data", help="copy the built-in upstreams' data")
    commands = data.add_subparsers(dest="data_command", metavar="SUBCOMMAND")
    copy = commands.add_parser(
        "copy",
        help="copy the SQLite Store and control plane in --data-dir into PostgreSQL "
        "(safe to run twice)",
    )
    copy.add_argument(
        "--to",
        metavar="URL",
        help="postgresql://user@host:port/db (default: env GATEWAY_DATABASE_URL)",
    )
    copy.add_argument(
        "--data-dir",
        metavar="DIR",
        help="where the SQLite files are (default: env GATEWAY_DATA_DIR or ./data)",
    )
    copy.set_defaults(func=_copy)

    def usage(_args: argparse.Namespace) -> int:
        data.print_help()
        return 2

    data.set_defaults(func=usage)


def _copy(args: argparse.Namespace) -> int:
    from gateway.upstreams.postgres.connection import UNAVAILABLE_ERRORS
    from gateway.upstreams.postgres.migrations import SchemaTooNew
    from gateway.upstreams.postgres.url import check_url

    url = args.to or os.environ.get("GATEWAY_DATABASE_URL")
    if not url:
        print("gateway data copy: give --to postgresql://...", file=sys.stderr)
        return 2
    try:
        check_url(url)
    except ValueError as exc:
        print(f"gateway data copy: {exc}", file=sys.stderr)
        return 2
    data_dir = Path(args.data_dir or os.environ.get("GATEWAY_DATA_DIR") or "data")
    from gateway.upstreams.data_copy import copy_to_postgres

    print(f"copying {data_dir} into {display_url(url)}")
    try:
        report = copy_to_postgres(data_dir, url, lambda line: print(line, flush=True))
    except SchemaTooNew as exc:
        print(f"gateway data copy: {exc}", file=sys.stderr)
        return 1
    except UNAVAILABLE_ERRORS as exc:
        print(f"gateway data copy: cannot reach {display_url(url)}: {type(exc).__name__}",
              file=sys.stderr)  # fmt: skip
        return 1
    for line in report.lines():
        print(line)
    return 0
