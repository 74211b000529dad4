"""--database-url: read from flag, environment and config file; checked without ever
showing its password (``display_url``: tests/unit/test_urls_shown.py)."""

from __future__ import annotations

import pytest

from gateway.cli import build_parser
from gateway.settings import SettingsError, load_settings

URL = "postgresql://gw:s3cret-pw@db.internal:5432/gateway"


def test_the_flag_environment_and_config_file_set_it(tmp_path) -> None:
    args = vars(build_parser().parse_args(["serve", "--database-url", URL]))
    assert load_settings({"database_url": args["database_url"]}, env={}).database_url == URL
    assert load_settings({}, env={"GATEWAY_DATABASE_URL": URL}).database_url == URL
    config = tmp_path / "gateway.yaml"
    config.write_text(f"database_url: {URL}\n")
    assert load_settings({}, env={}, config_file=str(config)).database_url == URL
    assert load_settings({}, env={}).database_url is None  # SQLite


def test_a_bad_url_is_refused_without_its_password() -> None:
    with pytest.raises(SettingsError) as caught:
        load_settings({"database_url": "mysql://gw:s3cret-pw@db/gateway"}, env={})
    assert "postgresql://" in str(caught.value)
    assert "s3cret-pw" not in str(caught.value)


# How the URL is shown (without user, password or query): tests/unit/test_urls_shown.py.
