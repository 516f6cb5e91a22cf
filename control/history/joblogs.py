"""Where a job's workers' output is kept on a machine, and finding it again (pure
but for reading folder listings).

    ROVE_HOME/jobs/<job>/logs/<node>/round<R>/rank<RANK>.stdout
                                              rank<RANK>.stderr
                                              rank<RANK>.error.json   (torch's @record)
                                     rove.log   (the node's launcher: rove's own log)

The agent writes there (`rove.agent.echo`); `rove logs` reads it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from rove.control.bus import embedded

STREAMS = ("stdout", "stderr")
_ROUND = re.compile(r"round(\d+)$")
_FILE = re.compile(r"rank(\d+)\.(stdout|stderr)$")


def folder(job: str) -> Path:
    """The job's log folder on this machine."""
    return embedded.job_dir(job) / "logs"


def agent_log(job: str, node: str) -> Path:
    """Where `rove run` keeps its own structured log for `node` of `job`."""
    return folder(job) / node / "rove.log"


def round_folder(node_folder: Path, round_: int | str) -> Path:
    return node_folder / f"round{round_}"


def file_name(rank: int | str, stream: str) -> str:
    return f"rank{rank}.{stream}"


@dataclass(frozen=True, order=True)
class LogFile:
    round: int
    node: str
    rank: int
    stream: str
    path: Path

    def title(self) -> str:
        return f"round {self.round}, node {self.node}, rank {self.rank}, {self.stream}"


def find(root: Path) -> list[LogFile]:
    """Every worker output file under a job's log folder, by round, node, rank, stream."""
    found = []
    for node_dir in sorted(p for p in root.glob("*") if p.is_dir()):
        for round_dir in node_dir.glob("round*"):
            r = _ROUND.search(round_dir.name)
            if r is None:
                continue
            for path in round_dir.glob("rank*.std*"):
                f = _FILE.search(path.name)
                if f is not None:
                    found.append(
                        LogFile(int(r.group(1)), node_dir.name, int(f.group(1)), f.group(2), path)
                    )
    return sorted(found)


def select(
    files: list[LogFile],
    *,
    round_: int | None = None,
    rank: int | None = None,
    node: str | None = None,
    stream: str | None = None,
) -> list[LogFile]:
    """The files asked for; `round_` None means the newest round there is."""
    if round_ is None and files:
        round_ = max(f.round for f in files)
    return [
        f
        for f in files
        if f.round == round_
        and (rank is None or f.rank == rank)
        and (node is None or f.node == node)
        and (stream is None or f.stream == stream)
    ]
