"""The faults: each injects one, at the moment it is called, and heals it.

A fault returns `Injected`: when it began and ended (healed), what it did, and what it
observed on the way (a problem for the run's checks when the system misbehaved). A
fault holds its fault for a while (a server down, a link cut) and then waits for an
observable state with a deadline load cannot miss; it never sleeps to let things
settle.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
from msgspec.structs import replace

from rove.control.bus.client import Bus
from rove.control.catalogue import events as ev
from rove.control.catalogue import subjects
from tests import factories
from tests.nemesis.world import JOB, NODE_TIMEOUT_S, World
from tests.support import eventually, fold_records

#: Seconds a NATS server, two of them, or a link stays down.
HOLD_S = {"nats-kill": (2.0, 6.0), "nats-quorum": (8.0, 12.0), "partition": (8.0, 12.0)}
#: Garbage messages of the flood, in about FLOOD_S seconds.
FLOOD, FLOOD_S = 50_000, 10.0
#: The most the leading master's memory may grow under the flood.
FLOOD_RSS_BOUND_MIB = 256


@dataclass
class Injected:
    fault: str
    began: float
    ended: float
    note: str = ""
    #: what went wrong while it was injected and healed (empty: nothing)
    problems: list[str] = field(default_factory=list)
    #: committed checkpoint steps this fault destroyed on purpose
    destroyed: set[int] = field(default_factory=set)
    figures: dict[str, float] = field(default_factory=dict)
    #: when the fault replaced the workers: only rounds after this one are its recovery
    #: (a killed agent's workers train on for a moment after it: docs/operations.md)
    round_before: int = 0
    #: the job had finished by the time this fault was injected and checked (set by the
    #: run): without a full-size step after the fault, nothing was left to recover
    job_done: bool = False


Fault = Callable[[World, random.Random], Awaitable[Injected]]


async def _stream_current(world: World) -> bool:
    """Whether every replica of the events stream is back and current."""
    assert world.bus is not None
    try:
        info = await world.bus.js.stream_info(subjects.EVENTS_STREAM)
    except Exception:  # no answer yet: not current
        return False
    cluster = info.cluster
    replicas = (cluster.replicas or []) if cluster else []
    return (
        cluster is not None
        and cluster.leader is not None
        and len(replicas) == 2
        and all(r.current and not r.offline for r in replicas)
    )


async def _stream_leader(world: World) -> tuple[int] | None:
    """(the index of the NATS server that leads the events stream,), once there is one."""
    assert world.bus is not None and world.cluster is not None
    info = await world.bus.js.stream_info(subjects.EVENTS_STREAM)
    leader = info.cluster.leader if info.cluster else None
    names = [n.server_name for n in world.cluster.nodes]
    return (names.index(leader),) if leader in names else None


async def nats_kill(world: World, rnd: random.Random) -> Injected:
    """kill -9 the NATS server that leads the events stream (the worst one to lose:
    writes in flight must be stored once, in order); start it again after a while."""
    assert world.cluster is not None
    (i,) = await eventually(lambda: _stream_leader(world), timeout=30)
    hold = rnd.uniform(*HOLD_S["nats-kill"])
    began = time.time()
    world.cluster.nodes[i].kill()
    await asyncio.sleep(hold)
    world.cluster.nodes[i].start()
    ended = time.time()
    await eventually(lambda: _stream_current(world), timeout=90)
    return Injected(
        "nats-kill", began, ended, f"n{i + 1}, the stream's leader, down {hold:.1f}s",
        figures={"catch_up_s": time.time() - ended},
    )  # fmt: skip


async def nats_quorum(world: World, rnd: random.Random) -> Injected:
    """kill -9 two of three NATS servers (JetStream has no quorum); start them again."""
    assert world.cluster is not None
    down = sorted(rnd.sample(range(3), 2))
    hold = rnd.uniform(*HOLD_S["nats-quorum"])
    began = time.time()
    acked = len(world.witness.acked)
    for i in down:
        world.cluster.nodes[i].kill()
    await asyncio.sleep(hold)
    during = len(world.witness.acked) - acked
    for i in down:
        world.cluster.nodes[i].start()
    ended = time.time()
    await eventually(lambda: _stream_current(world), timeout=120)
    problems = []
    if during > 2:  # (one may have been acknowledged as the servers died)
        problems.append(f"{during} witness events were acknowledged without a quorum")
    names = " and ".join(f"n{i + 1}" for i in down)
    return Injected("nats-quorum", began, ended, f"{names} down {hold:.1f}s", problems)


async def nats_rolling(world: World, rnd: random.Random) -> Injected:
    """Restart the three NATS servers one after another, as an upgrade does: each stops
    gracefully (SIGTERM), starts again, and the next goes only once every replica of the
    events stream is current again."""
    assert world.cluster is not None
    order = rnd.sample(range(3), 3)
    began = time.time()
    for i in order:
        world.cluster.nodes[i].stop()
        world.cluster.nodes[i].start()
        await eventually(lambda: _stream_current(world), timeout=120)
    ended = time.time()
    names = ", ".join(f"n{i + 1}" for i in order)
    return Injected("nats-rolling", began, ended, f"{names} restarted in turn")


async def nats_restart_all(world: World, rnd: random.Random) -> Injected:
    """kill -9 all three NATS servers at once (a power cut): the memory streams, the
    heartbeats and the leases in flight, are gone with them; start them again."""
    assert world.cluster is not None
    hold = rnd.uniform(*HOLD_S["nats-kill"])
    began = time.time()
    for node in world.cluster.nodes:
        node.kill()
    await asyncio.sleep(hold)
    for node in world.cluster.nodes:
        node.start()
    ended = time.time()
    await eventually(lambda: _stream_current(world), timeout=120)
    return Injected(
        "nats-restart-all", began, ended, f"all three down {hold:.1f}s",
        figures={"catch_up_s": time.time() - ended},
    )  # fmt: skip


#: Seconds of the long outage: past the agents' 60 s before they say the bus is silent.
OUTAGE_S = 75.0


async def nats_outage(world: World, rnd: random.Random) -> Injected:
    """Two of three NATS servers down for longer than the agents wait before they say
    so: the job must not fail, each agent must say that the bus does not answer and
    that it answers again, and the job must go on."""
    assert world.cluster is not None
    down = sorted(rnd.sample(range(3), 2))
    began = time.time()
    for i in down:
        world.cluster.nodes[i].kill()
    problems = []
    silent = "the bus has not answered job"
    try:
        await eventually(
            lambda: all(silent in p.log() for p in world.nodes.values()), timeout=OUTAGE_S + 30
        )
    except AssertionError:
        problems.append("an agent did not say that the bus does not answer")
    await asyncio.sleep(max(0.0, began + OUTAGE_S - time.time()))
    codes = {n: p.proc.poll() for n, p in world.nodes.items()}
    if any(c is not None for c in codes.values()):
        problems.append(f"nodes ended during the outage: {codes}")
    for i in down:
        world.cluster.nodes[i].start()
    ended = time.time()
    try:
        await eventually(
            lambda: all("the bus answers job" in p.log() for p in world.nodes.values()),
            timeout=120,
        )
    except AssertionError:
        problems.append("an agent did not say that the bus answers again")
    names = " and ".join(f"n{i + 1}" for i in down)
    return Injected("nats-outage", began, ended, f"{names} down {ended - began:.0f}s", problems)


async def nats_partition(world: World, rnd: random.Random) -> Injected:
    """Cut NATS server n3 off from the other two and every client; heal the link."""
    assert world.nats_ns is not None
    hold = rnd.uniform(*HOLD_S["partition"])
    began = time.time()
    world.nats_ns.cut()
    await asyncio.sleep(hold)
    world.nats_ns.heal()
    ended = time.time()
    await eventually(lambda: _stream_current(world), timeout=120)
    return Injected("nats-partition", began, ended, f"n3 cut off {hold:.1f}s")


async def node_partition(world: World, rnd: random.Random) -> Injected:
    """Cut rove node nb (agent and workers) off from NATS and its peer, past the node
    timeout; heal the link: nb must join the job again."""
    assert world.node_ns is not None
    hold = max(rnd.uniform(*HOLD_S["partition"]), 2 * NODE_TIMEOUT_S)
    joins = await _joins(world, "nb")
    round_before = max((r["round"] for r in world.rows()), default=0)
    began = time.time()
    world.node_ns.cut()
    await asyncio.sleep(hold)
    world.node_ns.heal()
    ended = time.time()
    problems = []
    try:
        await eventually(lambda: _more_joins(world, "nb", joins), timeout=120)
        # the job went on with na alone (a round of 2 ranks), then grew to both nodes
        # again. (The round alone is what to look for: on a busy machine nb can be back
        # before that round's workers trained a step.)
        await eventually(lambda: world.full_speed_at(ended), timeout=120)
        worlds = [
            r.event.world_size
            for r in await world.records()
            if isinstance(r.event, ev.RoundCompleted) and r.event.round > round_before
        ]
        if 2 not in worlds:
            problems.append(f"the job did not go on with na alone while nb was away: {worlds}")
        # (by the node timeout the master may go on without nb: a step nb persisted after
        # that would be an abandoned lineage's files under numbers the new one commits)
        late = [
            round(r.event.ts - began, 1)
            for r in await world.records()
            if isinstance(r.event, ev.CkptPersisted)
            and r.event.node == "nb"
            and began + NODE_TIMEOUT_S < r.event.ts < ended
        ]
        if late:
            problems.append(f"nb, cut off, persisted steps {late} s after the cut")
    except AssertionError:
        problems.append("nb did not join the job again, or the job did not grow back to it")
    return Injected("node-partition", began, ended, f"nb cut off {hold:.1f}s", problems)


async def _joins(world: World, node: str) -> int:
    return sum(
        1
        for r in await world.records()
        if isinstance(r.event, ev.NodeJoined) and r.event.node == node
    )


async def _more_joins(world: World, node: str, before: int) -> bool:
    return await _joins(world, node) > before


async def master_pause(world: World, rnd: random.Random) -> Injected:
    """SIGSTOP the leading master past its lease (a standby takes over), then SIGCONT:
    the woken master must write nothing the server accepts and must step down."""
    paused = await world.leader()
    master = world.masters[paused]
    began = time.time()
    master.pause()

    async def elected_other() -> Any:
        for r in reversed(await world.records()):
            if isinstance(r.event, ev.MasterElected) and r.event.ts > began:
                return r if r.event.master != paused else None
        return None

    new = await eventually(elected_other, timeout=60)
    await asyncio.sleep(rnd.uniform(1.0, 4.0))  # paused on past the election
    master.resume()
    ended = time.time()
    problems = []
    try:
        await eventually(lambda: "deposed: stepping down to standby" in master.log(), timeout=60)
    except AssertionError:
        problems.append(f"{paused}, woken after {new.event.master} was elected, did not step down")
    accepted = [
        r
        for r in await world.records()
        if r.seq > new.seq
        and isinstance(r.event, ev.Decision)
        and r.event.producer == f"master:{paused}"
    ]
    if accepted:
        kinds = sorted({type(r.event).__name__ for r in accepted})
        problems.append(f"the deposed {paused}'s writes were accepted: {kinds}")
    led = new.event.ts - began
    note = f"{paused} paused {ended - began:.1f}s; {new.event.master} led after {led:.1f}s"
    return Injected(
        "master-pause", began, ended, note, problems,
        figures={"failover_s": new.event.ts - began},
    )  # fmt: skip


def _usage(directory: Path) -> str:
    """The largest files under `directory`, for a problem's message."""
    files = sorted(
        (p.stat().st_size, str(p.relative_to(directory)))
        for p in directory.rglob("*")
        if p.is_file()
    )
    total = sum(size for size, _ in files)
    return f"{total} bytes in {len(files)} files, the largest: {files[-5:]}"


def _fill(directory: Path) -> Path:
    """A file that takes every free byte of `directory`'s file system."""
    filler = directory / "filler"
    try:
        f = filler.open("wb", buffering=0)  # a write that does not fit fails at once
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise AssertionError(
                f"the checkpoint file system was full before the fault: {_usage(directory)}"
            ) from exc
        raise
    with f:
        block = b"\0" * (1 << 20)
        try:
            while True:
                f.write(block)
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
        with contextlib.suppress(OSError):
            while True:  # the last partial block
                f.write(b"\0" * 4096)
    return filler


async def disk_full(world: World, rnd: random.Random) -> Injected:
    """Fill the checkpoint file system while the agents persist; free it again."""
    began = time.time()
    filler = await asyncio.to_thread(_fill, world.ckpt)

    async def failed() -> bool:
        return any(
            isinstance(r.event, ev.CkptFailed) and r.event.ts > began for r in await world.records()
        )

    problems = []
    try:
        await eventually(failed, timeout=60)
    except AssertionError:
        problems.append("no persist failed while the disk was full (ckpt_failed)")
    filler.unlink()
    ended = time.time()

    async def committed_again() -> bool:
        return any(
            isinstance(r.event, ev.CkptCommitted) and r.event.ts > ended
            for r in await world.records()
        )

    try:
        await eventually(committed_again, timeout=90)
    except AssertionError:
        problems.append("no step was committed once space was freed")
    return Injected(
        "disk-full", began, ended, f"full {ended - began:.1f}s", problems,
        figures={"commit_again_s": time.time() - ended},
    )  # fmt: skip


async def job_ended(world: World, phase: ev.JobPhase | None = None) -> bool:
    """Whether the job's `job_ended` (in `phase`, or any) is stored (False when the
    stream cannot be read)."""
    try:
        records = await world.records()
    except Exception:  # any failure to read: not known to have ended
        return False
    return any(isinstance(r.event, ev.JobEnded) and phase in (None, r.event.phase) for r in records)


def _committed_steps(world: World) -> list[int]:
    from tests.nemesis.checks import storage_of

    storage = storage_of(world.ckpt)
    return storage.steps() if storage else []


async def checkpoint_corrupt(world: World, rnd: random.Random) -> Injected:
    """Both nodes die (kill -9, shared memory lost as in a power cut); one rank's file of
    the newest committed step is flipped or truncated on disk; the nodes start again:
    the job must restore an older step, the same on every rank, and go on."""
    await eventually(lambda: len(_committed_steps(world)) >= 2, timeout=120)
    rounds = max((r["round"] for r in world.rows()), default=0)
    began = time.time()
    if await job_ended(world):
        # two steps were committed only at the job's end: nodes started again now would
        # wait for a next run no master serves (the run would hang, not fail)
        problem = "fewer than 2 steps were committed before the job ended"
        return Injected("checkpoint-corrupt", began, began, "not injected", [problem])
    for node in list(world.nodes):
        world.nodes[node].kill()
    from tests.nemesis.checks import storage_of

    storage = storage_of(world.ckpt)
    assert storage is not None
    step = storage.committed()
    assert step is not None
    files = sorted((storage.root / f"step-{step:08d}").glob("rank-*.ckpt"))
    victim = rnd.choice(files)
    how = rnd.choice(["flipped", "truncated"])
    data = bytearray(victim.read_bytes())
    if how == "flipped":
        data[rnd.randrange(len(data))] ^= 0xFF
    else:
        data = data[: rnd.randrange(len(data))]
    victim.write_bytes(bytes(data))
    for entry in world.shm.glob("*"):  # the nodes' memory is gone with them
        if entry.is_dir():
            import shutil

            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
    for node in list(world.nodes):
        world.start_node(node)
    ended = time.time()

    def restored() -> list[dict[str, Any]]:
        return [r for r in world.rows() if "restored" in r and r["round"] > rounds]

    problems = []
    try:
        rows = await eventually(restored, timeout=180)
        first = min(r["round"] for r in rows)
        steps = {r["restored"] for r in rows if r["round"] == first}
        # a round too small to have the corrupted rank reads only the files it has: the
        # step is whole for it (the checksums decide, and the lineage check follows)
        victim_rank = int(victim.stem.removeprefix("rank-"))
        read = [r for r in rows if r["restored"] == step and r["world"] > victim_rank]
        if read:
            problems.append(f"the corrupted step {step} was restored by {len(read)} ranks")
        elif len(steps) != 1:
            problems.append(f"the ranks of round {first} restored different steps: {steps}")
        else:
            problems += await _master_knows_the_step_restored(world, first, *steps, step)
    except AssertionError:
        problems.append("the job did not restore after the nodes came back")
    note = f"rank file {victim.name} of step {step} {how}"
    return Injected(
        "checkpoint-corrupt", began, ended, note, problems, destroyed={step}, round_before=rounds
    )


async def _master_knows_the_step_restored(
    world: World, rnd: int, step: int, named: int
) -> list[str]:
    """The workers of round `rnd` restored `step`: their agents say so
    (`training_progress.restored_step`), and the master's state takes it for the round's
    restore and the lineage's start (not the step the round named), unless a newer round
    came first; the step is committed again (storage names the unreadable one) before
    any newer step. Problems, if not."""

    async def said() -> Any:
        records = await world.records()
        told = any(
            isinstance(r.event, ev.TrainingProgress)
            and r.event.round == rnd
            and r.event.restored_step is not None
            for r in records
        )
        # (a round's workers stopped before their first step, by a newer round, say
        # nothing: the checks below then do not apply)
        newer = any(isinstance(r.event, ev.RoundCompleted) and r.event.round > rnd for r in records)
        if not told and not newer:
            return None
        state = fold_records(records, JOB)
        # (the step fallen back to is committed again at the master's next tick)
        return (state, records) if state.ckpt.recommit is None else None

    try:
        state, records = await eventually(said, timeout=60, every=1.0)
    except AssertionError:
        said_nothing = f"no agent said the step the workers of round {rnd} restored"
        return [f"{said_nothing}, or the master did not commit it again"]
    cut = dict(state.ckpt.cuts).get(rnd)
    newest = state.ckpt.cuts[-1][0] if state.ckpt.cuts else None
    if newest == rnd and (cut != step or (state.ckpt.restored or (None,))[0] != step):
        return [
            f"the master says round {rnd} restored {state.ckpt.restored} (lineage from step "
            f"{cut}); its workers restored step {step}"
        ]
    committed = [
        r.event.step
        for r in records
        if isinstance(r.event, ev.CkptCommitted) and r.event.round >= rnd
    ]
    # (`named` is what storage said was committed as the nodes died; the master may have
    # committed a newer step by then, which its agents had not yet recorded on storage:
    # the round then names that one, and restoring it is no fall-back)
    named = next(
        (
            r.event.restore_step
            for r in records
            if isinstance(r.event, ev.RoundCompleted)
            and r.event.round == rnd
            and r.event.restore_step is not None
        ),
        named,
    )
    if newest == rnd and step != named and step not in committed[:1]:
        return [f"step {step}, restored instead of step {named}, was not committed again first"]
    return []


# ----------------------------------------------------------------- hostile clients


def _forged(world: World, epoch: int) -> list[tuple[str, bytes]]:
    """(subject, payload) of every kind of poison, on every subject the catalogue lists."""
    nonce = f"{time.time_ns()}"

    def on_job(e: ev.Event) -> ev.Event:
        return replace(e, job=JOB, id=f"forged:{nonce}:{e.id}")

    events = [on_job(e) for e in factories.all_events()]
    named = [
        # a node claiming another's identity (and so its rank), on its own subject and on
        # the other's
        replace(factories.joined("na", inc="forged", job=JOB), id=f"forged:{nonce}:na"),
        # a fake lease holder: a client that holds shards it was never given, finishes one
        ev.ShardRequested(
            job=JOB, id=f"forged:{nonce}:req", producer="data:intruder", ts=time.time(),
            dataset="generated", client="intruder", request=1, count=4, node="nb",
            held=(0, 1, 2, 3),
        ),
        ev.ShardDone(
            job=JOB, id=f"forged:{nonce}:done", producer="data:intruder", ts=time.time(),
            dataset="generated", client="intruder", shard=ev.ShardRef(5),
        ),
        # a forged plan that removes a node, and a forged election, ahead of every epoch
        replace(
            next(e for e in events if isinstance(e, ev.ScalePlan)),
            remove=("na",), epoch=epoch + 1000,
        ),
        replace(factories.elected("forged", epoch + 1000, job=JOB), id=f"forged:{nonce}:el"),
    ]  # fmt: skip
    out = [(subjects.subject_for(e), ev.encode(e)) for e in [*events, *named]]
    out.append((subjects.node_facts(JOB, "nb"), ev.encode(named[0])))  # na's fact on nb's subject
    every = sorted(
        {s for s, _ in out}
        | {
            subjects.snapshot(JOB),
            subjects.lease_key(JOB),
            subjects.heartbeat(JOB, "na"),
            subjects.heartbeat(JOB, "nb"),
        }
    )
    rnd = random.Random(nonce)
    wrong = ev.encode(on_job(factories.elected("m9", 1)))
    for s in every:
        out += [
            (s, rnd.randbytes(rnd.randrange(1, 300))),  # random bytes
            (s, msgspec.msgpack.encode([1, "two", {"three": 3.0}])),  # msgpack, no event
            (s, wrong if "elected" not in s else ev.encode(on_job(factories.heartbeat("nb")))),
            (s, rnd.randbytes(900_000)),  # under the server's limit, far over any event
            (s, rnd.randbytes(2_000_000)),  # over the server's limit
        ]
    return out


async def _send_all(bus: Bus, poison: list[tuple[str, bytes]]) -> tuple[int, int]:
    """Publish every poison as this client; (stored, refused)."""
    sem = asyncio.Semaphore(256)

    async def one(subject: str, payload: bytes) -> bool:
        async with sem:
            try:
                await bus.publish_raw(subject, payload, deadline_s=3.0)
                return True
            except Exception:  # denied, too large, not a stream subject
                return False

    results = await asyncio.gather(*(one(s, p) for s, p in poison))
    return sum(results), len(results) - sum(results)


async def poison(world: World, rnd: random.Random) -> Injected:
    """Every kind of poison on every subject of the job, from clients with a node's and
    a trainer's credentials, another job's, and none: what they may write is stored (and
    dead-lettered or refused by the master); the rest is refused by the server. The job
    must not be interrupted (no new round) nor lose or repeat a sample."""
    records = await world.records()
    epoch = max((r.event.epoch for r in records if isinstance(r.event, ev.Decision)), default=0)
    rounds_before = max((r["round"] for r in world.rows()), default=0)
    items = _forged(world, epoch)
    began = time.time()
    figures: dict[str, float] = {"payloads": float(len(items))}
    problems = []

    async def send_as(who: str | None) -> None:
        try:
            bus = await world.connect(who, create_streams=False, connect_timeout_s=3.0)
        except Exception as exc:  # refused at the door
            if who is not None or not world.creds:
                problems.append(f"{who or 'a client without credentials'} could not connect: {exc}")
            figures["refused_anonymous"] = float(len(items))
            return
        try:
            stored, refused = await _send_all(bus, items)
            figures[f"refused_{who or 'anonymous'}"] = float(refused)
        finally:
            await bus.close()
        figures[f"stored_{who or 'anonymous'}"] = float(stored)
        if who == "stranger" and stored:
            problems.append(f"another job's agent stored {stored} messages in this job")

    # the senders at once: a publish the server denies waits out its attempt (about 3
    # s), and one after the other they took 23 s on a busy machine, longer than the job
    # had left to train after them
    await asyncio.gather(
        *(
            send_as(who)
            for who in ("nb", "trainer", "stranger", None)
            if who in world.creds or who is None
        )
    )
    ended = time.time()
    # the job goes on in the round it was in: a few more steps of every rank, or to its
    # last step (sending the poison on a busy machine can take most of the job)
    target = world.progress() + 5

    async def went_on() -> bool:
        if world.progress() >= target:
            return True
        return any(  # or it reached its end
            isinstance(r.event, ev.JobEnded) and r.event.phase is ev.JobPhase.FINISHED
            for r in await world.records()
        )

    try:
        await eventually(went_on, timeout=60)
    except AssertionError:
        problems.append("training did not go on after the poison")
    rounds_after = max((r["round"] for r in world.rows()), default=0)
    if rounds_after != rounds_before:
        problems.append(
            f"the poison interrupted training (round {rounds_before} -> {rounds_after})"
        )
    for r in await world.records():
        e = r.event
        if (
            r.seq
            and isinstance(e, ev.Decision)
            and e.producer.startswith("master:")
            and (e.producer not in {f"master:{m}" for m in world.masters})
        ):
            problems.append(f"a forged decision was stored: {type(e).__name__} #{r.seq}")
    return Injected(
        "poison", began, ended, f"{len(items)} payloads x 4 senders", problems, figures=figures
    )


def _rss_mib(pid: int) -> float:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


async def flood(world: World, rnd: random.Random) -> Injected:
    """50,000 garbage messages in about 10 s on the job's subjects, as a node's agent and
    as a trainer (what their credentials may write), while the leading master's memory
    is watched; and a client without credentials tries the same."""
    leader = world.masters[await world.leader()]
    pid = leader.proc.pid
    base = _rss_mib(pid)
    peak = base
    targets = [
        ("nb", subjects.node_facts(JOB, "nb")),
        ("trainer", subjects.data(JOB, "generated")),
    ]
    if not world.creds:
        targets = [("admin", s) for _, s in targets]
    buses = [await world.connect(who, create_streams=False) for who, _ in targets]
    began = time.time()
    problems = []
    try:
        refused = False
        if world.creds:
            try:
                anon = await world.connect(None, create_streams=False, connect_timeout_s=3.0)
                await anon.close()
            except Exception:  # refused, as it must be
                refused = True
            if not refused:
                problems.append("a client without credentials was admitted")
        gen = random.Random(rnd.random())
        t0 = time.monotonic()
        for i in range(FLOOD):
            k = i % len(targets)
            await buses[k].nc.publish(targets[k][1], gen.randbytes(gen.randrange(1, 200)))
            if i % 500 == 499:
                for b in buses:
                    await b.nc.flush()
                peak = max(peak, _rss_mib(pid))
                await asyncio.sleep(max(0.0, t0 + FLOOD_S * (i + 1) / FLOOD - time.monotonic()))
        for b in buses:
            await b.nc.flush()
    finally:
        for b in buses:
            await b.close()
    ended = time.time()

    letters: list[ev.EventRejected] = []

    async def dead_lettered() -> bool:
        nonlocal peak, letters
        peak = max(peak, _rss_mib(pid))
        letters = [
            r.event
            for r in await world.records()
            if isinstance(r.event, ev.EventRejected) and r.event.ts >= began
        ]
        return sum(e.count for e in letters) >= FLOOD

    try:
        await eventually(dead_lettered, timeout=120)
    except AssertionError:
        problems.append("not every flooded message was dead-lettered")
    if len(letters) >= 1000:
        problems.append(f"{len(letters)} dead letters: not in bursts (one each, nearly)")
    growth = peak - base
    if growth > FLOOD_RSS_BOUND_MIB:
        problems.append(f"the leader's memory grew {growth:.0f} MiB under the flood")
    times = sorted(r["t"] for r in world.rows() if "t" in r and began <= r["t"] <= ended)
    if len(times) <= 10:
        problems.append(f"training all but stopped during the flood ({len(times)} step rows)")
    pause = max((b - a for a, b in itertools.pairwise(times)), default=ended - began)
    return Injected(
        "flood", began, ended, f"{FLOOD} messages in {ended - began:.1f}s", problems,
        figures={"leader_rss_growth_mib": growth, "longest_pause_s": pause},
    )  # fmt: skip


FAULTS: dict[str, Fault] = {
    "nats-kill": nats_kill,
    "nats-quorum": nats_quorum,
    "nats-partition": nats_partition,
    "nats-rolling": nats_rolling,
    "nats-restart-all": nats_restart_all,
    "nats-outage": nats_outage,
    "node-partition": node_partition,
    "master-pause": master_pause,
    "disk-full": disk_full,
    "checkpoint-corrupt": checkpoint_corrupt,
    "poison": poison,
    "flood": flood,
}
