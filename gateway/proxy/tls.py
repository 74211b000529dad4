"""TLS on the proxy port: the certificate files, their validation, rotation without a
restart, and the listener (``start_tls_server``) that speaks TLS there.

* ``TlsFiles`` names the files: certificate (chain, leaf first), private key, optionally
  a CA whose client certificates are asked for (``client_auth``). A passphrase for the
  key is only ever read from an environment variable the caller names.
* ``build_context(files)`` validates them and builds the server ``ssl.SSLContext``: the
  standard library's modern defaults, TLS 1.2 at least, ALPN ``http/1.1`` only. Every
  problem is a ``TlsConfigError`` that names the file and says what to do; no message
  holds key material or the passphrase.
* ``TlsContextSource`` holds the context in force. ``reload()`` builds a fresh one from
  the files and only puts it in force if it is whole (readable, certificate and key
  match, not expired); a bad pair is refused, the old one stays, ``last_error`` says why.
  ``watch(interval)`` reloads when the files change (cert-manager's symlink swap
  included: ``os.stat`` follows links).
* ``start_tls_server`` serves TLS (and answers plain HTTP with a 400) for an unchanged
  ``asyncio.Protocol`` factory: see ``gateway.proxy.tls_sniff``.
* ``TlsListener`` is one port's TLS at run time: its source, how often the files are
  looked at, reloads asked for by a signal, the handshake deadline and counts
  (``DataPlane.start(..., tls=listener)``; built from the settings by
  ``gateway.tls_setup``).

Rotation: each connection takes the context in force when its ClientHello arrives, so
a new pair applies to every later handshake and none of the open connections is
touched; no listener restarts. (The alternative, one listener context whose
``sni_callback`` swaps ``ssl_object.context``, was tried and not taken: OpenSSL then
takes the certificate, key, CA store and ALPN from the new context but keeps the
listener context's verify mode and protocol versions, so a change of those would not
apply.)
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import hashlib
import logging
import os
import ssl
import stat
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal, get_args

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.types import PrivateKeyTypes

from gateway.proxy.tls_sniff import (
    DEFAULT_HANDSHAKE_TIMEOUT,
    PLAIN_HTTP_DETAIL,
    TlsServerConnection,
    TlsStats,
    plain_http_answer,
    serve_tls,
    subject_of,
)

__all__ = [
    "DEFAULT_HANDSHAKE_TIMEOUT",
    "PASSPHRASE_ENV",
    "PLAIN_HTTP_DETAIL",
    "ClientAuth",
    "TlsConfigError",
    "TlsContextSource",
    "TlsFiles",
    "TlsListener",
    "TlsReloader",
    "TlsServerConnection",
    "TlsStats",
    "build_context",
    "peer_subject",
    "plain_http_answer",
    "start_tls_server",
]

log = logging.getLogger("gateway.tls")

DEFAULT_WATCH_INTERVAL: Final = 5.0

ClientAuth = Literal["none", "optional", "required"]
CLIENT_AUTH_MODES: Final = get_args(ClientAuth)
# The usual name of the variable (not a secret: where the secret is); the caller decides.
PASSPHRASE_ENV: Final = "GATEWAY_TLS_KEY_PASSPHRASE"  # noqa: S105
MAX_FILE_BYTES: Final = 1024 * 1024  # far above any certificate chain, key or CA bundle
ALPN: Final = ("http/1.1",)
_VERIFY: Final = {
    "none": ssl.CERT_NONE,
    "optional": ssl.CERT_OPTIONAL,
    "required": ssl.CERT_REQUIRED,
}

ReloadCallback = Callable[[bool, str], None]
FileStamp = tuple[tuple[int, int, int, int] | None, ...]


class TlsConfigError(ValueError):
    """The TLS files cannot be used; the message names the file and what to do."""


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """Where the TLS listener's certificate, key and (optionally) client CA are.

    ``passphrase_env`` is the *name* of the environment variable holding the key's
    passphrase (e.g. ``GATEWAY_TLS_KEY_PASSPHRASE``), never the passphrase itself.
    ``client_auth``: "none" (no client certificate asked for), "optional" (asked for; a
    client without one is served, one with a certificate not from ``client_ca`` is
    refused), "required" (a client without one is refused)."""

    cert: str
    key: str
    client_ca: str | None = None
    client_auth: ClientAuth = "none"
    passphrase_env: str | None = None

    def paths(self) -> tuple[str, ...]:
        return (self.cert, self.key) if self.client_ca is None else (
            self.cert, self.key, self.client_ca
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class LoadedTls:
    """One validated set of files and the context built from it."""

    context: ssl.SSLContext
    certificate: x509.Certificate  # the leaf, as served
    chain_length: int
    digest: str  # of what was loaded: equal digests, equal contexts
    stamp: FileStamp  # the files as they were when read
    loaded_at: float  # time.time()


def build_context(files: TlsFiles, env: Mapping[str, str] | None = None) -> ssl.SSLContext:
    """The server context for ``files``, or ``TlsConfigError``. ``env`` (default
    ``os.environ``) is where the passphrase variable is looked up."""
    return load_files(files, os.environ if env is None else env).context


def load_files(files: TlsFiles, env: Mapping[str, str]) -> LoadedTls:
    """Read, validate and load ``files`` (blocking file reads and key parsing: run it in
    a thread when on the event loop and the key is encrypted)."""
    _check_settings(files)
    before = file_stamp(files)
    cert_pem = _read(files.cert, "certificate file")
    key_pem = _read(files.key, "private key file")
    ca_pem = _read(files.client_ca, "client CA file") if files.client_ca else None

    chain = _certificates(cert_pem, files.cert, "certificate file")
    leaf = chain[0]
    now = datetime.datetime.now(datetime.UTC)
    if leaf.not_valid_after_utc <= now:
        raise TlsConfigError(
            f"TLS certificate file {files.cert}: the certificate (serial {leaf.serial_number:x})"
            f" expired on {leaf.not_valid_after_utc.isoformat()}: install a renewed one"
        )
    if leaf.not_valid_before_utc > now:
        # Not refused: a certificate fresh from its issuer may be a few seconds ahead of
        # this machine's clock, and refusing it would keep the old one until it expires.
        log.warning(
            "TLS certificate %s (serial %x) is valid only from %s (is this clock behind?)",
            files.cert, leaf.serial_number, leaf.not_valid_before_utc.isoformat(),
        )  # fmt: skip
    passphrase = _passphrase(files, env)
    key = _private_key(key_pem, files, passphrase)
    spki = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    if key.public_key().public_bytes(*spki) != leaf.public_key().public_bytes(*spki):
        raise TlsConfigError(
            f"TLS private key file {files.key} does not belong to the certificate in "
            f"{files.cert} (serial {leaf.serial_number:x}): give the key the certificate "
            "was issued for (a rotation writing one file at a time is retried at the next check)"
        )
    if ca_pem is not None:
        assert files.client_ca is not None
        _certificates(ca_pem, files.client_ca, "client CA file")

    context = _context(files, passphrase)
    if file_stamp(files) != before:
        # What OpenSSL read may not be what was validated above (a rotation under way).
        raise TlsConfigError(
            f"TLS files {', '.join(files.paths())} changed while being read "
            "(a rotation under way?): they are read again at the next check"
        )
    digest = hashlib.sha256()
    for part in (cert_pem, key.public_key().public_bytes(*spki), ca_pem or b"",
                 files.client_auth.encode()):  # fmt: skip
        digest.update(hashlib.sha256(part).digest())
    return LoadedTls(context, leaf, len(chain), digest.hexdigest(), before, time.time())


def _check_settings(files: TlsFiles) -> None:
    if files.client_auth not in CLIENT_AUTH_MODES:
        raise TlsConfigError(
            f"TLS client_auth {files.client_auth!r} is not one of {', '.join(CLIENT_AUTH_MODES)}"
        )
    if files.client_auth != "none" and not files.client_ca:
        raise TlsConfigError(
            f"TLS client_auth {files.client_auth!r} needs a client CA file: give the CA "
            "that issues the client certificates"
        )
    if files.client_ca and files.client_auth == "none":
        # A CA given but no certificate asked for would look like client authentication
        # while authenticating nobody.
        raise TlsConfigError(
            f"TLS client CA file {files.client_ca} is given but client_auth is 'none': "
            "set client_auth to 'optional' or 'required', or drop the client CA"
        )


def _read(path: str, role: str) -> bytes:
    what = f"TLS {role} {path}"
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise TlsConfigError(f"{what} is not a regular file: give the path of the {role}")
        if st.st_size > MAX_FILE_BYTES:
            raise TlsConfigError(
                f"{what} is {st.st_size} bytes, more than a {role} can be: is it the right file?"
            )
        with open(path, "rb") as handle:
            data = handle.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        raise TlsConfigError(
            f"{what} does not exist: check the path (a symlink must point at an existing file)"
        ) from None
    except PermissionError:
        raise TlsConfigError(
            f"{what} cannot be read (permission denied): make it readable by the user "
            "the gateway runs as"
        ) from None
    except OSError as exc:
        raise TlsConfigError(f"{what} cannot be read: {exc.strerror or exc}") from None
    if not data.strip():
        raise TlsConfigError(
            f"{what} is empty (still being written?): give the PEM {role.split(' file')[0]}"
        )
    return data


def _certificates(data: bytes, path: str, role: str) -> list[x509.Certificate]:
    try:
        # (list(): the mypyc build checks this module without cryptography's types)
        return list(x509.load_pem_x509_certificates(data))
    except ValueError:
        raise TlsConfigError(
            f"TLS {role} {path} holds no readable PEM certificate (truncated, or not a "
            "certificate?): give PEM certificates (-----BEGIN CERTIFICATE-----)"
        ) from None


def _passphrase(files: TlsFiles, env: Mapping[str, str]) -> bytes | None:
    if files.passphrase_env is None:
        return None
    value = env.get(files.passphrase_env)
    return value.encode() if value else None


def _private_key(data: bytes, files: TlsFiles, passphrase: bytes | None) -> PrivateKeyTypes:
    # (Exception texts are not passed on: the messages below say what is wrong, and
    # nothing of the key or the passphrase can reach a log through them.)
    encrypted = b"ENCRYPTED" in data
    try:
        return serialization.load_pem_private_key(data, passphrase if encrypted else None)
    except TypeError:
        pass  # encrypted, and no passphrase
    except ValueError:
        if encrypted and passphrase is not None:
            raise TlsConfigError(
                f"TLS private key file {files.key}: the passphrase in the environment "
                f"variable {files.passphrase_env} does not decrypt it: give the right one"
            ) from None
        raise TlsConfigError(
            f"TLS private key file {files.key} holds no readable PEM private key "
            "(truncated, or the certificate instead?): give the certificate's key in PEM"
        ) from None
    except UnsupportedAlgorithm:
        raise TlsConfigError(
            f"TLS private key file {files.key}: a key type this build cannot use: "
            "give an RSA, EC or Ed25519 key"
        ) from None
    name = files.passphrase_env or PASSPHRASE_ENV
    unset = f" ({name} is not set)" if files.passphrase_env else ""
    raise TlsConfigError(
        f"TLS private key file {files.key} is encrypted: give its passphrase in the "
        f"environment variable {name}{unset}"
    )


def _context(files: TlsFiles, passphrase: bytes | None) -> ssl.SSLContext:
    # create_default_context(CLIENT_AUTH) loads no CA of its own for a server (its verify
    # mode is CERT_NONE): the only CA trusted for client certificates is client_ca, never
    # the system's (a public CA's customer is not a client of this gateway).
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    # Client-initiated renegotiation (TLS 1.2) costs the server a handshake per request
    # the client makes for free; nothing here needs it.
    context.options |= ssl.OP_NO_RENEGOTIATION
    # create_default_context honours SSLKEYLOGFILE: a stray variable would make the
    # gateway write every session's secrets to a file.
    context.keylog_filename = None  # type: ignore[assignment]
    context.set_alpn_protocols(list(ALPN))
    try:
        # A callable password: with none OpenSSL would prompt on the terminal for an
        # encrypted key (a key swapped for an encrypted one between the checks and here).
        context.load_cert_chain(files.cert, files.key, password=lambda: passphrase or b"")
    except (ssl.SSLError, OSError) as exc:
        raise TlsConfigError(
            f"TLS certificate file {files.cert} and key file {files.key} were refused by "
            f"OpenSSL ({_reason(exc)}): check that they are a matching PEM pair"
        ) from None
    if files.client_ca:
        try:
            context.load_verify_locations(cafile=files.client_ca)
        except (ssl.SSLError, OSError) as exc:
            raise TlsConfigError(
                f"TLS client CA file {files.client_ca} was refused by OpenSSL "
                f"({_reason(exc)}): give the PEM certificate(s) of the client CA"
            ) from None
    context.verify_mode = _VERIFY[files.client_auth]
    return context


def _reason(exc: BaseException) -> str:
    reason = getattr(exc, "reason", None)
    if isinstance(reason, str):
        return reason.lower().replace("_", " ")
    return type(exc).__name__


def file_stamp(files: TlsFiles) -> FileStamp:
    """Device, inode, size and mtime of each file, links followed: a symlink swap (what
    cert-manager's secret volumes do) changes the inode, an edit in place size or mtime."""
    out: list[tuple[int, int, int, int] | None] = []
    for path in files.paths():
        try:
            st = os.stat(path)
        except OSError:
            out.append(None)
            continue
        out.append((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(out)


class TlsContextSource:
    """The TLS context in force, replaced whole when the files change.

    A new handshake takes ``source.context`` once; a reload swaps the attribute, so a
    connection never sees half of two pairs, and open connections keep theirs.
    """

    def __init__(
        self,
        files: TlsFiles,
        *,
        on_reload: ReloadCallback | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        """Load the files now: a bad set at start-up raises ``TlsConfigError``.
        ``on_reload(ok, detail)`` is told each reload's outcome (``detail``: the new
        serial, "unchanged", or why it was refused)."""
        self.files = files
        self._env = os.environ if env is None else env
        self._on_reload = on_reload
        self._current = load_files(files, self._env)
        self._fingerprint = self._current.stamp
        self.last_error: str | None = None
        self.last_error_at: float | None = None
        self.reloads = 0  # a new pair put in force
        self.reload_failures = 0
        # Loads may overlap (the watcher's and a requested one, each in a thread): each
        # takes a ticket when it starts, and an outcome counts only if no later load's has.
        self._tickets = 0
        self._settled = 0

    @property
    def context(self) -> ssl.SSLContext:
        return self._current.context

    @property
    def certificate(self) -> x509.Certificate:
        return self._current.certificate

    def serial(self) -> int:
        return int(self._current.certificate.serial_number)

    def not_after(self) -> datetime.datetime:
        found: datetime.datetime = self._current.certificate.not_valid_after_utc
        return found

    def subject(self) -> str:
        return str(self._current.certificate.subject.rfc4514_string())

    def describe(self) -> str:
        """One line for the start-up log."""
        return (
            f"certificate {self.subject() or '-'} serial {self.serial():x} "
            f"valid until {self.not_after().isoformat()}, client certificates "
            f"{self.files.client_auth}"
        )

    def info(self) -> dict[str, object]:
        """The admin port's /info view: paths, the certificate, reload counts (no key,
        no passphrase, not even the passphrase variable's value)."""
        current = self._current
        return {
            "cert_file": self.files.cert,
            "key_file": self.files.key,
            "client_ca_file": self.files.client_ca,
            "client_auth": self.files.client_auth,
            "subject": self.subject(),
            "serial": f"{self.serial():x}",
            "not_after": self.not_after().isoformat(),
            "chain_length": current.chain_length,
            "loaded_at": datetime.datetime.fromtimestamp(
                current.loaded_at, datetime.UTC
            ).isoformat(),
            "reloads": self.reloads,
            "reload_failures": self.reload_failures,
            "last_error": self.last_error,
        }

    def reload(self, reason: str = "requested") -> bool:
        """Load the files again, here and now. True when a new context is in force; on
        an error the previous one stays, ``last_error`` says why, and False is returned."""
        ticket = self._start()
        return self._settle(ticket, reason, self._load())

    async def reload_async(self, reason: str = "requested") -> bool:
        """``reload`` with the reading and key parsing in a worker thread."""
        ticket = self._start()
        outcome = await asyncio.to_thread(self._load)
        return self._settle(ticket, reason, outcome)

    def changed_on_disk(self) -> bool:
        return file_stamp(self.files) != self._fingerprint

    async def watch(self, interval: float = DEFAULT_WATCH_INTERVAL) -> None:
        """Poll the files every ``interval`` s and reload when they changed. Runs until
        cancelled; a round that fails is logged and the watch goes on (a dead watcher
        would serve the old certificate until it expires)."""
        while True:
            await asyncio.sleep(interval)
            try:
                if self.changed_on_disk():
                    # Give a write in several steps a moment; a pair still half written
                    # after it is refused now and read again once the files change.
                    await asyncio.sleep(min(0.2, interval))
                    await self.reload_async("files changed")
            except Exception:
                log.exception("TLS file watch failed this round; still watching")

    def _start(self) -> int:
        # The stamp before reading: a write landing mid-read changes it again, so the
        # next poll reads once more; taken after, that write could go unnoticed.
        self._fingerprint = file_stamp(self.files)
        self._tickets += 1
        return self._tickets

    def _load(self) -> LoadedTls | Exception:
        try:
            return load_files(self.files, self._env)
        except Exception as exc:  # whatever the files hold: a refusal, not a dead watcher
            return exc

    def _settle(self, ticket: int, reason: str, outcome: LoadedTls | Exception) -> bool:
        if ticket < self._settled:
            return False  # a load started later has settled already: this one is older
        self._settled = ticket
        if isinstance(outcome, Exception):
            self._refuse(reason, outcome)
            return False
        refused_before, self.last_error = self.last_error, None
        if outcome.digest == self._current.digest:
            self._report(True, "unchanged")
            if refused_before is not None:  # the operator fixed the files: say it is over
                log.info(
                    "TLS files valid again (%s): unchanged, still serving serial %x",
                    reason, self.serial(),
                )  # fmt: skip
            return False
        previous, self._current = self._current, outcome
        self.reloads += 1
        log.info(
            "TLS certificate reloaded (%s): serial %x valid until %s (was serial %x)",
            reason, self.serial(), self.not_after().isoformat(),
            previous.certificate.serial_number,
        )  # fmt: skip
        self._report(True, f"serial {self.serial():x}")
        return True

    def _refuse(self, reason: str, exc: Exception) -> None:
        self.reload_failures += 1
        self.last_error_at = time.time()
        if isinstance(exc, TlsConfigError):
            self.last_error = str(exc)
            log.error(
                "TLS reload (%s) refused, still serving serial %x: %s",
                reason, self.serial(), exc,
            )  # fmt: skip
        else:
            # load_files turns every problem with the files into a TlsConfigError;
            # anything else is a bug in it, still a refusal (with the traceback).
            self.last_error = f"the TLS files could not be loaded: {type(exc).__name__}"
            log.error(
                "TLS reload (%s) refused, still serving serial %x: %s",
                reason, self.serial(), self.last_error, exc_info=exc,
            )  # fmt: skip
        self._report(False, self.last_error)

    def _report(self, ok: bool, detail: str) -> None:
        if self._on_reload is None:
            return
        try:
            self._on_reload(ok, detail)
        except Exception:
            log.exception("TLS reload callback failed")


class TlsReloader:
    """One port's certificate at run time: the source, its file watch, and reloads asked
    for from a signal handler (``request_reload``: the files are read in a worker
    thread, never on the event loop)."""

    def __init__(
        self,
        source: TlsContextSource,
        *,
        name: str,
        watch_interval: float = DEFAULT_WATCH_INTERVAL,
    ) -> None:
        if watch_interval <= 0:
            raise ValueError(f"watch_interval must be positive, not {watch_interval}")
        self.source = source
        self.name = name  # "proxy" or "admin": for logs and metrics
        self.watch_interval = watch_interval
        self._reloads: set[asyncio.Task[bool]] = set()

    def describe(self) -> str:
        """One line for the start-up log: what is served, and how it is kept fresh."""
        return (
            f"TLS on the {self.name} port: {self.source.describe()}, from "
            f"{self.source.files.cert}; reloaded when the files change (looked at every "
            f"{self.watch_interval:g} s) and on SIGHUP"
        )

    def info(self) -> dict[str, object]:
        """The admin port's /info view (paths, certificate, reload counts; no secret)."""
        return {**self.source.info(), "watch_interval": self.watch_interval}

    async def watch(self) -> None:
        """Reload when the files change; runs until cancelled."""
        await self.source.watch(self.watch_interval)

    def request_reload(self, reason: str = "SIGHUP") -> None:
        """Reload in the background (from a signal handler: the loop must be running).
        The outcome is logged and counted by the source's callback."""
        task = asyncio.get_running_loop().create_task(self.source.reload_async(reason))
        self._reloads.add(task)  # kept referenced until done
        task.add_done_callback(self._reloads.discard)

    async def close(self) -> None:
        """Cancel reloads still under way (at shutdown)."""
        for task in list(self._reloads):
            task.cancel()
        for task in list(self._reloads):
            with contextlib.suppress(asyncio.CancelledError):
                await task


class TlsListener(TlsReloader):
    """The proxy port's TLS: ``TlsReloader`` plus the handshake deadline and counts, and
    ``serve`` (what ``DataPlane.start`` calls)."""

    def __init__(
        self,
        source: TlsContextSource,
        *,
        name: str = "proxy",
        watch_interval: float = DEFAULT_WATCH_INTERVAL,
        handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT,
        stats: TlsStats | None = None,
    ) -> None:
        super().__init__(source, name=name, watch_interval=watch_interval)
        if handshake_timeout <= 0:
            raise ValueError(f"handshake_timeout must be positive, not {handshake_timeout}")
        self.handshake_timeout = handshake_timeout
        self.stats = stats if stats is not None else TlsStats()

    def describe(self) -> str:
        return f"{super().describe()}; plain HTTP is answered 400"

    def info(self) -> dict[str, object]:
        stats = self.stats
        return {
            **super().info(),
            "handshake_timeout": self.handshake_timeout,
            "handshakes": stats.handshakes,
            "handshake_failures": stats.handshake_failures,
            "handshake_timeouts": stats.handshake_timeouts,
            "plain_http_refused": stats.plain_http,
        }

    async def serve(
        self,
        loop: asyncio.AbstractEventLoop,
        protocol_factory: Callable[[], asyncio.BaseProtocol],
        host: str | None = None,
        port: int = 0,
        *,
        sock: Any = None,
        reuse_port: bool = False,
        backlog: int = 1024,
    ) -> asyncio.Server:
        """``start_tls_server`` with this listener's source, deadline and counts."""
        return await start_tls_server(
            loop,
            protocol_factory,
            self.source,
            host,
            port,
            sock=sock,
            reuse_port=reuse_port,
            backlog=backlog,
            ssl_handshake_timeout=self.handshake_timeout,
            stats=self.stats,
        )


def peer_subject(transport: asyncio.BaseTransport) -> str | None:
    """The subject (RFC 4514 string) of the client certificate verified on this
    connection, or None (no TLS, no client certificate asked for or given)."""
    if isinstance(transport, TlsServerConnection):
        return transport.peer_subject()  # parsed once per connection
    ssl_object = transport.get_extra_info("ssl_object")
    if isinstance(ssl_object, (ssl.SSLObject, ssl.SSLSocket)):
        return subject_of(ssl_object)
    return None


async def start_tls_server(
    loop: asyncio.AbstractEventLoop,
    protocol_factory: Callable[[], asyncio.BaseProtocol],
    source: TlsContextSource,
    host: str | None = None,
    port: int = 0,
    *,
    sock: Any = None,
    reuse_port: bool = False,
    backlog: int = 1024,
    ssl_handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT,
    stats: TlsStats | None = None,
) -> asyncio.Server:
    """Serve TLS on host:port (or on the bound, listening-ready socket ``sock``) for
    ``protocol_factory``'s protocols, as ``loop.create_server`` serves plain TCP.

    The protocol (an ``asyncio.Protocol``; a ``BufferedProtocol`` is not fed) is made
    and told ``connection_made`` on accept; it reads decrypted bytes and sees plain
    TCP's transport API (plus ``peercert``, ``ssl_object``, ``cipher``, ``sslcontext``;
    see ``peer_subject``). Each handshake uses ``source.context`` as it is when the
    ClientHello arrives and must finish within ``ssl_handshake_timeout`` s. A first
    byte that is not a TLS handshake record is answered 400 (JSON ``detail``) and the
    connection closed. ``stats`` counts handshakes, their failures and timeouts, and
    plain-HTTP refusals.
    """
    return await serve_tls(
        loop,
        protocol_factory,
        lambda: source.context,
        host,
        port,
        sock=sock,
        reuse_port=reuse_port,
        backlog=backlog,
        ssl_handshake_timeout=ssl_handshake_timeout,
        stats=stats,
    )
