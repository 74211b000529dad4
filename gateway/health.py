"""``gateway health``: probe this host's gateway, as a container healthcheck does.

It reads the settings ``gateway serve`` reads from ``GATEWAY_*`` and the config file (not
``serve``'s command-line flags: a deployment that sets the port with ``--port`` gives
``gateway health`` the same setting as ``GATEWAY_PORT``), so it follows the port and
speaks HTTPS when the proxy port does: a probe hard-wired to
``http://127.0.0.1:$GATEWAY_PORT`` failed (400) as soon as TLS was turned on, or the port
was set in the config file.

The certificate is not verified: the probe talks to its own host's loopback and sends
nothing secret, and a certificate for the service's public name never names 127.0.0.1.
When the proxy port asks every client for a certificate (``client_auth: required``) the
probe asks the admin port instead, which answers ``/ok`` and ``/ready`` alike.
"""

from __future__ import annotations

import http.client
import ssl
from dataclasses import dataclass

from gateway.settings import Settings

PROBE_TIMEOUT_SECONDS = 2.0  # under a healthcheck's usual 3 s


@dataclass(frozen=True)
class Target:
    """Where the probe goes."""

    host: str
    port: int
    https: bool
    port_name: str  # "proxy" or "admin", for messages

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.https else 'http'}://{host}:{self.port}"


def _loopback(host: str) -> str:
    """Where a listener bound to ``host`` is reached from this host."""
    if host in ("", "0.0.0.0", "*"):
        return "127.0.0.1"
    if host == "::":
        return "::1"
    return host


def target(settings: Settings) -> Target:
    tls = settings.tls_config()
    if tls.proxy is not None and tls.client_auth == "required":
        return Target(_loopback(settings.admin_host), settings.admin_port, tls.admin is not None,
                      "admin")  # fmt: skip
    return Target(_loopback(settings.host), settings.port, tls.proxy is not None, "proxy")


def probe(where: Target, path: str, timeout: float = PROBE_TIMEOUT_SECONDS) -> tuple[bool, str]:
    """(healthy, what was seen): healthy when ``path`` answers 200."""
    connection: http.client.HTTPConnection
    if where.https:
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE  # see the module's docstring
        connection = http.client.HTTPSConnection(
            where.host, where.port, timeout=timeout, context=context
        )
    else:
        connection = http.client.HTTPConnection(where.host, where.port, timeout=timeout)
    try:
        connection.request(
            "GET", path, headers={"Host": "127.0.0.1", "User-Agent": "gateway-health"}
        )
        response = connection.getresponse()
        body = response.read(4096)
    except (OSError, http.client.HTTPException) as exc:
        return False, f"{where.url}{path} ({where.port_name} port): {type(exc).__name__}: {exc}"
    finally:
        connection.close()
    seen = f"{where.url}{path} ({where.port_name} port): {response.status}"
    if response.status != 200:
        detail = body.decode("utf-8", "replace").strip()
        return False, f"{seen} {detail[:300]}" if detail else seen
    return True, seen
