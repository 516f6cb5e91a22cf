"""What this agent reports, and as whom: its node, its incarnation, its outbox.

Every fact an agent publishes names the job, the node and the agent's
incarnation (a new one each time the agent starts), and gets a deterministic
id from them and a counter, so a re-sent fact is stored once. Facts go out
through the agent's `Outbox`, in order, kept while the bus is down.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

from rove.control.bus.outbox import Outbox
from rove.control.catalogue import events as ev

if TYPE_CHECKING:
    from rove.control.bus import embedded


class NodeFacts:
    def __init__(
        self,
        outbox: Outbox,
        *,
        job: str,
        node: str,
        incarnation: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.outbox = outbox
        self.job = job
        self.node = node
        self.incarnation = incarnation or uuid.uuid4().hex[:10]
        self.clock = clock
        self._counter = 0

    def envelope(self, *id_parts: object) -> ev.NodeEnvelope:
        """The common fields of this agent's next fact (id from a counter, or `id_parts`)."""
        if not id_parts:
            self._counter += 1
            id_parts = (self._counter,)
        return ev.node_envelope(self.job, self.node, self.incarnation, self.clock(), *id_parts)

    def emit(self, event: ev.Event) -> None:
        """Publish `event` through the outbox (in order; kept while the bus is down)."""
        self.outbox.put(event)

    def nats_server_restarted(self, r: embedded.Restarted) -> None:
        """The job's NATS server, kept by this process (`--standalone`), was started
        again (`rove.control.bus.embedded.keep`): a fact, for `rove events`."""
        self.emit(
            ev.NatsServerRestarted(
                **self.envelope("nats", r.pid),
                pid_before=r.pid_before,
                pid=r.pid,
                ended=r.ended,
                down_s=r.down_s,
            )
        )

    def is_me(self, node: str, incarnation: str) -> bool:
        return (node, incarnation) == (self.node, self.incarnation)
