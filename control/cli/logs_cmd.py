"""`rove logs`: the workers' output of a job run on this machine, kept in its folder.

Prints the newest round's output (or `--round N`'s), for every rank or `--rank R`,
stdout and stderr, as the workers wrote it; one file plainly, several each under a
`==> round 2, node vm, rank 1, stderr <==` title. `--follow` goes on printing what is
written, and the next rounds', until the job ends.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import BinaryIO

from rove.control.bus import stored
from rove.control.catalogue import subjects
from rove.control.errors import UnknownJobError
from rove.control.flags import options as common
from rove.control.history import joblogs

#: how often --follow looks for more
FOLLOW_EVERY_S = 0.2


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("logs", help="print a job's workers' output", description=__doc__)
    common.add_job_arg(p)
    p.add_argument("--rank", type=common.whole, help="only this global rank")
    p.add_argument("--round", type=common.whole, help="this round (default: the newest)")
    p.add_argument("--node", help="only this node's workers")
    p.add_argument("--stream", choices=joblogs.STREAMS, help="only stdout or stderr")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing until the job ends")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.node:
        subjects.check_name("node", args.node)
    root = joblogs.folder(args.job)
    if not root.is_dir():
        raise UnknownJobError(
            f"no output of job {args.job!r} is kept on this machine (looked in {root}); "
            "check the job name, and run `rove logs` where its workers ran"
        )
    chosen = _chosen(root, args, args.round)
    if not chosen and not args.follow:
        raise UnknownJobError(f"no output in {root} matches --round/--rank/--node/--stream")
    out = sys.stdout.buffer
    offsets: dict[joblogs.LogFile, int] = {}
    last_title = _print_new(chosen, offsets, out, len(chosen) > 1 or args.follow, None)
    if not args.follow:
        return common.EXIT_OK
    round_ = max((f.round for f in chosen), default=args.round)
    while True:
        ended = stored.running_url(args.job) is None and chosen
        time.sleep(FOLLOW_EVERY_S)
        newest = _chosen(root, args, args.round)
        if newest and (args.round is not None or newest[0].round >= (round_ or 0)):
            chosen, round_ = newest, newest[0].round
        last_title = _print_new(chosen, offsets, out, True, last_title)
        if ended:
            print(f"rove logs: job {args.job} has ended", file=sys.stderr)
            return common.EXIT_OK


def _chosen(root: Path, args: argparse.Namespace, round_: int | None) -> list[joblogs.LogFile]:
    return joblogs.select(
        joblogs.find(root),
        round_=round_,
        rank=args.rank,
        node=args.node,
        stream=args.stream,
    )


def _print_new(
    files: list[joblogs.LogFile],
    offsets: dict[joblogs.LogFile, int],
    out: BinaryIO,
    titled: bool,
    last_title: str | None,
) -> str | None:
    """Print what each file gained since its offset; a title before a file's part when
    several are shown (and it is not the part just printed). Returns the last title."""
    for f in files:
        try:
            with f.path.open("rb") as fp:
                fp.seek(offsets.get(f, 0))
                data = fp.read()
        except OSError:
            continue
        if not data:
            continue
        offsets[f] = offsets.get(f, 0) + len(data)
        title = f.title()
        if titled and title != last_title:
            out.write(f"==> {title} <==\n".encode())
            last_title = title
        out.write(data)
    out.flush()
    return last_title
