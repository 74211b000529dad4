"""The background task that deletes expired items on an interval.

Reads never return expired items whether or not they have been swept; sweeping only
reclaims the space.
"""

from __future__ import annotations

import asyncio
import logging

from gateway.upstreams.postgres.connection import DatabaseUnavailable
from gateway.upstreams.store.backend import StoreStorage

log = logging.getLogger("gateway.store.sweeper")


async def sweep_forever(storage: StoreStorage, interval_seconds: float) -> None:
    """Sweep every ``interval_seconds`` until cancelled; a failed sweep is logged and retried."""
    while True:
        await asyncio.sleep(interval_seconds)
        try:
            removed = await storage.sweep_expired()
        except asyncio.CancelledError:
            raise
        except DatabaseUnavailable:
            # The database breaker logged the outage (once); no traceback per sweep.
            log.debug("store TTL sweep skipped: the database is unavailable")
            continue
        except Exception:
            log.exception("store TTL sweep failed; will retry in %.0f s", interval_seconds)
            continue
        if removed:
            log.info("store TTL sweep removed %d expired item(s)", removed)
