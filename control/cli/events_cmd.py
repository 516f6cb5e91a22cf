"""`rove events`: print a job's events as readable lines or JSON lines, optionally following."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime as dt
import sys
import time

from rove.control.bus import embedded, records, stored
from rove.control.bus.client import Bus, BusOptions
from rove.control.catalogue import events as ev
from rove.control.catalogue import subjects
from rove.control.cli.format import event_json, event_line
from rove.control.errors import ConfigError
from rove.control.flags import options as common
from rove.control.history import runs
from rove.control.process import aio

#: how often a follow of a job's own server looks whether it still answers
SERVER_CHECK_S = 1.0
#: how long the rest of a job whose server stopped waits for the server to let go of
#: its store (a server stopping writes its last events out first)
STORE_RELEASE_S = 10.0


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


@dataclasses.dataclass
class _Reading:
    """What one `rove events` has read so far, across the buses it reads (a job's own
    server live, then what it stored)."""

    #: the newest run's end as read so far (a live follow's); `end_read` set while it is
    end: ev.JobEnded | None = None
    end_read: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    #: the sequence of the last event read (shown or not): where a second bus goes on
    last_seq: int = 0
    #: set once whoever reads the output stopped (`rove events | head`): the feed's
    #: handler cannot end the command itself
    gone: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)


async def _run(args: argparse.Namespace) -> int:
    options = common.bus_options(args, name="rove-events", job=args.job, daemon=args.follow)
    # Following a job whose server is its own `rove run --standalone` on this machine:
    # the server stops as the job ends; losing it is the end of the follow, not news.
    own_server = args.follow and not args.nats and options.stored_job is None
    reading = _Reading()
    if not own_server:
        await _read(args, options, reading)
    else:
        # Read it live until it no longer answers, then what it stored after the last
        # event read: the server may stop before this has read the job's end, or even
        # before it connected (a connection that waited for it for ever was seen)
        options = dataclasses.replace(options, says_connection=False)
        server_gone = asyncio.Event()
        watch = asyncio.ensure_future(_server_gone(args.job, server_gone))
        try:
            with contextlib.suppress(aio.Stopped):
                await aio.unless(server_gone, _read(args, options, reading))
        finally:
            await aio.cancel_and_wait([watch])
        if server_gone.is_set():  # (not a --until-end that read the end live)
            await _read_stored(args, reading)
    if args.follow:
        print(_ending(args.job, reading.end), file=sys.stderr)
    if args.until_end and (reading.end is None or reading.end.phase is not ev.JobPhase.FINISHED):
        return common.EXIT_FAILED
    return common.EXIT_OK


async def _read(
    args: argparse.Namespace, options: BusOptions, reading: _Reading, *, after: int = 0
) -> None:
    """Print the job's events from the bus of `options` (those after sequence `after`),
    until what the command reads: what is stored now, the newest run's end
    (`--until-end`), or for ever (a live follow: a job's own server is watched by the
    caller)."""
    types = set(args.types) if args.types else None
    out = sys.stdout
    async with await Bus.connect(options) as bus:
        if not await bus.job_exists(args.job) and not (
            args.follow and common.starting(bus, args.job)  # (its events are to come)
        ):
            raise common.no_such_job(bus, args.job)

        bounds = (
            (0, None) if args.run is None else runs.span(await runs.starts(bus, args.job), args.run)
        )

        def write(text: str) -> None:
            if reading.gone.is_set():
                return
            try:
                out.write(text)
                out.flush()
            except BrokenPipeError:
                reading.gone.set()

        def show(rec: records.Recorded) -> None:
            reading.last_seq = rec.seq
            reading.end = runs.end_after(rec.event, reading.end)
            (reading.end_read.clear if reading.end is None else reading.end_read.set)()
            if not matches(rec.event, types, args.node) or not runs.within(rec.seq, bounds):
                return
            write((event_json(rec).decode() if args.json else event_line(rec)) + "\n")

        def bad(rej: records.Rejection) -> None:
            reading.last_seq = rej.seq
            if not args.json:
                write(f"{'':23}  #{rej.seq:<6} {'?':<24} {'(unreadable)':<16} {rej.error}\n")

        start_time = None
        if args.since is not None and not after:
            start_time = dt.datetime.fromtimestamp(
                common.moment_at(args.since, time.time()), dt.UTC
            )
        feed = await bus.subscribe(
            subjects.EVENTS_STREAM,
            subjects.job_events(args.job),
            show,
            bad,
            start_seq=after + 1 if after else None,
            start_time=start_time,
        )

        live = args.follow and not bus.stored_job  # until interrupted, or the reader goes

        async def read() -> None:
            if not live:
                await feed.settled()
            elif args.until_end:
                await feed.settled()
                if reading.end is None and args.since is not None:  # (it may have passed it)
                    reading.end = await runs.newest_end(bus, args.job)
                while reading.end is None:  # (a new run's start clears it again)
                    await reading.end_read.wait()
            else:
                await asyncio.Event().wait()

        try:
            try:  # (raises what a handler raised, if one did)
                await aio.unless(reading.gone, read())
            except aio.Stopped:
                raise BrokenPipeError from None  # (the CLI ends quietly: common.run_reporting)
            if args.follow and not live and args.since is not None:  # (past its end?)
                reading.end = await runs.newest_end(bus, args.job)
        finally:
            await feed.stop()


async def _read_stored(args: argparse.Namespace, reading: _Reading) -> None:
    """The rest of a job whose own server stopped while this read it: what the server
    stored after the last event read, once it let go of its store."""
    store = embedded.job_store(args.job)
    for _ in range(int(STORE_RELEASE_S / SERVER_CHECK_S)):
        if embedded.store_user(store) is None:
            break
        await asyncio.sleep(SERVER_CHECK_S)
    if stored.StoredJob.find(args.job) is None:  # (its store is gone too: that was all)
        return
    options = common.bus_options(args, name="rove-events", job=args.job)
    if options.stored_job is None:  # (a new run of the job started its server meanwhile)
        return
    await _read(args, options, reading, after=reading.last_seq)


def _ending(job: str, end: ev.JobEnded | None) -> str:
    """What a follow says as it ends: how the job's newest run ended, or that it was cut off."""
    if end is None:
        return (
            f"rove events: job {job} was {runs.CUT_OFF} ({runs.CUT_OFF_WHY}): nothing more "
            "will come; the same rove run command goes on with the job"
        )
    how = f"{end.phase}: {end.reason}" if end.reason else str(end.phase)
    return f"rove events: job {job} has ended ({how}): nothing more will come"


async def _server_gone(job: str, gone: asyncio.Event) -> None:
    """Set `gone` once `job`'s own server on this machine no longer answers (its `rove
    run --standalone` ended, and stopped it)."""
    while True:  # (another process's state: looked at, as `rove logs --follow` does)
        if await asyncio.to_thread(stored.running_url, job) is None:
            gone.set()
            return
        await asyncio.sleep(SERVER_CHECK_S)
