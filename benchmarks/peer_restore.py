"""A whole node lost, then training again: its state from a peer's memory, from storage,
and torchrun's `torch.save`/`torch.load`, side by side in one run.

Two nodes of one worker each train `benchmarks/peer_restore_train.py` (a state of
--size-mb per rank, the ranks in lockstep, a checkpoint every --ckpt-every steps). Once
training is steady (--kill-after steps past a save), the whole of node nb (its
launcher, agent, servers and worker) is killed with SIGKILL and its shared memory
deleted; a replacement nb is started at once (as a pool's standby would be). Measured
from the kill:

- `back_s`: until both ranks trained a step again;
- `lost_steps`: the newest step trained before the kill minus the step restored;
- `source`: where the ranks restored from.

Cases: `rove_peer` (`rove run`, flash checkpoints, no storage: the lost node's step
comes from its peer's replica), `rove_storage` (`rove run --checkpoint-dir`, files,
`--peer-replicas 0`: the committed step; with `--object-store`, also
`rove_object_store`: the same, persisted to an S3 endpoint), `torchrun` (`torchrun` on
a c10d rendezvous, rank 0 saves with `torch.save` to a file, every rank loads it after the restart).

    python benchmarks/peer_restore.py [--size-mb 1024]

Prints one JSON line: each case, and `peer_vs_storage` / `peer_vs_torchrun` (the ratio
of their `back_s`; target: from a peer at least 3 times faster than from storage, and 0 steps lost
beyond the last flash save).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
from common import free_port, trace_rows, wait_for

from rove.control.bus.embedded import EmbeddedServer

TRAINER = Path(__file__).resolve().parent / "peer_restore_train.py"
ROVE = [sys.executable, "-m", "rove.control.cli.main"]


def kill_whole(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL a launcher and everything under it at once: a node lost."""
    pids = [proc.pid, *(c.pid for c in psutil.Process(proc.pid).children(recursive=True))]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


def measure(
    work: Path,
    start: Any,
    a: argparse.Namespace,
    ready: Any = lambda: True,
) -> dict[str, Any]:
    """Start nodes na and nb (`start(name, incarnation)`), kill nb once steady, start it
    again, and time the way back."""
    trace = work / "trace.jsonl"
    na, nb = start("na", 0), start("nb", 0)
    procs = [na, nb]
    try:
        # the kill: --kill-after steps past a save, after at least --min-steps
        saves = max(3, -(-a.min_steps // a.ckpt_every))
        steady = saves * a.ckpt_every + a.kill_after

        def trained(at: int) -> bool:
            rows = trace_rows(trace)
            return len({r["rank"] for r in rows if r["step"] >= at}) == 2

        wait_for(lambda: trained(steady) and ready(), a.timeout, "steady training")
        before = trace_rows(trace)
        newest = max(r["step"] for r in before)
        old = {r["pid"] for r in before}
        killed = time.time()
        kill_whole(nb)
        shutil.rmtree(shm_dir(a, work, "nb"), ignore_errors=True)  # its memory went with it
        newest = max(newest, *(r["step"] for r in trace_rows(trace)))
        procs.append(start("nb", 1))

        def back() -> dict[int, dict[str, Any]] | None:
            firsts: dict[int, dict[str, Any]] = {}
            for r in trace_rows(trace):
                if r["pid"] not in old and r["t"] > killed and r["rank"] not in firsts:
                    firsts[r["rank"]] = r
            return firsts if len(firsts) == 2 else None

        try:
            firsts = wait_for(back, a.timeout, "training again")
        except TimeoutError as exc:  # (torchrun's restart can fail: say so, do not crash)
            return {"back_s": None, "error": str(exc), "newest_step_before": newest}
        restored = {r["from"] for r in firsts.values()}
        return {
            "back_s": round(max(r["t"] for r in firsts.values()) - killed, 2),
            "lost_steps": newest - min(restored),
            # the last step saved before the kill, less the one restored: 0 is the target
            "lost_beyond_last_save": newest // a.ckpt_every * a.ckpt_every - min(restored),
            "restored_step": min(restored),
            "newest_step_before": newest,
            "source": sorted({r["source"] for r in firsts.values()}),
            "load_s": max(r["load_s"] for r in firsts.values()),
        }
    finally:
        for p in procs:
            with contextlib.suppress(Exception):
                kill_whole(p)


def rove_case(
    root: Path,
    url: str,
    a: argparse.Namespace,
    storage: bool,
    store: str | None = None,
    store_env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """`store`: where the storage case persists (a URL; default: a local folder)."""
    name = ("object-store" if store else "storage") if storage else "peer"
    work = root / name
    work.mkdir()
    job = f"pr-{name}"
    env = {**os.environ, **(store_env or {}), "ROVE_HOME": str(work / "home")}
    master = subprocess.Popen(
        [*ROVE, "master", "--job", job, "--nats", url, "--node-timeout", "10"],
        stdout=(work / "master.log").open("wb"),
        stderr=subprocess.STDOUT,
        env=env,
    )
    where = store or str(work / "store")
    extra = ["--checkpoint-dir", where, "--peer-replicas", "0"] if storage else []
    if store and a.store_persist_every:
        extra += ["--persist-every", str(a.store_persist_every)]

    def start(node: str, n: int) -> subprocess.Popen[bytes]:
        shm = shm_dir(a, work, node)
        shm.mkdir(parents=True, exist_ok=True)
        return subprocess.Popen(
            [
                *ROVE,
                *("run", "--nats", url, "--job", job, "--node-id", node),
                *("--local-addr", "127.0.0.1", "--nnodes", "2", "--nproc-per-node", "1"),
                *("--max-restarts", "3", "--heartbeat-interval", "0.5", *extra),
                *trainer_args(work, a, "flash"),
            ],
            stdout=(work / f"{node}-{n}.log").open("wb"),
            stderr=subprocess.STDOUT,
            env={**env, "ROVE_SHM_DIR": str(shm)},
        )

    def checkpoints() -> dict[str, Any] | None:
        """The job's checkpoints as `rove status --json` says them (None: no answer)."""
        out = subprocess.run(
            [*ROVE, "status", "--job", job, "--nats", url, "--json"],
            capture_output=True,
            text=True,
            env=env,
            check=False,
        ).stdout
        return json.loads(out)["checkpoints"] if out.strip() else None

    def ready() -> bool:
        # storage: a step is committed; peer: a step of nb reached na
        ck = checkpoints()
        if ck is None:
            return False
        return ck["committed_step"] is not None if storage else "nb" in ck["replicas"]

    try:
        out = measure(work, start, a, ready)
        # where the master said the round restores from (the workers load it from memory
        # when it is peer: it was fetched there)
        ck = checkpoints()
        out["round_restored"] = ck["restored"] if ck is not None else None
        return out
    finally:
        master.terminate()
        master.wait(30)


def torchrun_case(root: Path, a: argparse.Namespace) -> dict[str, Any]:
    work = root / "torchrun"
    work.mkdir()
    port = free_port()

    def start(node: str, n: int) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [
                *(sys.executable, "-m", "torch.distributed.run"),
                *("--nnodes", "2", "--nproc-per-node", "1", "--max-restarts", "3"),
                *("--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"),
                *("--rdzv-id", "peer-restore", "--local-addr", "127.0.0.1"),
                *trainer_args(work, a, "torch"),
            ],
            stdout=(work / f"{node}-{n}.log").open("wb"),
            stderr=subprocess.STDOUT,
        )

    def first(node: str, n: int) -> subprocess.Popen[bytes]:
        p = start(node, n)
        if node == "na" and n == 0:
            time.sleep(2.0)  # na hosts the rendezvous store: nb, the one lost, does not
        return p

    return measure(work, first, a, lambda: (work / "ckpt" / "ckpt.pt").exists())


def object_store(root: Path) -> Any:
    """moto's S3 server on loopback, as the object-store checkpoint tests run it."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.s3server import S3Server

    server = S3Server(root / "moto.log")
    server.start()
    return server


def shm_dir(a: argparse.Namespace, work: Path, node: str) -> Path:
    """A node's shared memory (`ROVE_SHM_DIR`): in /dev/shm, as a real node's is (a
    folder on disk would page its flash saves out to the disk)."""
    return Path(a.shm_root) / work.name / f"shm-{node}"


def ratio(slow: dict[str, Any] | None, fast: dict[str, Any] | None) -> float | None:
    """How many times faster `fast` was back (None: one of them never came back, or
    was not run)."""
    if not slow or not fast or not slow.get("back_s") or not fast.get("back_s"):
        return None
    return round(float(slow["back_s"]) / float(fast["back_s"]), 2)


def trainer_args(work: Path, a: argparse.Namespace, checkpoint: str) -> list[str]:
    return [
        str(TRAINER),
        *("--size-mb", str(a.size_mb), "--ckpt-every", str(a.ckpt_every)),
        *("--step-s", str(a.step_s), "--checkpoint", checkpoint),
        *("--ckpt-dir", str(work / "ckpt"), "--trace", str(work / "trace.jsonl")),
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mb", type=int, default=1024, help="the state of each rank")
    p.add_argument("--ckpt-every", type=int, default=5)
    p.add_argument("--step-s", type=float, default=0.2, help="each step's own time")
    p.add_argument(
        "--kill-after",
        type=int,
        default=1,
        help="kill the node this many steps after a save (1: no asynchronous copy, to "
        "storage or a peer, of that save can have finished)",
    )
    p.add_argument(
        "--min-steps",
        type=int,
        default=0,
        help="train at least this many steps before the kill (default: 3 saves' worth)",
    )
    p.add_argument(
        "--object-store",
        action="store_true",
        help="a third rove case persisting to an S3 object store (moto's emulator on "
        "loopback, from `make test`'s .venv-s3) instead of a local folder",
    )
    p.add_argument(
        "--store-persist-every",
        type=int,
        default=0,
        help="the object-store case persists every Nth step only (0: every save): what a "
        "job whose uploads take longer than a save interval needs, so that every node "
        "persists the same steps",
    )
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--work", type=Path, help="keep logs and traces here")
    p.add_argument(
        "--cases",
        default="peer,storage,torchrun",
        help="which cases to run, comma-separated (a ratio needs both of its cases)",
    )
    a = p.parse_args()
    cases = set(a.cases.split(","))
    memory = "/dev/shm" if Path("/dev/shm").is_dir() else None
    with (
        tempfile.TemporaryDirectory(prefix="rove-peer-restore-") as tmp,
        tempfile.TemporaryDirectory(prefix="rove-peer-restore-", dir=memory) as shm,
    ):
        a.shm_root = shm
        root = a.work or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        server = EmbeddedServer(root / "nats")
        url = server.start()
        s3 = None
        try:
            peer = rove_case(root, url, a, storage=False) if "peer" in cases else None
            storage = rove_case(root, url, a, storage=True) if "storage" in cases else None
            if a.object_store:
                s3 = object_store(root)
                remote = rove_case(
                    root, url, a, True, f"s3://{s3.bucket()}/ckpt", store_env=s3.env()
                )
        finally:
            server.stop()
            if s3 is not None:
                s3.stop()
        torchrun = torchrun_case(root, a) if "torchrun" in cases else None
    result = {
        "size_mb": a.size_mb,
        "ckpt_every": a.ckpt_every,
        "step_s": a.step_s,
        "kill_after": a.kill_after,
        "min_steps": a.min_steps,
        "store_persist_every": a.store_persist_every,
        "rove_peer": peer,
        "rove_storage": storage,
        "torchrun": torchrun,
        "peer_vs_storage": ratio(storage, peer),
        **(
            {"rove_object_store": remote, "peer_vs_object_store": ratio(remote, peer)}
            if a.object_store
            else {}
        ),
        "peer_vs_torchrun": ratio(torchrun, peer),
        "targets": {"peer_vs_storage": 3.0, "peer_lost_steps_beyond_last_save": 0},
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
