"""``gateway store reindex``: re-embed the Store's items now, with a progress bar.

Reads the same settings as ``gateway serve`` (``--config``, ``GATEWAY_*``), opens the Store's
SQLite file or PostgreSQL database (``--database-url``) directly (a running gateway may keep
serving: both work on the same tables, and the running Store's in-memory mirror picks the
new vectors up from the change log), and re-embeds the items whose vectors are missing or
belong to another configuration, or every item with ``--all``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
from pathlib import Path
from typing import Any, TextIO

BAR_WIDTH = 30


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
    return asyncio.run(run_reindex(config, everything=args.all, out=sys.stderr))


async def run_reindex(config: Any, *, everything: bool, out: TextIO) -> int:
    """Re-embed and draw progress on ``out``; 0 when done, 1 when the provider failed."""
    from gateway.upstreams.postgres.connection import (
        UNAVAILABLE_ERRORS,
        DatabaseUnavailable,
        redact,
    )
    from gateway.upstreams.store.backend import create_storage
    from gateway.upstreams.store.embeddings import EmbeddingUnavailable
    from gateway.upstreams.store.semantic import ReindexProgress, SemanticIndex

    unreachable: tuple[type[BaseException], ...] = (DatabaseUnavailable, *UNAVAILABLE_ERRORS)
    storage = create_storage(config)
    try:
        await storage.open()
    except unreachable:
        # The driver's message can name the host but never the password; ours does neither.
        out.write(
            f"gateway store reindex: cannot reach the Store database at "
            f"{redact(config.database_url or '')}\n"
        )
        await storage.close()
        return 1
    index = SemanticIndex(config.index, storage)
    await index.open(reindex_in_background=False)

    def draw(progress: ReindexProgress) -> None:
        total = max(progress.total, 1)
        filled = BAR_WIDTH * progress.done // total
        bar = "#" * filled + "." * (BAR_WIDTH - filled)
        out.write(f"\r[{bar}] {progress.done}/{progress.total} items")
        out.flush()

    try:
        progress = await index.reindex(everything=everything, on_progress=draw)
    except EmbeddingUnavailable as exc:
        out.write(f"\ngateway store reindex: {exc.detail}\n")
        return 1
    except DatabaseUnavailable as exc:
        out.write(f"\ngateway store reindex: {exc.detail}\n")
        return 1
    finally:
        await index.close()
        await storage.close()
    if progress.done == 0:
        out.write("nothing to re-embed: every item matches the configured index\n")
    else:
        out.write(f"\nre-embedded {progress.done} item(s) with {config.index.model}\n")
    return 0
