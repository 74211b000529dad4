"""Re-embed the Store's items now, with a progress bar: what ``gateway store reindex``
runs (its command line, which reads the gateway's settings, is ``gateway.store_cli``).

Opens the Store's SQLite file or PostgreSQL database directly (a running gateway may keep
serving: both work on the same tables, and the running Store's in-memory mirror picks the
new vectors up from the change log), and re-embeds the items whose vectors are missing or
belong to another configuration, or every item with ``--all``.
"""

from __future__ import annotations

from typing import Any, TextIO

from gateway.urls import display_url

BAR_WIDTH = 30


async def run_reindex(config: Any, *, everything: bool, out: TextIO) -> int:
    """Re-embed and draw progress on ``out``; 0 when done, 1 when the provider failed."""
    from gateway.upstreams.postgres.connection import (
        UNAVAILABLE_ERRORS,
        DatabaseUnavailable,
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
            f"{display_url(config.database_url or '')}\n"
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
