"""Settings of the built-in Store, read from the ``store:`` section of the gateway config."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from gateway.upstreams.http_api.body_budget import address_policy
from gateway.upstreams.http_api.parse_budget import ParseShare

# Hook (issue 12): the embedding index's own section lives in index_config.py.
from gateway.upstreams.store.index_config import IndexConfig

SynchronousMode = Literal["full", "normal"]

# An item may live at most ~100 years; anything longer is a typo, not a retention policy.
MAX_TTL_MINUTES = 52_560_000.0
MAX_BODY_BYTES_CEILING = 64 * 1024 * 1024
# The bounds of the bytes of item values answers may hold (see answers.py).
MAX_ANSWER_BYTES_CEILING = 1024 * 1024 * 1024
MAX_ANSWER_BYTES_IN_FLIGHT_CEILING = 16 * 1024 * 1024 * 1024
# The bounds of store.max_search_depth: a first page of the largest limit (models.MAX_LIMIT)
# always fits; the deepest page the request models allow (MAX_OFFSET + MAX_LIMIT) is the top.
MIN_SEARCH_DEPTH = 1_000
MAX_SEARCH_DEPTH_CEILING = 1_001_000


@dataclass(frozen=True)
class StoreConfig:
    """How the Store keeps its data and when items expire."""

    data_dir: Path
    default_ttl_minutes: float | None = None
    refresh_ttl_on_read: bool = True
    sweep_interval_seconds: float = 60.0
    max_body_bytes: int = 1_048_576
    # The most bytes of item values (their JSON text, UTF-8) one answer (a search or a
    # listing) may hold: beyond it the request is refused (422, ask for a smaller limit),
    # never answered with fewer items than exist. At least max_body_bytes, so that any item
    # can be read; an answer of one item is never refused.
    max_answer_bytes: int = 64 * 1024 * 1024
    # The most bytes of item values all the answers being read or sent at once may hold
    # (503 with Retry-After beyond it); None: 4 x max_answer_bytes.
    max_answer_bytes_in_flight: int | None = None
    # The longest an answer carrying items (a search, a GET) may take to be sent: its bytes
    # count against max_answer_bytes_in_flight until its client has read it, so a client
    # that stops reading is cut off (its connection aborted) and the bytes given back.
    answer_send_timeout_seconds: float = 30.0
    # The deepest a search with a query may page: offset + limit at most this, else 422.
    # Ranking holds every candidate before the page in memory ((id, score) pairs, twice as
    # many for hybrid) and the word ranking's top-N sort holds as many rows, so this bounds
    # a search's memory and CPU; listing mode (no query) pages off an index and is not
    # bound by it. 10,000, as Elasticsearch's index.max_result_window.
    max_search_depth: int = 10_000
    database_filename: str = "store.sqlite3"
    # "full" fsyncs the WAL on every commit (survives power loss); "normal" survives a
    # killed process but may lose the last commits on power loss.
    sqlite_synchronous: SynchronousMode = "full"
    busy_timeout_seconds: float = 5.0
    # The longest one read (a search, a listing) may run on a SQLite reader thread before it
    # is aborted (503): a costly filter over many large items must not hold a reader, and
    # its memory, for long. PostgreSQL's statement_timeout is the same bound there.
    query_timeout_seconds: float = 5.0
    read_threads: int = 4
    # PostgreSQL instead of the SQLite file (set from --database-url, not from the store:
    # section); its pool size and the longest a request waits for the database.
    database_url: str | None = None
    database_pool_size: int = 10
    database_timeout_seconds: float = 5.0
    # While PostgreSQL is away, requests are answered 503 at once and one probe connection
    # is tried this often (the breaker's cool-down).
    database_retry_seconds: float = 1.0
    # Hook (issue 12): search by meaning; None keeps BM25 only.
    index: IndexConfig | None = None
    # The event loop's time for parsing request bodies (shared with the proxy port and the
    # control plane when the gateway runs the Store): one client address's bodies may take
    # body_parse_share of it on average, all together body_parse_total_share; an idle
    # address may take body_parse_burst_seconds at once, all of them the total burst.
    # Past that a body is refused before it is read (429, or 503 for the total), with
    # Retry-After (http_api/parse_budget.py).
    body_parse_share: float = 0.1
    body_parse_total_share: float = 0.5
    body_parse_burst_seconds: float = 0.25
    body_parse_total_burst_seconds: float | None = None  # None: 5 x the burst (1.25 s)
    # Peers whose X-Forwarded-For names the client, besides loopback (the gateway's own
    # connections): the client address the parse budget counts by.
    trusted_proxies: tuple[str, ...] = ()
    # IPv6 clients are counted by this prefix (gateway serve gives its own ipv6_prefix).
    client_ipv6_prefix: int = 64

    def __post_init__(self) -> None:
        _check_ttl("default_ttl_minutes", self.default_ttl_minutes)
        _check_positive("sweep_interval_seconds", self.sweep_interval_seconds, upper=86_400.0)
        _check_positive("busy_timeout_seconds", self.busy_timeout_seconds, upper=600.0)
        _check_positive("query_timeout_seconds", self.query_timeout_seconds, upper=600.0)
        _check_positive(
            "answer_send_timeout_seconds", self.answer_send_timeout_seconds, upper=3600.0
        )
        _check_positive("database_retry_seconds", self.database_retry_seconds, upper=3600.0)
        if not 1 <= self.max_body_bytes <= MAX_BODY_BYTES_CEILING:
            raise ValueError(
                f"store.max_body_bytes: must be between 1 and {MAX_BODY_BYTES_CEILING}, "
                f"got {self.max_body_bytes}"
            )
        if not self.max_body_bytes <= self.max_answer_bytes <= MAX_ANSWER_BYTES_CEILING:
            raise ValueError(
                f"store.max_answer_bytes: must be between store.max_body_bytes "
                f"({self.max_body_bytes}, so that any item can be read) and "
                f"{MAX_ANSWER_BYTES_CEILING}, got {self.max_answer_bytes}"
            )
        if not MIN_SEARCH_DEPTH <= self.max_search_depth <= MAX_SEARCH_DEPTH_CEILING:
            raise ValueError(
                f"store.max_search_depth: must be between {MIN_SEARCH_DEPTH} and "
                f"{MAX_SEARCH_DEPTH_CEILING}, got {self.max_search_depth}"
            )
        in_flight = self.answer_bytes_in_flight
        if not self.max_answer_bytes <= in_flight <= MAX_ANSWER_BYTES_IN_FLIGHT_CEILING:
            raise ValueError(
                f"store.max_answer_bytes_in_flight: must be between store.max_answer_bytes "
                f"({self.max_answer_bytes}) and {MAX_ANSWER_BYTES_IN_FLIGHT_CEILING}, "
                f"got {in_flight}"
            )
        if not 1 <= self.read_threads <= 64:
            raise ValueError(
                f"store.read_threads: must be between 1 and 64, got {self.read_threads}"
            )
        if self.sqlite_synchronous not in ("full", "normal"):
            raise ValueError(
                f"store.sqlite_synchronous: must be 'full' or 'normal', "
                f"got {self.sqlite_synchronous!r}"
            )
        _check_positive("body_parse_share", self.body_parse_share, upper=1.0)
        _check_positive("body_parse_total_share", self.body_parse_total_share, upper=1.0)
        if self.body_parse_total_share < self.body_parse_share:
            raise ValueError(
                f"store.body_parse_total_share: must be at least store.body_parse_share "
                f"({self.body_parse_share}), got {self.body_parse_total_share}"
            )
        _check_positive("body_parse_burst_seconds", self.body_parse_burst_seconds, upper=3600.0)
        if self.body_parse_total_burst_seconds is not None:
            _check_positive(
                "body_parse_total_burst_seconds", self.body_parse_total_burst_seconds, upper=3600.0
            )
        try:
            address_policy(self.trusted_proxies, self.client_ipv6_prefix)
        except ValueError as exc:
            raise ValueError(f"store.trusted_proxies / store.client_ipv6_prefix: {exc}") from None
        name = self.database_filename
        if not name or "/" in name or "\\" in name or name in (".", ".."):
            raise ValueError(f"store.database_filename: must be a plain file name, got {name!r}")

    def parse_share(self) -> ParseShare:
        """The parse budget's shares (``http_api/parse_budget.py``)."""
        return ParseShare(
            per_address=self.body_parse_share,
            total=self.body_parse_total_share,
            burst_seconds=self.body_parse_burst_seconds,
            total_burst_seconds=self.body_parse_total_burst_seconds,
        )

    @property
    def answer_bytes_in_flight(self) -> int:
        """``max_answer_bytes_in_flight``, or its default: four answers of the largest size."""
        if self.max_answer_bytes_in_flight is None:
            return min(4 * self.max_answer_bytes, MAX_ANSWER_BYTES_IN_FLIGHT_CEILING)
        return self.max_answer_bytes_in_flight

    @property
    def database_path(self) -> Path:
        """The SQLite file holding every item."""
        return self.data_dir / self.database_filename

    @classmethod
    def from_mapping(cls, section: Mapping[str, Any], data_dir: Path) -> StoreConfig:
        """Build a config from the YAML ``store:`` mapping; a ``ValueError`` names the bad key."""
        if not isinstance(section, Mapping):
            raise ValueError(f"store: must be a mapping, got {type(section).__name__}")
        unknown = sorted(str(k) for k in section if k not in _READERS)
        if unknown:
            raise ValueError(
                f"store: unknown key(s) {', '.join(unknown)}; "
                f"known keys are {', '.join(sorted(_READERS))}"
            )
        kwargs: dict[str, Any] = {}
        for key, value in section.items():
            kwargs[key] = _READERS[key](key, value)
        return cls(data_dir=Path(data_dir), **kwargs)


def _check_ttl(key: str, value: float | None) -> None:
    if value is None:
        return
    if not math.isfinite(value) or not 0 < value <= MAX_TTL_MINUTES:
        raise ValueError(f"store.{key}: must be a number of minutes > 0 and <= {MAX_TTL_MINUTES:g}")


def _check_positive(key: str, value: float, *, upper: float) -> None:
    if not math.isfinite(value) or not 0 < value <= upper:
        raise ValueError(f"store.{key}: must be a number > 0 and <= {upper:g}, got {value!r}")


def _number(key: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"store.{key}: must be a number, got {value!r}")
    return float(value)


def _optional_number(key: str, value: object) -> float | None:
    return None if value is None else _number(key, value)


def _integer(key: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"store.{key}: must be an integer, got {value!r}")
    return value


def _optional_integer(key: str, value: object) -> int | None:
    return None if value is None else _integer(key, value)


def _boolean(key: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"store.{key}: must be true or false, got {value!r}")
    return value


def _strings(key: str, value: object) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"store.{key}: must be a list of strings (CIDRs), got {value!r}")
    return tuple(value)


def _string(key: str, value: object) -> str:
    if not isinstance(value, str):
        raise ValueError(f"store.{key}: must be a string, got {value!r}")
    return value


_READERS: dict[str, Any] = {
    "default_ttl_minutes": _optional_number,
    "refresh_ttl_on_read": _boolean,
    "sweep_interval_seconds": _number,
    "max_body_bytes": _integer,
    "max_answer_bytes": _integer,
    "max_answer_bytes_in_flight": _optional_integer,
    "max_search_depth": _integer,
    "database_filename": _string,
    "sqlite_synchronous": _string,
    "busy_timeout_seconds": _number,
    "query_timeout_seconds": _number,
    "answer_send_timeout_seconds": _number,
    "read_threads": _integer,
    "body_parse_share": _number,
    "body_parse_total_share": _number,
    "body_parse_burst_seconds": _number,
    "body_parse_total_burst_seconds": _optional_number,
    "trusted_proxies": _strings,
    "client_ipv6_prefix": _integer,
    # Hook (issue 12): the API key is read from the environment, never from the file.
    "index": lambda key, value: IndexConfig.from_mapping(value, os.environ),
}
