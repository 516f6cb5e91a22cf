"""A managed job's workload from `rove run` / `rove submit` arguments: a TensorFlow
job's parameter servers on nodes of their own, sized apart; the flags a node gets; what
`rove submit` refuses before it looks for a server."""

from __future__ import annotations

import pytest

from rove.agent.managed import workload
from rove.agent.run_args import build_parser
from rove.control.catalogue import events as ev
from rove.control.errors import ConfigError
from tests.support import ROOT, rove_cli

SHARDED = ROOT / "examples" / "train_sharded.py"

TF = ("--nnodes", "3:4", "--nproc-per-node", "2", "--tf-ps", "--num-ps", "1")
SCRIPT = ("examples/tf_ps.py", "--nproc-per-node", "the script's own")


def test_parameter_servers_sized_apart_run_one_per_node_with_their_role() -> None:
    argv = [*TF, "--ps-node-memory", "16G", "--ps-node-cpu", "4", *SCRIPT]
    w = workload(argv, build_parser().parse_args(argv), "/opt/rove")
    assert w.ps is not None
    assert (w.ps.count, w.ps.resources) == (1, ev.Resources(cpu=4, memory_bytes=16 * ev.GIB))
    assert w.argv == (*TF, *SCRIPT), "the parameter servers' sizes are the scaler's, not a node's"
    # after the workload's flags (the last one counts), before the script and its arguments
    assert w.ps.argv == (*TF, "--tf-role", "ps", "--nproc-per-node", "1", *SCRIPT)
    parsed = build_parser().parse_args(list(w.ps.argv))
    assert (parsed.tf_role, parsed.nproc_per_node) == ("ps", "1")
    assert parsed.training_script_args == list(SCRIPT[1:])


def test_without_their_own_size_every_node_runs_the_same_and_mistakes_are_said() -> None:
    argv = [*TF, *SCRIPT]
    assert workload(argv, build_parser().parse_args(argv), "/opt/rove").ps is None
    torch_job = ["--nnodes", "2", "--ps-node-memory", "8G", "train.py"]
    with pytest.raises(ConfigError, match="add --tf-ps"):
        workload(torch_job, build_parser().parse_args(torch_job), "/")
    too_few = ["--nnodes", "1", "--tf-ps", "--ps-node-memory", "8G", "examples/tf_ps.py"]
    with pytest.raises(ConfigError, match="give at least 2"):
        workload(too_few, build_parser().parse_args(too_few), "/")


def test_submit_refuses_what_belongs_to_the_scaler_and_a_missing_script() -> None:
    """(`rove submit` refuses these before it looks for a server.)"""
    done = rove_cli(
        "submit",
        *("--job", "j", "--nats", "nats://127.0.0.1:1"),
        "--",
        *("--node-id", "x", str(SHARDED)),
    )
    assert done.returncode == 2
    assert "--node-id does not belong after --" in done.stderr
    done = rove_cli("submit", "--job", "j", "--nats", "nats://127.0.0.1:1", "--", "nope.py")
    assert done.returncode == 2 and "training script nope.py not found" in done.stderr
    done = rove_cli("submit", "--job", "j", "--nats", "nats://127.0.0.1:1", "--", "docs")
    assert done.returncode == 2 and "docs is a folder without a __main__.py" in done.stderr
    done = rove_cli(
        "submit", "--job", "j", "--policy", "grow=yes", "--", str(SHARDED), "--nats", "x"
    )
    assert done.returncode == 2 and "--policy grow=yes: use KEY=VALUE" in done.stderr


@pytest.mark.parametrize(
    ("given", "said"),
    [
        # (a traceback: torchrun's reading of --nnodes raised ValueError)
        (["--", "--nnodes", "x"], "rove submit: --nnodes x: use a number of nodes N or a range"),
        (["--", "--nnodes", "3:1"], "rove submit: --nnodes 3:1: need 0 < MIN <= MAX"),
        # (accepted: each node failed on it)
        (["--", "--nproc-per-node", "0"], "rove submit: --nproc-per-node 0: use a number"),
        # (45 lines of `rove run`'s usage, then "bad arguments" without which)
        (
            ["--", "--jbo", "3"],
            "rove submit: bad `rove run` arguments after --: unrecognized arguments: --jbo "
            "(did you mean: --jbo → --job?)",
        ),
        # (`rove: unrecognized arguments: --nnodes`, and nothing on where they go)
        # (and then "did you mean: --nnodes → --node-cpu?")
        (
            ["--nnodes", "2"],
            "rove submit: unrecognized arguments: --nnodes: `rove submit` takes the job's "
            "`rove run` arguments after --, e.g. rove submit --job j1 --nats URL -- --nnodes "
            "1:4 train.py; see rove submit --help",
        ),
    ],
)
def test_submit_says_a_mistake_in_the_jobs_rove_run_arguments_in_one_line(
    given: list[str], said: str
) -> None:
    done = rove_cli("submit", "--job", "j", "--nats", "nats://127.0.0.1:1", *given, str(SHARDED))
    assert done.returncode == 2 and said in done.stderr, done.stderr
    assert len(done.stderr.splitlines()) == 1 and "Traceback" not in done.stderr, done.stderr


def test_nodes_of_an_auto_scaled_job_get_the_launchers_flags_but_its_own() -> None:
    from rove.agent.managed import node_argv
    from rove.agent.run_args import build_parser

    argv = [
        *("--standalone", "--auto-scale", "--job", "j", "--metrics-port", "9400"),
        *("--nats-auth", "a.json", "--worker-nats-auth=t.json", "--nproc-per-node", "2"),
        *("train.py", "--job", "user's own --job", "--lr", "1"),
    ]
    args = build_parser().parse_args(argv)
    assert node_argv(argv, args) == (
        *("--nproc-per-node", "2"),
        *("train.py", "--job", "user's own --job", "--lr", "1"),
    )
