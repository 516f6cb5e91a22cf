"""The counts and times in rove's sentences: one node is "1 node", not "1 nodes"."""

from __future__ import annotations

from rove.control.domain import tf_cluster
from rove.control.domain.words import counted, failure, local_time, ranks
from rove.control.flags.options import moment, moment_at


def test_one_of_anything_is_said_in_the_singular() -> None:
    assert counted(1, "node") == "1 node"
    assert counted(0, "failure") == "0 failures"
    assert counted(2, "round") == "2 rounds"
    assert counted(1, "process", "processes") == "1 process"
    assert counted(3, "process", "processes") == "3 processes"


def test_ranks_are_one_rank_or_a_span() -> None:
    assert ranks([0]) == "rank 0"
    assert ranks((4,)) == "rank 4"
    assert ranks([0, 1, 2, 3]) == "ranks 0-3"
    assert ranks([]) == "no rank"


def test_a_failure_says_its_kind_once() -> None:
    assert failure("killed", "killed by SIGKILL") == "killed by SIGKILL"
    assert failure("oom", "CUDA out of memory") == "oom: CUDA out of memory"
    assert failure("segfault", "crashed with SIGSEGV") == "segfault: crashed with SIGSEGV"
    assert failure("killed", "killedby") == "killed: killedby"
    assert failure("unknown", "exited with code 3") == "exited with code 3"
    assert failure("user_error", "ValueError: bad config") == "ValueError: bad config"


def test_a_tensorflow_round_that_cannot_run_counts_its_servers_right() -> None:
    assert "with 1 parameter server needs at least 3 processes" in str(tf_cluster.problem(2, 1))
    assert "with 2 parameter servers needs" in str(tf_cluster.problem(3, 2))


def test_a_time_is_shown_in_the_local_zone_in_a_form_since_reads_back(zone_ahead: str) -> None:
    """`rove events`, `rove status` and `rove jobs` show one form, which `--since` reads
    back as the same moment (in a zone 5:30 ahead of UTC)."""
    assert local_time(0.0) == "1970-01-01 05:30:00"
    assert local_time(0.125, millis=True) == "1970-01-01 05:30:00.125"
    assert moment_at(moment(local_time(1_800_000_000.0)), 0.0) == 1_800_000_000.0
