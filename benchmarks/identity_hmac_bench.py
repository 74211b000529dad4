"""The identity HMAC's cost, each way the gateway can compute it, side by side.

    .venv/bin/python benchmarks/identity_hmac_bench.py [--pin CPU] [--calls N]
        [--gateway-src DIR]

Rows (one API key of ten characters, as the data plane hashes a key it has not seen on
the connection): the digest as it was up to 3818b65 (hashlib on OpenSSL) and the same on
CPython's own SHA-256, both as Python code; ``IdentityHasher(native=False)``, the
fallback as installed (compiled when the data plane is); and
``gateway/ratelimit/_identity_hmac.c`` with its portable block and with SHA-NI (when the
CPU has it). Each row runs in a process of its own (the C module picks its block at
import: ``GATEWAY_SHA_NI=0``), pinned to one core with ``taskset`` when ``--pin`` is given;
the figure is the best of 7 repeats of N calls, in ns a call, with the ratio to the first
row. All rows check their digest against ``hmac.new`` first.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import hashlib, hmac, json, sys, timeit
from gateway.policy.model import IdentityKind
from gateway.ratelimit.identity import IdentityHasher

way, calls = sys.argv[1], int(sys.argv[2])
secret = b"0123456789abcdef0123456789abcdef"
value = "bench-1234"
kind = IdentityKind.API_KEY


def replica(sha256):
    # IdentityHasher.digest as it was up to 3818b65, on the given SHA-256 (as Python code).
    key = secret.ljust(64, b"\0")
    inner0, outer0 = sha256(bytes(b ^ 0x36 for b in key)), sha256(bytes(b ^ 0x5C for b in key))

    def digest(kind, value):
        inner = inner0.copy()
        inner.update(b"api_key\0" + value.encode())
        outer = outer0.copy()
        outer.update(inner.digest())
        return outer.hexdigest()[:32]

    return digest


sha_ni = 0
if way == "openssl":
    digest = replica(hashlib.sha256)
elif way == "cpython":
    import _sha256
    digest = replica(_sha256.sha256)
else:
    hasher = IdentityHasher(secret, native=(way == "c"))
    if way == "c" and not hasher.native:
        print(json.dumps({"missing": True}))
        sys.exit(0)
    digest = hasher.digest
    if way == "c":
        from gateway.ratelimit import _identity_hmac
        sha_ni = _identity_hmac.SHA_NI
want = hmac.new(secret, b"api_key\0" + value.encode(), hashlib.sha256).hexdigest()[:32]
assert digest(kind, value) == want
best = min(timeit.repeat(lambda: digest(kind, value), number=calls, repeat=7))
print(json.dumps({"ns": best / calls * 1e9, "sha_ni": sha_ni}))
"""

WAYS = [
    ("openssl", "hashlib on OpenSSL, as Python code (the digest up to 3818b65)", {}),
    ("cpython", "hashlib on CPython's _sha256, as Python code", {}),
    ("fallback", "IdentityHasher(native=False): the fallback as installed", {}),
    ("c", "C, portable block", {"GATEWAY_SHA_NI": "0"}),
    ("c", "C, SHA-NI block (when the CPU has it)", {}),
]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pin", help="run each row with taskset -c PIN")
    parser.add_argument("--calls", type=int, default=200_000)
    parser.add_argument(
        "--gateway-src",
        type=Path,
        default=ROOT,
        help="the checkout or unpacked build to import gateway from (default: this one)",
    )
    args = parser.parse_args()
    src = args.gateway_src.resolve()
    prefix = []
    if args.pin is not None:
        if shutil.which("taskset") is None:
            raise SystemExit("--pin needs taskset (util-linux)")
        prefix = ["taskset", "-c", args.pin]
    print(f"* machine: {platform.processor() or platform.machine()}, nproc={os.cpu_count()}, "
          f"python {platform.python_version()}; {args.calls:,} calls, best of 7")  # fmt: skip
    print("\n| way | ns a call | vs first row | block |\n|---|---:|---:|---|")
    first = None
    for way, title, env in WAYS:
        done = subprocess.run(
            [*prefix, sys.executable, "-c", CHILD, way, str(args.calls)],
            cwd=src,
            env={**os.environ, "PYTHONPATH": str(src), **env},
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        if done.returncode != 0:
            raise SystemExit(f"{title}: failed\n{done.stderr[-2000:]}")
        row = json.loads(done.stdout.strip().splitlines()[-1])
        if row.get("missing"):
            print(f"| {title} | not built | | |")
            continue
        ns = row["ns"]
        first = first or ns
        block = ("SHA-NI" if row["sha_ni"] else "portable") if way == "c" else "hashlib"
        print(f"| {title} | {ns:,.0f} | {first / ns:.2f}x | {block} |")


if __name__ == "__main__":
    main()
