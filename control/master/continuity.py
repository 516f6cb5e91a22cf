"""Whether the event stream still holds everything a snapshot depends on (pure).

A master rebuilds a job from its newest snapshot and the events after it. Two
things can make that rebuild silently wrong, and both are detected here so
that the master fails loudly instead:

* **the stream ends before the snapshot**: events the snapshot had folded, and
  that the server had acknowledged, are no longer in the stream. This is what a
  server losing acknowledged writes looks like (a power failure without
  `sync_interval: always`, a disk lost on a majority of replicas: Jepsen's
  2025 NATS analysis);
* **the stream starts after the snapshot**: the events right after it were
  purged or expired, so the tail cannot be replayed.
"""

from __future__ import annotations


def problem(snapshot_seq: int, first_seq: int, last_seq: int) -> str | None:
    """Why the stream (`first_seq`..`last_seq`) cannot continue a snapshot taken at
    `snapshot_seq`, or None."""
    if snapshot_seq > last_seq:
        return (
            f"the event stream ends at sequence {last_seq}, but the job's snapshot was "
            f"taken at sequence {snapshot_seq}: events the server had acknowledged are "
            "gone (lost writes: a power failure without sync_interval: always, or lost "
            "disks). The job cannot be rebuilt as it was; see docs/operations.md, "
            "'What survives what'"
        )
    if first_seq > snapshot_seq + 1 and last_seq >= first_seq:
        return (
            f"the event stream starts at sequence {first_seq}, but the job's snapshot was "
            f"taken at sequence {snapshot_seq}: events {snapshot_seq + 1}..{first_seq - 1} "
            "were purged or expired before any master folded them. The job cannot be "
            "rebuilt as it was; see docs/operations.md, 'What survives what'"
        )
    return None
