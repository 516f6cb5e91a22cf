"""The checkpoints part of `rove status`: the view (plain data) and its line (pure)."""

from __future__ import annotations

from typing import Any

from rove.control.domain.words import counted, ranks
from rove.control.master.checkpoints import CkptState


def view(c: CkptState) -> dict[str, Any]:
    return {
        "committed_step": c.committed,
        "in_memory": {node: step for node, (step, _ranks) in c.memory.items()},
        "spilled": {node: list(rs) for node, rs in c.spilled.items() if node in c.memory},
        "replicas": {
            node: {"step": step, "held_by": [h for h, _ in holders]}
            for node, (step, _ranks, holders) in c.replicas.items()
        },
        "restored": (
            None
            if c.restored is None
            else dict(zip(("step", "source", "fetched_ranks"), c.restored, strict=True))
        ),
        "persist_failures": c.failures,
        "last_error": c.last_error or None,
    }


def line(ck: dict[str, Any], ended: bool = False, kept_until: str | None = None) -> str:
    """One line of what the checkpoints are ('' before any). Of an `ended` job: what was
    durable at its end, and which newer steps were in memory only (freed since). Of a job
    cut off (`kept_until`, when its nodes' shared memory may be reclaimed): which steps a
    rerun can still restore from memory, and until when."""
    if not ck["in_memory"] and ck["committed_step"] is None:
        return ""
    committed = ck["committed_step"]
    if ended or kept_until is not None:
        newer = {n: s for n, s in ck["in_memory"].items() if committed is None or s > committed}
        memory = ", ".join(f"{n} step {s}" for n, s in sorted(newer.items()))
        text = "checkpoints: " + (
            f"committed step {committed}" if committed is not None else "none persisted"
        )
        if memory and ended:
            text += f"; {'newer steps were' if committed is not None else 'the newest was'}"
            text += f" in memory only: {memory}"
        elif memory:
            text += (
                f"; in its nodes' shared memory: {memory}, kept for a rerun to restore until"
                f" about {kept_until} (ROVE_SHM_GRACE_S), then the next job there may reclaim it"
            )
    else:
        spilled = ck.get("spilled") or {}
        memory = ", ".join(
            f"{n} step {s}" + (f" ({ranks(spilled[n])} spilled to disk)" if n in spilled else "")
            for n, s in sorted(ck["in_memory"].items())
        )
        text = "checkpoints: " + (
            f"committed step {committed}"
            if committed is not None
            else "nothing persisted yet: a lost node's steps come back only from its peers"
            if ck["replicas"]
            else "nothing persisted yet: losing a node loses its in-memory steps"
        )
        text += f"; in memory: {memory or '-'}"
    if ck["restored"] is not None:
        got = ck["restored"]
        fetched = (
            f", {counted(got['fetched_ranks'], 'rank')} fetched" if got["fetched_ranks"] else ""
        )
        which = "its last round" if ended else "this round"
        text += f"; {which} restored step {got['step']} from {got['source']}{fetched}"
    if ck["replicas"]:
        text += "; on peers: " + ", ".join(
            f"{n} step {r['step']} on {'+'.join(r['held_by'])}"
            for n, r in sorted(ck["replicas"].items())
        )
    if ck["persist_failures"]:
        text += f"; {ck['persist_failures']} persist failures (last: {ck['last_error']})"
    return text
