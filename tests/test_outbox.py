"""An outbox never dies silently: a fact it may never send is said, and its owner told."""

from __future__ import annotations

import asyncio

import nats.errors

from rove.control import events as ev
from rove.control.bus import Bus
from rove.control.outbox import Outbox
from tests import factories
from tests.support import eventually, stored_events


async def test_a_fact_that_can_never_be_sent_stops_the_outbox_loudly(bus: Bus) -> None:
    """A payload over the server's 1 MiB limit is no bus outage: no retry can send it."""
    outbox = Outbox(bus, what="facts of n1")
    outbox.start()
    outbox.put(factories.joined("n1"))
    huge = ev.EventRejected(
        **ev.decision_envelope("j1", 1, "m1", 1.0, "huge"),
        stream="ROVE_EVENTS",
        stream_seq=1,
        subject="rove.ev.j1.node.n1",
        error="x",
        payload_size=2 << 20,
        payload_head=b"x" * (2 << 20),
    )
    outbox.put(huge)
    outbox.put(factories.joined("n2"))
    await eventually(lambda: outbox.failure is not None, timeout=20)
    assert isinstance(outbox.failure, nats.errors.MaxPayloadError)
    assert outbox.task is not None and outbox.task.done()
    assert isinstance(outbox.task.exception(), nats.errors.MaxPayloadError), "for a supervisor"
    await asyncio.sleep(0.2)
    nodes = [r.event.node for r in await stored_events(bus) if isinstance(r.event, ev.NodeJoined)]
    assert nodes == ["n1"], "in order: nothing after the fact it failed on"
    await outbox.stop()
