"""The same scripts, the same command line, under torchrun and under `rove run` (warm
start, the default, and `--no-warm-start`): what the workers see and what they print
must match, but for the differences docs/runtime.md lists ("Differences from torchrun").
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.support import launcher_env, patience

pytestmark = pytest.mark.slow

HERE = Path(__file__).parent
LAUNCHERS = {
    "torchrun": [sys.executable, "-m", "torch.distributed.run"],
    "rove": [sys.executable, "-m", "rove.control.cli.main", "run"],
    "rove-cold": [sys.executable, "-m", "rove.control.cli.main", "run", "--no-warm-start"],
}
COMMAND = ["--standalone", "--nproc-per-node", "2"]


#: torch 2.13's own crash as gloo groups are torn down at exit (a rank aborts after its
#: script ended; docs/runtime.md, "Why workers hold their process groups"): torchrun's
#: workers meet it now and then, rove's hold their groups
TORCH_TEARDOWN_ABORT = "terminate called without an active exception"


def launch(
    launcher: str,
    tmp: Path,
    *script: str,
    state: Path | None = None,
    preexec: Callable[[], None] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run `script` under `launcher`; `state`: a file the script writes, put back as it
    was before a run of the baseline is tried again; `preexec`: run in the launcher's
    process before it starts."""
    before = state.read_bytes() if state is not None and state.exists() else None
    for attempt in range(3):
        if attempt and state is not None:
            state.unlink(missing_ok=True)
            if before is not None:
                state.write_bytes(before)
        out = subprocess.run(
            [*LAUNCHERS[launcher], *COMMAND, *script],
            capture_output=True,
            text=True,
            timeout=patience(180),
            cwd=HERE,
            env={**launcher_env(), "ROVE_HOME": str(tmp / "home")},
            preexec_fn=preexec,
        )
        if not (launcher == "torchrun" and TORCH_TEARDOWN_ABORT in out.stderr):
            break  # (the baseline is run again when torch crashed it on the way out)
    assert out.returncode == 0, f"{launcher}:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}"
    return out


def as_a_background_job() -> None:
    """What `nohup CMD &` from a script gives the launcher: SIGINT, SIGHUP and SIGQUIT
    (and here SIGUSR1) ignored. Launchers handle the first three, so their workers start
    with the defaults; an ignored SIGUSR1 passes on to them."""
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)


def probe(launcher: str, tmp: Path) -> dict[int, dict[str, Any]]:
    where = tmp / launcher
    launch(launcher, tmp, "probe.py", str(where), preexec=as_a_background_job)
    return {rank: json.loads((where / f"rank{rank}.json").read_text()) for rank in (0, 1)}


#: what differs, and why (docs/runtime.md, "Differences from torchrun")
DIFFERENT = {
    "draws",  # unseeded: fresh per process under every launcher, so never equal
    "torch_initial_seed",  # the same
    "argv",  # argv[1] names each launcher's own output folder here
    "env",  # compared below, but for the two documented values
    "open_files",  # compared below: a warm worker holds its forkserver's pipes
}
#: launcher-set variables whose values differ: torchrun's `localhost` and its agent's
#: store; rove gives the round's address and lets rank 0 host each round's store
ENV_DIFFERENT = {
    "MASTER_ADDR": ("localhost", "127.0.0.1"),
    "TORCHELASTIC_USE_AGENT_STORE": ("True", "False"),
}


@pytest.fixture(scope="module")
def probes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[int, dict[str, Any]]]:
    tmp = tmp_path_factory.mktemp("probe")
    return {launcher: probe(launcher, tmp) for launcher in LAUNCHERS}


@pytest.mark.parametrize("launcher", ["rove", "rove-cold"])
def test_the_worker_sees_what_torchruns_worker_sees(
    probes: dict[str, dict[int, dict[str, Any]]], launcher: str
) -> None:
    for rank in (0, 1):
        theirs, ours = probes["torchrun"][rank], probes[launcher][rank]
        differing = {k for k in theirs if theirs[k] != ours.get(k)} - DIFFERENT
        assert not differing, {k: (theirs[k], ours.get(k)) for k in sorted(differing)}
        assert set(ours) == set(theirs)
        assert ours["argv"][0] == theirs["argv"][0] == "probe.py"
        for key, (torchrun_value, rove_value) in ENV_DIFFERENT.items():
            assert (theirs["env"][key], ours["env"][key]) == (torchrun_value, rove_value)
        same = {k: v for k, v in theirs["env"].items() if k not in ENV_DIFFERENT}
        assert {k: ours["env"][k] for k in same} == same
        assert theirs["open_files"] == [], "a fresh interpreter holds only 0, 1 and 2"
        assert ours["signals"]["SIGINT"] == "default_int_handler", "launched as a background job"
        assert ours["signals"]["SIGUSR1"] == "SIG_IGN", "an inherited ignore passes on"
        leaked = [f for f in ours["open_files"] if not f.startswith("pipe:")]
        if launcher == "rove-cold":
            assert ours["open_files"] == []
        else:  # the forkserver's own pipes and /dev/null: no file, socket or NATS link
            assert set(leaked) <= {"/dev/null"}, ours["open_files"]


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_unseeded_draws_differ_across_ranks_and_seeded_ones_are_the_seed(
    probes: dict[str, dict[int, dict[str, Any]]], launcher: str
) -> None:
    ranks = probes[launcher]
    for source in ("torch", "numpy", "random"):
        assert ranks[0]["draws"][source] != ranks[1]["draws"][source], source
        assert ranks[0]["seeded"][source] == probes["torchrun"][0]["seeded"][source], source
    assert ranks[0]["torch_initial_seed"] != ranks[1]["torch_initial_seed"]


def _losses(output: str) -> list[str]:
    return sorted(
        line for line in output.splitlines() if re.match(r"\[\d\] (epoch|resuming)", line)
    )


def test_a_ddp_tutorial_with_snapshots_trains_the_same(tmp_path: Path) -> None:
    """Two epochs under each launcher, then (torchrun and rove's default) one more
    resumed from the snapshot: every rank's losses are the same to the last digit."""
    runs = {}
    for launcher in LAUNCHERS:
        snapshot = tmp_path / f"{launcher}.pt"
        runs[launcher] = _losses(
            launch(launcher, tmp_path, "ddp_snapshot.py", "2", str(snapshot), state=snapshot).stdout
        )
    assert len(runs["torchrun"]) == 4, runs["torchrun"]
    for launcher, got in runs.items():
        assert got == runs["torchrun"], launcher
    resumed = {
        launcher: _losses(
            launch(
                launcher,
                tmp_path,
                *("ddp_snapshot.py", "3", str(tmp_path / f"{launcher}.pt")),
                state=tmp_path / f"{launcher}.pt",
            ).stdout
        )
        for launcher in ("torchrun", "rove")
    }
    assert "[0] resuming from snapshot at epoch 2" in resumed["torchrun"], resumed
    assert len(resumed["torchrun"]) == 4 and resumed["rove"] == resumed["torchrun"]


def _lines(output: str, pattern: str) -> list[str]:
    """The ranks' lines that match `pattern`, sorted. Each begins where a line does or
    where a rank's `[N] ` does: two processes writing one pipe may run one's line into
    the end of the other's (`{'train_runtime': ...}[1] world 2 ...` under torchrun)."""
    pieces = re.split(r"\n|(?=\[\d\] )", output)
    return sorted(piece for piece in pieces if re.match(pattern, piece))


def test_a_mingpt_like_trainer_with_a_tqdm_bar_trains_the_same(tmp_path: Path) -> None:
    """Every rank's mean loss per epoch is the same to the last digit under each
    launcher, and rank 0's tqdm bar reaches stderr as it would a terminal (each state
    it drew, the last at 100%)."""
    runs = {launcher: launch(launcher, tmp_path, "mingpt.py", "2") for launcher in LAUNCHERS}
    losses = {name: _lines(out.stdout, r"\[\d\] epoch \d+ loss") for name, out in runs.items()}
    assert len(losses["torchrun"]) == 4, runs["torchrun"].stdout
    for launcher, got in losses.items():
        assert got == losses["torchrun"], launcher
        bar = runs[launcher].stderr
        states = re.findall(r"epoch 1: +(\d+)%\|", bar)  # (\r reads as a line end here)
        assert len(states) > 2 and states[-1] == "100", bar[-2000:]


def test_the_hugging_face_trainer_trains_the_same(tmp_path: Path) -> None:
    """The Trainer sets up its own process group from the launcher's environment: the
    same world, the same loss at every step and the same final weights."""
    runs = {
        launcher: launch(launcher, tmp_path, "hf_trainer.py", "6", str(tmp_path / launcher))
        for launcher in LAUNCHERS
    }
    said = {launcher: _lines(out.stdout, r"\[\d\] (step|world)") for launcher, out in runs.items()}
    assert len(said["torchrun"]) == 14, runs["torchrun"].stdout[-2000:]
    assert "[0] world 2 checksum" in "\n".join(said["torchrun"])
    for launcher, got in said.items():
        assert got == said["torchrun"], launcher
