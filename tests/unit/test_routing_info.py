"""The admin /info's upstream list: names, URLs without credentials, upgrade flags."""

from __future__ import annotations

from gateway.proxy.routing import Router
from gateway.proxy.upstream_pool import Upstream


def test_info_names_each_upstream_with_its_url_never_its_credentials():
    router = Router(
        [("/store", Upstream("store", "http://127.0.0.1:9001")),
         ("/api", Upstream("route:/api", "https://user:s3cret@api.internal:8443/base"))],
        Upstream("default", "http://[::1]:9000", upgrade=True),
    )  # fmt: skip
    assert router.info() == [
        {"prefix": "/store", "upstream": "store", "url": "http://127.0.0.1:9001",
         "upgrade": False},
        {"prefix": "/api", "upstream": "route:/api", "url": "https://***@api.internal:8443/base",
         "upgrade": False},
        {"prefix": "(everything else)", "upstream": "default", "url": "http://[::1]:9000",
         "upgrade": True},
    ]  # fmt: skip
    assert "s3cret" not in repr(router.info())
