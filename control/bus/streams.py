"""rove's JetStream streams: what each holds, where, and for how long (pure).

    ROVE_EVENTS   rove.ev.>    facts and decisions: file storage, fsynced as the
                               server is configured, bounded in age and bytes
    ROVE_HB       rove.hb.>    the newest heartbeat per node: memory
    ROVE_ANSWERS  rove.ans.>   the master's shard leases to data clients: memory
    ROVE_SNAP     rove.snap.>  the newest master snapshot per job: file storage

Memory streams hold what can be rebuilt: a heartbeat is sent again within
seconds, and a lease is a function of the stored requests (every master
replaying `ROVE_EVENTS` allocates the same shards and announces them again), so
neither spends the fsync budget of the facts that matter (docs/data.md, "Leases").
"""

from __future__ import annotations

from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig

from rove.control.bus.options import BusOptions
from rove.control.catalogue import subjects

#: Heartbeats older than this are dropped (a node's newest is all that matters).
HEARTBEAT_MAX_AGE_S = 86400.0
#: Leases older than this are dropped: a client away longer gets its pending
#: leases announced again by the leader (`rove.control.master.runner`).
ANSWER_MAX_AGE_S = 3600.0
#: The most memory the leases of all jobs on a server take (the oldest go first).
ANSWER_MAX_BYTES = 32 * 1024 * 1024


def configs(o: BusOptions) -> list[StreamConfig]:
    """Every stream rove creates, for the bus options `o` (replicas, limits)."""
    return [
        StreamConfig(
            name=subjects.EVENTS_STREAM,
            subjects=[f"{subjects.EVENTS_ROOT}.>"],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            num_replicas=o.replicas,
            duplicate_window=o.duplicate_window_s,
            allow_direct=True,
            # bounded (docs/operations.md, "Storage"): old events are retired
            max_age=o.events_max_age_s,
            max_bytes=o.events_max_bytes,
            discard=DiscardPolicy.OLD,
        ),
        StreamConfig(
            name=subjects.HEARTBEAT_STREAM,
            subjects=[f"{subjects.HEARTBEAT_ROOT}.>"],
            retention=RetentionPolicy.LIMITS,
            # the newest per node, worth nothing after a restart: kept in memory,
            # out of the fsync budget of the facts that matter
            storage=StorageType.MEMORY,
            num_replicas=o.replicas,
            max_msgs_per_subject=1,
            duplicate_window=o.duplicate_window_s,
            allow_direct=True,
            max_age=HEARTBEAT_MAX_AGE_S,  # an ended job's nodes leave nothing behind
        ),
        StreamConfig(
            name=subjects.ANSWER_STREAM,
            subjects=[f"{subjects.ANSWER_ROOT}.>"],
            retention=RetentionPolicy.LIMITS,
            # rebuilt from the stored requests by any master: memory, no fsync
            storage=StorageType.MEMORY,
            num_replicas=o.replicas,
            duplicate_window=o.duplicate_window_s,
            allow_direct=True,
            max_age=ANSWER_MAX_AGE_S,
            max_bytes=ANSWER_MAX_BYTES,
            discard=DiscardPolicy.OLD,
        ),
        StreamConfig(
            name=subjects.SNAPSHOT_STREAM,
            subjects=[f"{subjects.SNAPSHOT_ROOT}.>"],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            num_replicas=o.replicas,
            max_msgs_per_subject=1,
            allow_rollup_hdrs=True,
            allow_direct=True,
            max_age=o.events_max_age_s,  # no use once the job's events are retired
        ),
    ]
