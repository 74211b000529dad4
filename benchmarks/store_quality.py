"""Store search quality: recall@10 and nDCG@10 for BM25 alone, vectors alone and hybrid.

A small fixed corpus of agent memories (30 that queries ask about, ~250 distractors) and a
query set with graded relevance judgements
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
from typing import Any

import aiohttp

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from gateway.upstreams.store import StoreConfig, create_store_app  # noqa: E402
from gateway.upstreams.store.hybrid import convex_fusion, reciprocal_rank_fusion  # noqa: E402
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

# Distractors with near-miss identifiers (other tickets, error codes, phone numbers, hosts):
# an embedding sees "Ticket ZX-4822" as nearly "Ticket ZX-4821", BM25 does not. And neutral
# memories on topics no query asks about, so ten results are not most of the corpus.
_SERVICES = ["checkout", "search", "profile", "billing", "upload", "login", "reports"]
_SYMPTOMS = ["times out", "returns HTTP 502", "shows a blank page", "logs a stack trace"]
_NEUTRAL = [
    "Repaint the hallway wall in light grey",
    "The plumber fixes the leaking sink on Monday",
    "Order a new office chair with lumbar support",
    "Water the tomato plants in the greenhouse",
    "Renew the parking permit for lot C",
    "Buy printer paper and blue ink cartridges",
    "The bookshelf in the study needs one more shelf",
    "Replace the hallway light bulb with a warm LED",
    "Prune the roses along the fence in autumn",
    "Measure the living room for a new rug",
]
for n in range(60):
    ticket = 4800 + n
    if ticket != 4821:
        service, symptom = _SERVICES[n % 7], _SYMPTOMS[n % 4]
        CORPUS[f"t{n:02d}"] = f"Ticket ZX-{ticket}: {service} page {symptom} after deploy"
    code = 1000 + n
    if code != 1042:
        CORPUS[f"e{n:02d}"] = f"Error E{code} in the {_SERVICES[n % 7]} service: totals mismatch"
for n in range(20):
    CORPUS[f"p{n:02d}"] = (
        f"{['Erin', 'Frank', 'Gail', 'Hugo'][n % 4]}'s phone number is 555-01{n + 50}"
    )
    CORPUS[f"h{n:02d}"] = f"Staging database for project Osprey is db-osprey-{n:02d}"
for n, text in enumerate(_NEUTRAL * 4):
    CORPUS[f"n{n:02d}"] = f"{text} (note {n})"

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


Ranked = dict[str, list[tuple[str, float]]]  # query -> (key, score), best first


async def _rankings(config: StoreConfig, limit: int = K) -> Ranked:
    runner, url = await _serve(config)
    try:
        async with aiohttp.ClientSession(base_url=url) as http:

            async def put(key: str, text: str) -> None:
                body = {"namespace": ["mem"], "key": key, "value": {"text": text}}
                async with http.put("/store/items", json=body) as response:
                    assert response.status == 204, await response.text()

            keys = list(CORPUS)
            for start in range(0, len(keys), 32):  # concurrent puts share embedding calls
                await asyncio.gather(*(put(k, CORPUS[k]) for k in keys[start : start + 32]))
            rankings = {}
            for query in JUDGEMENTS:
                body = {"namespace_prefix": ["mem"], "query": query, "limit": limit}
                async with http.post("/store/items/search", json=body) as response:
                    found = await response.json()
                rankings[query] = [(item["key"], item["score"]) for item in found["items"]]
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
        timeout_seconds=120.0,  # a model on this machine's CPU, not a hosted service
    )
    with tempfile.TemporaryDirectory() as tmp:
        # Each ranking to depth 20, as hybrid search takes them for a page of 10.
        bm25 = await _rankings(StoreConfig(data_dir=Path(tmp) / "bm25"), 2 * K)
        vectors = await _rankings(
            StoreConfig(data_dir=Path(tmp) / "vectors", index=replace(index, ranking="vector")),
            2 * K,
        )
        live_hybrid = await _rankings(StoreConfig(data_dir=Path(tmp) / "hybrid", index=index))
    if server is not None:
        await server.stop()
    ids = {name: n for n, name in enumerate(CORPUS)}
    names = list(CORPUS)

    def fused_offline(fuse: Any) -> dict[str, list[str]]:
        ranked = {}
        for query in JUDGEMENTS:
            words = [(ids[key], score) for key, score in bm25[query]]
            meaning = [(ids[key], score) for key, score in vectors[query]]
            ranked[query] = [names[item] for item, _ in fuse(words, meaning)][:K]
        return ranked

    def keys(ranked: Ranked) -> dict[str, list[str]]:
        return {query: [key for key, _ in found][:K] for query, found in ranked.items()}

    rows: dict[str, dict[str, list[str]]] = {
        "BM25": keys(bm25),
        "vectors": keys(vectors),
        f"hybrid, as served ({index.fusion}, weight {index.hybrid_weight})": keys(live_hybrid),
        "hybrid RRF k=60": fused_offline(
            lambda w, m: reciprocal_rank_fusion([[i for i, _ in w], [i for i, _ in m]])
        ),
    }
    for weight in (0.1, 0.2, 0.3, 0.5, 0.7):
        rows[f"hybrid convex, weight {weight}"] = fused_offline(
            lambda w, m, weight=weight: convex_fusion(w, m, weight)
        )
    groups: dict[str, list[str]] = {
        "all 20": list(JUDGEMENTS),
        "by meaning (10)": list(JUDGEMENTS)[:10],
        "exact words (5)": list(JUDGEMENTS)[10:15],
        "mixed (5)": list(JUDGEMENTS)[15:],
    }
    embedder = "deterministic test embedder" if args.url is None else f"{args.model} at {url}"
    print(f"Store search quality, {len(CORPUS)} documents, {len(JUDGEMENTS)} queries, {embedder}")
    print("(rows 'hybrid RRF' and 'hybrid convex' fuse the BM25 and vector rankings above")
    print(" offline, exactly as the Store does; 'as served' is the Store's own answer)")
    print()
    header = "| ranking | " + " | ".join(f"{g}: R@10 / nDCG@10" for g in groups) + " |"
    print(header)
    print("|" + "---|" * (len(groups) + 1))
    for name, rankings in rows.items():
        cells = []
        for queries in groups.values():
            recall, ndcg = _scores(rankings, queries)
            cells.append(f"{recall:.2f} / {ndcg:.2f}")
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    asyncio.run(main())
