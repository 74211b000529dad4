"""The ``store.index`` section: which embedding model the Store uses and how it ranks.

Same shape as the reference's ``store.index`` (``embed``, ``dims``, ``fields``), plus where
the OpenAI-compatible endpoint lives and how search results are ranked.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import urlsplit

from gateway.upstreams.store.text_index import INDEX_PATH_PATTERN
from gateway.urls import display_url

Ranking = Literal["hybrid", "vector"]
Fusion = Literal["convex", "rrf"]

OPENAI_URL = "https://api.openai.com/v1"
MAX_DIMS = 16_384
# Exact search scores every vector: measured ~32 ms p50 for 100k x 384 floats here
# (benchmarks/store_vector_bench.py), so ~20M floats is ~15 ms.
EXACT_SEARCH_FLOATS = 20_000_000
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_PATH = re.compile(INDEX_PATH_PATTERN)


@dataclass(frozen=True)
class IndexConfig:
    """An embedding index over the Store's items (absent: BM25 only)."""

    model: str
    dims: int
    fields: tuple[str, ...] = ("$",)
    url: str = OPENAI_URL
    # Never shown: repr=False keeps it out of logs of the config object.
    api_key: str | None = field(default=None, repr=False)
    ranking: Ranking = "hybrid"
    # How hybrid ranking fuses BM25 and cosine (hybrid.py), and BM25's share in "convex".
    fusion: Fusion = "convex"
    hybrid_weight: float = 0.5
    timeout_seconds: float = 10.0
    retries: int = 3
    batch_size: int = 64
    query_cache_size: int = 1024
    # Up to this many vectors in the store a search is exact (numpy over every vector in
    # memory); above it an approximate (HNSW, usearch) index answers. None: ~15 ms of
    # exact scoring on the measured machine, EXACT_SEARCH_FLOATS / dims vectors (52k at 384
    # dims, 13k at 1536); see docs/store.md.
    exact_search_max_vectors: int | None = None

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("store.index.embed: the model name is empty")
        if not 1 <= self.dims <= MAX_DIMS:
            raise ValueError(f"store.index.dims: must be between 1 and {MAX_DIMS}")
        if not self.fields:
            raise ValueError("store.index.fields: give at least one field path, or '$'")
        for path in self.fields:
            if not _PATH.match(path):
                raise ValueError(f"store.index.fields: {path!r} is not a field path")
        if self.ranking not in ("hybrid", "vector"):
            raise ValueError(
                f"store.index.ranking: must be 'hybrid' or 'vector', got {self.ranking!r}"
            )
        if self.fusion not in ("convex", "rrf"):
            raise ValueError(f"store.index.fusion: must be 'convex' or 'rrf', got {self.fusion!r}")
        if not math.isfinite(self.hybrid_weight) or not 0 <= self.hybrid_weight <= 1:
            raise ValueError("store.index.hybrid_weight: must be between 0 and 1")
        if not math.isfinite(self.timeout_seconds) or not 0 < self.timeout_seconds <= 300:
            raise ValueError("store.index.timeout_seconds: must be > 0 and <= 300")
        if not 0 <= self.retries <= 10:
            raise ValueError("store.index.retries: must be between 0 and 10")
        if not 1 <= self.batch_size <= 2048:
            raise ValueError("store.index.batch_size: must be between 1 and 2048")
        if not 0 <= self.query_cache_size <= 1_000_000:
            raise ValueError("store.index.query_cache_size: must be between 0 and 1000000")
        if self.exact_search_max_vectors is not None and self.exact_search_max_vectors < 0:
            raise ValueError("store.index.exact_search_max_vectors: must be >= 0")
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("store.index.url: must be an http(s) URL such as http://host:port/v1")
        if parts.username or parts.password:
            # A URL is logged and shown in /info; a secret inside it would leak there.
            raise ValueError("store.index.url: put credentials in api_key_env, not in the URL")

    @property
    def exact_limit(self) -> int:
        """Vectors up to which search stays exact."""
        if self.exact_search_max_vectors is not None:
            return self.exact_search_max_vectors
        return EXACT_SEARCH_FLOATS // self.dims

    @property
    def signature(self) -> str:
        """What an item's vectors depend on besides its own paths: model and size."""
        return f"{self.model}|{self.dims}"

    def describe(self) -> dict[str, object]:
        """What ``/info`` shows: no key, only whether one is set."""
        return {
            "model": self.model,
            "dims": self.dims,
            "fields": list(self.fields),
            "url": display_url(self.url),
            "api_key_set": self.api_key is not None,
            "ranking": self.ranking,
            "fusion": self.fusion,
            "hybrid_weight": self.hybrid_weight,
        }

    @classmethod
    def from_mapping(cls, section: object, environ: Mapping[str, str]) -> IndexConfig:
        """Build from the YAML mapping; the API key comes from ``environ`` (never the file)."""
        if not isinstance(section, Mapping):
            raise ValueError(f"store.index: must be a mapping, got {type(section).__name__}")
        unknown = sorted(str(k) for k in section if k not in _KEYS)
        if unknown:
            raise ValueError(
                f"store.index: unknown key(s) {', '.join(unknown)}; "
                f"known keys are {', '.join(sorted(_KEYS))}"
            )
        embed = section.get("embed")
        if not isinstance(embed, str) or ":" not in embed:
            raise ValueError(
                "store.index.embed: must be 'openai:<model>' (any OpenAI-compatible "
                f"/v1/embeddings endpoint; set url for a self-hosted one), got {embed!r}"
            )
        provider, model = embed.split(":", 1)
        if provider != "openai":
            raise ValueError(
                f"store.index.embed: unknown provider {provider!r}; 'openai:<model>' covers "
                "every OpenAI-compatible endpoint (set url for a self-hosted server)"
            )
        kwargs: dict[str, Any] = {"model": model}
        if "dims" not in section:
            raise ValueError("store.index.dims: required (the model's vector size)")
        kwargs["dims"] = _integer("dims", section["dims"])
        if "fields" in section:
            fields = section["fields"]
            if not isinstance(fields, list) or not all(isinstance(f, str) for f in fields):
                raise ValueError("store.index.fields: must be a list of field paths")
            kwargs["fields"] = tuple(fields)
        url = section.get("url", OPENAI_URL)
        if not isinstance(url, str):
            raise ValueError("store.index.url: must be a string")
        kwargs["url"] = url.rstrip("/")
        env_name = section.get("api_key_env", "OPENAI_API_KEY")
        if not isinstance(env_name, str) or not _ENV_NAME.match(env_name):
            raise ValueError("store.index.api_key_env: must be an environment variable name")
        api_key = environ.get(env_name) or None
        if api_key is None and kwargs["url"] == OPENAI_URL:
            raise ValueError(
                f"store.index: the OpenAI API needs a key; set {env_name} in the environment"
            )
        kwargs["api_key"] = api_key
        for key in ("retries", "batch_size", "query_cache_size", "exact_search_max_vectors"):
            if key in section:
                kwargs[key] = _integer(key, section[key])
        for key in ("timeout_seconds", "hybrid_weight"):
            if key in section:
                value = section[key]
                if isinstance(value, bool) or not isinstance(value, int | float):
                    raise ValueError(f"store.index.{key}: must be a number")
                kwargs[key] = float(value)
        for key in ("ranking", "fusion"):
            if key in section:
                kwargs[key] = section[key]
        return cls(**kwargs)


def _integer(key: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"store.index.{key}: must be an integer, got {value!r}")
    return value


_KEYS = frozenset(
    {
        "embed",
        "dims",
        "fields",
        "url",
        "api_key_env",
        "ranking",
        "fusion",
        "hybrid_weight",
        "timeout_seconds",
        "retries",
        "batch_size",
        "query_cache_size",
        "exact_search_max_vectors",
    }
)
