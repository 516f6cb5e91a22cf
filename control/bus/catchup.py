"""Bulk catch-up: deliver a backlog of stored messages fast, then hand over.

A new master (or `rove status`) must fold everything stored before it can act.
nats-py's normal path costs ~12 µs per message on this class of machine
(a `Msg`, a header dict, a queue, a task switch, ordered-consumer bookkeeping),
which caps replay below 100k events/s no matter what rove does. For the
backlog only, `catch_up` creates an ephemeral push consumer (no acks, flow
control on) whose deliveries go straight from the protocol parser to the
handler (`RoveNatsClient.raw_deliveries`).

How the consumer is filtered is a choice, made by `read_unfiltered` from the
stream's counts. nats-server reads a wildcard-filtered consumer's next message
at a cost that grows with the number of subjects the filter matches (about
12 µs per message at 512 node subjects, against 2 µs unfiltered, measured on
this machine's class of hardware). When the job owns enough of the stream, the
catch-up reads it unfiltered and drops other jobs' messages by their subject
(a 512-node job alone on its stream replays at about 120k events/s, not 85k).

It is an optimisation with a safe exit: on a delivery gap, an unexpected
status, a stall or a disconnect it stops and returns the last sequence it
handled, and the caller continues from the next one with an ordered consumer.
Nothing is skipped and nothing is handled twice.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from rove.control.bus.natsclient import RoveNatsClient, delivery_sequences
from rove.control.errors import plain
from rove.control.process import logs

log = logs.get("rove.catchup")

#: Backlogs smaller than this are left to the ordered consumer.
MIN_BACKLOG = 2000

Deliver = Callable[[int, str, bytes], Awaitable[None] | None]

_STATUS = b"NATS/1.0 "
_STATUS_100 = b"NATS/1.0 100"


#: Measured wall time per message of a replay on this machine (2 cores, the
#: server and the client together): a filtered read costs FILTERED_BASE_US plus
#: FILTERED_PER_SUBJECT_US per subject the filter matches; an unfiltered read
#: costs UNFILTERED_US per message of the job and FOREIGN_US per message of
#: another job, received and dropped (benchmarks/master_recovery.py).
FILTERED_BASE_US = 7.6
FILTERED_PER_SUBJECT_US = 0.007
UNFILTERED_US = 7.9
FOREIGN_US = 4.3


def read_unfiltered(job_msgs: int, stream_msgs: int, job_subjects: int) -> bool:
    """Whether reading every message and dropping other jobs' beats a filtered read.

    `job_msgs` of the stream's `stream_msgs` messages match the filter, over
    `job_subjects` distinct subjects. A pure cost comparison with the constants
    above; either way the same messages reach the handler, in the same order.
    """
    if job_msgs <= 0 or stream_msgs <= 0:
        return False
    foreign = max(0, stream_msgs - job_msgs)
    filtered = job_msgs * (FILTERED_BASE_US + FILTERED_PER_SUBJECT_US * job_subjects)
    unfiltered = job_msgs * UNFILTERED_US + foreign * FOREIGN_US
    return unfiltered < filtered


def subject_matcher(subject_filter: str) -> Callable[[bytes], bool]:
    """A test of a raw subject against a NATS filter (`*` one token, `>` the rest)."""
    tokens = subject_filter.split(".")
    if tokens[-1] == ">" and not any(t in ("*", ">") for t in tokens[:-1]):
        prefix = ".".join(tokens[:-1]).encode() + b"."
        return lambda subject: subject.startswith(prefix)

    def matches(subject: bytes) -> bool:
        parts = subject.decode().split(".")
        for i, t in enumerate(tokens):
            if t == ">":
                return len(parts) > i
            if i >= len(parts) or (t != "*" and t != parts[i]):
                return False
        return len(parts) == len(tokens)

    return matches


async def _unfiltered_pays(js: JetStreamContext, stream: str, subject_filter: str) -> bool:
    try:
        info = await js.stream_info(stream, subjects_filter=subject_filter)
    except (nats.errors.Error, nats.js.errors.Error):
        return False
    counts = info.state.subjects or {}
    return read_unfiltered(sum(counts.values()), info.state.messages, len(counts))


async def catch_up(
    nc: RoveNatsClient,
    js: JetStreamContext,
    stream: str,
    subject_filter: str,
    start_seq: int,
    target: int,
    deliver: Deliver,
    *,
    stall_s: float = 5.0,
    unfiltered: bool | None = None,
) -> int:
    """Deliver the stored messages with `start_seq <= seq <= target`, in order.

    `unfiltered` forces the way the consumer is filtered; by default
    `read_unfiltered` decides from the stream's counts. Returns the last stream
    sequence handed to `deliver` or passed over as another job's
    (`start_seq - 1` if none); the caller resumes from the next one.
    """
    last = start_seq - 1
    expected_delivery = 1
    done = asyncio.Event()
    if unfiltered is None:
        unfiltered = await _unfiltered_pays(js, stream, subject_filter)
    log.debug("bulk catch-up", stream=stream, start_seq=start_seq, unfiltered=unfiltered)
    ours = subject_matcher(subject_filter) if unfiltered else None

    async def on_raw(subject: bytes, reply: bytes, data: bytes, headers: bytes | None) -> None:
        nonlocal last, expected_delivery
        if headers is not None and headers.startswith(_STATUS):
            if headers.startswith(_STATUS_100):
                if reply:  # flow control: the server waits for this answer
                    await nc.publish(reply.decode())
                return  # idle heartbeat
            done.set()  # consumer deleted, leader change ...: hand over
            return
        if done.is_set():
            return
        seq, delivery, pending = delivery_sequences(reply)
        if delivery != expected_delivery:
            done.set()  # a gap: hand over to the ordered consumer at last + 1
            return
        expected_delivery += 1
        if ours is None or ours(subject):
            result = deliver(seq, subject.decode(), data)
            if result is not None:
                await result
        last = seq
        if seq >= target or pending == 0:
            done.set()

    sub = await nc.subscribe(nc.new_inbox())
    nc.raw_deliveries[sub._id] = on_raw
    consumer: str | None = None
    try:
        info = await js.add_consumer(
            stream,
            ConsumerConfig(
                deliver_subject=sub.subject,
                deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
                opt_start_seq=start_seq,
                filter_subject=None if unfiltered else subject_filter,
                ack_policy=AckPolicy.NONE,
                flow_control=True,
                idle_heartbeat=1.0,
                mem_storage=True,
                num_replicas=1,
                inactive_threshold=30.0,
            ),
        )
        consumer = info.name
        while not done.is_set():
            before = last
            try:
                await asyncio.wait_for(done.wait(), stall_s)
            except TimeoutError:
                if last == before:
                    log.info(
                        "bulk catch-up stalled; continuing with the ordered consumer",
                        stream=stream,
                        last_seq=last,
                    )
                    break
    except (nats.errors.Error, nats.js.errors.Error) as exc:
        log.info("bulk catch-up unavailable; using the ordered consumer", error=plain(exc))
    finally:
        done.set()
        nc.raw_deliveries.pop(sub._id, None)
        try:
            await sub.unsubscribe()
            if consumer is not None:
                await js.delete_consumer(stream, consumer)
        except (nats.errors.Error, nats.js.errors.Error):
            pass  # the consumer expires by itself (inactive_threshold)
    return last
