"""The built-in Store: a namespaced JSON document store with search, served by its own app."""

from __future__ import annotations

from gateway.upstreams.store.app import create_store_app
from gateway.upstreams.store.config import StoreConfig

__all__ = ["StoreConfig", "create_store_app"]
