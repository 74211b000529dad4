"""How close PostgreSQL's ranking (ts_rank) is to SQLite's (FTS5 BM25): the overlap of the
top 10 for the same queries on the same fixed corpus.

    .venv/bin/python benchmarks/search_overlap.py [--items 5000] [--queries 300]

The corpus is store_bench's (Zipf-distributed words from a fixed vocabulary, seed 7); each
query is 2 words drawn from the mid-frequency band, as in store_bench. Both storages are
driven in-process through the StoreStorage interface (a throwaway PostgreSQL is started).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.store_bench import QUERY_WORDS, make_value  # noqa: E402
from gateway.upstreams.store.backend import create_storage  # noqa: E402
from gateway.upstreams.store.config import StoreConfig  # noqa: E402
from gateway.upstreams.store.models import StorePutRequest, StoreSearchRequest  # noqa: E402
from tests.support.postgres_server import postgres_server  # noqa: E402


async def run(items: int, queries: int, url: str, data_dir: Path) -> None:
    backends = {
        "sqlite": create_storage(StoreConfig(data_dir=data_dir)),
        "postgresql": create_storage(StoreConfig(data_dir=data_dir, database_url=url)),
    }
    for storage in backends.values():
        await storage.open()
    rng = random.Random(7)
    for index in range(items):
        request = StorePutRequest.model_validate(
            {
                "namespace": ["c", f"u{index % 50}"],
                "key": f"k{index}",
                "value": make_value(rng, index),
            }
        )
        for storage in backends.values():
            await storage.put(request)
    overlaps, same_order, same_first = [], 0, 0
    qrng = random.Random(11)
    for _ in range(queries):
        query = " ".join(qrng.sample(QUERY_WORDS, 2))
        request = StoreSearchRequest.model_validate({"query": query, "limit": 10})
        tops = {}
        for name, storage in backends.items():
            tops[name] = [item["key"] for item in await storage.search(request)]
        a, b = tops["sqlite"], tops["postgresql"]
        if not a and not b:
            continue
        overlaps.append(len(set(a) & set(b)) / max(len(a), len(b)))
        same_order += a == b
        same_first += bool(a and b and a[0] == b[0])
    for storage in backends.values():
        await storage.close()
    n = len(overlaps)
    print(f"corpus {items} items, {n} queries with matches")
    print(f"top-10 overlap: mean {statistics.mean(overlaps):.3f}, "
          f"median {statistics.median(overlaps):.3f}, min {min(overlaps):.2f}")  # fmt: skip
    print(f"same first result: {same_first / n:.3f}; identical top-10 order: {same_order / n:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=5000)
    parser.add_argument("--queries", type=int, default=300)
    args = parser.parse_args()
    with postgres_server() as server, tempfile.TemporaryDirectory() as tmp:
        asyncio.run(run(args.items, args.queries, server.create_database(), Path(tmp)))


if __name__ == "__main__":
    main()
