"""``gateway store reindex``: the command line of the Store's re-embedding. It reads the
same settings as ``gateway serve`` (``--config``, ``GATEWAY_*``) and hands the Store's
configuration to ``gateway.upstreams.store.reindex_command.run_reindex`` (the Store offers
the function; the command line, which knows the settings, calls it)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
from pathlib import Path
from typing import Any


def register(commands: Any) -> None:
    """Add ``store reindex`` to the CLI's subcommands."""
    store = commands.add_parser("store", help="operate the built-in Store")
    store_commands = store.add_subparsers(dest="store_command", metavar="SUBCOMMAND")
    store_commands.required = True
    reindex = store_commands.add_parser(
        "reindex",
        help="re-embed the Store's items for the configured store.index",
        description=(
            "Re-embed the items whose vectors are missing or were made with another model, "
            "dims or fields (--all: every item), using store.index from the config file."
        ),
    )
    reindex.add_argument("--config", metavar="FILE", help="YAML config file (also GATEWAY_CONFIG)")
    reindex.add_argument("--data-dir", metavar="DIR", help="the Store's data directory")
    reindex.add_argument(
        "--database-url",
        metavar="URL",
        help="the Store's PostgreSQL database (also GATEWAY_DATABASE_URL)",
    )
    reindex.add_argument("--all", action="store_true", help="re-embed every item")
    reindex.set_defaults(func=_reindex)


def _reindex(args: argparse.Namespace) -> int:
    from gateway.settings import SettingsError, load_settings
    from gateway.upstreams.store.config import StoreConfig

    try:
        settings = load_settings(
            {"data_dir": args.data_dir, "database_url": args.database_url},
            config_file=args.config,
        )
        config = StoreConfig.from_mapping(settings.store, Path(settings.data_dir))
        if settings.database_url is not None:
            # Same settings as `gateway serve`: the Store lives in PostgreSQL.
            config = dataclasses.replace(config, database_url=settings.database_url)
    except (SettingsError, ValueError) as exc:
        print(f"gateway store reindex: configuration error: {exc}", file=sys.stderr)
        return 2
    if config.index is None:
        print(
            "gateway store reindex: no store.index in the configuration; nothing to embed",
            file=sys.stderr,
        )
        return 2
    if config.database_url is None and not config.database_path.exists():
        print(f"gateway store reindex: no Store at {config.database_path}", file=sys.stderr)
        return 2
    from gateway.upstreams.store.reindex_command import run_reindex

    return asyncio.run(run_reindex(config, everything=args.all, out=sys.stderr))
