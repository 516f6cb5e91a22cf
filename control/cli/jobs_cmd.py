"""`rove jobs`: the jobs run on this machine, past and running, and keeping their folders.

    rove jobs                 a table: state, start, duration, rounds, restarts, goodput
    rove jobs --json          one JSON object per job
    rove jobs --prune         remove all but the newest ROVE_KEEP_JOBS (20) folders,
                              never a running or pinned job's
    rove jobs --keep J        pin job J (--unkeep J: unpin)

Each job's summary is read from its events (an ended job's from its stored stream)
and cached in its folder once it has ended.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

from rove.control.bus import embedded, records, stored
from rove.control.bus.client import Bus
from rove.control.catalogue import subjects
from rove.control.domain import goodput as gp
from rove.control.errors import RoveError, UnknownJobError
from rove.control.flags import options as common
from rove.control.history import jobs as jobs_mod
from rove.control.history import runs
from rove.control.master.evolve import evolve
from rove.control.master.state import initial
from rove.control.process import aio


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "jobs", help="list the jobs run on this machine, prune old ones", description=__doc__
    )
    p.add_argument("--json", action="store_true", help="one JSON object per job")
    p.add_argument("--prune", action="store_true", help="remove old jobs' folders")
    p.add_argument("--keep", metavar="JOB", help="pin JOB: retention never removes it")
    p.add_argument("--unkeep", metavar="JOB", help="unpin JOB")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    for job in (args.keep, args.unkeep):
        if job is not None:
            subjects.check_name("job", job)
            if not embedded.job_dir(job).is_dir():
                raise UnknownJobError(f"no job {job!r} on this machine ({jobs_mod.root()})")
            jobs_mod.pin(job, on=job == args.keep)
            print(f"job {job}: {'pinned' if job == args.keep else 'no longer pinned'}")
    if args.keep or args.unkeep:
        return common.EXIT_OK
    if args.prune:
        for job in jobs_mod.prune(jobs_mod.keep_from_env()):
            print(f"removed job {job} ({embedded.job_dir(job)})")
        return common.EXIT_OK
    rows = [aio.run(summary(job)) for job in jobs_mod.names()]
    if args.json:
        for row in rows:
            sys.stdout.write(json.dumps(row.to_json()) + "\n")
    else:
        pinned = {j for j in jobs_mod.names() if (embedded.job_dir(j) / jobs_mod.PIN).exists()}
        sys.stdout.write(jobs_mod.render(rows, pinned) if rows else "no jobs on this machine\n")
    return common.EXIT_OK


async def summary(job: str) -> jobs_mod.Summary:
    """One job's summary: cached once ended, else read from its events."""
    # its own embedded server, running; or the shared NATS a node of this machine ran it
    # on (`rove run --nats`), read there while it answers (the job may run on there)
    local = stored.running_url(job)
    shared = stored.shared_url(job) if local is None else None
    if local is None and (found := jobs_mod.cached(job)) is not None:
        return found  # (an ended job's, whichever server it ran on: no server asked)
    running = local is not None or (shared is not None and stored.answers(shared))
    if not running and stored.StoredJob.find(job) is None:  # on a server not reached
        where = f"its events are on {shared}, not reached" if shared else ""
        return jobs_mod.Summary(job, jobs_mod.ELSEWHERE, None, 0.0, 0, 0, where, None)
    try:
        args = _local_nats_args()
        state, ledger = initial(job), gp.Ledger()
        async with await Bus.connect(common.bus_options(args, name="rove-jobs", job=job)) as bus:
            # the newest run's goodput, as `rove goodput` reads it (the state's fold
            # leaves the earlier runs behind itself)
            newest = runs.span(await runs.starts(bus, job), None)

            def fold(rec: records.Recorded) -> None:
                nonlocal state
                state = evolve(state, rec.event, rec.seq)
                if runs.within(rec.seq, newest):
                    ledger.add(rec.event)

            await bus.read(subjects.EVENTS_STREAM, subjects.job_events(job), fold)
    except RoveError as exc:
        return jobs_mod.Summary(job, "unreadable", None, 0.0, 0, 0, str(exc)[:200], None)
    known = ledger.steps_reported
    if runs.cut_off(not running, state.phase.terminal):
        # (its time ends with its last event; not cached: a rerun goes on with this run)
        cut = jobs_mod.summarize(state, gp.report(ledger, ledger.last_ts), known)
        return dataclasses.replace(cut, state=runs.CUT_OFF)
    result = jobs_mod.summarize(state, gp.report(ledger, time.time()), known)
    if local is None and state.phase.terminal:  # (a shared NATS job too, once it ended)
        jobs_mod.cache(result)
    return result


def _local_nats_args() -> argparse.Namespace:
    """NATS flags that find a job of this machine by its folder (never ROVE_NATS_URL)."""
    p = argparse.ArgumentParser()
    common.add_nats_args(p)
    args = p.parse_args([])
    args.nats = None
    return args
