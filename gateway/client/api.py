"""Async client of the deployments control plane (hosted, or the gateway's built-in one).

Every call carries the API key: redirects are never followed (a 3xx is an error naming
where the server pointed), URLs are shown without their credentials, and answers are
read up to a bound.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any
from urllib.parse import quote

import aiohttp
from yarl import URL

from gateway.urls import display_url

from .errors import ControlPlaneError, RevisionFailed, RevisionWaitTimeout

DEFAULT_URL = "http://127.0.0.1:8080"
DEFAULT_POLL_INTERVAL = 60.0
DEFAULT_WAIT_TIMEOUT = 1800.0
DEFAULT_REQUEST_TIMEOUT = 30.0
# Enough of an error body to diagnose; a misconfigured URL can return megabytes of HTML.
MAX_ERROR_TEXT = 4000
# At most this much of an error body is read (the rest is never received: the connection
# is closed); MAX_ERROR_TEXT characters of it are shown.
MAX_ERROR_BODY_BYTES = 64 * 1024
# An expected answer larger than this is refused. The largest legitimate one, a page of
# 100 deployments or revisions, is a few MiB at most (request bodies are bounded too).
MAX_RESPONSE_BYTES = 64 * 1024 * 1024
# Ends a wait without DEPLOYED and without FAILED in the name.
NON_FAILED_DEAD_ENDS = frozenset({"INTERRUPTED", "SKIPPED"})

JSONObject = dict[str, Any]


@dataclass(frozen=True)
class WaitProgress:
    """One read of a revision while waiting for it."""

    deployment_id: str
    revision_id: str
    status: str
    elapsed: float
    polls: int
    changed: bool


ProgressCallback = Callable[[WaitProgress], None]


@dataclass(frozen=True)
class ClientSettings:
    """Address and credentials, from explicit values or the environment."""

    base_url: str
    api_key: str
    tenant_id: str

    @classmethod
    def resolve(
        cls,
        env: Mapping[str, str],
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        tenant_id: str | None = None,
    ) -> ClientSettings:
        """Explicit values win over ``GATEWAY_CONTROL_PLANE_URL``, ``GATEWAY_API_KEY`` and
        ``GATEWAY_TENANT_ID``. ``LANGSMITH_API_KEY`` (the hosted service's key) is the
        fallback for the key only when the URL is ``https://``, which is never the default:
        it is not sent in clear, nor to whatever listens on the default local port.
        Raises ``ValueError`` (saying what to set) when the key or tenant is missing or the
        URL is not http(s)."""
        url = base_url or env.get("GATEWAY_CONTROL_PLANE_URL") or DEFAULT_URL
        try:
            parsed: URL | None = URL(url)
        except ValueError:
            parsed = None
        if parsed is None or parsed.scheme not in ("http", "https") or not parsed.host:
            raise ValueError(
                f"control plane URL must be http(s)://host[:port][/prefix]: {display_url(url)}"
            )
        key = api_key or env.get("GATEWAY_API_KEY") or ""
        if not key:
            foreign = env.get("LANGSMITH_API_KEY") or ""
            if foreign and parsed.scheme == "https":
                key = foreign
            elif foreign:
                raise ValueError(
                    f"no API key for {display_url(url)}: LANGSMITH_API_KEY is set but is only "
                    "used with an https:// control plane URL (--url or "
                    "GATEWAY_CONTROL_PLANE_URL), never sent over plain HTTP; pass --api-key "
                    "or set GATEWAY_API_KEY to this control plane's key"
                )
            else:
                raise ValueError(
                    "no API key: pass --api-key or set GATEWAY_API_KEY (LANGSMITH_API_KEY "
                    "is used too, with an https:// control plane URL)"
                )
        tenant = tenant_id or env.get("GATEWAY_TENANT_ID") or ""
        if not tenant:
            raise ValueError("no tenant id: pass --tenant-id or set GATEWAY_TENANT_ID")
        return cls(url, key, tenant)


class ControlPlaneClient:
    """The quick-start calls; use as ``async with ControlPlaneClient(...) as client``.

    Every call checks the status the API documents (201 create, 200 read/list/patch,
    204 delete) and raises :class:`ControlPlaneError` with the response text otherwise.
    ``base_url`` may carry a path prefix such as ``/api-host``. Redirects are not
    followed (they would carry the API key, which aiohttp does not drop across origins,
    and the body with its secret values elsewhere): a 3xx raises ``ControlPlaneError``.
    """

    def __init__(
        self,
        base_url: str,
        api_key: str,
        tenant_id: str,
        *,
        request_timeout: float = DEFAULT_REQUEST_TIMEOUT,
        session: aiohttp.ClientSession | None = None,
    ) -> None:
        self._base = URL(base_url)
        self._shown_base = display_url(base_url)  # what messages say: never its credentials
        self._headers = {"X-Api-Key": api_key, "X-Tenant-Id": tenant_id}
        self._timeout = aiohttp.ClientTimeout(total=request_timeout)
        self._session = session
        self._owns_session = session is None

    @classmethod
    def from_settings(
        cls, settings: ClientSettings, *, request_timeout: float = DEFAULT_REQUEST_TIMEOUT
    ) -> ControlPlaneClient:
        return cls(
            settings.base_url,
            settings.api_key,
            settings.tenant_id,
            request_timeout=request_timeout,
        )

    async def __aenter__(self) -> ControlPlaneClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the HTTP session if this client created it."""
        if self._owns_session and self._session is not None:
            await self._session.close()
            self._session = None

    def _url(self, path: str) -> URL:
        return self._base.with_path(self._base.raw_path.rstrip("/") + path, encoded=True)

    async def _request(
        self,
        method: str,
        path: str,
        expected: int,
        *,
        body: Mapping[str, Any] | None = None,
        params: Mapping[str, str] | None = None,
    ) -> Any:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        what = f"{method} {path}"
        url = self._url(path)
        try:
            async with self._session.request(
                method,
                url,
                json=body,
                params=params,
                headers=self._headers,
                timeout=self._timeout,
                allow_redirects=False,  # never: see the class docstring
            ) as response:
                status = response.status
                if 300 <= status < 400:
                    raise ControlPlaneError(
                        f"{what}: the control plane at {self._shown_base} answered {status}, "
                        f"redirecting to {_location(url, response)}; not followed (a redirect "
                        "would carry the API key and the request body there). If you trust "
                        "that address, use it as the control plane URL.",
                        status=status,
                    )
                if status != expected:
                    raw, cut = await _read_bounded(response, MAX_ERROR_BODY_BYTES)
                    text = raw.decode("utf-8", "replace")
                    shown = text[:MAX_ERROR_TEXT]
                    more = " [cut]" if cut or len(text) > MAX_ERROR_TEXT else ""
                    raise ControlPlaneError(
                        f"{what}: expected {expected}, got {status}: {shown}{more}",
                        status=status,
                        text=shown,
                    )
                declared = response.content_length
                if declared is not None and declared > MAX_RESPONSE_BYTES:
                    raise _too_large(what, status)
                raw, cut = await _read_bounded(response, MAX_RESPONSE_BYTES)
                if cut:
                    raise _too_large(what, status)
                text = raw.decode("utf-8", "replace")
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise ControlPlaneError(
                f"{what}: control plane unreachable at {self._shown_base}: "
                f"{self._scrub(str(exc)) or type(exc).__name__}"
            ) from None
        if expected == 204:
            return None
        try:
            return json.loads(text)
        except ValueError:
            raise ControlPlaneError(
                f"{what}: response is not JSON: {text[:MAX_ERROR_TEXT]}",
                status=expected,
                text=text[:MAX_ERROR_TEXT],
            ) from None

    async def _object(self, method: str, path: str, expected: int, **kwargs: Any) -> JSONObject:
        data = await self._request(method, path, expected, **kwargs)
        if not isinstance(data, dict):
            raise ControlPlaneError(f"{method} {path}: expected a JSON object, got {data!r:.200}")
        return data

    def _scrub(self, text: str) -> str:
        """``text`` (an aiohttp error, which may quote the URL) without the base URL's
        user or password."""
        text = text.replace(str(self._base), self._shown_base)
        for secret in (
            self._base.raw_password,
            self._base.password,
            self._base.raw_user,
            self._base.user,
        ):
            if secret and len(secret) >= 3:  # a shorter one would mangle the message
                text = text.replace(secret, "***")
        return text

    async def create_deployment(self, body: Mapping[str, Any]) -> JSONObject:
        """``POST /v2/deployments`` (201); the answer holds ``id`` and ``latest_revision_id``."""
        return await self._object("POST", "/v2/deployments", 201, body=body)

    async def list_deployments(
        self, *, limit: int = 20, offset: int = 0, name_contains: str | None = None
    ) -> JSONObject:
        """``GET /v2/deployments`` (200): ``{"resources": [...], "offset": next}``."""
        params = {"limit": str(limit), "offset": str(offset)}
        if name_contains:
            params["name_contains"] = name_contains
        return await self._object("GET", "/v2/deployments", 200, params=params)

    async def get_deployment(self, deployment_id: str) -> JSONObject:
        """``GET /v2/deployments/{id}`` (200)."""
        return await self._object("GET", f"/v2/deployments/{_seg(deployment_id)}", 200)

    async def update_deployment(self, deployment_id: str, body: Mapping[str, Any]) -> JSONObject:
        """``PATCH /v2/deployments/{id}`` (200); ``source_revision_config`` or ``secrets``
        start a new revision."""
        return await self._object("PATCH", f"/v2/deployments/{_seg(deployment_id)}", 200, body=body)

    async def delete_deployment(self, deployment_id: str) -> None:
        """``DELETE /v2/deployments/{id}`` (204)."""
        await self._request("DELETE", f"/v2/deployments/{_seg(deployment_id)}", 204)

    async def list_revisions(
        self, deployment_id: str, *, limit: int = 20, offset: int = 0
    ) -> JSONObject:
        """``GET /v2/deployments/{id}/revisions`` (200), latest first."""
        return await self._object(
            "GET",
            f"/v2/deployments/{_seg(deployment_id)}/revisions",
            200,
            params={"limit": str(limit), "offset": str(offset)},
        )

    async def get_revision(self, deployment_id: str, revision_id: str) -> JSONObject:
        """``GET /v2/deployments/{id}/revisions/{rid}`` (200)."""
        return await self._object(
            "GET", f"/v2/deployments/{_seg(deployment_id)}/revisions/{_seg(revision_id)}", 200
        )

    async def redeploy_revision(self, deployment_id: str, revision_id: str) -> JSONObject:
        """``POST …/revisions/{rid}/redeploy`` (200): a new revision from a past one."""
        return await self._object(
            "POST",
            f"/v2/deployments/{_seg(deployment_id)}/revisions/{_seg(revision_id)}/redeploy",
            200,
        )

    async def wait_for_revision(
        self,
        deployment_id: str,
        revision_id: str,
        *,
        poll_interval: float = DEFAULT_POLL_INTERVAL,
        timeout: float = DEFAULT_WAIT_TIMEOUT,  # noqa: ASYNC109 - the documented wait contract
        on_progress: ProgressCallback | None = None,
    ) -> JSONObject:
        """Read the revision every ``poll_interval`` seconds until it is DEPLOYED.

        Raises :class:`RevisionFailed` at a status containing FAILED (or INTERRUPTED),
        :class:`RevisionWaitTimeout` when ``timeout`` seconds pass first, and
        :class:`ControlPlaneError` on any unexpected HTTP answer.
        """
        if poll_interval <= 0 or timeout < 0:
            raise ValueError("poll_interval must be > 0 and timeout >= 0")
        started = time.monotonic()
        last: str | None = None
        polls = 0
        try:
            async with asyncio.timeout(timeout):
                while True:
                    revision = await self.get_revision(deployment_id, revision_id)
                    polls += 1
                    status = revision.get("status")
                    if not isinstance(status, str):
                        raise ControlPlaneError(
                            f"revision {revision_id}: no status in {json.dumps(revision)[:500]}"
                        )
                    if on_progress is not None:
                        on_progress(
                            WaitProgress(
                                deployment_id,
                                revision_id,
                                status,
                                time.monotonic() - started,
                                polls,
                                status != last,
                            )
                        )
                    last = status
                    if status == "DEPLOYED":
                        return revision
                    if "FAILED" in status or status in NON_FAILED_DEAD_ENDS:
                        reason = revision.get("status_message") or "no reason given"
                        raise RevisionFailed(
                            f"revision {revision_id} of deployment {deployment_id} ended "
                            f"{status}: {reason}",
                            revision,
                        )
                    await asyncio.sleep(poll_interval)
        except TimeoutError:
            raise RevisionWaitTimeout(
                f"revision {revision_id} of deployment {deployment_id} not DEPLOYED after "
                f"{timeout:g} s (last status: {last or 'unknown'})",
                last,
            ) from None


async def _read_bounded(response: aiohttp.ClientResponse, limit: int) -> tuple[bytes, bool]:
    """At most ``limit`` bytes of the body, and whether there was more (not read: leaving
    the response closes the connection instead of draining it)."""
    data = bytearray()
    while len(data) <= limit:
        chunk = await response.content.read(limit + 1 - len(data))
        if not chunk:
            break
        data += chunk
    return bytes(data[:limit]), len(data) > limit


def _too_large(what: str, status: int) -> ControlPlaneError:
    return ControlPlaneError(
        f"{what}: the answer is larger than {MAX_RESPONSE_BYTES} bytes, the most the client "
        "accepts; refused",
        status=status,
    )


def _location(url: URL, response: aiohttp.ClientResponse) -> str:
    """Where a redirect points, resolved against the request URL, without credentials."""
    location = response.headers.get("Location")
    if not location:
        return "(no Location header)"
    try:
        target = str(url.join(URL(location)))
    except ValueError:
        return "(a Location that does not parse)"
    return display_url(target)


def _seg(value: str) -> str:
    """A path segment with reserved characters escaped."""
    if not value or "/" in value or value in (".", ".."):
        raise ValueError(f"not a valid id: {value!r}")
    return quote(value, safe="")
