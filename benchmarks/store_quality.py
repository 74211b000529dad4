"""Store search quality: recall@10 and nDCG@10 for BM25 alone, vectors alone and hybrid.

A small fixed corpus of agent memories and a query set with graded relevance judgements
(2: what the query asks for, 1: related). Three kinds of query: by meaning (no word in
common with the answer), by exact words (names, ids, error codes), and mixed. Each ranking
runs in a real Store (in-process, over HTTP) on the same data.

    .venv/bin/python benchmarks/store_quality.py        # the deterministic test embedder
    # a real OpenAI-compatible endpoint (key from OPENAI_API_KEY if set):
    .venv/bin/python benchmarks/store_quality.py --url http://127.0.0.1:8081/v1 \
        --model all-minilm-l6-v2 --dims 384

The deterministic embedder (tests/support/embedding_server.py) puts synonyms in one bucket,
so its "vectors" column shows the plumbing working, not what a real model achieves.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import aiohttp

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from gateway.upstreams.store import StoreConfig, create_store_app  # noqa: E402
from gateway.upstreams.store.index_config import IndexConfig  # noqa: E402
from tests.support.embedding_server import EmbeddingServer  # noqa: E402

CORPUS: dict[str, str] = {
    "m01": "Alice prefers a dark roast coffee every morning before work",
    "m02": "Alice cannot drink milk; order her latte with oat milk",
    "m03": "Bob switched from espresso to green matcha last spring",
    "m04": "The barista at the corner shop knows Alice by name",
    "m05": "Alice's sedan failed inspection: the engine light is on",
    "m06": "Book the automobile for new winter tyres in November",
    "m07": "Bob's mechanic said the car battery is nearly dead",
    "m08": "Alice adopted a terrier puppy called Biscuit",
    "m09": "Biscuit needs his vaccination at the vet on Tuesday",
    "m10": "Bob is allergic to cats; avoid feline visitors",
    "m11": "Alice trains for the Berlin marathon, jogging five days a week",
    "m12": "Bob swims freestyle laps in the pool on Sundays",
    "m13": "Alice has felt gloomy and unhappy since the layoff",
    "m14": "Bob was cheerful after his promotion",
    "m15": "Alice is saving money for a house; monthly budget is tight",
    "m16": "Bob's salary goes into an index fund each month",
    "m17": "Alice's physician booked a checkup at the clinic next Friday",
    "m18": "Bob plays guitar in a band; concert on Saturday",
    "m19": "Alice wants a holiday in Portugal; flights are booked for June",
    "m20": "Bob bakes sourdough bread; his kitchen recipe uses rye",
    "m21": "Ticket ZX-4821: login page returns HTTP 500 after deploy",
    "m22": "Error E1042 in the billing service: invoice totals mismatch",
    "m23": "Alice writes Python software; she is fixing a bug in the parser",
    "m24": "Bob reads a novel by Ursula Le Guin before bedtime",
    "m25": "Alice has insomnia and takes short naps in the afternoon",
    "m26": "The weather forecast says storm and rain for the trip",
    "m27": "Project Kestrel ships on 2026-03-01; owner is Dana",
    "m28": "Dana's phone number changed to 555-0172",
    "m29": "Kestrel staging database is db-kestrel-02",
    "m30": "Bob's favourite tea is earl grey with lemon",
}

# query -> {doc: grade}
JUDGEMENTS: dict[str, dict[str, int]] = {
    # by meaning
    "espresso drinks": {"m01": 2, "m02": 2, "m03": 1, "m04": 1},
    "vehicle maintenance": {"m05": 2, "m06": 2, "m07": 2},
    "dog care": {"m08": 2, "m09": 2},
    "exercise and fitness": {"m11": 2, "m12": 2},
    "feeling sad": {"m13": 2},
    "personal finance": {"m15": 2, "m16": 2},
    "medical appointment": {"m17": 2, "m09": 1},
    "vacation plans": {"m19": 2, "m26": 1},
    "trouble sleeping": {"m25": 2, "m24": 1},
    "what does bob like to drink": {"m03": 2, "m30": 2},
    # by exact words
    "ZX-4821": {"m21": 2},
    "E1042": {"m22": 2},
    "Kestrel": {"m27": 2, "m29": 2},
    "555-0172": {"m28": 2},
    "Biscuit": {"m08": 2, "m09": 2},
    # mixed
    "Alice coffee order": {"m01": 2, "m02": 2, "m04": 1},
    "Bob music gig": {"m18": 2},
    "Dana Kestrel project owner": {"m27": 2, "m28": 1},
    "python bug fix": {"m23": 2},
    "baking recipe": {"m20": 2},
}
K = 10


def recall_at(ranked: list[str], relevant: dict[str, int], k: int = K) -> float:
    return len([d for d in ranked[:k] if d in relevant]) / len(relevant)


def ndcg_at(ranked: list[str], relevant: dict[str, int], k: int = K) -> float:
    dcg = sum((2 ** relevant.get(d, 0) - 1) / math.log2(i + 2) for i, d in enumerate(ranked[:k]))
    ideal = sorted(relevant.values(), reverse=True)[:k]
    idcg = sum((2**g - 1) / math.log2(i + 2) for i, g in enumerate(ideal))
    return dcg / idcg


async def _serve(config: StoreConfig) -> tuple[aiohttp.web.AppRunner, str]:
    from aiohttp import web

    runner = web.AppRunner(create_store_app(config), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


async def _rankings(config: StoreConfig) -> dict[str, list[str]]:
    runner, url = await _serve(config)
    try:
        async with aiohttp.ClientSession(base_url=url) as http:
            for key, text in CORPUS.items():
                body = {"namespace": ["mem"], "key": key, "value": {"text": text}}
                async with http.put("/store/items", json=body) as response:
                    assert response.status == 204, await response.text()
            rankings = {}
            for query in JUDGEMENTS:
                body = {"namespace_prefix": ["mem"], "query": query, "limit": K}
                async with http.post("/store/items/search", json=body) as response:
                    found = await response.json()
                rankings[query] = [item["key"] for item in found["items"]]
            return rankings
    finally:
        await runner.cleanup()


def _scores(rankings: dict[str, list[str]], queries: list[str]) -> tuple[float, float]:
    recall = sum(recall_at(rankings[q], JUDGEMENTS[q]) for q in queries) / len(queries)
    ndcg = sum(ndcg_at(rankings[q], JUDGEMENTS[q]) for q in queries) / len(queries)
    return recall, ndcg


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", help="an OpenAI-compatible /v1 base URL (default: test server)")
    parser.add_argument("--model", default="test-embed")
    parser.add_argument("--dims", type=int, default=64)
    args = parser.parse_args()
    server = None
    url = args.url
    if url is None:
        server = await EmbeddingServer(dims=args.dims).start()
        url = server.url
    index = IndexConfig(
        model=args.model,
        dims=args.dims,
        url=url,
        api_key=os.environ.get("OPENAI_API_KEY") or None,
        fields=("text",),
    )
    results: dict[str, dict[str, list[str]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        base = StoreConfig(data_dir=Path(tmp) / "bm25")
        results["BM25"] = await _rankings(base)
        for ranking in ("vector", "hybrid"):
            config = replace(
                base, data_dir=Path(tmp) / ranking, index=replace(index, ranking=ranking)
            )
            results["vectors" if ranking == "vector" else "hybrid (RRF)"] = await _rankings(config)
    if server is not None:
        await server.stop()
    groups: dict[str, list[str]] = {
        "all 20": list(JUDGEMENTS),
        "by meaning (10)": list(JUDGEMENTS)[:10],
        "exact words (5)": list(JUDGEMENTS)[10:15],
        "mixed (5)": list(JUDGEMENTS)[15:],
    }
    embedder = "deterministic test embedder" if args.url is None else f"{args.model} at {url}"
    print(f"Store search quality, {len(CORPUS)} documents, {len(JUDGEMENTS)} queries, {embedder}")
    print()
    header = "| ranking | " + " | ".join(f"{g}: R@10 / nDCG@10" for g in groups) + " |"
    print(header)
    print("|" + "---|" * (len(groups) + 1))
    for name, rankings in results.items():
        cells = []
        for queries in groups.values():
            recall, ndcg = _scores(rankings, queries)
            cells.append(f"{recall:.2f} / {ndcg:.2f}")
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    asyncio.run(main())
