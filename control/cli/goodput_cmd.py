"""`rove goodput`: how much of a job's time trained its model, from the event log.

Replays the job's events (`rove.control.domain.goodput`) and prints the goodput ratio and
the badput by bucket, for the job's whole life or a window of it, as a table or one
JSON object; `--svg` also draws the timeline with its failures.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
from pathlib import Path
from typing import Any

from rove.control.bus.client import Bus
from rove.control.domain import goodput as gp
from rove.control.domain.goodput_svg import render as render_svg
from rove.control.domain.words import counted, local_iso
from rove.control.errors import ConfigError
from rove.control.flags import options as common
from rove.control.history import runs
from rove.control.process import aio


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "goodput", help="a job's goodput and badput, from its events", description=__doc__
    )
    common.add_job_arg(p)
    when = (
        "a duration back from now (30s, 10m, 2h) or an ISO-8601 time, local unless it names a zone"
    )
    p.add_argument("--since", type=common.moment, metavar="WHEN", help=f"window start: {when}")
    p.add_argument("--until", type=common.moment, metavar="WHEN", help=f"window end: {when}")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--svg", type=Path, metavar="FILE", help="also draw the timeline to FILE")
    common.add_run_arg(p)
    common.add_nats_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    now = time.time()
    since, until = (
        None if w is None else common.moment_at(w, now) for w in (args.since, args.until)
    )
    if since is not None and until is not None and until <= since:
        raise ConfigError(
            f"--until ({local_iso(until)}) must be after --since ({local_iso(since)})"
        )
    if args.svg is not None and not args.svg.parent.is_dir():
        raise ConfigError(f"cannot write {args.svg}: {args.svg.parent} is not a directory")
    ledger, stored = aio.run(_read(args))
    cut = args.run is None and runs.cut_off(stored, bool(ledger.ended))
    # (a run cut off ends with its last event: its time does not grow while nothing runs)
    report = gp.report(ledger, ledger.last_ts if cut else now, since, until)
    if args.svg is not None:
        args.svg.write_text(render_svg(report))
    known = ledger.steps_reported
    if args.json:
        sys.stdout.write(json.dumps({**as_json(report, known=known), "cut_off": cut}) + "\n")
    else:
        sys.stdout.write(render(report, known=known, cut_off=cut))
        if args.svg is not None:
            sys.stdout.write(f"timeline: {args.svg}\n")
    return common.EXIT_OK


async def _read(args: argparse.Namespace) -> tuple[gp.Ledger, bool]:
    """The ledger of the run asked for, and whether it was read from the job's store."""
    options = common.bus_options(args, name="rove-goodput", job=args.job)
    async with await Bus.connect(options) as bus:
        if not await bus.job_exists(args.job):
            raise common.no_such_job(bus, args.job)
        return await runs.ledger(bus, args.job, args.run), bus.stored_job


def as_json(r: gp.Report, *, known: bool = True) -> dict[str, Any]:
    """`known`: whether any worker reported a step; without one, `goodput` is null."""
    return {
        "job": r.job,
        "since": r.start,
        "until": r.end,
        "seconds": round(r.total_s, 3),
        "goodput": round(r.goodput, 4) if known else None,
        "steps_reported": known,
        "buckets": {b.value: round(s, 3) for b, s in r.seconds.items()},
        "rounds": r.rounds,
        "restores": dict(r.restores),
        "failures": [
            {"ts": f.ts, "what": f.what, "node": f.node, "reason": f.reason} for f in r.failures
        ],
        "ended": r.ended or None,
    }


def render(r: gp.Report, *, known: bool = True, cut_off: bool = False) -> str:
    state = f"ended {r.ended}" if r.ended else runs.CUT_OFF if cut_off else "running"
    lines = [
        f"job {r.job} ({state}): {local_iso(r.start)} to {local_iso(r.end)}, {r.total_s:.1f} s, "
        f"{counted(r.rounds, 'round')}, {counted(len(r.failures), 'failure')}",
        "",
        f"{'bucket':<22}{'seconds':>12}{'share':>9}",
    ]
    total = r.total_s or 1.0
    for bucket, secs in sorted(r.seconds.items(), key=lambda kv: -kv[1]):
        if secs or bucket is gp.Bucket.PRODUCTIVE:
            lines.append(f"{bucket.value:<22}{secs:>12.1f}{secs / total:>9.1%}")
    lines += ["", f"goodput {r.goodput:.1%}" if known else gp.NOT_KNOWN]
    if r.restores:
        lines.append(
            "restores: " + ", ".join(f"{n} from {src}" for src, n in sorted(r.restores.items()))
        )
    if r.failures:
        lines += ["", "failures:"]
        for f in r.failures:
            when = dt.datetime.fromtimestamp(f.ts).strftime("%H:%M:%S")  # (local, as above)
            lines.append(f"  {when}  {f.what:<15} {f.node:<14} {f.reason}")
    return "\n".join(lines) + "\n"
