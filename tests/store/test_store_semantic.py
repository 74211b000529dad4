"""Search by meaning: the Store with an embedding index, against the deterministic
embedding server (tests/support/embedding_server.py) on loopback. Every test that runs a
Store runs on both backends (``store_database_url``: the SQLite file, then PostgreSQL)."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from langgraph_sdk import get_client

from gateway.upstreams.store import StoreConfig
from gateway.upstreams.store.app import SEMANTIC_KEY
from gateway.upstreams.store.hybrid import convex_fusion, reciprocal_rank_fusion
from gateway.upstreams.store.index_config import IndexConfig
from tests.support.embedding_server import EmbeddingServer

from .semantic_support import indexed_store_config, with_index
from .store_support import RunningStore, start_store


def _keys(found: dict[str, Any]) -> list[str]:
    return [item["key"] for item in found["items"]]


class Indexed:
    """A running indexed Store with an SDK client and a raw HTTP session."""

    def __init__(self, store: RunningStore, server: EmbeddingServer) -> None:
        self.store = store
        self.server = server
        self.client = get_client(url=store.url, api_key=None)
        self.sdk = self.client.store
        self.http = aiohttp.ClientSession(base_url=store.url)

    @property
    def semantic(self) -> Any:
        return self.store.app[SEMANTIC_KEY]

    async def rows(self, sql: str) -> list[Any]:
        """``sql`` (``{vectors}``, ``{embeddings}``: the backend's table names) read through
        the Store's own storage, so the same check runs on SQLite and PostgreSQL."""
        dialect = self.semantic.dialect
        query = sql.format(vectors=dialect.vectors, embeddings=dialect.embeddings)
        return list(
            await self.semantic.storage.read(
                lambda connection, _: connection.execute(query).fetchall()
            )
        )

    async def close(self) -> None:
        await self.http.close()
        await self.client.aclose()
        await self.store.runner.cleanup()


async def _open(config: StoreConfig, server: EmbeddingServer) -> Indexed:
    return Indexed(await start_store(config), server)


@pytest.fixture
async def indexed(
    tmp_path: Path, embedding_server: EmbeddingServer, store_database_url: str | None
) -> AsyncIterator[Indexed]:
    config = indexed_store_config(tmp_path / "data", embedding_server, store_database_url)
    running = await _open(config, embedding_server)
    try:
        yield running
    finally:
        await running.close()


@pytest.fixture
async def vector_only(
    tmp_path: Path, embedding_server: EmbeddingServer, store_database_url: str | None
) -> AsyncIterator[Indexed]:
    config = indexed_store_config(
        tmp_path / "data", embedding_server, store_database_url, ranking="vector"
    )
    running = await _open(config, embedding_server)
    try:
        yield running
    finally:
        await running.close()


MEMORIES = {
    "coffee": {"text": "Alice prefers dark roast coffee in the morning", "topic": "food"},
    "tea": {"text": "Bob drinks green matcha every afternoon", "topic": "food"},
    "car": {"text": "The sedan needs new tyres before winter", "topic": "errands"},
    "dog": {"text": "Walk the puppy twice a day", "topic": "pets"},
    "ticket": {"text": "Ticket ZX-4821 closed: the build broke on Friday", "topic": "work"},
}


async def _put_memories(sdk: Any, namespace: list[str] | None = None) -> None:
    for key, value in MEMORIES.items():
        await sdk.put_item(namespace or ["users", "alice"], key=key, value=value)


async def test_a_query_finds_items_by_meaning_not_only_by_words(indexed: Indexed) -> None:
    await _put_memories(indexed.sdk)
    found = await indexed.sdk.search_items(["users"], query="espresso")
    assert _keys(found)[0] == "coffee"  # no shared word: synonyms share an embedding bucket
    scores = [item["score"] for item in found["items"]]
    assert all(0.0 <= score <= 1.0 for score in scores)
    assert scores == sorted(scores, reverse=True)


async def test_without_an_index_the_same_query_finds_nothing(sdk: Any) -> None:
    await _put_memories(sdk)
    assert (await sdk.search_items(["users"], query="espresso"))["items"] == []


async def test_vector_ranking_scores_are_cosine_similarities(vector_only: Indexed) -> None:
    for key, value in MEMORIES.items():
        await vector_only.sdk.put_item(["users"], key=key, value=value, index=["text"])
    found = await vector_only.sdk.search_items(["users"], query=MEMORIES["coffee"]["text"])
    top = found["items"][0]
    assert top["key"] == "coffee"
    assert top["score"] == pytest.approx(1.0, abs=1e-5)  # same words: the same vector
    assert all(-1.0 <= item["score"] <= 1.0 for item in found["items"])


async def test_hybrid_keeps_exact_word_matches_the_embedding_barely_sees(indexed: Indexed) -> None:
    await _put_memories(indexed.sdk)
    # Fill the namespace with coffee items, close in meaning to the query's "coffee".
    for n in range(12):
        await indexed.sdk.put_item(
            ["users", "alice"], key=f"brew{n}", value={"text": f"espresso latte brew {n}"}
        )
    query = "ZX-4821 coffee"
    hybrid = _keys(await indexed.sdk.search_items(["users"], query=query, limit=5))
    assert "ticket" in hybrid[:2]  # BM25 knows the id, and fusion keeps it near the top


async def test_items_found_by_both_rankings_outrank_items_found_by_one() -> None:
    fused = reciprocal_rank_fusion([[1, 2, 3], [3, 4, 1]])
    assert [item for item, _ in fused][:2] == [1, 3]
    assert fused[0][1] == pytest.approx((1 / 61 + 1 / 63) / (2 / 61))
    assert reciprocal_rank_fusion([[7], [7]]) == [(7, 1.0)]
    assert reciprocal_rank_fusion([[], []]) == []


def test_convex_fusion_keeps_the_size_of_the_scores() -> None:
    # Item 1 matches the query's rare word (BM25 8.0); 2 and 3 only its common word.
    words = [(1, 8.0), (2, 2.0), (3, 2.0)]
    meaning = [(3, 0.9), (2, 0.88), (4, 0.7), (5, 0.6), (1, 0.55), (6, -0.2)]
    fused = convex_fusion(words, meaning, 0.5)
    assert [item for item, _ in fused] == [1, 3, 2, 4, 5, 6]
    assert fused[0][1] == pytest.approx(0.5 * 1.0 + 0.5 * 0.55)
    assert fused[-1] == (6, 0.0)  # a negative cosine counts as 0: scores stay in 0..1
    # RRF drops the sizes: the near misses both rankings list come first.
    rrf = reciprocal_rank_fusion([[1, 2, 3], [3, 2, 4, 5, 1, 6]])
    assert [item for item, _ in rrf][:3] == [3, 2, 1]
    assert convex_fusion([], [(5, 0.5)], 0.5) == [(5, 0.25)]
    assert convex_fusion([(5, 3.0)], [], 1.0) == [(5, 1.0)]


async def test_rrf_fusion_can_be_chosen(
    tmp_path: Path, embedding_server: EmbeddingServer, store_database_url: str | None
) -> None:
    config = indexed_store_config(
        tmp_path / "d", embedding_server, store_database_url, fusion="rrf"
    )
    running = await _open(config, embedding_server)
    try:
        await _put_memories(running.sdk)
        found = await running.sdk.search_items(["users"], query="dark roast coffee")
        assert found["items"][0]["key"] == "coffee"
        assert found["items"][0]["score"] == pytest.approx(1.0)  # first in both rankings
        assert running.semantic.describe()["fusion"] == "rrf"
    finally:
        await running.close()


async def test_each_field_path_is_embedded_on_its_own(indexed: Indexed) -> None:
    server = indexed.server
    await indexed.sdk.put_item(
        ["docs"],
        key="k",
        value={"title": "coffee", "sections": [{"t": "car"}, {"t": "dog"}], "n": 3},
        index=["title", "sections[*].t", "missing"],
    )
    assert server.requests[-1] == ["coffee", "car", "dog"]
    paths = await indexed.rows("SELECT path FROM {vectors} ORDER BY id")
    assert [p for (p,) in paths] == ["title", "sections[*].t", "sections[*].t"]


async def test_default_fields_embed_the_whole_value_as_json(indexed: Indexed) -> None:
    await indexed.sdk.put_item(["docs"], key="k", value={"b": "coffee", "a": 1})
    assert indexed.server.requests[-1] == ['{"a": 1, "b": "coffee"}']


async def test_index_false_and_paths_choose_what_is_found_by_meaning(vector_only: Indexed) -> None:
    sdk = vector_only.sdk
    requests_before = len(vector_only.server.requests)
    await sdk.put_item(["idx"], key="hidden", value={"text": "espresso"}, index=False)
    assert len(vector_only.server.requests) == requests_before  # nothing to embed
    titled = {"title": "car", "body": "latte"}
    await sdk.put_item(["idx"], key="titled", value=titled, index=["title"])
    found = await sdk.search_items(["idx"], query="coffee")
    # The only item with vectors, then the one without (score null, as InMemoryStore answers).
    assert _keys(found) == ["titled", "hidden"]
    assert found["items"][0]["score"] < 0.5  # its title is about cars, not coffee
    assert found["items"][1]["score"] is None


async def test_prefix_filter_limit_and_offset_hold_in_search_mode(indexed: Indexed) -> None:
    await _put_memories(indexed.sdk, ["users", "alice"])
    await _put_memories(indexed.sdk, ["users", "bob"])
    only_bob = await indexed.sdk.search_items(["users", "bob"], query="coffee", limit=100)
    assert {tuple(item["namespace"]) for item in only_bob["items"]} == {("users", "bob")}
    food = await indexed.sdk.search_items(["users"], query="coffee", filter={"topic": "food"})
    assert {item["value"]["topic"] for item in food["items"]} == {"food"}
    ranked = _keys(await indexed.sdk.search_items(["users"], query="coffee", limit=10))
    assert len(ranked) == 10
    page = _keys(await indexed.sdk.search_items(["users"], query="coffee", limit=3, offset=2))
    assert page == ranked[2:5]


async def test_replacing_and_deleting_an_item_replaces_and_removes_its_vectors(
    vector_only: Indexed,
) -> None:
    sdk = vector_only.sdk
    await sdk.put_item(["n"], key="k", value={"text": "espresso"}, index=["text"])
    await sdk.put_item(["n"], key="k", value={"text": "puppy"}, index=["text"])
    found = await sdk.search_items(["n"], query="dog")
    assert found["items"][0]["score"] == pytest.approx(1.0, abs=1e-5)
    assert len(found["items"]) == 1
    await sdk.delete_item(["n"], key="k")
    assert (await sdk.search_items(["n"], query="dog"))["items"] == []
    assert await vector_only.rows("SELECT count(*) FROM {vectors}") == [(0,)]
    assert await vector_only.rows("SELECT count(*) FROM {embeddings}") == [(0,)]


async def test_a_provider_that_is_down_gives_503_and_stores_nothing(indexed: Indexed) -> None:
    indexed.server.status_override = 503
    response = await indexed.http.put(
        "/store/items", json={"namespace": ["a"], "key": "k", "value": {"text": "coffee"}}
    )
    assert response.status == 503
    body = await response.json()
    assert "embedding provider unavailable" in body["detail"]
    assert len(indexed.server.requests) == 3  # one try and two retries
    assert await indexed.sdk.get_item(["a"], key="k") is None
    indexed.server.status_override = None
    search = await indexed.http.post("/store/items/search", json={"query": "x"})
    assert search.status == 200


async def test_a_search_while_the_provider_is_down_is_503_too(indexed: Indexed) -> None:
    await indexed.sdk.put_item(["a"], key="k", value={"text": "coffee"})
    indexed.server.status_override = 500
    response = await indexed.http.post("/store/items/search", json={"query": "a new query"})
    assert response.status == 503
    assert "detail" in await response.json()


async def test_transient_failures_are_retried(indexed: Indexed) -> None:
    indexed.server.fail_next = 2
    await indexed.sdk.put_item(["a"], key="k", value={"text": "coffee"})
    assert len(indexed.server.requests) == 3
    assert (await indexed.sdk.get_item(["a"], key="k"))["value"] == {"text": "coffee"}


async def test_a_refusal_is_not_retried(indexed: Indexed) -> None:
    indexed.server.status_override = 401
    response = await indexed.http.put(
        "/store/items", json={"namespace": ["a"], "key": "k", "value": {"text": "coffee"}}
    )
    assert response.status == 503
    assert "(401)" in (await response.json())["detail"]
    assert len(indexed.server.requests) == 1


async def test_a_slow_provider_is_cut_off_by_the_timeout(
    tmp_path: Path,
    embedding_server: EmbeddingServer,
    store_database_url: str | None,
) -> None:
    config = indexed_store_config(
        tmp_path / "d", embedding_server, store_database_url, timeout_seconds=0.2, retries=0
    )
    running = await _open(config, embedding_server)
    try:
        embedding_server.delay_seconds = 2.0
        response = await running.http.put(
            "/store/items", json={"namespace": ["a"], "key": "k", "value": {"t": "x"}}
        )
        assert response.status == 503
        assert "in time" in (await response.json())["detail"]
    finally:
        embedding_server.delay_seconds = 0.0
        await running.close()


async def test_concurrent_writes_share_embedding_requests(indexed: Indexed) -> None:
    await asyncio.gather(
        *(
            indexed.sdk.put_item(["burst"], key=f"k{n}", value={"text": f"coffee {n}"})
            for n in range(40)
        )
    )
    assert indexed.server.texts_embedded == 40
    assert len(indexed.server.requests) < 40
    assert max(len(batch) for batch in indexed.server.requests) > 1


async def test_batches_never_exceed_the_configured_size(
    tmp_path: Path,
    embedding_server: EmbeddingServer,
    store_database_url: str | None,
) -> None:
    running = await _open(
        indexed_store_config(tmp_path / "d", embedding_server, store_database_url, batch_size=4),
        embedding_server,
    )
    try:
        value = {"parts": [f"word{n}" for n in range(3)]}
        await asyncio.gather(
            *(
                running.sdk.put_item(["b"], key=f"k{n}", value=value, index=["parts[*]"])
                for n in range(10)
            )
        )
        assert embedding_server.texts_embedded == 30
        # A single item's 3 texts never split; batches of items stay within 4 texts.
        assert all(len(batch) <= 4 for batch in embedding_server.requests)
    finally:
        await running.close()


async def test_a_repeated_query_is_embedded_once(indexed: Indexed) -> None:
    await _put_memories(indexed.sdk)
    before = len(indexed.server.requests)
    first = await indexed.sdk.search_items(["users"], query="espresso")
    second = await indexed.sdk.search_items(["users"], query="espresso")
    assert first == second
    assert len(indexed.server.requests) == before + 1
    assert indexed.semantic.client.stats.cache_hits == 1


async def test_the_api_key_is_sent_and_never_shown(
    tmp_path: Path,
    embedding_server: EmbeddingServer,
    store_database_url: str | None,
) -> None:
    secret = "sk-test-0123456789"
    config = indexed_store_config(
        tmp_path / "d", embedding_server, store_database_url, api_key=secret
    )
    assert secret not in repr(config)
    running = await _open(config, embedding_server)
    try:
        await running.sdk.put_item(["a"], key="k", value={"t": "coffee"})
        assert embedding_server.authorizations[-1] == f"Bearer {secret}"
        assert secret not in str(running.semantic.describe())
        assert running.semantic.describe()["api_key_set"] is True
    finally:
        await running.close()


async def test_changing_the_fields_reembeds_existing_items_in_the_background(
    tmp_path: Path,
    embedding_server: EmbeddingServer,
    store_database_url: str | None,
) -> None:
    config = indexed_store_config(
        tmp_path / "d", embedding_server, store_database_url, ranking="vector"
    )
    first = await _open(config, embedding_server)
    try:
        for n in range(70):  # more than one re-index batch
            await first.sdk.put_item(["r"], key=f"k{n}", value={"title": "car", "body": "espresso"})
        await first.sdk.put_item(
            ["r"], key="explicit", value={"title": "dog", "body": "x"}, index=["title"]
        )
        top = await first.sdk.search_items(["r"], query="coffee", limit=1)
        whole_value_score = top["items"][0]["score"]
    finally:
        await first.close()
    texts_before = embedding_server.texts_embedded
    second = await _open(with_index(config, fields=("body",)), embedding_server)
    try:
        for _ in range(200):
            if second.semantic.progress.state in ("done", "idle") and second.semantic.progress.done:
                break
            await asyncio.sleep(0.05)
        progress = second.semantic.progress.describe()
        assert progress["state"] == "done"
        assert progress["done"] == progress["total"] == 70  # not the explicit-path item
        assert embedding_server.texts_embedded - texts_before == 70
        top = await second.sdk.search_items(["r"], query="coffee", limit=1)
        assert top["items"][0]["score"] == pytest.approx(1.0, abs=1e-5)
        assert top["items"][0]["score"] > whole_value_score
        assert await second.semantic.stale_count() == 0
    finally:
        await second.close()


async def test_reindex_waits_out_a_provider_outage_and_reports_it(
    tmp_path: Path,
    embedding_server: EmbeddingServer,
    store_database_url: str | None,
) -> None:
    config = indexed_store_config(tmp_path / "d", embedding_server, store_database_url)
    first = await _open(config, embedding_server)
    try:
        await first.sdk.put_item(["r"], key="k", value={"title": "car"})
    finally:
        await first.close()
    embedding_server.status_override = 503
    second = await _open(with_index(config, model="other-model"), embedding_server)
    try:
        for _ in range(200):
            if second.semantic.progress.state == "waiting":
                break
            await asyncio.sleep(0.02)
        described = second.semantic.describe()["reindex"]
        assert described["state"] == "waiting"
        assert "503" in described["last_error"]
        embedding_server.status_override = None
        # An on-demand run (as `gateway store reindex` does) finishes the job.
        progress = await second.semantic.reindex()
        assert (progress.state, progress.done) == ("done", 1)
    finally:
        await second.close()


async def test_the_approximate_index_answers_like_exact_search_and_follows_writes(
    tmp_path: Path,
    embedding_server: EmbeddingServer,
    store_database_url: str | None,
) -> None:
    pytest.importorskip("usearch")  # the optional [vectors] extra; dev installs it
    exact_config = indexed_store_config(
        tmp_path / "d", embedding_server, store_database_url, ranking="vector"
    )
    running = await _open(with_index(exact_config, exact_search_max_vectors=5), embedding_server)
    try:
        await _put_memories(running.sdk, ["u", "a"])
        await _put_memories(running.sdk, ["u", "b"])
        await running.sdk.search_items(["u"], query="espresso", limit=2)
        # Past exact_search_max_vectors: the HNSW index is built on a background thread.
        mirror = running.semantic.mirror
        assert mirror.build_thread is not None
        await asyncio.to_thread(mirror.build_thread.join, 60)
        assert mirror.approximate
        found = await running.sdk.search_items(["u"], query="espresso", limit=2)
        assert sorted(_keys(found)) == ["coffee", "coffee"]
        # A write after the build is seen by the next search (change log catch-up).
        await running.sdk.put_item(["u", "a"], key="coffee", value={"text": "puppy"})
        await running.sdk.delete_item(["u", "b"], key="coffee")
        found = await running.sdk.search_items(["u"], query="espresso", limit=1)
        assert _keys(found) != ["coffee"]
        found = await running.sdk.search_items(["u"], query="dog", limit=2)
        assert found["items"][0]["key"] in ("coffee", "dog")
        assert found["items"][0]["score"] > 0.9
        # Scoped to one namespace and filtered, still right (the index widens its ask).
        scoped = await running.sdk.search_items(
            ["u", "b"], query="espresso", filter={"topic": "food"}, limit=5
        )
        assert _keys(scoped) == ["tea"]
    finally:
        await running.close()


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"embed": "openai:m", "dims": 8, "url": "http://h/v1", "nope": 1}, "unknown key"),
        ({"embed": "cohere:m", "dims": 8}, "unknown provider"),
        ({"embed": "m", "dims": 8}, "'openai:<model>'"),
        ({"embed": "openai:m", "url": "http://h/v1"}, "dims: required"),
        ({"embed": "openai:m", "dims": 0, "url": "http://h/v1"}, "dims: must be"),
        ({"embed": "openai:m", "dims": 8}, "set OPENAI_API_KEY"),
        ({"embed": "openai:m", "dims": 8, "url": "ftp://h"}, "url: must be"),
        ({"embed": "openai:m", "dims": 8, "url": "http://u:p@h/v1"}, "credentials"),
        ({"embed": "openai:m", "dims": 8, "url": "http://h", "fields": ["a..b"]}, "field path"),
        ({"embed": "openai:m", "dims": 8, "url": "http://h", "ranking": "bm25"}, "ranking"),
        ({"embed": "openai:m", "dims": 8, "url": "http://h", "fusion": "max"}, "fusion"),
        ({"embed": "openai:m", "dims": 8, "url": "http://h", "hybrid_weight": 2}, "hybrid_weight"),
        ({"embed": "openai:m", "dims": 8, "url": "http://h", "retries": "3"}, "retries"),
    ],
)
def test_bad_index_sections_are_refused_with_the_key_named(
    section: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=r"store\.index") as error:
        IndexConfig.from_mapping(section, {})
    assert message in str(error.value)


def test_the_index_section_reads_the_key_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-abc")
    config = StoreConfig.from_mapping(
        {"index": {"embed": "openai:text-embedding-3-small", "dims": 1536, "fields": ["text"]}},
        tmp_path,
    )
    index = config.index
    assert index is not None
    assert (index.model, index.dims, index.fields, index.ranking) == (
        "text-embedding-3-small",
        1536,
        ("text",),
        "hybrid",
    )
    assert index.api_key == "sk-abc"
    assert "sk-abc" not in repr(config) and "sk-abc" not in str(index.describe())


async def test_gateway_store_reindex_reembeds_with_a_progress_bar(
    tmp_path: Path,
    embedding_server: EmbeddingServer,
    store_database_url: str | None,
) -> None:
    data_dir = tmp_path / "data"
    config = indexed_store_config(data_dir, embedding_server, store_database_url)
    first = await _open(config, embedding_server)
    try:
        for n in range(5):
            await first.sdk.put_item(["c"], key=f"k{n}", value={"title": "car", "body": "tea"})
    finally:
        await first.close()
    config_file = tmp_path / "gateway.yaml"
    config_file.write_text(
        "store:\n"
        "  index:\n"
        "    embed: openai:test-embed\n"
        "    dims: 64\n"
        f"    url: {embedding_server.url}\n"
        "    fields: [body]\n"
    )
    command = [
        sys.executable, "-m", "gateway", "store", "reindex",
        "--config", str(config_file), "--data-dir", str(data_dir),
    ]  # fmt: skip
    if store_database_url is not None:
        command += ["--database-url", store_database_url]
    process = await asyncio.create_subprocess_exec(
        *command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    _, stderr = await asyncio.wait_for(process.communicate(), timeout=60)
    assert process.returncode == 0, stderr.decode()
    assert "5/5 items" in stderr.decode()
    assert "re-embedded 5 item(s) with test-embed" in stderr.decode()
    assert embedding_server.requests[-1] == ["tea"] * 5
    # Again: nothing is stale any more; --all re-embeds everything.
    process = await asyncio.create_subprocess_exec(
        *command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    _, stderr = await asyncio.wait_for(process.communicate(), timeout=60)
    assert process.returncode == 0
    assert "nothing to re-embed" in stderr.decode()
    embedding_server.status_override = 503
    process = await asyncio.create_subprocess_exec(
        *command, "--all", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    _, stderr = await asyncio.wait_for(process.communicate(), timeout=60)
    assert process.returncode == 1
    assert "embedding provider unavailable" in stderr.decode()


async def test_gateway_store_reindex_without_an_index_says_so(tmp_path: Path) -> None:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway", "store", "reindex", "--data-dir", str(tmp_path),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, stderr = await asyncio.wait_for(process.communicate(), timeout=60)
    assert process.returncode == 2
    assert "no store.index" in stderr.decode()


async def test_a_second_process_on_the_same_store_sees_every_write_by_meaning(
    tmp_path: Path,
    embedding_server: EmbeddingServer,
    store_database_url: str | None,
) -> None:
    config = indexed_store_config(
        tmp_path / "d", embedding_server, store_database_url, ranking="vector"
    )
    one = await _open(config, embedding_server)
    two = await _open(config, embedding_server)  # its own storage, threads and mirror
    try:
        await one.sdk.put_item(["s"], key="a", value={"text": "espresso"}, index=["text"])
        assert _keys(await two.sdk.search_items(["s"], query="coffee")) == ["a"]
        assert two.semantic.mirror.vectors == 1
        await one.sdk.put_item(["s"], key="a", value={"text": "sedan"}, index=["text"])
        await one.sdk.put_item(["s"], key="b", value={"text": "latte"}, index=["text"])
        found = await two.sdk.search_items(["s"], query="coffee")
        assert _keys(found) == ["b", "a"]
        assert found["items"][0]["score"] == pytest.approx(1.0, abs=1e-5)
        await one.sdk.delete_item(["s"], key="b")
        assert _keys(await two.sdk.search_items(["s"], query="coffee")) == ["a"]
        assert two.semantic.mirror.vectors == 1
    finally:
        await one.close()
        await two.close()


async def test_a_mirror_further_behind_than_the_change_log_reloads(
    tmp_path: Path,
    embedding_server: EmbeddingServer,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    store_database_url: str | None,
) -> None:
    from gateway.upstreams.store import vectors

    monkeypatch.setattr(vectors, "CHANGE_LOG_KEEP", 3)
    config = indexed_store_config(
        tmp_path / "d", embedding_server, store_database_url, ranking="vector"
    )
    one = await _open(config, embedding_server)
    two = await _open(config, embedding_server)
    try:
        await one.sdk.put_item(["s"], key="first", value={"text": "puppy"}, index=["text"])
        await two.sdk.search_items(["s"], query="dog")  # two's mirror is now current
        for n in range(6):  # more changes than the log keeps
            await one.sdk.put_item(["s"], key=f"k{n}", value={"text": "sedan"}, index=["text"])
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="gateway.store.vectors"):
            found = await two.sdk.search_items(["s"], query="dog", limit=20)
        assert [r.message for r in caplog.records] == [
            "store vectors loaded: 7 vector(s), exact search"
        ]
        assert _keys(found)[0] == "first"
        assert len(found["items"]) == 7
        assert two.semantic.mirror.vectors == 7
    finally:
        await one.close()
        await two.close()


async def test_a_selective_filter_in_a_broad_scope_still_finds_its_items(
    vector_only: Indexed, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gateway.upstreams.store import mirror

    # Make a scope of more than one item "broad", and give up walking after 64 vectors.
    monkeypatch.setattr(mirror, "SMALL_SCOPE_ITEMS", 1)
    monkeypatch.setattr(mirror, "MAX_WALK", 64)
    for n in range(80):
        await vector_only.sdk.put_item(
            ["f"], key=f"c{n}", value={"text": "espresso", "topic": "drink"}, index=["text"]
        )
    for n in range(3):
        await vector_only.sdk.put_item(
            ["f"], key=f"s{n}", value={"text": f"sedan {n}", "topic": "food"}, index=["text"]
        )
    found = await vector_only.sdk.search_items(
        ["f"], query="coffee", filter={"topic": "food"}, limit=5
    )
    assert sorted(_keys(found)) == ["s0", "s1", "s2"]
    found = await vector_only.sdk.search_items(["f"], query="coffee", limit=5)
    assert all(key.startswith("c") for key in _keys(found))
    assert len(found["items"]) == 5


async def test_only_one_process_on_a_store_runs_the_background_reindex(
    tmp_path: Path,
    embedding_server: EmbeddingServer,
    store_database_url: str | None,
) -> None:
    config = indexed_store_config(tmp_path / "d", embedding_server, store_database_url)
    first = await _open(config, embedding_server)
    try:
        for n in range(30):
            await first.sdk.put_item(["r"], key=f"k{n}", value={"title": "car", "body": "tea"})
    finally:
        await first.close()
    before = embedding_server.texts_embedded
    changed = with_index(config, fields=("body",))
    one, two = await asyncio.gather(
        _open(changed, embedding_server), _open(changed, embedding_server)
    )
    try:
        for _ in range(300):
            states = {one.semantic.progress.state, two.semantic.progress.state}
            if "done" in states:
                break
            await asyncio.sleep(0.02)
        assert "done" in states  # the other: "elsewhere" (or "idle" if it looked late)
        assert await one.semantic.stale_count() == 0
        assert embedding_server.texts_embedded - before == 30  # not 60
    finally:
        await one.close()
        await two.close()


async def test_the_texts_to_embed_are_made_with_the_charged_parse(
    tmp_path: Path, embedding_server: EmbeddingServer
) -> None:
    """The texts an indexed write embeds walk its value as the parse does: they are made by
    the callable read_model charges to the client's parse budget (http_api/body_budget.py),
    and handed to the embedding as made."""
    import json

    from gateway.upstreams.store.app import _put_request
    from gateway.upstreams.store.vectors import texts_to_embed

    store = await start_store(indexed_store_config(tmp_path / "d", embedding_server))
    try:
        semantic = store.app[SEMANTIC_KEY]
        value = {"text": "espresso", "notes": ["crema", {"deep": "ristretto"}]}
        raw = json.dumps({"namespace": ["m"], "key": "k", "value": value}).encode()
        item, forms, texts = _put_request(raw, semantic)
        assert texts and texts == texts_to_embed(item.value, None, semantic.config)
        assert forms == item.stored_forms()
        # An item written with index=false is parsed, and nothing is made to embed.
        raw = json.dumps({"namespace": ["m"], "key": "k", "value": value, "index": False})
        assert _put_request(raw.encode(), semantic)[2] == []
        # Without an index, nothing either.
        assert _put_request(raw.encode(), None)[2] is None
        # A write through the API walks its value for the texts once, in that callable:
        # the embedding takes them as made, and does not walk the value again.
        from gateway.upstreams.store import semantic as semantic_module

        walks: list[object] = []
        walk = semantic_module.texts_to_embed

        def counted(*args: Any) -> list[tuple[str, str]]:
            walks.append(args[0])
            return walk(*args)

        semantic_module.texts_to_embed = counted
        try:
            body = {"namespace": ["m"], "key": "k2", "value": value}
            async with (
                aiohttp.ClientSession() as http,
                http.put(f"{store.url}/store/items", json=body) as r,
            ):
                assert r.status == 204, await r.text()
        finally:
            semantic_module.texts_to_embed = walk
        assert walks == [value]
    finally:
        await store.runner.cleanup()
