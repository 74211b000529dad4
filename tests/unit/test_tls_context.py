"""The TLS files and context (gateway/proxy/tls.py): validation with clear errors, the
server context's settings proven by real handshakes between SSLObjects over memory
BIOs, and reloads that refuse a bad pair and keep the old one. The CA, server and client
certificates are made with tests/support/tls_pki.py.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import ssl
from dataclasses import dataclass
from pathlib import Path

import pytest
from cryptography import x509

from gateway.proxy.tls import (
    PASSPHRASE_ENV,
    TlsConfigError,
    TlsContextSource,
    TlsFiles,
    build_context,
    file_stamp,
    peer_subject,
)
from gateway.proxy.tls_sniff import subject_of
from tests.support.tls_pki import (
    NOW,
    Pki,
    client_context,
    key_pem,
    pem,
    swap_to,
    write_pair,
)


@dataclass
class Handshake:
    server: ssl.SSLObject
    client: ssl.SSLObject
    server_error: ssl.SSLError | None
    client_error: ssl.SSLError | None

    @property
    def served_serial(self) -> int:
        der = self.client.getpeercert(binary_form=True)
        assert der is not None
        return int(x509.load_der_x509_certificate(der).serial_number)


def handshake(server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext) -> Handshake:
    """A real TLS handshake between two SSLObjects, bytes carried by hand."""
    s_in, s_out, c_in, c_out = (ssl.MemoryBIO() for _ in range(4))
    server = server_ctx.wrap_bio(s_in, s_out, server_side=True)
    client = client_ctx.wrap_bio(c_in, c_out, server_hostname="localhost")
    done = {"server": False, "client": False}
    errors: dict[str, ssl.SSLError | None] = {"server": None, "client": None}
    for _ in range(8):
        for side, obj in (("client", client), ("server", server)):
            if done[side] or errors[side] is not None:
                continue
            try:
                obj.do_handshake()
                done[side] = True
            except ssl.SSLWantReadError:
                pass
            except ssl.SSLError as exc:
                errors[side] = exc
            s_in.write(c_out.read())
            c_in.write(s_out.read())
    if done["client"] and errors["client"] is None:
        # TLS 1.3: a refused client certificate reaches the client as an alert after
        # its side of the handshake: read once to see it.
        try:
            client.read(1)
        except ssl.SSLWantReadError:
            pass
        except ssl.SSLError as exc:
            errors["client"] = exc
    return Handshake(server, client, errors["server"], errors["client"])


@pytest.fixture(scope="module")
def pki() -> Pki:
    return Pki()


@pytest.fixture
def files(tmp_path: Path, pki: Pki) -> TlsFiles:
    cert, key = write_pair(tmp_path / "one", pki.issue("gateway.test", serial=1001))
    return TlsFiles(cert=cert, key=key)


# --- the context


def test_the_context_is_a_modern_server_context(files: TlsFiles, pki: Pki) -> None:
    context = build_context(files)
    assert context.minimum_version == ssl.TLSVersion.TLSv1_2
    assert context.verify_mode == ssl.CERT_NONE
    assert context.options & ssl.OP_NO_RENEGOTIATION
    assert context.options & ssl.OP_NO_COMPRESSION
    assert context.keylog_filename is None
    # A real handshake: the certificate is served, ALPN picks http/1.1 over h2.
    client = client_context(pki)
    client.set_alpn_protocols(["h2", "http/1.1"])
    done = handshake(context, client)
    assert done.server_error is None and done.client_error is None
    assert done.served_serial == 1001
    assert done.server.selected_alpn_protocol() == "http/1.1"
    assert done.client.version() in ("TLSv1.2", "TLSv1.3")
    # A client that offers only h2 is served without ALPN (it falls back or gives up).
    h2_only = client_context(pki)
    h2_only.set_alpn_protocols(["h2"])
    assert handshake(context, h2_only).server.selected_alpn_protocol() is None


def test_sslkeylogfile_does_not_make_the_gateway_write_session_secrets(
    files: TlsFiles, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pki: Pki
) -> None:
    client = client_context(pki)  # (made before: a client context honours it too)
    keylog = tmp_path / "keys.log"
    monkeypatch.setenv("SSLKEYLOGFILE", str(keylog))
    context = build_context(files)
    assert context.keylog_filename is None
    assert handshake(context, client).server_error is None
    # (create_default_context creates the file with a comment line; no secret follows)
    secrets = [line for line in keylog.read_bytes().splitlines() if not line.startswith(b"#")]
    assert secrets == []


@pytest.mark.parametrize("mode", ["optional", "required"])
def test_client_certificates_are_verified_against_the_client_ca_only(
    tmp_path: Path, pki: Pki, mode: str
) -> None:
    cert, key = write_pair(tmp_path / "srv", pki.issue("gateway.test"))
    clients = Pki("Client CA")
    ca_file = clients.write_ca(tmp_path / "clients.pem")
    files = TlsFiles(cert=cert, key=key, client_ca=ca_file, client_auth=mode)  # type: ignore[arg-type]
    context = build_context(files)
    assert context.verify_mode == (ssl.CERT_OPTIONAL if mode == "optional" else ssl.CERT_REQUIRED)
    # Only the client CA is trusted (not the system's CAs, not the server's own CA).
    assert [c["subject"] for c in context.get_ca_certs()] == [
        ((("organizationName", "Gateway Tests"),), (("commonName", "Client CA"),))
    ]
    good = clients.issue("alice", server=False)
    done = handshake(context, client_context(pki, good, tmp_path))
    assert done.server_error is None
    assert subject_of(done.server) == "CN=alice,O=Gateway Tests"
    # A certificate from another CA (here: the server's) is refused in both modes.
    stranger = pki.issue("mallory", server=False)
    refused = handshake(context, client_context(pki, stranger, tmp_path / "s"))
    assert refused.server_error is not None
    assert "certificate verify failed" in str(refused.server_error)
    assert refused.client_error is not None
    # No certificate: served when optional, refused when required.
    anonymous = handshake(context, client_context(pki))
    if mode == "optional":
        assert anonymous.server_error is None and subject_of(anonymous.server) is None
    else:
        assert anonymous.server_error is not None
        assert "certificate" in str(anonymous.client_error)


def test_an_rsa_pair_and_a_chain_with_the_ca_load(tmp_path: Path, pki: Pki) -> None:
    issued = pki.issue("rsa.gateway.test", rsa_key=True, serial=77)
    cert, key = write_pair(tmp_path / "rsa", issued)
    Path(cert).write_bytes(pem(issued.cert) + pem(pki.ca.cert))  # leaf first, then the CA
    source = TlsContextSource(TlsFiles(cert=cert, key=key))
    assert source.serial() == 77
    assert source.info()["chain_length"] == 2
    assert handshake(source.context, client_context(pki)).served_serial == 77


def test_an_encrypted_key_takes_its_passphrase_from_the_named_variable(
    tmp_path: Path, pki: Pki
) -> None:
    passphrase = "correct horse battery staple"
    cert, key = write_pair(tmp_path / "enc", pki.issue("gw", serial=5), passphrase.encode())
    files = TlsFiles(cert=cert, key=key, passphrase_env=PASSPHRASE_ENV)
    context = build_context(files, env={PASSPHRASE_ENV: passphrase})
    assert handshake(context, client_context(pki)).served_serial == 5

    with pytest.raises(TlsConfigError) as unset:
        build_context(files, env={})
    assert str(unset.value) == (
        f"TLS private key file {key} is encrypted: give its passphrase in the environment "
        f"variable {PASSPHRASE_ENV} ({PASSPHRASE_ENV} is not set)"
    )
    with pytest.raises(TlsConfigError) as unnamed:
        build_context(TlsFiles(cert=cert, key=key), env={PASSPHRASE_ENV: passphrase})
    assert f"is encrypted: give its passphrase in the environment variable {PASSPHRASE_ENV}" in str(
        unnamed.value
    )
    with pytest.raises(TlsConfigError) as wrong:
        build_context(files, env={PASSPHRASE_ENV: "Tr0ub4dor&3"})
    assert str(wrong.value) == (
        f"TLS private key file {key}: the passphrase in the environment variable "
        f"{PASSPHRASE_ENV} does not decrypt it: give the right one"
    )
    assert "Tr0ub4dor" not in str(wrong.value) and passphrase not in str(wrong.value)
    # A passphrase for a key that is not encrypted is not needed, and not an error.
    plain_cert, plain_key = write_pair(tmp_path / "plain", pki.issue("gw", serial=6))
    plain = TlsFiles(cert=plain_cert, key=plain_key, passphrase_env=PASSPHRASE_ENV)
    assert handshake(build_context(plain, env={PASSPHRASE_ENV: "x"}), client_context(pki))


# --- errors: which file, what to do, never the key


def _error(files: TlsFiles) -> str:
    with pytest.raises(TlsConfigError) as caught:
        build_context(files, env={})
    return str(caught.value)


def test_missing_unreadable_and_empty_files_are_named(files: TlsFiles, tmp_path: Path) -> None:
    gone = str(tmp_path / "nope.crt")
    assert _error(TlsFiles(cert=gone, key=files.key)) == (
        f"TLS certificate file {gone} does not exist: check the path (a symlink must point "
        "at an existing file)"
    )
    dangling = tmp_path / "dangling.key"
    dangling.symlink_to(tmp_path / "missing-target")
    assert _error(TlsFiles(cert=files.cert, key=str(dangling))).startswith(
        f"TLS private key file {dangling} does not exist"
    )
    assert _error(TlsFiles(cert=str(tmp_path), key=files.key)) == (
        f"TLS certificate file {tmp_path} is not a regular file: give the path of the "
        "certificate file"
    )
    empty = tmp_path / "empty.key"
    empty.write_bytes(b"\n")
    assert _error(TlsFiles(cert=files.cert, key=str(empty))) == (
        f"TLS private key file {empty} is empty (still being written?): give the PEM private key"
    )
    huge = tmp_path / "huge.crt"
    huge.write_bytes(b"x" * (1024 * 1024 + 1))
    assert "more than a certificate file can be" in _error(TlsFiles(cert=str(huge), key=files.key))


def test_garbage_truncated_and_swapped_files_are_refused_without_their_content(
    files: TlsFiles, tmp_path: Path
) -> None:
    key_bytes = Path(files.key).read_bytes()
    cert_bytes = Path(files.cert).read_bytes()
    garbage = tmp_path / "garbage.pem"
    garbage.write_bytes(b"this is not PEM at all\n")
    assert _error(TlsFiles(cert=str(garbage), key=files.key)) == (
        f"TLS certificate file {garbage} holds no readable PEM certificate (truncated, or "
        "not a certificate?): give PEM certificates (-----BEGIN CERTIFICATE-----)"
    )
    half = tmp_path / "half.crt"
    half.write_bytes(cert_bytes[: len(cert_bytes) // 2])
    assert "holds no readable PEM certificate" in _error(TlsFiles(cert=str(half), key=files.key))
    half_key = tmp_path / "half.key"
    half_key.write_bytes(key_bytes[: len(key_bytes) // 2])
    message = _error(TlsFiles(cert=files.cert, key=str(half_key)))
    assert message == (
        f"TLS private key file {half_key} holds no readable PEM private key (truncated, or "
        "the certificate instead?): give the certificate's key in PEM"
    )
    # The key's body never appears in a message (here: the base64 lines of the key).
    for line in key_bytes.splitlines()[1:-1]:
        assert line.decode() not in message
    swapped = _error(TlsFiles(cert=files.key, key=files.cert))
    assert "holds no readable PEM certificate" in swapped
    for line in key_bytes.splitlines()[1:-1]:
        assert line.decode() not in swapped


def test_a_key_of_another_certificate_is_refused(files: TlsFiles, tmp_path: Path, pki: Pki) -> None:
    _, other_key = write_pair(tmp_path / "other", pki.issue("other"))
    assert _error(TlsFiles(cert=files.cert, key=other_key)) == (
        f"TLS private key file {other_key} does not belong to the certificate in "
        f"{files.cert} (serial 3e9): give the key the certificate was issued for (a "
        "rotation writing one file at a time is retried at the next check)"
    )


def test_an_expired_certificate_is_refused(tmp_path: Path, pki: Pki) -> None:
    old = pki.issue("old", serial=0xDEAD, not_after=NOW - datetime.timedelta(minutes=5))
    cert, key = write_pair(tmp_path / "old", old)
    message = _error(TlsFiles(cert=cert, key=key))
    assert message.startswith(
        f"TLS certificate file {cert}: the certificate (serial dead) expired on"
    )
    assert message.endswith(": install a renewed one")


def test_client_authentication_settings_must_agree(files: TlsFiles, tmp_path: Path) -> None:
    assert _error(TlsFiles(cert=files.cert, key=files.key, client_auth="required")) == (
        "TLS client_auth 'required' needs a client CA file: give the CA that issues the "
        "client certificates"
    )
    ca = str(tmp_path / "ca.pem")
    Path(ca).write_bytes(Path(files.cert).read_bytes())
    assert _error(TlsFiles(cert=files.cert, key=files.key, client_ca=ca)) == (
        f"TLS client CA file {ca} is given but client_auth is 'none': set client_auth to "
        "'optional' or 'required', or drop the client CA"
    )
    bad_mode = TlsFiles(cert=files.cert, key=files.key, client_auth="sometimes")  # type: ignore[arg-type]
    assert _error(bad_mode) == (
        "TLS client_auth 'sometimes' is not one of none, optional, required"
    )
    garbage = tmp_path / "garbage-ca.pem"
    garbage.write_bytes(b"not a CA")
    with_garbage = TlsFiles(
        cert=files.cert, key=files.key, client_ca=str(garbage), client_auth="optional"
    )
    assert _error(with_garbage).startswith(f"TLS client CA file {garbage} holds no readable PEM")


# --- the source: reloads


def test_the_source_reports_the_certificate_in_force(files: TlsFiles) -> None:
    source = TlsContextSource(files)
    assert source.serial() == 1001
    assert source.subject() == "CN=gateway.test,O=Gateway Tests"
    assert source.not_after() > NOW
    info = source.info()
    assert info["serial"] == "3e9"
    assert info["cert_file"] == files.cert and info["key_file"] == files.key
    assert info["client_auth"] == "none" and info["last_error"] is None
    assert info["reloads"] == 0 and info["reload_failures"] == 0
    assert "serial 3e9" in source.describe()


def test_a_bad_start_raises(tmp_path: Path, files: TlsFiles) -> None:
    with pytest.raises(TlsConfigError, match="does not exist"):
        TlsContextSource(TlsFiles(cert=str(tmp_path / "x.crt"), key=files.key))


def test_reload_puts_a_good_pair_in_force_and_refuses_a_bad_one(
    tmp_path: Path, pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    live = tmp_path / "live"
    write_pair(tmp_path / "v1", pki.issue("gw", serial=1))
    swap_to(live, tmp_path / "v1")
    files = TlsFiles(cert=str(live / "tls.crt"), key=str(live / "tls.key"))
    outcomes: list[tuple[bool, str]] = []
    source = TlsContextSource(files, on_reload=lambda ok, detail: outcomes.append((ok, detail)))
    first = source.context

    assert source.reload() is False  # nothing changed
    assert outcomes == [(True, "unchanged")] and source.context is first

    # A mismatched pair: refused, the old context stays, the reason is kept and told.
    mismatched = tmp_path / "v2"
    write_pair(mismatched, pki.issue("gw", serial=2))
    (mismatched / "tls.key").write_bytes(key_pem(pki.issue("other").key))
    swap_to(live, mismatched)
    assert source.reload() is False
    assert source.context is first and source.serial() == 1
    assert (
        source.last_error is not None and "does not belong to the certificate" in source.last_error
    )
    assert outcomes[-1] == (False, source.last_error)
    assert source.reload_failures == 1 and source.info()["last_error"] == source.last_error
    assert handshake(source.context, client_context(pki)).served_serial == 1

    # The pair in force put back: nothing reloads, but the refusal is said to be over.
    with caplog.at_level(logging.INFO, logger="gateway.tls"):
        swap_to(live, tmp_path / "v1")
        assert source.reload("poll") is False and source.last_error is None
        assert "TLS files valid again (poll): unchanged, still serving serial 1" in caplog.text
        swap_to(live, mismatched)
        assert source.reload() is False

    # A good pair: in force, the error cleared.
    write_pair(tmp_path / "v3", pki.issue("gw", serial=3))
    swap_to(live, tmp_path / "v3")
    assert source.reload() is True
    assert source.serial() == 3 and source.context is not first
    assert source.last_error is None and outcomes[-1] == (True, "serial 3")
    assert source.reloads == 1
    assert handshake(source.context, client_context(pki)).served_serial == 3
    # The context the first handshake took is untouched: a connection made with it
    # keeps it (the listener hands each connection the context of its moment).
    assert handshake(first, client_context(pki)).served_serial == 1


def test_a_callback_that_raises_does_not_break_the_reload(files: TlsFiles) -> None:
    def broken(ok: bool, detail: str) -> None:
        raise RuntimeError("metrics are down")

    source = TlsContextSource(files, on_reload=broken)
    assert source.reload() is False
    assert source.last_error is None


def test_the_file_stamp_follows_a_symlink_swap(tmp_path: Path, pki: Pki) -> None:
    live = tmp_path / "live"
    write_pair(tmp_path / "a", pki.issue("gw", serial=10))
    write_pair(tmp_path / "b", pki.issue("gw", serial=11))
    swap_to(live, tmp_path / "a")
    files = TlsFiles(cert=str(live / "tls.crt"), key=str(live / "tls.key"))
    source = TlsContextSource(files)
    before = file_stamp(files)
    assert not source.changed_on_disk()
    swap_to(live, tmp_path / "b")
    assert file_stamp(files) != before
    assert source.changed_on_disk()
    assert source.reload() is True and source.serial() == 11
    assert not source.changed_on_disk()


async def _until(predicate, what: str) -> None:  # type: ignore[no-untyped-def]
    """Wait for ``predicate()`` (no timing is asserted: the limit only ends a hang)."""
    for _ in range(3000):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never happened: {what}")


async def test_watch_reloads_on_change_and_retries_a_half_written_pair(
    tmp_path: Path, pki: Pki
) -> None:
    directory = tmp_path / "in-place"
    write_pair(directory, pki.issue("gw", serial=21))
    files = TlsFiles(cert=str(directory / "tls.crt"), key=str(directory / "tls.key"))
    outcomes: list[tuple[bool, str]] = []
    source = TlsContextSource(files, on_reload=lambda ok, detail: outcomes.append((ok, detail)))
    watcher = asyncio.create_task(source.watch(0.02))
    try:
        # Written in place one file at a time, the certificate first and cut short: refused
        # (the old pair stays), then read again when the files change once more.
        new = pki.issue("gw", serial=22)
        whole = pem(new.cert)
        Path(files.cert).write_bytes(whole[: len(whole) // 2])
        await _until(lambda: any(not ok for ok, _ in outcomes), "the half-written file refused")
        assert source.serial() == 21 and source.last_error is not None
        assert "holds no readable PEM certificate" in source.last_error
        Path(files.cert).write_bytes(whole)  # whole now, but the key is still the old one
        await _until(lambda: "does not belong" in (source.last_error or ""), "mismatch refused")
        assert source.serial() == 21
        Path(files.key).write_bytes(key_pem(new.key))
        await _until(lambda: source.serial() == 22, "the completed pair in force")
        assert source.last_error is None
        assert outcomes[-1] == (True, "serial 16")
        assert handshake(source.context, client_context(pki)).served_serial == 22
    finally:
        watcher.cancel()


# --- the client certificate's subject


def test_peer_subject_of_a_transport_without_tls_is_none() -> None:
    class Plain(asyncio.Transport):
        pass

    assert peer_subject(Plain()) is None


def test_subject_of_needs_a_verified_certificate(tmp_path: Path, pki: Pki) -> None:
    cert, key = write_pair(tmp_path / "srv", pki.issue("gateway.test"))
    ca = pki.write_ca(tmp_path / "ca.pem")
    client = pki.issue("svc-billing", server=False)
    verified = build_context(TlsFiles(cert, key, client_ca=ca, client_auth="optional"))
    done = handshake(verified, client_context(pki, client, tmp_path))
    assert subject_of(done.server) == "CN=svc-billing,O=Gateway Tests"
    # Without client authentication no certificate is asked for: no subject.
    unverified = build_context(TlsFiles(cert, key))
    assert subject_of(handshake(unverified, client_context(pki, client, tmp_path)).server) is None
