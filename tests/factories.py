"""Builders of valid events for tests (pure data, no I/O)."""

from __future__ import annotations

from rove.control import events as ev

JOB = "j1"


def joined(
    node: str, *, inc: str = "i1", ts: float = 100.0, n: int = 0, job: str = JOB
) -> ev.NodeJoined:
    return ev.NodeJoined(
        job=job,
        id=ev.make_id(node, inc, "joined", n),
        producer=f"agent:{node}",
        ts=ts,
        node=node,
        host=f"host-{node}",
        pid=1000 + n,
        incarnation=inc,
        nproc_per_node=2,
    )


def left(node: str, *, inc: str = "i1", ts: float = 100.0, job: str = JOB) -> ev.NodeLeft:
    return ev.NodeLeft(
        job=job,
        id=ev.make_id(node, inc, "left"),
        producer=f"agent:{node}",
        ts=ts,
        node=node,
        incarnation=inc,
        reason="done",
    )


def heartbeat(
    node: str, *, inc: str = "i1", seq: int = 1, ts: float = 100.0, job: str = JOB, step: int = 0
) -> ev.Heartbeat:
    return ev.Heartbeat(
        job=job,
        id=ev.make_id(node, inc, "hb", seq),
        producer=f"agent:{node}",
        ts=ts,
        node=node,
        incarnation=inc,
        seq=seq,
        cpu_percent=12.5,
        mem_used_bytes=2**30,
        mem_total_bytes=2**34,
        ranks=(ev.RankStat(rank=0, local_rank=0, pid=11, step=step, samples_per_s=100.0),),
    )


def elected(master: str, epoch: int, *, ts: float = 100.0, job: str = JOB) -> ev.MasterElected:
    return ev.MasterElected(
        job=job,
        id=ev.make_id(job, "elected", epoch),
        producer=f"master:{master}",
        ts=ts,
        epoch=epoch,
        master=master,
    )


def configured(epoch: int, timeout: float = 10.0, *, job: str = JOB) -> ev.JobConfigured:
    return ev.JobConfigured(
        job=job,
        id=ev.make_id(job, "configured"),
        producer="master:m1",
        ts=100.0,
        epoch=epoch,
        spec=ev.JobSpec(node_timeout_s=timeout),
    )


def lost(node: str, epoch: int, *, inc: str = "i1", job: str = JOB) -> ev.NodeLost:
    return ev.NodeLost(
        job=job,
        id=ev.make_id(job, epoch, "node_lost", node, inc),
        producer="master:m1",
        ts=200.0,
        epoch=epoch,
        node=node,
        incarnation=inc,
        last_seen=150.0,
        timeout_s=10.0,
    )


def stop(job: str = JOB) -> ev.StopRequested:
    return ev.StopRequested(job=job, id="stop-1", producer="cli:me", ts=100.0, reason="enough")


def ended(epoch: int, phase: ev.JobPhase = ev.JobPhase.STOPPED, *, job: str = JOB) -> ev.JobEnded:
    return ev.JobEnded(
        job=job,
        id=ev.make_id(job, epoch, "ended"),
        producer="master:m1",
        ts=100.0,
        epoch=epoch,
        phase=phase,
        reason="enough",
    )


def rejected(seq: int, epoch: int, *, job: str = JOB) -> ev.EventRejected:
    return ev.EventRejected(
        job=job,
        id=ev.make_id(job, "rejected", "ROVE_EVENTS", seq),
        producer="master:m1",
        ts=100.0,
        epoch=epoch,
        stream="ROVE_EVENTS",
        stream_seq=seq,
        subject=f"rove.ev.{job}.node.x",
        error="not msgpack",
        payload_size=3,
        payload_head=b"\xff\x00\x01",
    )


def one_of_each() -> list[ev.Event]:
    return [
        joined("n1"),
        left("n1"),
        heartbeat("n1"),
        stop(),
        elected("m1", 7),
        configured(7),
        lost("n1", 7),
        ended(7),
        rejected(12, 7),
    ]
