"""The built-in APIs' JSON bodies parsed within the loop's parse budget (``parse_budget.py``).

Every handler that takes a JSON body reads it with ``read_model``: the client's address is
asked first (a refused one is answered before its body is read), then again right before
the parse (nothing awaits between that check and the parse, so several bodies of one
address in flight at once cannot all pass on one check), and the parse's CPU time is
charged to it, whether the body was valid or not. The ``parse`` given does all the work
that walks the body (decoding, the model, checks of its values, forms made for storing
it), so that all of it is charged.

The client address: behind the gateway, every request comes from the gateway's own
connection, so the TCP peer names nobody. The gateway's ``X-Forwarded-For`` is the chain
its trusted proxies gave (when its peer is one of them) followed by its own TCP peer, so
walking it right to left past loopback and the gateway's ``trusted_proxies``, as the
gateway itself walks it (``ClientAddressPolicy``), finds the client the gateway resolved.
``gateway serve`` gives its built-in APIs its own ``trusted_proxies`` and ``ipv6_prefix``;
a Store in its own process must be given the gateway's address and the gateway's trusted
proxies (``--trusted-proxy``). A peer not trusted is the client, whatever it sends.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from aiohttp import web

from gateway.ratelimit.identity import ClientAddressPolicy
from gateway.upstreams.http_api.parse_budget import ParseBudget, ParseRefusal, ParseShare
from gateway.upstreams.http_api.problems import InvalidRequest

T = TypeVar("T")
log = logging.getLogger("gateway.builtin")

LOOPBACK: tuple[str, ...] = ("127.0.0.0/8", "::1/128")
BUDGET_KEY = web.AppKey("body_parse_budget", ParseBudget)
ADDRESS_POLICY_KEY = web.AppKey("body_parse_address_policy", ClientAddressPolicy)


def address_policy(
    trusted_proxies: Sequence[str] = (), ipv6_prefix: int = 64
) -> ClientAddressPolicy:
    """Loopback and ``trusted_proxies`` believed for ``X-Forwarded-For``; IPv6 clients
    counted by their ``ipv6_prefix`` (the gateway's own setting when it runs the API)."""
    return ClientAddressPolicy.parse([*LOOPBACK, *trusted_proxies], ipv6_prefix)


def use_parse_budget(
    app: web.Application,
    budget: ParseBudget | None = None,
    policy: ClientAddressPolicy | None = None,
) -> ParseBudget:
    """Give ``app`` its parse budget (one a process: the apps of one loop share one)."""
    if budget is None:  # (not ``or``: an unused budget is empty, so falsy)
        budget = ParseBudget(ParseShare())
    app[BUDGET_KEY] = budget
    app[ADDRESS_POLICY_KEY] = policy or address_policy()
    return budget


def client_address(request: web.Request) -> str:
    policy = request.app[ADDRESS_POLICY_KEY]
    forwarded = request.headers.getall("X-Forwarded-For", [])
    return policy.client_address(request.remote, ", ".join(forwarded) if forwarded else None)


# The most a body is charged a byte: ten times the costliest shape measured (one-element
# arrays, ~1 µs a byte to parse and walk on a slow machine), and at least a millisecond a
# body. The thread's CPU clock also counts what is not the body's doing, and a collection
# of the interpreter's garbage that falls inside a parse took 0.65 s once under CI load:
# charged whole, it put a client of 60-byte bodies into debt.
CHARGE_PER_BYTE = 10e-6
MIN_CHARGE_CAP = 0.001


def most_a_body_costs(size: int) -> float:
    """The charge cap of a body of ``size`` bytes (seconds)."""
    return max(MIN_CHARGE_CAP, size * CHARGE_PER_BYTE)


def refusal_before_body(request: web.Request) -> ParseRefusal | None:
    """Whether the body this request announces would be refused now (its ``Expect:
    100-continue`` is then answered with the refusal, so the body is never sent)."""
    budget = request.app.get(BUDGET_KEY)
    if budget is None:
        return None
    return budget.refusal(client_address(request), request.content_length)


def _admit(budget: ParseBudget, address: str, size: int | None) -> None:
    refusal = budget.refusal(address, size)
    if refusal is not None:
        raise InvalidRequest(
            f"body: {refusal.detail}", refusal.status, retry_after=refusal.retry_after
        )


async def read_model(
    request: web.Request,
    parse: Callable[[bytes], T],
    read: Callable[[], Awaitable[bytes]] | None = None,
) -> T:
    """``parse(body)`` within the budget: 429 or 503 with ``Retry-After`` when the client's
    address (or every address together) has used its share. ``read``: how the handler
    reads its body (its own size checks), default ``request.read``."""
    budget = request.app[BUDGET_KEY]
    address = client_address(request)
    _admit(budget, address, request.content_length)
    raw: bytes = await (read or request.read)()
    _admit(budget, address, len(raw))
    # CPU time of this thread (the loop's): what the body cost, not the time the process
    # was waiting for a core besides (a busy host must not charge clients for it).
    started = time.thread_time()
    try:
        return parse(raw)
    finally:
        spent = min(time.thread_time() - started, most_a_body_costs(len(raw)))
        if budget.charge(address, spent):
            # Once as an address goes into debt, not per refusal; no address (the access
            # log names clients by hash only).
            log.warning(
                "a client address used its share of the time for parsing request bodies "
                "(its last body took %.0f ms of CPU to parse): its bodies are refused with "
                "429 for a while",
                spent * 1000,
            )
