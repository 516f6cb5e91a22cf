"""torchrun's command line without torch (rove.agent.torchrun_cli), checked against the
installed torch's own, and a `rove run` launcher that never imports torch."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from rove.agent import torchrun_cli
from tests.support import RunProc, fresh_python, patience

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _no_pet(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith("PET_"):
            monkeypatch.delenv(key)


def _shape(action: argparse.Action) -> tuple[Any, ...]:
    kind = getattr(action.type, "__name__", action.type)
    return (
        type(action).__name__,
        tuple(action.option_strings),
        action.dest,
        action.default,
        kind,
        tuple(action.choices) if action.choices else None,
        action.nargs,
        action.const,
        action.required,
    )


def _torchs() -> argparse.ArgumentParser:
    from torch.distributed.run import get_args_parser

    return get_args_parser()


def test_the_installed_torch_is_the_one_the_parser_was_checked_against() -> None:
    # (were torch upgraded, `parser()` would be torch's own: this says the copy needs
    # checking against the new release, and CHECKED moving on)
    assert torchrun_cli.checked(torchrun_cli.installed_torch()), torchrun_cli.installed_torch()
    assert not torchrun_cli.checked("2.12.1") and not torchrun_cli.checked(None)
    assert torchrun_cli.checked("2.13.0+cpu")


@pytest.mark.parametrize("pet", [{}, {"PET_NNODES": "2:4", "PET_STANDALONE": "1"}])
def test_the_parser_has_torchruns_flags_destinations_defaults_and_types(
    monkeypatch: pytest.MonkeyPatch, pet: dict[str, str]
) -> None:
    _no_pet(monkeypatch)
    for key, value in pet.items():
        monkeypatch.setenv(key, value)
    ours = [_shape(a) for a in torchrun_cli.own_parser()._actions]
    theirs = [_shape(a) for a in _torchs()._actions]
    assert ours == theirs


COMMAND_LINES = [
    ["train.py"],
    ["--nproc-per-node", "4", "--nnodes=1:3", "train.py", "--lr", "0.1", "-m", "x"],
    ["--nproc_per_node=2", "--standalone", "-m", "pkg.train", "--epochs", "3"],
    ["--no-python", "--max-restarts", "3", "--role", "trainer", "./run.sh", "a"],
    ["--run-path", "--start-method", "fork", "/abs/train.py", "--x=1"],
    ["--local-ranks-filter", "0,2", "--monitor-interval", "0.5", "train.py"],
    ["--rdzv-backend", "c10d", "--rdzv-endpoint", "h:29400", "--rdzv-id", "j", "t.py"],
    ["-r", "3", "-t", "1", "--log-dir", "/tmp/l", "--shutdown-timeout", "5", "t.py"],
    ["--duplicate-stdout-filters", "a,,b,c", "--master-port", "29501", "t.py"],
]


@pytest.mark.parametrize("argv", COMMAND_LINES)
def test_command_lines_parse_as_torchrun_parses_them(
    monkeypatch: pytest.MonkeyPatch, argv: list[str]
) -> None:
    _no_pet(monkeypatch)
    monkeypatch.setenv("PET_NPROC_PER_NODE", "3")
    assert vars(torchrun_cli.own_parser().parse_args(argv)) == vars(_torchs().parse_args(argv))


@pytest.mark.parametrize("argv", COMMAND_LINES)
def test_the_launch_is_torchruns_config_from_args(
    monkeypatch: pytest.MonkeyPatch, argv: list[str]
) -> None:
    from torch.distributed.run import config_from_args

    _no_pet(monkeypatch)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    args = torchrun_cli.own_parser().parse_args(argv)
    theirs, cmd, cmd_args = config_from_args(args)
    omp = os.environ.pop("OMP_NUM_THREADS", None)
    ours, our_cmd, our_args = torchrun_cli.launch(args)
    assert os.environ.pop("OMP_NUM_THREADS", None) == omp
    for field in ("min_nodes", "max_nodes", "nproc_per_node", "max_restarts"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert (ours.start_method, ours.role) == (theirs.start_method, theirs.role)
    assert ours.console_ranks == theirs.logs_specs._local_ranks_filter
    if args.run_path:
        assert our_cmd is None and our_args == list(cmd_args)
    else:
        assert (our_cmd, our_args) == (cmd, list(cmd_args))
    asked = args.redirects != "0" or args.tee != "0"
    assert (ours.torch_logs is not None) == asked
    if asked:
        assert ours.torch_logs._redirects == theirs.logs_specs._redirects
        assert ours.torch_logs._tee == theirs.logs_specs._tee


@pytest.mark.parametrize(
    ("nnodes", "expected"), [("1", (1, 1)), ("2:4", (2, 4)), ("1:2:3", None), ("x", None)]
)
def test_nnodes_reads_as_torchruns(nnodes: str, expected: tuple[int, int] | None) -> None:
    from torch.distributed.run import parse_min_max_nnodes

    if expected is None:
        with pytest.raises(ValueError):
            torchrun_cli.nnodes(nnodes)
        with pytest.raises((ValueError, RuntimeError)):
            parse_min_max_nnodes(nnodes)
    else:
        assert torchrun_cli.nnodes(nnodes) == parse_min_max_nnodes(nnodes) == expected


def test_nproc_names_are_read_by_torch_and_nonsense_is_refused() -> None:
    from torch.distributed.run import determine_local_world_size

    assert torchrun_cli.nproc("cpu") == determine_local_world_size("cpu")
    assert torchrun_cli.nproc("auto") == determine_local_world_size("auto")
    with pytest.raises(ValueError, match="Unsupported nproc_per_node"):
        torchrun_cli.nproc("four workers")


def test_the_launcher_and_its_argument_errors_import_no_torch() -> None:
    probe = (
        "import sys\n"
        "import rove.agent.launcher as launcher\n"
        "assert 'torch' not in sys.modules, 'importing the launcher imported torch'\n"
        "code = launcher.main(['--nnodes', '0', 'train.py'])\n"
        "assert 'torch' not in sys.modules, 'an argument error imported torch'\n"
        "print('exit', code)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        timeout=patience(60),
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "exit 2" in out.stdout and "--nnodes 0" in out.stderr


def test_an_agent_whose_workers_torch_starts_imports_torch_when_built_not_in_its_first_round(
    tmp_path: Path,
) -> None:
    """Workers that torch's start_processes starts (`--no-warm-start`, `--redirects`,
    `--tee`) need torch in the agent: it is imported as the runtime is built, before
    the agent's event loop runs its heartbeats, not at the first round inside it. Warm
    workers with rove's logs (the default) never need it."""
    probe = (
        "import sys\n"
        "from pathlib import Path\n"
        "from rove.agent import warm\n"
        "from rove.agent.echo import EchoedLogs\n"
        "from rove.agent.workers import TorchRuntime\n"
        f"d = Path({str(tmp_path)!r})\n"
        "TorchRuntime(warm.run_script, ['script', 'x.py'], EchoedLogs(d / 'l1'), d / 'p1')\n"
        "assert 'torch' not in sys.modules, 'warm workers with rove logs imported torch'\n"
        "TorchRuntime(sys.executable, ['x.py'], EchoedLogs(d / 'l2'), d / 'p2')\n"
        "assert 'torch.distributed.elastic.multiprocessing' in sys.modules, 'not imported'\n"
        "print('ok')\n"
    )
    assert "ok" in fresh_python(probe, timeout=60)


def _maps(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.slow
def test_a_warm_jobs_launcher_never_maps_torch(tmp_path: Path) -> None:
    """The launcher of a warm job (the default) forks its workers from the warm server
    without loading torch itself: its memory maps no libtorch while the workers train,
    and the job ends as usual."""
    go = tmp_path / "go"
    script = tmp_path / "wait_for_go.py"
    script.write_text(
        "import os, pathlib, sys, time, torch\n"
        f"go = pathlib.Path({str(go)!r})\n"
        "pathlib.Path(sys.argv[1], os.environ['RANK']).write_text('up')\n"
        "while not go.exists():\n"
        "    time.sleep(0.05)\n"
        "print('rank', os.environ['RANK'], 'saw torch', torch.__version__)\n"
    )
    run = RunProc(
        tmp_path,
        "n0",
        *("--standalone", "--nproc-per-node", "2", "--job", "notorch"),
        *(str(script), str(tmp_path)),
    )
    deadline = time.monotonic() + patience(120)
    while not all((tmp_path / r).exists() for r in ("0", "1")):
        assert run.proc.poll() is None, "the job ended before its workers started"
        assert time.monotonic() < deadline, "the workers did not start"
        time.sleep(0.1)
    maps = _maps(run.proc.pid)
    assert "libtorch" not in maps and "/torch/" not in maps
    go.write_text("go")
    assert run.wait() == 0
    log = run.log_path.read_text()
    assert "rank 0 saw torch" in log and "rank 1 saw torch" in log


@pytest.mark.parametrize(
    ("argv", "script", "its_args"),
    [
        (["train.py", "--a", "1"], "train.py", ["--a", "1"]),  # abbreviates --auto-*, ...
        (
            ["--nproc-per-node", "2", "t.py", "--max", "3", "--job", "x"],
            "t.py",
            ["--max", "3", "--job", "x"],
        ),
        (
            ["--job=j", "-r3", "-m", "pkg.train", "--nnodes", "4", "-m"],
            "pkg.train",
            ["--nnodes", "4", "-m"],
        ),
        (["-mv", "pkg.train", "--kafka"], "pkg.train", ["--kafka"]),
        (["--standalone", "--", "t.py", "--", "--x"], "t.py", ["--", "--x"]),
        (["--nproc-per-nod", "2", "t.py", "-h"], "t.py", ["-h"]),  # rove's own flag abbreviated
        (["--nproc", "2", "t.py", "--nproc", "3"], "t.py", ["--nproc", "3"]),
    ],
)
def test_rove_runs_parser_leaves_the_scripts_words_to_the_script(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], script: str, its_args: list[str]
) -> None:
    """argparse read a script's `--a` as an abbreviation of rove's flags and ended the
    run ("ambiguous option: --a could match --auto-config, ...")."""
    from rove.agent.run_args import build_parser

    _no_pet(monkeypatch)
    parsed = build_parser().parse_args(argv)
    assert (parsed.training_script, parsed.training_script_args) == (script, its_args)
    assert parsed.job in (None, "j")
    assert parsed.nnodes == "1:1", "the script's --nnodes is the script's"


@pytest.mark.parametrize("argv", [["--nproc", "2", "t.py"], ["--nproc=2", "t.py"]])
def test_an_abbreviation_of_both_spellings_of_one_flag_is_that_flag(
    monkeypatch: pytest.MonkeyPatch, argv: list[str]
) -> None:
    """`--nproc` abbreviates --nproc-per-node and --nproc_per_node: one flag, which
    Python 3.11's argparse (and torchrun on it) called ambiguous."""
    from rove.agent.run_args import build_parser

    _no_pet(monkeypatch)
    assert build_parser().parse_args(argv).nproc_per_node == "2"


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (
            ["--no", "2", "t.py", "--lr", "1"],
            "ambiguous option: --no could match --no-python, --node-rank, --node-id,",
        ),
        (
            ["--jbo", "j", "t.py", "--lr", "1"],
            "unrecognized arguments: --jbo (did you mean: --jbo → --job?)",
        ),
    ],
)
def test_a_mistake_before_the_script_is_named_and_the_scripts_flags_are_not_guessed_at(
    capsys: pytest.CaptureFixture[str], argv: list[str], said: str
) -> None:
    from rove.agent.run_args import build_parser
    from rove.control.flags import suggest

    parser = build_parser()
    suggest.install(parser, argv)
    with pytest.raises(SystemExit):
        parser.parse_args(argv)
    err = capsys.readouterr().err
    assert said in err and "--lr" not in err, err
