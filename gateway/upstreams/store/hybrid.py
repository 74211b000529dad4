"""Fusing the word (BM25) and meaning (vector) rankings into one.

Reciprocal rank fusion: an item's fused score is the sum over the rankings it appears in of
``1 / (k + rank)`` (rank from 1). It needs no calibration between BM25 scores (unbounded)
and cosine similarities, an exact word match (a name, an id, an error code) that the
embedding misses still ranks high through BM25, and an item found by both rises above
items found by one. The score is divided by its largest possible value (first in every
ranking), so it lies in 0..1 and an item first in both rankings scores 1.0.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from gateway.upstreams.store.models import StoreSearchRequest


class Ranker(Protocol):
    """Ranks a search by meaning inside the storage's read transaction.

    ``scope_sql`` (over ``items AS i``, with ``scope_params``) keeps the live items under the
    namespace prefix that pass the filter; ``bm25(depth)`` is the word ranking's first
    ``depth`` item ids. Answers the requested page as (item id, score), best first.
    """

    def __call__(
        self,
        connection: sqlite3.Connection,
        scope_sql: str,
        scope_params: list[Any],
        bm25: Callable[[int], list[int]],
        request: StoreSearchRequest,
    ) -> list[tuple[int, float]]: ...


# The usual constant (Cormack et al. 2009); benchmarks/store_quality.py measures others.
RRF_K = 60


def reciprocal_rank_fusion(
    rankings: Sequence[Sequence[int]], k: int = RRF_K
) -> list[tuple[int, float]]:
    """Item ids of every ranking (best first), fused, best first, with scores in 0..1.

    Ties keep the order in which the items were first seen, ranking by ranking.
    """
    if not rankings:
        return []
    fused: dict[int, float] = {}
    for ranking in rankings:
        for rank, item in enumerate(ranking, start=1):
            fused[item] = fused.get(item, 0.0) + 1.0 / (k + rank)
    best_possible = len(rankings) / (k + 1)
    ordered = sorted(fused.items(), key=lambda pair: -pair[1])
    return [(item, min(1.0, score / best_possible)) for item, score in ordered]
