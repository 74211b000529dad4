"""StoreConfig.from_mapping: the ``store:`` section of the gateway config file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gateway.upstreams.store import StoreConfig


def test_defaults(tmp_path: Path) -> None:
    config = StoreConfig.from_mapping({}, tmp_path)
    assert config == StoreConfig(data_dir=tmp_path)
    assert config.default_ttl_minutes is None
    assert config.refresh_ttl_on_read is True
    assert config.sweep_interval_seconds == 60.0
    assert config.max_body_bytes == 1_048_576
    assert config.max_answer_bytes == 64 * 1_048_576
    assert config.answer_bytes_in_flight == 4 * config.max_answer_bytes
    assert config.database_path == tmp_path / "store.sqlite3"


def test_every_key(tmp_path: Path) -> None:
    config = StoreConfig.from_mapping(
        {
            "default_ttl_minutes": 30,
            "refresh_ttl_on_read": False,
            "sweep_interval_seconds": 5,
            "max_body_bytes": 2048,
            "max_answer_bytes": 4096,
            "max_answer_bytes_in_flight": 10_000,
            "database_filename": "items.db",
            "sqlite_synchronous": "normal",
            "busy_timeout_seconds": 2.5,
            "read_threads": 2,
        },
        tmp_path,
    )
    assert config.default_ttl_minutes == 30.0
    assert config.refresh_ttl_on_read is False
    assert config.sweep_interval_seconds == 5.0
    assert config.max_body_bytes == 2048
    assert config.max_answer_bytes == 4096
    assert config.answer_bytes_in_flight == 10_000
    assert config.database_path == tmp_path / "items.db"
    assert config.sqlite_synchronous == "normal"
    assert config.busy_timeout_seconds == 2.5
    assert config.read_threads == 2


@pytest.mark.parametrize(
    ("section", "key"),
    [
        ({"default_ttl": 5}, "default_ttl"),
        ({"default_ttl_minutes": 0}, "default_ttl_minutes"),
        ({"default_ttl_minutes": -1}, "default_ttl_minutes"),
        ({"default_ttl_minutes": "5"}, "default_ttl_minutes"),
        ({"default_ttl_minutes": float("nan")}, "default_ttl_minutes"),
        ({"refresh_ttl_on_read": "yes"}, "refresh_ttl_on_read"),
        ({"refresh_ttl_on_read": 1}, "refresh_ttl_on_read"),
        ({"sweep_interval_seconds": 0}, "sweep_interval_seconds"),
        ({"sweep_interval_seconds": True}, "sweep_interval_seconds"),
        ({"max_body_bytes": 0}, "max_body_bytes"),
        ({"max_body_bytes": 1.5}, "max_body_bytes"),
        ({"max_body_bytes": 10**12}, "max_body_bytes"),
        ({"max_answer_bytes": 1000}, "max_answer_bytes"),  # below max_body_bytes
        ({"max_answer_bytes": 2**40}, "max_answer_bytes"),
        ({"max_answer_bytes": 2.5e6}, "max_answer_bytes"),
        ({"max_answer_bytes_in_flight": 2_000_000}, "max_answer_bytes_in_flight"),
        ({"max_answer_bytes_in_flight": 2**40}, "max_answer_bytes_in_flight"),
        ({"max_answer_bytes_in_flight": "1G"}, "max_answer_bytes_in_flight"),
        ({"sqlite_synchronous": "off"}, "sqlite_synchronous"),
        ({"database_filename": "../escape.db"}, "database_filename"),
        ({"read_threads": 0}, "read_threads"),
        ({"busy_timeout_seconds": -1}, "busy_timeout_seconds"),
    ],
)
def test_bad_values_name_the_key(tmp_path: Path, section: dict[str, Any], key: str) -> None:
    with pytest.raises(ValueError, match=key):
        StoreConfig.from_mapping(section, tmp_path)


def test_section_must_be_a_mapping(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="store"):
        StoreConfig.from_mapping(["default_ttl_minutes"], tmp_path)  # type: ignore[arg-type]
