"""A generated JSON access log for ``gateway rules simulate``: N requests over M identities.

Identities are drawn with Zipf-like weights (a few heavy clients, a long tail), so a table
with tight limits has someone to limit. Each identity has a client address and its three
identity hashes (random 12 hex, as the gateway logs them); 90 % send an API key, a third a
user id. Paths cover the default table's busy rows; times are spread evenly over
``--seconds`` with jitter. Lines carry ``"decision": null`` (no gateway decided them).

    .venv/bin/python benchmarks/replay_log.py --requests 100000 --identities 1000 OUT.log
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

PATHS = [  # (weight, method, path); {uuid} is filled per request
    (30, "POST", "/runs/query"),
    (20, "GET", "/threads/{uuid}"),
    (12, "POST", "/runs"),
    (10, "GET", "/runs/{uuid}"),
    (8, "GET", "/repos/acme/agent"),
    (6, "POST", "/runs/batch"),
    (5, "GET", "/runs/stats"),
    (4, "POST", "/generate"),
    (3, "POST", "/datasets/{uuid}/charts"),
    (2, "GET", "/info"),
]
START_US = 1_795_000_000_000_000  # 2026-11-18T08:26:40Z


def _hex(rng: random.Random) -> str:
    return f"{rng.getrandbits(48):012x}"


def generate(out: Path, requests: int, identities: int, seconds: int, seed: int = 7) -> None:
    rng = random.Random(seed)
    people = []
    for i in range(identities):
        key = _hex(rng) if rng.random() < 0.9 else None
        user = _hex(rng) if rng.random() < 0.33 else None
        client = f"10.{(i >> 16) & 255}.{(i >> 8) & 255}.{i & 255}"
        people.append((key, user, client, _hex(rng)))
    weights = [1 / (rank + 1) ** 1.1 for rank in range(identities)]
    who = rng.choices(range(identities), weights=weights, k=requests)
    path_weights = [w for w, _, _ in PATHS]
    what = rng.choices(range(len(PATHS)), weights=path_weights, k=requests)
    uuids = [f"{rng.getrandbits(128):032x}" for _ in range(256)]
    step = seconds * 1_000_000 / requests
    with out.open("w", encoding="utf-8") as handle:
        for n in range(requests):
            key, user, client, ip = people[who[n]]
            _, method, path = PATHS[what[n]]
            if "{uuid}" in path:
                u = rng.choice(uuids)
                path = path.replace("{uuid}", f"{u[:8]}-{u[8:12]}-4{u[13:16]}-8{u[17:20]}-{u[20:]}")
            start = START_US + int(n * step + rng.random() * step)
            record = {
                "method": method, "path": path, "status": 200, "region": "us",
                "client": client, "rule": None, "decision": None, "identity": None,
                "upstream": "default", "duration_ms": 1.0, "upstream_ms": 0.8,
                "request_id": f"{n:032x}", "time": None, "key": key, "user": user, "ip": ip,
                "start_us": start,
            }  # fmt: skip
            handle.write(json.dumps(record, separators=(",", ":")))
            handle.write("\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--requests", type=int, default=1_000_000)
    parser.add_argument("--identities", type=int, default=10_000)
    parser.add_argument("--seconds", type=int, default=3600, help="time the log spans")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    generate(args.out, args.requests, args.identities, args.seconds, args.seed)


if __name__ == "__main__":
    main()
