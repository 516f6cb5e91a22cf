"""The data lines of `rove status`: a dataset's shards, a stream's partitions (pure)."""

from __future__ import annotations

from typing import Any

import msgspec

from rove.control.domain import shards
from rove.control.master import data, streams


def dataset_view(d: Any, ds: Any) -> dict[str, Any]:
    total, done = data.total(d, ds), data.done_count(d, ds)
    return {
        "name": ds.name,
        "spec": msgspec.to_builtins(ds.spec),
        "shards": total,
        "done": done,
        "leased": len(ds.leases),
        "todo": total - done - len(ds.leases),
        # a stream's clients whose request waits in the master for records to be cut
        "waiting_for_records": len(ds.parked),
        "epoch": (
            0
            if ds.spec.stream or not total
            else min(shards.epoch_of(ds.spec, min(ds.cursor, total - 1)), ds.spec.epochs - 1)
        ),
        "round": ds.round,
        "restored_step": ds.step,
        "requeued_total": ds.requeued_total,
        "nodes": {
            node: {
                "shards": n.shards,
                "samples": n.samples,
                "samples_per_s": (
                    round(n.samples / (n.last_ts - n.first_ts), 1)
                    if n.last_ts > n.first_ts
                    else None
                ),
            }
            for node, n in sorted(ds.nodes.items())
        },
    }


def dataset_line(ds: dict[str, Any], ended: bool = False) -> str:
    """`ended`: of a job that has ended, whose leases went with its workers (unsaid)."""
    per_node = "; ".join(
        f"{node or '(no node)'} {n['shards']} shards"
        + (f" {n['samples_per_s']:.0f} samples/s" if n["samples_per_s"] else "")
        for node, n in ds["nodes"].items()
    )
    restored = (
        f", restored from step {ds['restored_step']}" if ds["restored_step"] is not None else ""
    )
    return (
        f"dataset {ds['name']}: epoch {ds['epoch'] + 1}/{ds['spec']['epochs']}, "
        f"{ds['done']}/{ds['shards']} shards done, "
        + ("" if ended else f"{ds['leased']} leased, ")
        + f"{ds['requeued_total']} requeued{restored}"
        + (
            f", {ds['waiting_for_records']} waiting for records"
            if ds.get("waiting_for_records")
            else ""
        )
        + (f"; by node: {per_node}" if per_node else "")
    )


def stream_view(st: Any, now: float, committed: int | None) -> dict[str, Any]:
    lag = streams.lag(st)
    vector = streams.committed(st, committed)
    trained = dict(st.saved[-1].offsets) if st.saved else {}
    fresh = streams.freshness(st)
    return {
        "dataset": st.dataset,
        "topic": st.topic,
        "shards": st.count,
        "records": st.records,
        "partitions": {
            str(w.partition): {
                "high": w.high,
                "cut": st.next.get(w.partition, w.low),
                "lag": lag[w.partition],
                "trained": trained.get(w.partition),
            }
            for w in st.watermarks
        },
        "saved_step": st.saved[-1].step if st.saved else None,
        "freshness_s": round(fresh, 2) if fresh is not None else None,
        "committed_offsets": dict(vector.offsets) if vector is not None else None,
        "expired": [
            [g.partition, g.start, g.end]
            for g in streams.expired(st, vector or (st.saved[-1] if st.saved else None))
        ],
        "gaps": [[g.partition, g.start, g.end] for g in st.gaps],
        "gap_records": st.gap_records,
        "last_cut_age_s": round(now - st.last_ts, 1) if st.last_ts else None,
        "pruned_shards": st.floor,
        "undecodable": st.undecodable,
        "dead_letters": [[x.partition, x.offset, x.error] for x in st.dead_letters],
    }


def stream_line(st: dict[str, Any]) -> str:
    parts = "; ".join(
        f"p{p} {v['cut']}/{v['high']}" + (f" lag {v['lag']}" if v["lag"] else "")
        for p, v in sorted(st["partitions"].items(), key=lambda kv: int(kv[0]))
    )
    gaps = (
        f"; {st['gap_records']} records lost to retention before a shard covered them"
        if st["gap_records"]
        else ""
    )
    age = f", last cut {st['last_cut_age_s']:g}s ago" if st["last_cut_age_s"] is not None else ""
    line = (
        f"stream {st['dataset']} (topic {st['topic']}): {st['shards']} shards, "
        f"{st['records']} records cut{age}; by partition, cut/high: {parts or 'none yet'}{gaps}"
    )
    if st["saved_step"] is not None:
        trained = "; ".join(
            f"p{p} {v['trained']}"
            for p, v in sorted(st["partitions"].items(), key=lambda kv: int(kv[0]))
            if v["trained"] is not None
        )
        fresh = (
            f", freshness {st['freshness_s']:g}s (produced to trained)"
            if st["freshness_s"] is not None
            else ""
        )
        line += f"\n  trained up to (step {st['saved_step']}): {trained}{fresh}"
    if st["undecodable"]:
        newest = ", ".join(f"p{p}@{at}" for p, at, _ in st["dead_letters"][-5:])
        error = st["dead_letters"][-1][2] if st["dead_letters"] else ""
        line += (
            f"\n  {st['undecodable']} undecodable records skipped (dead letters; newest "
            f"{newest}): {error}"
        )
    for p, start, end in st["expired"]:
        line += (
            f"\n  ERROR: retention deleted p{p} {start}-{end} before the restore point "
            "trained it: a restore would fail; keep the topic longer"
        )
    return line
