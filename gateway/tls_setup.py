"""HTTPS as configured (``Settings.tls_config()``) put to work: the proxy port's
``TlsListener`` and the admin port's ``AdminTls``, each counting its reloads and showing
its certificate's expiry in the metrics.

* ``tls_listener(settings, metrics)``: the proxy port's listener for
  ``DataPlane.start(..., tls=...)`` (None: plain HTTP). ``tls_source`` is its context
  source alone.
* ``admin_tls(settings, metrics)``: the admin port's own certificate as an
  ``ssl.SSLContext`` for aiohttp's ``TCPSite(ssl_context=...)`` that follows
  rotations (None: plain HTTP).
* ``check_tls(settings)``: every configured pair loaded once, for a supervisor to
  refuse a bad one before it forks its workers.

Files that cannot be used raise ``SettingsError`` (the CLI prints it as a configuration
error and exits 2) with ``TlsConfigError``'s message: it names the file and what to do,
and never holds key material or the passphrase. An encrypted key's passphrase is read
from ``GATEWAY_TLS_KEY_PASSPHRASE`` (the environment only: a flag would show in process
lists, a config file would put it beside the key) for either port's key.
"""

from __future__ import annotations

import logging
import os
import ssl
from collections.abc import Mapping
from typing import Final, cast

from gateway.metrics import Metrics
from gateway.proxy.tls import (
    PASSPHRASE_ENV,
    ClientAuth,
    TlsConfigError,
    TlsContextSource,
    TlsFiles,
    TlsListener,
    TlsReloader,
    load_files,
)
from gateway.settings import Settings, SettingsError, TlsConfig, TlsPair

__all__ = [
    "ADMIN",
    "PROXY",
    "AdminTls",
    "admin_tls",
    "check_tls",
    "tls_listener",
    "tls_source",
]

log = logging.getLogger("gateway.tls")

PROXY: Final = "proxy"
ADMIN: Final = "admin"


def proxy_files(config: TlsConfig) -> TlsFiles | None:
    if config.proxy is None:
        return None
    return TlsFiles(
        cert=config.proxy.cert,
        key=config.proxy.key,
        client_ca=config.client_ca,
        # one of the three: Settings.tls_config() refuses anything else
        client_auth=cast(ClientAuth, config.client_auth),
        passphrase_env=PASSPHRASE_ENV,
    )


def admin_files(config: TlsConfig) -> TlsFiles | None:
    pair: TlsPair | None = config.admin
    if pair is None:
        return None
    # No client certificates on the admin port: its callers are operators and
    # Prometheus, which the admin token and the network policy already admit.
    return TlsFiles(cert=pair.cert, key=pair.key, passphrase_env=PASSPHRASE_ENV)


def tls_source(
    settings: Settings, metrics: Metrics, *, env: Mapping[str, str] | None = None
) -> TlsContextSource | None:
    """The proxy port's TLS context source (None: no certificate configured, plain
    HTTP). Its reloads are counted in ``gateway_tls_reloads_total{listener="proxy"}``
    and its certificate's expiry kept in
    ``gateway_tls_certificate_expiry_timestamp_seconds``. ``env``: where the
    passphrase is looked up (default ``os.environ``)."""
    files = proxy_files(settings.tls_config())
    return None if files is None else _source(files, metrics, PROXY, env)


def tls_listener(
    settings: Settings, metrics: Metrics, *, env: Mapping[str, str] | None = None
) -> TlsListener | None:
    """The proxy port's TLS, for ``DataPlane.start(..., tls=...)`` (None: plain HTTP)."""
    config = settings.tls_config()
    source = tls_source(settings, metrics, env=env)
    if source is None:
        return None
    return TlsListener(
        source,
        name=PROXY,
        watch_interval=config.watch_interval,
        handshake_timeout=config.handshake_timeout,
    )


class AdminTls(TlsReloader):
    """The admin port's certificate: ``context`` is what aiohttp's site listens with.

    aiohttp takes one ``ssl.SSLContext`` when the site starts. Its server-name callback
    (which OpenSSL calls for every ClientHello, with or without SNI) hands each
    handshake the source's current context, so a rotation applies to the next
    connection with no restart; open connections keep theirs. (OpenSSL takes the
    certificate, key and ALPN from the context so handed over but keeps the listening
    context's verify mode and protocol versions; on this port those never change.)"""

    def __init__(self, source: TlsContextSource, *, watch_interval: float) -> None:
        super().__init__(source, name=ADMIN, watch_interval=watch_interval)
        self.context = source.context  # the listening context: the pair loaded first

        def current(
            ssl_object: ssl.SSLObject, server_name: str | None, context: ssl.SSLContext
        ) -> None:
            fresh = source.context
            if ssl_object.context is not fresh:
                ssl_object.context = fresh

        self.context.sni_callback = current

    def describe(self) -> str:
        return f"{super().describe()}; plain HTTP fails the handshake"


def admin_tls(
    settings: Settings, metrics: Metrics, *, env: Mapping[str, str] | None = None
) -> AdminTls | None:
    """The admin port's own certificate (``tls.admin``), or None: plain HTTP."""
    config = settings.tls_config()
    files = admin_files(config)
    if files is None:
        return None
    return AdminTls(_source(files, metrics, ADMIN, env), watch_interval=config.watch_interval)


def check_tls(settings: Settings, env: Mapping[str, str] | None = None) -> None:
    """Load every configured pair once (``SettingsError`` when one cannot be used):
    for a supervisor, so that a bad file is one clear message and not one per worker."""
    config = settings.tls_config()
    for listener, files in ((PROXY, proxy_files(config)), (ADMIN, admin_files(config))):
        if files is not None:
            try:
                load_files(files, os.environ if env is None else env)
            except TlsConfigError as exc:
                raise SettingsError(_where(listener, exc)) from None


def _where(listener: str, exc: TlsConfigError) -> str:
    return f"HTTPS on the {listener} port: {exc}"


def _source(
    files: TlsFiles, metrics: Metrics, listener: str, env: Mapping[str, str] | None
) -> TlsContextSource:
    expiry = metrics.tls_expiry.labels(listener)
    loaded: list[TlsContextSource] = []  # the source, once made (the callback needs it)

    def reloaded(ok: bool, detail: str) -> None:
        # ok with "unchanged": the files were read again and hold the pair in force.
        outcome = "refused" if not ok else "unchanged" if detail == "unchanged" else "ok"
        metrics.child(metrics.tls_reloads, listener, outcome).inc()
        if ok and loaded:
            expiry.set(loaded[0].not_after().timestamp())

    try:
        source = TlsContextSource(files, on_reload=reloaded, env=env)
    except TlsConfigError as exc:
        raise SettingsError(_where(listener, exc)) from None
    loaded.append(source)
    expiry.set(source.not_after().timestamp())
    return source
