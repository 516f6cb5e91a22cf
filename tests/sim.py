"""A simulated cluster for pure master logic: fold events, decide with an injected clock.

Decisions are folded back as if they had come through the stream, exactly as
the runner does, so whole scenarios run in microseconds without any I/O. Leases
(`shard_leased`) are not: the runner announces each once to the answers stream,
which no master folds.
"""

from __future__ import annotations

import msgspec

from rove.control.catalogue import events as ev
from rove.control.master.decide import decide
from rove.control.master.evolve import evolve
from rove.control.master.netcheck import Wait
from rove.control.master.silence import Heard, replaces
from rove.control.master.state import JobState, initial
from tests import factories


class Sim:
    def __init__(self, params: ev.RdzvParams, *, node_timeout: float = 30.0) -> None:
        self.state: JobState = initial(factories.JOB)
        self.now = 1000.0
        self.seq = 0
        self.params = params
        self.decisions: list[ev.Decision] = []
        self.announced: set[str] = set()
        self.liveness: dict[str, ev.Heartbeat] = {}
        #: when the leader heard each node live, by its clock (none: judged by the stamps)
        self.heard: dict[str, Heard] = {}
        #: how far each node's clock is ahead of the leader's (its stamps are off by it)
        self.skews: dict[str, float] = {}
        #: what the leader measured of them, as the replica does (`skew.ClockOff`)
        self.clock_off: dict[str, float] = {}
        #: why the rendezvous waits, and why no scale plan is made, after the last tick
        self.waiting: Wait | None = None
        self.scale_waiting: Wait | None = None
        self.apply(factories.elected("m1", 1, ts=0.0))
        self.apply(factories.configured(1, node_timeout))

    def apply(self, event: ev.Event) -> None:
        self.seq += 1
        self.state = evolve(self.state, event, self.seq)

    def tick(self, seconds: float = 0.0) -> list[ev.Decision]:
        """Advance the clock, decide until quiet, fold what was decided."""
        self.now += seconds
        out: list[ev.Decision] = []
        for _ in range(10):
            ds, self.waiting, self.scale_waiting = decide(
                self.state, self.liveness, self.now, heard=self.heard, clock_off=self.clock_off
            )
            ds = [d for d in ds if not (isinstance(d, ev.ShardLeased) and d.id in self.announced)]
            if not ds:
                break
            for d in ds:
                if isinstance(d, ev.ShardLeased):
                    self.announced.add(d.id)  # to the answers stream: never folded
                else:
                    self.apply(d)
            out.extend(ds)
        self.decisions.extend(out)
        return out

    def wait(self, seconds: float, *beating: str) -> list[ev.Decision]:
        """Advance the clock with `beating` nodes heartbeating at the new time, then tick."""
        self.now += seconds
        for node in beating:
            self.beat(node, inc=self.state.nodes[node].incarnation)
        return self.tick()

    def join(
        self,
        node: str,
        *,
        inc: str = "i1",
        nproc: int = 2,
        ports: tuple[int, ...] | None = None,
        tf_role: str = "",
    ) -> None:
        self.apply(factories.joined(node, inc=inc, ts=self.stamp(node)))
        joined = factories.rdzv(
            node, inc=inc, ts=self.stamp(node), nproc=nproc, params=self.params, ports=ports
        )
        self.apply(msgspec.structs.replace(joined, tf_role=tf_role) if tf_role else joined)
        self.beat(node, inc=inc)

    def beat(self, node: str, *, inc: str = "i1") -> bool:
        """A heartbeat of `node`, stamped by its clock; whether it became its newest."""
        seq = self.liveness[node].seq + 1 if node in self.liveness else 1
        hb = factories.heartbeat(node, inc=inc, seq=seq, ts=self.stamp(node))
        record = self.state.nodes.get(node)
        # kept as the replica keeps it (an old incarnation's never hides the current's)
        if replaces(self.liveness.get(node), hb, record.incarnation if record else None):
            self.liveness[node] = hb
            return True
        return False

    def skew(self, node: str, ahead: float, *, measured: bool = True) -> None:
        """`node`'s clock reads `ahead` seconds ahead of the leader's (behind if negative);
        `measured`: the leader has heard its live heartbeats, and knows it."""
        self.skews[node] = ahead
        if measured:
            self.clock_off[node] = -ahead

    def stamp(self, node: str) -> float:
        """Now, by `node`'s clock."""
        return self.now + self.skews.get(node, 0.0)

    def rounds(self) -> list[ev.RoundCompleted]:
        return [d for d in self.decisions if isinstance(d, ev.RoundCompleted)]

    def members(self) -> list[str]:
        return [m.node for m in self.state.rdzv.members]
