"""Fetching a JWKS over HTTPS, off the request path, with a deadline and a size bound.

The one module of ``identity`` that speaks HTTP. TLS certificates are verified (aiohttp's
default, never turned off here) and redirects are not followed: a redirect could lead
from the configured https:// URL to a plain-HTTP one, whose keys anyone on the path could
replace.
"""

from __future__ import annotations

from typing import Final

import aiohttp

from gateway.identity.jwks import MAX_JWKS_BYTES
from gateway.urls import display_url, urls_shown

FETCH_TIMEOUT_SECONDS: Final = 10.0


class JwksFetchError(Exception):
    """The JWKS could not be fetched; the message says why (no body content)."""


class JwksFetcher:
    """GETs one JWKS URL. Uses the process's shared ``ClientSession`` when given one,
    else its own, closed by ``close()``."""

    def __init__(
        self,
        url: str,
        session: aiohttp.ClientSession | None = None,
        timeout: float = FETCH_TIMEOUT_SECONDS,
        max_bytes: int = MAX_JWKS_BYTES,
    ) -> None:
        self.url = url
        self.shown = display_url(url)  # what messages say: never its credentials
        self._session = session
        self._own_session: aiohttp.ClientSession | None = None
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._max_bytes = max_bytes

    async def fetch(self) -> bytes:
        """The document's bytes; ``JwksFetchError`` on any failure."""
        session = self._session or self._own()
        try:
            async with session.get(
                self.url,
                allow_redirects=False,
                timeout=self._timeout,
                headers={"Accept": "application/json, application/jwk-set+json"},
            ) as response:
                if response.status != 200:
                    raise JwksFetchError(f"HTTP {response.status} from {self.shown}")
                declared = response.content_length
                if declared is not None and declared > self._max_bytes:
                    raise JwksFetchError(f"{self.shown} answered {declared} bytes, over the bound")
                body = bytearray()
                # Counted after decompression, so a small gzip bomb is stopped too.
                async for chunk in response.content.iter_chunked(65536):
                    body += chunk
                    if len(body) > self._max_bytes:
                        raise JwksFetchError(f"{self.shown} answered over {self._max_bytes} bytes")
                return bytes(body)
        except (aiohttp.ClientError, TimeoutError) as exc:
            # (aiohttp's own text may name the URL: shown, not as configured)
            why = urls_shown(str(exc), self.shown)
            raise JwksFetchError(f"cannot fetch {self.shown}: {type(exc).__name__}: {why}") from exc

    def _own(self) -> aiohttp.ClientSession:
        if self._own_session is None or self._own_session.closed:
            self._own_session = aiohttp.ClientSession()
        return self._own_session

    async def close(self) -> None:
        if self._own_session is not None:
            await self._own_session.close()
            self._own_session = None
