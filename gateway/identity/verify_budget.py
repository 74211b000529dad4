"""How much CPU the verification of tokens that fail may take, per client address and
in all, in one second.

A token the gateway has not seen is verified before its request is counted (its user is
what gets counted): PyJWT parses it (a pure-Python pass over up to 8 KB, once per key
tried) and then up to ``jwt.MAX_KEYS_TRIED`` public-key operations run. Without a budget
one client sending fresh tokens keeps the worker busy with them however low its limits
are. So the CPU time of every verification that fails is charged to the client address
(for IPv6 its counted group, ``ClientAddressPolicy``) and to all clients together, and
while either share is spent for the current second a new token is not verified at all.
Verifications that succeed are not charged: a client cannot make a valid token, each is
verified once and then answered from a cache, and after a key rotation every active user
is verified again at once, which must not look like an attack.

Fixed one-second windows, every address on the same boundaries: the table is emptied when
the second changes, so it holds at most the addresses that failed a verification in that
second. Pure: the clock and the costs are passed in.
"""

from __future__ import annotations

import math


class VerifyBudget:
    """Seconds of failed verification a second, per client address and in all."""

    __slots__ = ("_by_client", "_second", "_spent", "per_client", "total")

    def __init__(self, per_client: float, total: float) -> None:
        if not (per_client > 0 and total > 0):
            raise ValueError("per_client and total must be > 0")
        self.per_client = per_client
        self.total = total
        self._second = -math.inf
        self._spent = 0.0
        self._by_client: dict[str, float] = {}

    def _roll(self, now: float) -> None:
        second = math.floor(now)
        if second != self._second:
            self._second = second
            self._spent = 0.0
            self._by_client.clear()

    def allows(self, client: str, now: float) -> bool:
        """Whether a token from ``client`` may be verified now. One that starts with budget
        left may spend more than is left (one token's cost): bounded, and charged."""
        self._roll(now)
        return self._spent < self.total and self._by_client.get(client, 0.0) < self.per_client

    def spend(self, client: str, seconds: float, now: float) -> None:
        """Charge ``seconds`` of a failed verification to ``client`` at ``now``."""
        if seconds <= 0:
            return
        self._roll(now)
        self._spent += seconds
        self._by_client[client] = self._by_client.get(client, 0.0) + seconds
