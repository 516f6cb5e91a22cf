"""Worker environment: the variables torchrun sets, computed from a round."""

from __future__ import annotations

from rove.agent.worker_env import member_of, worker_envs
from tests import factories


def test_ranks_and_sizes_follow_the_round() -> None:
    r = factories.round_completed(3, 1, "n1", "n2")
    place = member_of(r, "n2", "i1")
    assert place is not None
    group_rank, member = place
    envs = worker_envs(r, group_rank, member, job="j1", max_restarts=5)
    assert sorted(envs) == [0, 1]
    e = envs[1]
    assert (e["RANK"], e["LOCAL_RANK"], e["GROUP_RANK"], e["WORLD_SIZE"]) == ("3", "1", "1", "4")
    assert (e["LOCAL_WORLD_SIZE"], e["GROUP_WORLD_SIZE"], e["ROLE_WORLD_SIZE"]) == ("2", "2", "4")
    assert (e["MASTER_ADDR"], e["MASTER_PORT"]) == ("10.0.0.1", "29500")
    assert e["TORCHELASTIC_MAX_RESTARTS"] == "5" and e["TORCHELASTIC_RUN_ID"] == "j1"
    assert e["ROLE_RANK"] == "3" and e["ROLE_NAME"] == "default"


def test_a_node_of_another_incarnation_is_not_a_member() -> None:
    r = factories.round_completed(1, 1, "n1")
    assert member_of(r, "n1", "other") is None
