"""How many token signature checks each client address, and all of them together, may
cause in one second.

A token the gateway has not seen is verified before the request is counted (its user is
what gets counted), and a random one costs up to ``jwt.MAX_KEYS_TRIED`` public-key
operations (~0.03-0.15 ms each). Without a budget, one client sending fresh tokens could
keep the worker busy with them however low its limits are; with one, a client that uses
its address's share is answered 429 until the next second, without a check, and clients
at other addresses keep theirs. The share in all bounds many addresses together.

Fixed one-second windows, every address on the same boundaries: the table is emptied when
the second changes, so it never holds more addresses than checks were spent in that
second (at most ``total`` plus what one token can cost). Pure: the clock is passed in.
"""

from __future__ import annotations

import math


class CheckBudget:
    """Signature checks a second, per client address and in all."""

    __slots__ = ("_by_client", "_second", "_spent", "per_client", "total")

    def __init__(self, per_client: int, total: int) -> None:
        if per_client < 1 or total < 1:
            raise ValueError("per_client and total must be >= 1")
        self.per_client = per_client
        self.total = total
        self._second = -math.inf
        self._spent = 0
        self._by_client: dict[str, int] = {}

    def _roll(self, now: float) -> None:
        second = math.floor(now)
        if second != self._second:
            self._second = second
            self._spent = 0
            self._by_client.clear()

    def allows(self, client: str, now: float) -> bool:
        """Whether ``client`` may have a token checked now. A check that starts with budget
        left may spend a few more than is left (one token's keys): bounded, and counted."""
        self._roll(now)
        return self._spent < self.total and self._by_client.get(client, 0) < self.per_client

    def spend(self, client: str, checks: int, now: float) -> None:
        """Count ``checks`` signature checks made for ``client`` at ``now``."""
        if checks <= 0:
            return
        self._roll(now)
        self._spent += checks
        self._by_client[client] = self._by_client.get(client, 0) + checks
