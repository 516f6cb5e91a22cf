"""`rove events`: print a job's events as readable lines or JSON lines, optionally following."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime as dt
import sys
import time

from rove.control.bus import records, stored
from rove.control.bus.client import Bus
from rove.control.catalogue import events as ev
from rove.control.catalogue import subjects
from rove.control.cli.format import event_json, event_line
from rove.control.errors import ConfigError
from rove.control.flags import options as common
from rove.control.history import runs
from rove.control.process import aio

#: how often a follow of a job's own server looks whether it still answers
SERVER_CHECK_S = 1.0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("events", help="print a job's events", description=__doc__)
    common.add_job_arg(p)
    p.add_argument("--follow", "-f", action="store_true", help="keep printing new events")
    p.add_argument(
        "--until-end",
        action="store_true",
        help="follow until the job's newest run has ended, even on a shared NATS (implies "
        "--follow); exit 0 if it finished, 1 if it failed, was stopped or was cut off",
    )
    p.add_argument(
        "--since",
        type=common.moment,
        metavar="WHEN",
        help="only events newer than this: a duration back from now (30s, 10m, 2h) or an "
        "ISO-8601 time, local unless it names a zone ('2026-11-23 10:32', 2026-11-23T10:32Z)",
    )
    p.add_argument(
        "--type",
        dest="types",
        action="append",
        metavar="TYPE",
        help="only this event type (repeatable), e.g. node_lost",
    )
    p.add_argument("--node", help="only events about this node")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    common.add_run_arg(p)
    common.add_nats_args(p)
    p.set_defaults(func=run)


def matches(event: ev.Event, types: set[str] | None, node: str | None) -> bool:
    if types and ev.kind(event) not in types:
        return False
    return not (node and getattr(event, "node", None) != node)


def run(args: argparse.Namespace) -> int:
    if args.types:
        unknown = sorted(set(args.types) - set(ev.EVENT_TYPES))
        if unknown:
            raise ConfigError(
                f"unknown event type(s) {', '.join(unknown)}; "
                f"known: {', '.join(sorted(ev.EVENT_TYPES))}"
            )
    if args.node:
        subjects.check_name("node", args.node)
    if args.until_end:
        args.follow = True
    return aio.run(_run(args))


async def _run(args: argparse.Namespace) -> int:
    options = common.bus_options(args, name="rove-events", job=args.job, daemon=args.follow)
    # Following a job whose server is its own `rove run --standalone` on this machine:
    # the server stops as the job ends; losing it is the end of the follow, not news.
    own_server = args.follow and not args.nats and options.stored_job is None
    if own_server:
        options = dataclasses.replace(options, says_connection=False)
    types = set(args.types) if args.types else None
    out = sys.stdout
    # the newest run's end as read so far (a live follow's); `end_read` set while it is
    end: list[ev.JobEnded | None] = [None]
    end_read = asyncio.Event()
    async with await Bus.connect(options) as bus:
        if not await bus.job_exists(args.job):
            raise common.no_such_job(bus, args.job)

        bounds = (
            (0, None) if args.run is None else runs.span(await runs.starts(bus, args.job), args.run)
        )

        # set once whoever reads the output stopped (`rove events | head`): the feed's
        # handler cannot end the command itself
        gone = asyncio.Event()

        def write(text: str) -> None:
            if gone.is_set():
                return
            try:
                out.write(text)
                out.flush()
            except BrokenPipeError:
                gone.set()

        def show(rec: records.Recorded) -> None:
            end[0] = runs.end_after(rec.event, end[0])
            (end_read.clear if end[0] is None else end_read.set)()
            if not matches(rec.event, types, args.node) or not runs.within(rec.seq, bounds):
                return
            write((event_json(rec).decode() if args.json else event_line(rec)) + "\n")

        def bad(rej: records.Rejection) -> None:
            if not args.json:
                write(f"{'':23}  #{rej.seq:<6} {'?':<24} {'(unreadable)':<16} {rej.error}\n")

        start_time = None
        if args.since is not None:
            start_time = dt.datetime.fromtimestamp(
                common.moment_at(args.since, time.time()), dt.UTC
            )
        feed = await bus.subscribe(
            subjects.EVENTS_STREAM, subjects.job_events(args.job), show, bad, start_time=start_time
        )

        live = args.follow and not bus.stored_job  # until interrupted, or the reader goes

        async def read() -> None:
            """Until what the command reads: what is stored now, a job's own server gone,
            the newest run's end (`--until-end`), or for ever."""
            if not live:
                await feed.settled()
            elif own_server:
                await _server_gone(args.job)
            elif args.until_end:
                await feed.settled()
                if end[0] is None and args.since is not None:  # (it may have passed the end)
                    end[0] = await runs.newest_end(bus, args.job)
                while end[0] is None:  # (a new run's start clears it again)
                    await end_read.wait()
            else:
                await asyncio.Event().wait()

        try:
            try:  # (raises what a handler raised, if one did)
                await aio.unless(gone, read())
            except aio.Stopped:
                raise BrokenPipeError from None  # (the CLI ends quietly: common.run_reporting)
            if args.follow and not live and args.since is not None:  # (past its end?)
                end[0] = await runs.newest_end(bus, args.job)
            if args.follow:
                print(_ending(args.job, end[0]), file=sys.stderr)
        finally:
            await feed.stop()
    if args.until_end and (end[0] is None or end[0].phase is not ev.JobPhase.FINISHED):
        return common.EXIT_FAILED
    return common.EXIT_OK


def _ending(job: str, end: ev.JobEnded | None) -> str:
    """What a follow says as it ends: how the job's newest run ended, or that it was cut off."""
    if end is None:
        return (
            f"rove events: job {job} was {runs.CUT_OFF} ({runs.CUT_OFF_WHY}): nothing more "
            "will come; the same rove run command goes on with the job"
        )
    how = f"{end.phase}: {end.reason}" if end.reason else str(end.phase)
    return f"rove events: job {job} has ended ({how}): nothing more will come"


async def _server_gone(job: str) -> None:
    """Return once `job`'s own server on this machine no longer answers (its `rove run
    --standalone` ended, and stopped it)."""
    while True:  # (another process's state: looked at, as `rove logs --follow` does)
        if await asyncio.to_thread(stored.running_url, job) is None:
            return
        await asyncio.sleep(SERVER_CHECK_S)
