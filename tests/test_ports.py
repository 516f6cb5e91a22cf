"""The ports a node offers its next round (`rove.agent.ports`)."""

from __future__ import annotations

import dataclasses
import itertools
import socket

import msgspec
import pytest

from rove.agent import ports
from rove.agent.diagnosis import classify
from rove.agent.endings import store_port_taken
from rove.agent.runtime import RootFailure
from rove.control.catalogue import events as ev
from tests import factories
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


def test_two_sessions_and_their_workers_pick_from_ranges_apart(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`make test` runs two pytest sessions at once, each with two xdist workers in the
    first: a port one restarts NATS on must never be another's pick meanwhile."""
    seen: dict[tuple[str, str], set[int]] = {}
    for session, workers in (("1/2", ("gw0", "gw1")), ("2/2", ("",))):
        for worker in workers:
            monkeypatch.setenv("ROVE_TEST_PORTS", session)
            monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
            monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", str(len(workers)))
            seen[session, worker] = {free_port() for _ in range(40)}
    spans = sorted((min(p), max(p)) for p in seen.values())
    assert all(a[1] < b[0] for a, b in itertools.pairwise(spans)), spans
    monkeypatch.setenv("ROVE_TEST_PORTS", "3/2")
    with pytest.raises(ValueError, match="ROVE_TEST_PORTS must be k/n"):
        free_port()


def _store_failure(port: int, local_rank: int = 0) -> RootFailure:
    """Rank 0's failure as torch 2.13 words it when its store cannot listen on `port`."""
    said = (
        "torch.distributed.DistNetworkError: The server socket has failed to listen on any "
        f"local network address. port: {port}, useIpv6: false, code: -98, name: EADDRINUSE"
    )
    diagnosis = classify(1, None, f"Traceback (most recent call last):\n{said}\n")
    return RootFailure(local_rank, 4242, 1, diagnosis, f"{said}\n")


def test_a_store_port_held_by_another_process_is_rove_s_pick_failing() -> None:
    """A real socket holds the round's MASTER_PORT: rank 0's failure there is the port
    taken; once it is free again, or for another rank or another port, it is not."""
    with socket.socket() as holder:
        holder.bind(("", 0))
        holder.listen()
        port = holder.getsockname()[1]
        r = msgspec.structs.replace(factories.round_completed(1, 1, "n1"), master_port=port)
        assert store_port_taken(r, 0, _store_failure(port), "127.0.0.1") == port
        assert store_port_taken(r, 1, _store_failure(port, 1), "127.0.0.1") == 0
        other = msgspec.structs.replace(r, master_port=port + 1)
        assert store_port_taken(other, 0, _store_failure(port), "127.0.0.1") == 0
        assert store_port_taken(None, 0, _store_failure(port), "127.0.0.1") == 0
    assert not ports.taken(port)
    assert store_port_taken(r, 0, _store_failure(port), "127.0.0.1") == 0, "no one holds it"
    # a TensorFlow task's port, found taken by its runtime, is passed on as it is
    tf = msgspec.structs.replace(r, tasks=(ev.TfTask("chief", 0, 0, "n1", "127.0.0.1", port),))
    found = dataclasses.replace(_store_failure(port), port_taken=port)
    assert store_port_taken(tf, 0, found, "127.0.0.1") == port
