"""Fusing the word (BM25) and meaning (vector) rankings into one.

Two fusion functions, both giving a score in 0..1 (higher is better):

* ``convex`` (the default): ``weight * bm25 / best_bm25 + (1 - weight) * max(cosine, 0)``.
  BM25 is divided by the best BM25 score among the candidates (its theoretical minimum is
  0), the cosine is already bounded. Keeping the scores' size matters for exact words: a
  query ``ZX-4821`` matches every ticket on ``zx`` but only one on ``4821`` too, and that one
  keeps a BM25 score several times the others', while an embedding finds all the tickets
  alike. Measured in ``benchmarks/store_quality.py``; Bruch et al. (2023, "An Analysis of
  Fusion Functions for Hybrid Retrieval") report the same against RRF.
* ``rrf``: reciprocal rank fusion, ``sum of 1 / (k + rank)`` over the rankings an item is in,
  divided by its largest possible value. It needs no calibration but throws the score sizes
  away, so near-miss identifiers that both rankings list outrank the exact match.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from gateway.upstreams.store.vector_dialect import IndexConnection, VectorDialect

# The usual RRF constant (Cormack et al. 2009).
RRF_K = 60
# BM25's share of the convex combination; benchmarks/store_quality.py measures others.
DEFAULT_WEIGHT = 0.5


class Ranker(Protocol):
    """Ranks a search by meaning inside the storage's read transaction.

    ``scope_sql`` (over ``items AS i``, with ``scope_params``) keeps the live items under the
    namespace prefix that pass the filter; ``bm25(depth)`` is the word ranking's first
    ``depth`` (item id, score), best first. Answers the first ``depth`` (item id, score) of
    the ranking, best first; fewer only when the scope holds no more items it can score.
    """

    def __call__(
        self,
        connection: IndexConnection,
        scope_sql: str,
        scope_params: list[Any],
        bm25: Callable[[int], list[tuple[int, float]]],
        depth: int,
    ) -> list[tuple[int, float]]: ...

    def unscored(self, dialect: VectorDialect) -> str:
        """The condition (over ``items AS i``, no parameters) on the items this ranking can
        never score; they follow the ranking with score null, as langgraph's InMemoryStore
        answers the items it has no vectors for."""
        ...


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


def convex_fusion(
    by_words: Sequence[tuple[int, float]],
    by_meaning: Sequence[tuple[int, float]],
    weight: float = DEFAULT_WEIGHT,
) -> list[tuple[int, float]]:
    """``weight * bm25 / best_bm25 + (1 - weight) * max(cosine, 0)``, best first.

    An item missing from one ranking scores 0 there (it was not among its candidates).
    Ties keep the order in which the items were first seen, words first.
    """
    best = max((score for _, score in by_words), default=0.0)
    fused: dict[int, float] = {}
    if best > 0:
        for item, score in by_words:
            fused[item] = weight * max(score, 0.0) / best
    for item, cosine in by_meaning:
        fused[item] = fused.get(item, 0.0) + (1.0 - weight) * max(cosine, 0.0)
    ordered = sorted(fused.items(), key=lambda pair: -pair[1])
    return [(item, min(1.0, score)) for item, score in ordered]
