"""The built-in upstreams' loopback ports never take the gateway's own ports.

They are bound (kernel-chosen) before the gateway's public and admin ports; a port the
kernel hands out that the operator configured for the gateway would make the gateway
fail to start with "address already in use" (seen in CI: the Store took the port the
test had chosen for the gateway)."""

from __future__ import annotations

import socket

from gateway.app import loopback_listener


class _RefuseFirst:
    """An ``avoid`` set holding the first ``count`` ports it is asked about: whatever
    the kernel hands out first is, by construction, a reserved port."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.asked: list[int] = []

    def __contains__(self, port: object) -> bool:
        assert isinstance(port, int)
        self.asked.append(port)
        return len(self.asked) <= self.count


def _bindable(port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def test_a_reserved_port_the_kernel_hands_out_is_refused_and_released():
    avoid = _RefuseFirst(3)
    sock = loopback_listener(avoid)
    try:
        port = sock.getsockname()[1]
        refused = avoid.asked[:3]
        assert len(avoid.asked) == 4 and avoid.asked[3] == port
        assert port not in refused
        # The refused ports were held only while choosing: the gateway can bind them now.
        assert all(_bindable(p) for p in refused)
        # The chosen one listens.
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            pass
    finally:
        sock.close()


def test_a_port_outside_the_reserved_ones_is_taken_at_once():
    avoid = _RefuseFirst(0)
    sock = loopback_listener(avoid)
    try:
        assert avoid.asked == [sock.getsockname()[1]]
    finally:
        sock.close()


def test_a_reservation_covering_every_port_is_an_error_not_a_hang():
    class Everything:
        def __contains__(self, port: object) -> bool:
            return True

    try:
        loopback_listener(Everything())
    except OSError as exc:
        assert "no free loopback port" in str(exc)
    else:
        raise AssertionError("expected OSError")
