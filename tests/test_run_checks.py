"""`rove run`'s arguments as the agent takes them: the job's name, paths made absolute."""

from __future__ import annotations

from pathlib import Path

import pytest

from rove.agent.launcher import agent_config
from rove.agent.run_args import build_parser
from rove.control.errors import ConfigError

SCRIPT = str(Path(__file__).parent.parent / "examples" / "train.py")


def _job(*flags: str) -> str:
    args = build_parser().parse_args(["--nats", "nats://127.0.0.1:4222", *flags])
    return agent_config(args)[0].job


def test_a_torchrun_rdzv_id_or_script_name_that_is_no_job_name_names_the_job_after_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # torchrun takes any --rdzv-id (a scheduler's "12345.batch", "exp.1") and any script
    named = _job("--rdzv-id", "exp.1", SCRIPT)
    assert named == _job("--rdzv-id", "exp.1", SCRIPT), "alike on every node"
    assert named.startswith("exp-1-") and named != _job("--rdzv-id", "exp:1", SCRIPT)
    assert f"job name {named}, made of --rdzv-id 'exp.1'" in capsys.readouterr().err
    assert _job("--rdzv-id", "exp-1", SCRIPT) == "exp-1"
    assert capsys.readouterr().err == "", "a valid id is the name, nothing said"
    script = tmp_path / "train me (v2).py"
    script.write_text("")
    assert _job(str(script)).startswith("train-me-v2-")
    assert _job("-m", "examples.train").startswith("examples-train-"), "a module's whole name"
    script = tmp_path / "__.py"
    script.write_text("")
    assert _job(str(script)).startswith("job-")


def test_checkpoint_and_log_folders_reach_the_workers_as_absolute_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a script that changes its folder (Hydra's runs do) read a relative ROVE_CKPT_DIR
    # elsewhere than the agent persisted to; `--checkpoint-dir=~/x` kept its `~`
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    args = build_parser().parse_args(
        ["--nats", "nats://127.0.0.1:4222", "--checkpoint-dir=~/ck", "--log-dir", "logs", SCRIPT]
    )
    cfg = agent_config(args)[0]
    assert cfg.checkpoint_dir == str(tmp_path / "home" / "ck")
    assert args.log_dir == str(tmp_path / "logs")
    url = build_parser().parse_args(
        ["--nats", "nats://127.0.0.1:4222", "--checkpoint-dir", "s3://bucket/run", SCRIPT]
    )
    assert agent_config(url)[0].checkpoint_dir == "s3://bucket/run", "a URL as it is"


def _stop_timeout(*flags: str) -> float:
    args = build_parser().parse_args(["--nats", "nats://127.0.0.1:4222", *flags, SCRIPT])
    return agent_config(args)[0].stop_timeout_s


def test_the_shutdown_timeout_is_the_flag_else_torchruns_variable_else_ten_seconds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    assert _stop_timeout() == 10.0
    assert _stop_timeout("--shutdown-timeout", "0") == 0.0, "0 is SIGKILL at once (was 10)"
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "45")
    assert _stop_timeout() == 45.0, "torchrun's variable, as torchrun reads it"
    assert _stop_timeout("--shutdown-timeout", "5") == 5.0
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "soon")
    with pytest.raises(ConfigError, match="TORCH_ELASTIC_SHUTDOWN_TIMEOUT='soon'"):
        _stop_timeout()


def test_torch_elastics_one_machine_line_runs_as_one_standalone_node() -> None:
    """`--nnodes 1:4 --rdzv-endpoint localhost:29400` (torch elastic's quick start): no
    other machine can reach that rendezvous, so the job is this machine's one node. It
    was refused for want of --nats. A rendezvous others may reach still needs --nats."""
    from rove.agent import run_checks

    for endpoint in (
        "localhost:29400",
        "127.0.0.1:29400",
        "[::1]:29400",
        "[::1]",
        "::1",
        "localhost",
    ):
        assert run_checks.on_loopback(endpoint), endpoint
    for endpoint in ("10.1.2.3:29400", "node1:29400", "", None):
        assert not run_checks.on_loopback(endpoint), endpoint
    args = build_parser().parse_args(
        ["--nnodes", "1:4", "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:29400", SCRIPT]
    )
    _cfg, standalone = agent_config(args)
    assert standalone and args.nnodes == "1"
    args = build_parser().parse_args(["--nnodes", "2:4", "--rdzv-endpoint", "localhost:1", SCRIPT])
    with pytest.raises(ConfigError, match="the nodes meet on a NATS server"):
        agent_config(args)  # (two nodes at least: rove's nodes meet on NATS)
