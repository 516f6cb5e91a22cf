"""The ports a node offers its next round (`rove.agent.ports`)."""

from __future__ import annotations

import socket

from rove.agent import ports
from tests.support import free_port


def test_offers_lie_below_the_ephemeral_and_the_nodeport_ranges() -> None:
    # Linux's default ephemeral range starts at 32768: below it and below NodePorts
    assert ports.offer_range(32768) == range(20000, 30000)
    # a range that starts higher changes nothing: NodePorts bound it
    assert ports.offer_range(49152) == range(20000, 30000)
    # one that starts lower moves the offers down with it
    assert ports.offer_range(15000) == range(5000, 15000)
    # never among the well-known ports
    assert ports.offer_range(5000) == range(1024, 5000)
    # no room at all: the kernel's choice
    assert not ports.offer_range(1024)
    assert not ports.offer_range(100)
    for low in (1025, 20000, 30000, 30001, 32768, 40000, 60999):
        offers = ports.offer_range(low)
        assert offers and offers.stop <= low and offers.start >= 1024
        assert offers.stop <= ports.NODE_PORTS.start or offers.start >= ports.NODE_PORTS.stop


def test_free_ports_are_distinct_free_and_offered_from_the_range() -> None:
    offers = ports.offer_range(ports.ephemeral_low())
    picked = ports.free_ports("127.0.0.1", 5)
    assert len(set(picked)) == 5
    assert all(p in offers for p in picked)
    for p in picked:  # each can be bound (nothing held them past the pick)
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_held_port_is_never_offered() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        # the only port of the range is taken: the kernel's choice instead, never it
        for n in (1, 2):
            picked = ports.free_ports("127.0.0.1", n, within=range(port, port + 1))
            assert len(set(picked)) == n and port not in picked


def test_no_range_left_is_the_kernels_choice() -> None:
    picked = ports.free_ports("127.0.0.1", 3, within=range(0))
    assert len(set(picked)) == 3 and all(p > 0 for p in picked)


def test_the_tests_own_ports_never_meet_the_agents_offers() -> None:
    offers = ports.offer_range(ports.ephemeral_low())
    assert all(free_port() not in offers for _ in range(50))
