"""The counts in rove's sentences: one node is "1 node", not "1 nodes"."""

from __future__ import annotations

from rove.control.domain import tf_cluster
from rove.control.domain.words import counted, failure, ranks


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
