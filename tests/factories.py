"""Builders of valid events for tests (pure data, no I/O)."""

from __future__ import annotations

from rove.control.catalogue import events as ev
from rove.control.catalogue import parts

JOB = "j1"


def _fact(node: str, inc: str, ts: float, job: str, *id_parts: object) -> ev.NodeEnvelope:
    """The fields every fact of an agent carries."""
    return ev.node_envelope(job, node, inc, ts, *id_parts)


def joined(
    node: str, *, inc: str = "i1", ts: float = 100.0, n: int = 0, job: str = JOB
) -> ev.NodeJoined:
    return ev.NodeJoined(
        **_fact(node, inc, ts, job, "joined", n),
        host=f"host-{node}",
        pid=1000 + n,
        nproc_per_node=2,
    )


def left(node: str, *, inc: str = "i1", ts: float = 100.0, job: str = JOB) -> ev.NodeLeft:
    return ev.NodeLeft(
        **_fact(node, inc, ts, job, "left"),
        reason="done",
    )


def heartbeat(
    node: str, *, inc: str = "i1", seq: int = 1, ts: float = 100.0, job: str = JOB, step: int = 0
) -> ev.Heartbeat:
    return ev.Heartbeat(
        **_fact(node, inc, ts, job, "hb", seq),
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


def run_started(epoch: int, run: int = 2, node: str = "n1", *, job: str = JOB) -> ev.RunStarted:
    return ev.RunStarted(
        **ev.decision_envelope(job, epoch, "m1", 200.0, "run_started", run), run=run, node=node
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


def v1_events() -> list[ev.Event]:
    """The events frozen in tests/data/events_v1.* (do not change)."""
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


PARAMS = ev.RdzvParams(min_nodes=1, max_nodes=2, node_unit=1, max_restarts=3, last_call_s=2.0)


def rdzv(
    node: str,
    *,
    inc: str = "i1",
    ts: float = 100.0,
    nproc: int = 2,
    params: ev.RdzvParams = PARAMS,
    n: int = 0,
    job: str = JOB,
    ports: tuple[int, ...] | None = None,
) -> ev.RdzvJoined:
    return ev.RdzvJoined(
        **_fact(node, inc, ts, job, "rdzv", n, ts),
        addr=f"10.0.0.{node[-1]}",
        nproc_per_node=nproc,
        ports=(29500 + n,) if ports is None else ports,
        params=params,
    )


def started(
    node: str, rnd: int, ranks: tuple[int, ...], *, inc: str = "i1", job: str = JOB
) -> ev.WorkersStarted:
    return ev.WorkersStarted(
        **_fact(node, inc, 100.0, job, "started", rnd),
        round=rnd,
        ranks=ranks,
        pids=tuple(1000 + r for r in ranks),
    )


def exited(
    node: str,
    rnd: int,
    *,
    rank: int = 0,
    kind: ev.FailureKind = ev.FailureKind.KILLED,
    reason: str = "killed by SIGKILL",
    inc: str = "i1",
    ts: float = 100.0,
    job: str = JOB,
    port_taken: int = 0,
) -> ev.WorkerExited:
    return ev.WorkerExited(
        **_fact(node, inc, ts, job, "exited", rnd, rank),
        round=rnd,
        rank=rank,
        local_rank=rank % 2,
        kind=kind,
        reason=reason,
        exit_code=-9,
        signal="SIGKILL",
        log_tail="last words",
        port_taken=port_taken,
    )


def succeeded(node: str, rnd: int, *, inc: str = "i1", job: str = JOB) -> ev.WorkersSucceeded:
    return ev.WorkersSucceeded(
        **_fact(node, inc, 100.0, job, "succeeded", rnd),
        round=rnd,
    )


def round_completed(rnd: int, epoch: int, *nodes: str, job: str = JOB) -> ev.RoundCompleted:
    members = tuple(
        ev.RoundMember(node=n, incarnation="i1", addr="10.0.0.1", nproc=2, first_rank=2 * i)
        for i, n in enumerate(nodes)
    )
    return ev.RoundCompleted(
        job=job,
        id=ev.make_id(job, epoch, "round", rnd),
        producer="master:m1",
        ts=100.0,
        epoch=epoch,
        round=rnd,
        members=members,
        world_size=2 * len(nodes),
        master_addr="10.0.0.1",
        master_port=29500,
    )


def excluded(node: str, epoch: int, *, inc: str = "i1", job: str = JOB) -> ev.NodeExcluded:
    return ev.NodeExcluded(
        job=job,
        id=ev.make_id(job, epoch, "excluded", node, inc),
        producer="master:m1",
        ts=100.0,
        epoch=epoch,
        node=node,
        incarnation=inc,
        reason="hardware",
    )


def replaced(node: str, epoch: int, *, inc: str = "i1", by: str = "i2") -> ev.NodeReplaced:
    return ev.NodeReplaced(
        **ev.decision_envelope(JOB, epoch, "m1", 100.0, "replaced", node, inc),
        node=node,
        incarnation=inc,
        by_incarnation=by,
        by_host=f"host-{node}",
        by_pid=1001,
    )


def one_of_each() -> list[ev.Event]:
    return [
        *v1_events(),
        rdzv("n1"),
        started("n1", 1, (0, 1)),
        exited("n1", 1),
        succeeded("n1", 1),
        round_completed(1, 7, "n1"),
        excluded("n1", 7),
        replaced("n1", 7),
    ]


def check_reported(
    node: str,
    check_round: int,
    *,
    ok: bool = True,
    elapsed: float = 1.0,
    inc: str = "i1",
    job: str = JOB,
) -> ev.NetworkCheckReported:
    return ev.NetworkCheckReported(
        **_fact(node, inc, 100.0, job, "check", check_round),
        check_round=check_round,
        ok=ok,
        elapsed_s=elapsed,
        error="" if ok else "connection refused",
    )


def check_assigned(
    check_round: int, epoch: int, *groups: tuple[str, ...], job: str = JOB
) -> ev.NetworkCheckAssigned:
    return ev.NetworkCheckAssigned(
        job=job,
        id=ev.make_id(job, epoch, "netcheck", check_round),
        producer="master:m1",
        ts=100.0,
        epoch=epoch,
        check_round=check_round,
        timeout_s=60.0,
        groups=tuple(
            ev.CheckGroup(nodes=g, incarnations=("i1",) * len(g), master_addr="h", master_port=1)
            for g in groups
        ),
    )


def check_completed(epoch: int, *, job: str = JOB) -> ev.NetworkCheckCompleted:
    return ev.NetworkCheckCompleted(
        job=job,
        id=ev.make_id(job, epoch, "netcheck_done"),
        producer="master:m1",
        ts=100.0,
        epoch=epoch,
        results=(ev.NodeCheck(node="n1", failures=0, best_s=1.0),),
        faulty=(),
        stragglers=(),
    )


def task_restarted(
    node: str, rnd: int, rank: int, role: str = "worker", *, restarts: int = 1, job: str = JOB
) -> ev.TaskRestarted:
    return ev.TaskRestarted(
        **_fact(node, "i1", 100.0, job, "task_restarted", rnd, rank, restarts),
        round=rnd,
        rank=rank,
        role=role,
        index=rank - 2,
        kind=ev.FailureKind.KILLED,
        reason="killed by SIGKILL",
        exit_code=-9,
        restarts=restarts,
    )


def every_event() -> list[ev.Event]:
    return [
        *one_of_each(),
        task_restarted("n1", 1, 3),
        ev.NatsServerRestarted(
            **_fact("n1", "i1", 100.0, JOB, "nats", 4242),
            pid_before=4241,
            pid=4242,
            ended="was killed by SIGKILL",
            down_s=0.4,
        ),
        check_reported("n1", 0),
        check_assigned(0, 7, ("n1", "n2")),
        check_completed(7),
        run_started(1),
    ]


def in_memory(
    node: str, step: int, ranks: tuple[int, ...], *, inc: str = "i1", job: str = JOB, rnd: int = 1
) -> ev.CkptInMemory:
    return ev.CkptInMemory(
        **_fact(node, inc, 100.0, job, "mem", step, rnd),
        step=step,
        ranks=ranks,
        round=rnd,
    )


def replica(
    holder: str,
    source: str,
    step: int,
    *,
    ranks: tuple[int, ...] = (0, 1),
    round: int = 1,
    inc: str = "i1",
    source_inc: str = "",
    job: str = JOB,
) -> ev.ReplicaStored:
    return ev.ReplicaStored(
        **_fact(holder, inc, 100.0, job, "replica", source, step),
        source=source,
        step=step,
        round=round,
        ranks=tuple(ev.ReplicaRank(r, 1 << 20, 0xABC + r) for r in ranks),
        source_incarnation=source_inc,
    )


def found(node: str, step: int, *, inc: str = "i1", job: str = JOB) -> ev.CkptFound:
    return ev.CkptFound(**_fact(node, inc, 100.0, job, "found"), step=step, location="s3://b/j")


def persisted(
    node: str,
    step: int,
    ranks: tuple[int, ...],
    world: int = 4,
    *,
    inc: str = "i1",
    job: str = JOB,
    rnd: int = 1,
) -> ev.CkptPersisted:
    return ev.CkptPersisted(
        **_fact(node, inc, 100.0, job, "persisted", step, rnd),
        step=step,
        ranks=ranks,
        world_size=world,
        location="/ckpt",
        round=rnd,
    )


def ckpt_failed(node: str, step: int, *, inc: str = "i1", job: str = JOB) -> ev.CkptFailed:
    return ev.CkptFailed(
        **_fact(node, inc, 100.0, job, "ckpt_failed", step),
        step=step,
        error="the disk is full",
    )


def committed(step: int, epoch: int, world: int = 4, *, job: str = JOB) -> ev.CkptCommitted:
    return ev.CkptCommitted(
        job=job,
        id=ev.make_id(job, epoch, "ckpt_committed", step),
        producer="master:m1",
        ts=100.0,
        epoch=epoch,
        step=step,
        world_size=world,
    )


def data_events(job: str = JOB) -> list[ev.Event]:
    """One of each data-shard event (facts from a client, then the master's answers)."""
    fact = {"job": job, "producer": "data:c1", "ts": 100.0}
    decision = {"job": job, "producer": "master:m1", "ts": 100.5, "epoch": 7}
    spec = ev.DatasetSpec(size=1000, shard_size=100, epochs=2, seed=1)
    return [
        ev.DatasetRegistered(**fact, id="c1:1", dataset="ds", spec=spec, client="c1", node="n1"),
        ev.ShardRequested(
            **fact,
            id="c1:2",
            dataset="ds",
            client="c1",
            request=2,
            count=2,
            node="n1",
            round=1,
            restore=ev.DataPosition(done=((0, 3),), partial=(ev.ShardRef(4, 17),)),
            restore_step=40,
            done=(ev.ShardRef(3),),
            answered=1,
        ),
        ev.ShardDone(**fact, id="c1:3", dataset="ds", client="c1", shard=ev.ShardRef(4, 17)),
        ev.ShardLeased(
            **decision,
            id="l1",
            dataset="ds",
            client="c1",
            request=2,
            shards=(ev.ShardRef(4, 17), ev.ShardRef(5)),
            deadline=700.0,
            node="n1",
        ),
        ev.ShardRequeued(
            **decision, id="q1", dataset="ds", shards=(ev.ShardRef(5),), reason="node_lost"
        ),
        ev.DataRestored(
            **decision, id="r1", dataset="ds", round=1, step=40, done_shards=4, partial_shards=1
        ),
        ev.DataRejected(
            **decision, id="x1", dataset="ds", client="c1", event_id="c1:9", reason="duplicate"
        ),
    ]


def progressed(
    node: str,
    rnd: int,
    step: int,
    at: float,
    *,
    first: tuple[int, float] = (1, 0.0),
    ckpt_s: float = 0.0,
    data_s: float = 0.0,
    restore_s: float = 0.0,
    restored: int | None = None,
    inc: str = "i1",
    job: str = JOB,
) -> ev.TrainingProgress:
    return ev.TrainingProgress(
        **_fact(node, inc, at, job, "progress", rnd, step),
        round=rnd,
        step=step,
        at=at,
        first_step=first[0],
        first_at=first[1] or at,
        ckpt_block_s=ckpt_s,
        data_wait_s=data_s,
        restore_s=restore_s,
        restored_step=restored,
    )


def all_events() -> list[ev.Event]:
    return [
        *every_event(),
        progressed("n1", 1, 10, 110.0, first=(1, 101.0)),
        in_memory("n1", 5, (0, 1)),
        persisted("n1", 5, (0, 1)),
        ckpt_failed("n1", 6),
        committed(5, 7),
        *data_events(),
        *scale_events(),
        *parts.split(round_completed(3, 2, *(f"node-{i:04d}" for i in range(2000))))[-2:],
    ]


def workload(lo: int = 1, hi: int = 2) -> ev.Workload:
    return ev.Workload(
        argv=("--nproc-per-node", "1", "train.py"),
        cwd="/tmp",
        min_nodes=lo,
        max_nodes=hi,
        resources=ev.Resources(cpu=1.0, memory_bytes=2 * ev.GIB),
    )


def scale_events(job: str = JOB) -> list[ev.Event]:
    launch = ev.NodeLaunch(
        node="n0-a1", slot=0, attempt=1, resources=ev.Resources(memory_bytes=4 * ev.GIB)
    )
    return [
        ev.JobSubmitted(**ev.envelope(job, "cli", 100.0, "submitted"), workload=workload()),
        ev.ScalePlan(
            **ev.decision_envelope(job, 7, "m1", 100.0, "scale_plan", 1),
            plan=1,
            rule=ev.ScaleRule.OOM,
            reason="n0-a0 ran out of memory",
            cause="x",
            launch=(launch,),
            remove=("n0-a0",),
            target=1,
        ),
        ev.PlanApplied(
            **ev.envelope(job, "scaler:s1", 100.0, "applied", 1),
            plan=1,
            scaler="s1",
            backend="local",
            created=("n0-a1",),
            removed=("n0-a0",),
        ),
        ev.PlanFailed(
            **ev.envelope(job, "scaler:s1", 100.0, "failed", 2),
            plan=2,
            scaler="s1",
            backend="local",
            error="no room",
        ),
        gone("n0-a1", job=job),
        ev.NodePending(
            **ev.envelope(job, "scaler:s1", 100.0, "node_pending", "n0-a2"),
            node="n0-a2",
            scaler="s1",
            reason="unschedulable for 120s: 0/3 nodes are available: 3 Insufficient memory.",
        ),
        ev.StreamShardsAdded(
            **ev.envelope(job, "bridge:b1", 100.0, "stream", "clicks", 0, 0, 2),
            dataset="clicks",
            topic="clicks",
            bridge="b1",
            shards=(ev.StreamShard(0, 0, 256), ev.StreamShard(1, 0, 40)),
            watermarks=(ev.Watermark(0, 0, 300), ev.Watermark(1, 0, 40)),
        ),
        ev.StreamCheckpointed(
            **ev.envelope(job, "data:n0-r0-main", 101.0, "n0-r0-main", 1),
            dataset="clicks",
            client="n0-r0-main",
            step=12,
            round=1,
            done=((0, 0),),
            partial=((1, 7),),
            newest_ts=100.5,
        ),
        ev.RecordsUndecodable(
            **ev.envelope(job, "data:n0-r0-w1", 101.5, "n0-r0-w1", 3),
            dataset="clicks",
            client="n0-r0-w1",
            partition=1,
            offsets=(17,),
            count=1,
            error="JSONDecodeError('Expecting value: line 1 column 1 (char 0)')",
        ),
        ev.ScaleRequested(
            **ev.envelope(job, "cli:me@host", 100.0, "scale", "r1"),
            min_nodes=1,
            max_nodes=3,
            reason="more data today",
        ),
        ev.CkptFound(
            **ev.node_envelope(job, "n0", "inc1", 100.0, "found"),
            step=120,
            location="s3://bucket/job",
        ),
        replica("n1", "n0", 120, job=job),
    ]


def gone(
    node: str,
    *,
    inc: str = "i1",
    ts: float = 100.0,
    job: str = JOB,
    exit_code: int = -9,
    reason: str = "",
) -> ev.NodeGone:
    return ev.NodeGone(
        **ev.envelope(job, "scaler:s1", ts, "gone", node, inc),
        node=node,
        incarnation=inc,
        scaler="s1",
        reason=reason or f"process exited with code {exit_code}",
        exit_code=exit_code,
    )
