"""TensorFlow parameter-server rounds in the master (pure): roles by rank, addresses from
the ports each node offered, TF_CONFIG, a job that ends when its chief does, and task
restarts folded for `rove status`."""

from __future__ import annotations

import json

from rove.control.catalogue import events as ev
from rove.control.domain import tf_cluster
from tests import factories
from tests.sim import Sim

TF = ev.RdzvParams(min_nodes=2, max_nodes=2, last_call_s=1.0, tf_ps=1)


def member(node: str, nproc: int, first: int) -> ev.RoundMember:
    return ev.RoundMember(
        node=node, incarnation="i1", addr=f"h{node}", nproc=nproc, first_rank=first
    )


def test_roles_follow_rank_order_chief_then_parameter_servers_then_workers() -> None:
    tasks = tf_cluster.assign(
        [member("a", 2, 0), member("b", 3, 2)], {"a": (41001, 41002), "b": (5, 6, 7, 8)}, 2
    )
    assert not isinstance(tasks, str)
    assert [(t.role, t.index, t.rank, t.node, t.port) for t in tasks] == [
        ("chief", 0, 0, "a", 41001),
        ("ps", 0, 1, "a", 41002),
        ("ps", 1, 2, "b", 5),
        ("worker", 0, 3, "b", 6),
        ("worker", 1, 4, "b", 7),
    ]
    config = json.loads(tf_cluster.tf_config(tasks, 3))
    assert config == {
        "cluster": {
            "chief": ["ha:41001"],
            "ps": ["ha:41002", "hb:5"],
            "worker": ["hb:6", "hb:7"],
        },
        "task": {"type": "worker", "index": 0},
        "rpc_layer": "grpc",
    }


def test_too_few_processes_or_ports_say_why() -> None:
    few = tf_cluster.assign([member("a", 2, 0)], {"a": (1, 2)}, 1)
    assert isinstance(few, str) and "needs at least 3 processes" in few and "has 2" in few
    short = tf_cluster.assign([member("a", 3, 0)], {"a": (1, 2)}, 1)
    assert isinstance(short, str) and "offered 2 free ports for its 3" in short


def _tf_sim() -> Sim:
    sim = Sim(TF)
    sim.join("n1", nproc=2, ports=(41001, 41002))
    sim.join("n2", nproc=2, ports=(42001, 42002))
    sim.tick(2.0)
    return sim


def test_a_tensorflow_round_carries_every_task_and_ends_when_the_chief_finishes() -> None:
    sim = _tf_sim()
    (r1,) = sim.rounds()
    assert [(t.role, t.node, t.port) for t in r1.tasks] == [
        ("chief", "n1", 41001),
        ("ps", "n1", 41002),
        ("worker", "n2", 42001),
        ("worker", "n2", 42002),
    ]
    assert sim.state.rdzv.tasks == r1.tasks
    # the workers' node never ends on its own (servers serve until stopped): not the end
    sim.apply(factories.succeeded("n2", 1))
    assert not any(isinstance(d, ev.JobEnded) for d in sim.tick())
    sim.apply(factories.succeeded("n1", 1))
    (ended,) = [d for d in sim.tick() if isinstance(d, ev.JobEnded)]
    assert ended.phase is ev.JobPhase.FINISHED and "coordinator (chief, on node n1)" in ended.reason


def test_a_parameter_server_failure_restarts_the_round_with_the_same_tasks() -> None:
    sim = _tf_sim()
    sim.apply(factories.exited("n1", 1, rank=1, kind=ev.FailureKind.KILLED))
    sim.tick()
    r1, r2 = sim.rounds()
    assert r2.restart_count == 1 and [t.role for t in r2.tasks] == [t.role for t in r1.tasks]


def test_a_round_too_small_for_the_job_waits_and_says_why() -> None:
    sim = Sim(ev.RdzvParams(min_nodes=1, max_nodes=1, tf_ps=2))
    sim.join("n1", nproc=3, ports=(1, 2, 3))
    sim.tick(2.0)
    assert sim.rounds() == []
    assert sim.waiting is not None and "needs at least 4 processes" in sim.waiting.reason


def test_task_restarts_are_counted_per_role_and_the_newest_kept() -> None:
    sim = _tf_sim()
    for n in range(1, 13):
        sim.apply(factories.task_restarted("n2", 1, 2 + n % 2, restarts=n))
    sim.apply(factories.task_restarted("n1", 1, 1, "ps"))
    rdzv = sim.state.rdzv
    assert dict(rdzv.task_restarts) == {"worker": 12, "ps": 1}
    assert len(rdzv.recent_restarts) == 10 and rdzv.recent_restarts[-1].role == "ps"


def test_status_shows_the_roles_and_the_tasks_restarted_in_place() -> None:
    from rove.control.cli.status_cmd import render, status_view

    sim = _tf_sim()
    sim.apply(factories.task_restarted("n2", 1, 3, restarts=1))
    text = render(status_view(sim.state, sim.liveness, None, sim.now))
    assert (
        "tensorflow: chief on n1 (10.0.0.1:41001); ps 0 on n1 (10.0.0.1:41002); "
        "worker 0 on n2 (10.0.0.2:42001); worker 1 on n2 (10.0.0.2:42002)"
    ) in text
    assert "restarted in place: 1 worker" in text
    assert "round 1, worker 1 on n2: killed by SIGKILL" in text


def test_a_workers_death_is_absorbed_under_the_default_restart_budget(tmp_path: object) -> None:
    """TensorFlow's coordinator retries a dead worker's closures elsewhere, so restarting
    the worker in place must not need --max-restarts (default 0, as torchrun's): the
    docs' commands would otherwise fail at the first worker killed."""
    from pathlib import Path

    from rove.agent.launcher import agent_config
    from rove.agent.run_args import build_parser
    from rove.agent.runtimes import tf_runtime

    script = str(Path(__file__).parent.parent / "examples" / "tf_ps.py")
    args = build_parser().parse_args(
        ["--standalone", "--tf-ps", "--num-ps", "1", "--num-workers", "2", script]
    )
    cfg, _ = agent_config(args)
    assert cfg.max_restarts == 0, "rounds: torchrun's default"
    assert cfg.max_task_restarts == 10
    assert tf_runtime(cfg, "i1").max_restarts == 10  # type: ignore[attr-defined]
    capped = build_parser().parse_args(
        ["--standalone", "--tf-ps", "--max-worker-restarts", "2", "--num-workers", "2", script]
    )
    assert agent_config(capped)[0].max_task_restarts == 2


def test_nodes_that_host_parameter_servers_get_them_and_the_others_the_chief() -> None:
    """`--tf-role ps` nodes (sized for parameter servers) run every parameter server,
    wherever they stand in rank order."""
    members = [member("a", 2, 0), member("p", 2, 2), member("b", 1, 4)]
    ports = {"a": (1, 2), "p": (3, 4), "b": (5,)}
    tasks = tf_cluster.assign(members, ports, 2, ps_nodes={"p"})
    assert not isinstance(tasks, str)
    assert [(t.role, t.index, t.rank, t.node) for t in tasks] == [
        ("chief", 0, 0, "a"),
        ("worker", 0, 1, "a"),
        ("ps", 0, 2, "p"),
        ("ps", 1, 3, "p"),
        ("worker", 1, 4, "b"),
    ]
    wrong = tf_cluster.assign(members, ports, 1, ps_nodes={"p"})
    assert isinstance(wrong, str) and "run 2 processes for 1 parameter server" in wrong


def test_a_round_puts_the_parameter_servers_on_the_node_that_hosts_them() -> None:
    sim = Sim(ev.RdzvParams(min_nodes=3, max_nodes=3, last_call_s=1.0, tf_ps=1))
    sim.join("n1", nproc=2, ports=(41001, 41002))
    sim.join("n2", nproc=1, ports=(42001,), tf_role="ps")
    sim.join("n3", nproc=1, ports=(43001,))
    sim.tick(2.0)
    [rnd] = sim.rounds()
    roles = {(t.node, t.role) for t in rnd.tasks}
    assert roles == {("n1", "chief"), ("n1", "worker"), ("n2", "ps"), ("n3", "worker")}
