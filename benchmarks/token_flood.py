"""Fresh forged tokens from one address: how much verifying them costs the gateway.

    .venv/bin/python benchmarks/token_flood.py 1000 10

For each budget given (``identity.user.jwt.max_failed_verify_ms_per_client``, CPU ms a
second; 1000, a whole core, is "no budget", 10 the default), a gateway (in this process,
the shipped rules, Ed25519 tokens) gets 3,000 requests from 127.0.0.2 over 20
connections, each with a new token signed by a key it does not know, while 127.0.0.3
sends 200 new valid tokens, one every 20 ms. Printed: the attacker's answers, the
signature checks the gateway made, the CPU time its failed verifications took, and the
client's latency (the attacker shares this process's loop, so the latency is indicative
only; the checks and CPU time are the figures). Loopback only.
"""

import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import jwt as pyjwt  # noqa: E402
from cryptography.hazmat.primitives import serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ed25519  # noqa: E402

from tests.support.gateway import running_gateway  # noqa: E402
from tests.support.raw_upstream import running_raw_upstream  # noqa: E402

ISS, AUD = "https://idp.test", "my-api"
ATTACKS, CLIENT_TOKENS, CONNECTIONS = 3000, 200, 20


def token(private: ed25519.Ed25519PrivateKey, sub: str) -> bytes:
    claims = {"iss": ISS, "aud": AUD, "sub": sub, "exp": int(time.time()) + 600}
    return pyjwt.encode(claims, private, algorithm="EdDSA").encode()


async def request(port: int, bearer: bytes, source: str) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
    writer.write(
        b"GET /x HTTP/1.1\r\nHost: a\r\nAuthorization: Bearer "
        + bearer
        + b"\r\nConnection: close\r\n\r\n"
    )
    reply = await reader.read()
    writer.close()
    return int(reply.split(b" ", 2)[1])


def config(tmp: Path, per_client: float, public: ed25519.Ed25519PublicKey) -> Path:
    pem = public.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    (tmp / "idp.pem").write_bytes(pem)
    path = tmp / "gateway.yaml"
    path.write_text(
        "identity:\n  user:\n    jwt:\n"
        f"      public_key_file: {tmp / 'idp.pem'}\n"
        f"      issuer: {ISS}\n      audience: {AUD}\n      algorithms: [EdDSA]\n"
        f"      max_failed_verify_ms_per_client: {per_client}\n"
        f"      max_failed_verify_ms: {max(per_client, 100)}\n"
    )
    return path


async def run(per_client: float, tmp: Path) -> None:
    idp, stranger = ed25519.Ed25519PrivateKey.generate(), ed25519.Ed25519PrivateKey.generate()
    forged = [token(stranger, f"m{i}") for i in range(ATTACKS)]
    valid = [token(idp, f"u{i}") for i in range(CLIENT_TOKENS)]
    path = str(config(tmp, per_client, idp.public_key()))
    async with (
        running_raw_upstream() as upstream,
        running_gateway(upstream.url, config_file=path) as gw,
    ):
        port = int(gw.url.rsplit(":", 1)[1])
        verifier = gw.proxy.gateway.verified.tokens
        statuses: list[int] = []

        async def attacker(first: int) -> None:
            for i in range(first, ATTACKS, CONNECTIONS):
                statuses.append(await request(port, forged[i], "127.0.0.2"))

        attackers = [asyncio.create_task(attacker(k)) for k in range(CONNECTIONS)]
        latencies, refused = [], 0
        started = time.perf_counter()
        for bearer in valid:
            sent = time.perf_counter()
            refused += await request(port, bearer, "127.0.0.3") != 200
            latencies.append((time.perf_counter() - sent) * 1000)
            await asyncio.sleep(0.02)
        await asyncio.gather(*attackers)
        elapsed = time.perf_counter() - started
        latencies.sort()
        print(
            f"budget {per_client:g} ms/s per address: attacker {len(statuses)} requests "
            f"({statuses.count(429)} answered 429), {verifier.stats.signature_checks} "
            f"signature checks, {verifier.stats.failed_seconds * 1000:.0f} ms of CPU on "
            f"failed verifications in {elapsed:.1f} s; client 127.0.0.3: {refused} of "
            f"{CLIENT_TOKENS} refused, p50 {statistics.median(latencies):.2f} ms, "
            f"p99 {latencies[int(len(latencies) * 0.99) - 1]:.2f} ms"
        )


if __name__ == "__main__":
    for budget in (float(a) for a in sys.argv[1:] or ["1000", "10"]):
        with tempfile.TemporaryDirectory() as d:
            asyncio.run(run(budget, Path(d)))
