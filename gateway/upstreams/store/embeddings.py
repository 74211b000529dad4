"""Client of an OpenAI-compatible ``/v1/embeddings`` endpoint: batching, retries, a cache.

* Batching: texts asked for by concurrent callers in the same event-loop turn go out in one
  request (up to ``batch_size`` texts each), so a burst of writes costs a few calls, not one
  per item.
* Faults: each call is bounded by ``timeout_seconds`` and retried ``retries`` times with
  exponential backoff on timeouts, connection errors, 429 and 5xx. What still fails raises
  ``EmbeddingUnavailable`` (the Store answers 503); nothing is half-written because the
  vectors are computed before the write is queued.
* Cache: query embeddings are kept in an LRU so a repeated search costs no call.
* The API key goes only into the Authorization header; it is never logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import aiohttp
import numpy as np
import numpy.typing as npt

from gateway.upstreams.store.errors import StoreRequestError
from gateway.upstreams.store.index_config import IndexConfig

log = logging.getLogger("gateway.store.embeddings")

Vector = npt.NDArray[np.float32]
_BACKOFF_BASE_SECONDS = 0.1
_BACKOFF_CAP_SECONDS = 2.0
# Texts longer than this are cut before they are sent: providers refuse over-long input
# (OpenAI: 8191 tokens), and one oversized field must not fail the whole batch.
MAX_TEXT_CHARS = 16_000


class EmbeddingUnavailable(StoreRequestError):
    """The embedding provider could not embed the texts after every retry."""

    def __init__(self, reason: str) -> None:
        super().__init__(503, f"embedding provider unavailable: {reason}; retry the request")
        self.reason = reason


class _Permanent(Exception):
    """A provider answer that retrying will not change (bad request, wrong key, bad shape)."""


@dataclass
class EmbeddingStats:
    """Counters for tests, benchmarks and ``/info``."""

    requests: int = 0
    texts: int = 0
    retries: int = 0
    failures: int = 0
    cache_hits: int = 0
    batch_sizes: list[int] = field(default_factory=list)


@dataclass
class _Pending:
    texts: list[str]
    done: asyncio.Future[list[Vector]]


class EmbeddingClient:
    """Embeds texts through the configured endpoint; vectors come back L2-normalised."""

    def __init__(self, config: IndexConfig) -> None:
        self._config = config
        self._session: aiohttp.ClientSession | None = None
        self._pending: list[_Pending] = []
        self._flush_scheduled = False
        self._cache: OrderedDict[str, Vector] = OrderedDict()
        self._tasks: set[asyncio.Task[None]] = set()
        self.stats = EmbeddingStats()

    async def open(self) -> None:
        if self._session is None:
            self._session = aiohttp.ClientSession()

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def embed_query(self, text: str) -> Vector:
        """The query's vector, from the cache when the same query was embedded before."""
        cached = self._cache.get(text)
        if cached is not None:
            self._cache.move_to_end(text)
            self.stats.cache_hits += 1
            return cached
        (vector,) = await self.embed([text])
        if self._config.query_cache_size:
            self._cache[text] = vector
            if len(self._cache) > self._config.query_cache_size:
                self._cache.popitem(last=False)
        return vector

    async def embed(self, texts: Sequence[str]) -> list[Vector]:
        """One vector per text, in order; joins whatever other callers ask in this turn."""
        if not texts:
            return []
        loop = asyncio.get_running_loop()
        pending = _Pending([t[:MAX_TEXT_CHARS] for t in texts], loop.create_future())
        self._pending.append(pending)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            loop.call_soon(self._flush)
        return await pending.done

    def _flush(self) -> None:
        self._flush_scheduled = False
        waiting, self._pending = self._pending, []
        batch: list[_Pending] = []
        size = 0
        for pending in waiting:
            if batch and size + len(pending.texts) > self._config.batch_size:
                self._send(batch)
                batch, size = [], 0
            batch.append(pending)
            size += len(pending.texts)
        if batch:
            self._send(batch)

    def _send(self, batch: list[_Pending]) -> None:
        task = asyncio.create_task(self._answer(batch), name="store-embed")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _answer(self, batch: list[_Pending]) -> None:
        texts = [text for pending in batch for text in pending.texts]
        try:
            vectors = await self._embed_with_retries(texts)
        except EmbeddingUnavailable as exc:
            for pending in batch:
                if not pending.done.done():
                    pending.done.set_exception(exc)
            return
        start = 0
        for pending in batch:
            end = start + len(pending.texts)
            if not pending.done.done():
                pending.done.set_result(vectors[start:end])
            start = end

    async def _embed_with_retries(self, texts: list[str]) -> list[Vector]:
        attempts = self._config.retries + 1
        reason = "no attempt made"
        for attempt in range(attempts):
            if attempt:
                self.stats.retries += 1
                delay = min(_BACKOFF_CAP_SECONDS, _BACKOFF_BASE_SECONDS * 2 ** (attempt - 1))
                await asyncio.sleep(delay * (0.5 + random.random()))  # jitter
            try:
                return await self._call(texts)
            except _Permanent as exc:
                reason = str(exc)
                break
            except (TimeoutError, aiohttp.ClientError, _Transient) as exc:
                reason = _describe(exc)
        self.stats.failures += 1
        log.warning(
            "embedding %d text(s) with %s failed: %s", len(texts), self._config.model, reason
        )
        raise EmbeddingUnavailable(reason)

    async def _call(self, texts: list[str]) -> list[Vector]:
        if self._session is None:
            raise _Permanent("the embedding client is not open")
        headers = {"Content-Type": "application/json"}
        if self._config.api_key is not None:
            headers["Authorization"] = f"Bearer {self._config.api_key}"
        body = {"model": self._config.model, "input": texts, "encoding_format": "float"}
        self.stats.requests += 1
        self.stats.batch_sizes.append(len(texts))
        timeout = aiohttp.ClientTimeout(total=self._config.timeout_seconds)
        async with self._session.post(
            f"{self._config.url}/embeddings", json=body, headers=headers, timeout=timeout
        ) as response:
            if response.status == 429 or response.status >= 500:
                raise _Transient(f"the provider answered {response.status}")
            if response.status != 200:
                raise _Permanent(f"the provider refused the request ({response.status})")
            try:
                answer = await response.json(content_type=None)
            except ValueError as exc:
                raise _Transient("the provider's answer is not JSON") from exc
        vectors = _vectors_from(answer, len(texts), self._config.dims)
        self.stats.texts += len(texts)
        return vectors


class _Transient(Exception):
    """A provider answer worth retrying (overloaded, failing, garbled)."""


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "the provider did not answer in time"
    if isinstance(exc, aiohttp.ClientConnectionError):
        return "cannot connect to the provider"
    return str(exc) or type(exc).__name__


def _vectors_from(answer: object, count: int, dims: int) -> list[Vector]:
    """The vectors of an OpenAI-shaped answer, ordered by ``index``, unit length."""
    data = answer.get("data") if isinstance(answer, dict) else None
    if not isinstance(data, list) or len(data) != count:
        raise _Permanent(f"the provider's answer does not hold {count} embedding(s)")
    ordered: list[object] = [None] * count
    for position, entry in enumerate(data):
        if not isinstance(entry, dict):
            raise _Permanent("the provider's answer has an entry that is not an object")
        index = entry.get("index", position)
        if not isinstance(index, int) or not 0 <= index < count:
            raise _Permanent("the provider's answer has a bad index")
        ordered[index] = entry.get("embedding")
    vectors = []
    for raw in ordered:
        if not isinstance(raw, list) or len(raw) != dims:
            raise _Permanent(f"the provider's embedding does not have {dims} dimensions")
        try:
            vector = np.asarray(raw, dtype=np.float32)
        except (TypeError, ValueError) as exc:
            raise _Permanent("the provider's embedding holds non-numbers") from exc
        vectors.append(normalised(vector))
    return vectors


def normalised(vector: Vector) -> Vector:
    """Unit length, so cosine similarity is a dot product; a zero vector stays zero."""
    norm = float(np.linalg.norm(vector))
    if not np.isfinite(norm):
        raise _Permanent("the provider's embedding holds non-finite numbers")
    return vector if norm == 0.0 else (vector / norm).astype(np.float32)
