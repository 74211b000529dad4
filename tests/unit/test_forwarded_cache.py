"""The resolved X-Forwarded-For cache answers exactly what walking the chain answers.

Differential: thousands of random chains (trusted hops, client hops, IPv6, mapped IPv4,
garbage, empty hops, several header lines) through the gateway's cached lookup, each
asked twice and from two trusted peers, against ``ClientAddressPolicy.client_address``
on the same bytes; and past the cache's bound, where it starts over.
"""

from __future__ import annotations

import random

from gateway.proxy import handler as handler_module
from gateway.proxy.handler import Peer
from tests.support.gateway import running_gateway

# trusted (10.0.0.0/8 and loopback below), clients, then what a walk must stop at
TRUSTED = ["10.0.0.1", "10.0.0.2", "127.0.0.9"]
CLIENTS = ["203.0.113.7", "198.51.100.1", "2001:db8::1", "2001:db8:0:0:1::5"]
ODD = ["::ffff:203.0.113.9", "[2001:db8::2]:443", "fe80::1%eth0"]
BAD = ["garbage", "", " ", "1.2.3", "999.1.1.1", "unknown"]
HOPS = TRUSTED + CLIENTS + ODD + BAD


def _chain(rng: random.Random) -> list[bytes]:
    lines = []
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        hops = [rng.choice(HOPS) for _ in range(rng.randint(0, 5))]
        sep = rng.choice([",", ", ", " ,"])
        lines.append(sep.join(hops).encode("latin-1"))
    return lines


async def test_cached_client_matches_the_walk_for_random_chains():
    async with running_gateway(None, trusted_proxies=["10.0.0.0/8", "127.0.0.0/8"]) as gw:
        gateway = gw.gateway
        policy = gateway.addresses
        peers = [Peer("127.0.0.1", True, None), Peer("10.0.0.3", True, None)]
        rng = random.Random(27)
        for _ in range(3000):
            chain = _chain(rng)
            for peer in peers:
                joined = b", ".join(chain).decode("latin-1") or None
                expected = policy.forwarded_client(peer.address, joined)
                assert gateway._forwarded_client(peer, chain) == expected, (peer, chain)
                assert gateway._forwarded_client(peer, chain) == expected, (peer, chain)


async def test_the_cache_is_bounded_and_starts_over():
    async with running_gateway(None, trusted_proxies=["127.0.0.0/8"]) as gw:
        gateway = gw.gateway
        peer = Peer("127.0.0.1", True, None)
        bound = handler_module.MAX_FORWARDED_CHAINS
        for n in range(bound + 10):
            client = f"203.0.{n // 256 % 256}.{n % 256}"
            assert gateway._forwarded_client(peer, [client.encode()]) == (client, True)
            assert len(gateway._forwarded) <= bound
        # a malformed first hop names the trusted peer itself, from whichever peer asks
        assert gateway._forwarded_client(peer, [b"nonsense"]) == ("127.0.0.1", False)
        other = Peer("127.0.0.5", True, None)
        assert gateway._forwarded_client(other, [b"nonsense"]) == ("127.0.0.5", False)


async def test_long_chains_are_resolved_but_not_kept():
    async with running_gateway(None, trusted_proxies=["127.0.0.0/8"]) as gw:
        gateway = gw.gateway
        peer = Peer("127.0.0.1", True, None)
        for n in range(50):
            chain = ", ".join(["198.51.100.1"] * 2000 + [f"203.0.113.{n}"]).encode()
            assert gateway._forwarded_client(peer, [chain]) == (f"203.0.113.{n}", True)
        assert gateway._forwarded_client(peer, [b"203.0.113.200"]) == ("203.0.113.200", True)
        assert len(gateway._forwarded) == 1
