"""The TensorFlow worker runtime: this node's tasks of a parameter-server round.

Each local process of a TensorFlow round is one task (`round_completed.tasks`,
with its `TF_CONFIG`): the **chief** runs the user's script, the coordinator
of `ParameterServerStrategy`; **parameter servers** and **workers** run
`rove.agent.tf_server`. Every task runs through `rove.agent.child`, so it dies
with its agent.

What happens when a task ends:

    chief, code 0      the round's work is done: `wait` returns success (this
                       node's servers serve until the job ends)
    worker, any code   started again at once on the same address: the
                       coordinator's closures retry on the other workers and
                       the restarted one rejoins by itself; nothing else
                       restarts. `listener` is told. After `max_restarts` in a
                       round, the round fails instead.
    parameter server   the round fails (the agent reports it; the master starts
    chief, code != 0   a new round): every task starts again, the coordinator
    worker whose port  restores from its last committed checkpoint and the data
      was taken        rolls back to that checkpoint's position. A repeated
                       user error fails the job fast, as for torch. (A worker
                       whose port was taken, `tf_server.PORT_TAKEN`, would fail
                       the same way on the same address; the next round's
                       ports are offered afresh.)

So unlike torch's, a TensorFlow round's `wait` returns when its chief ends,
not when every task has: parameter servers and workers serve until stopped.

Tasks start from spares (`rove.agent.tf_spare`): processes that imported TensorFlow
before they were needed, so that a new round's tasks skip the import that is most of
their start. A node keeps one spare per task of its round, started once the round is
at work (every server of this node serving and its chief, if it runs it, past its
first step; at the latest `SPARE_DELAY_S` after the start) so that they never slow the
start they are meant to speed up. A task with no spare starts as a fresh process.

Every task and spare runs with `TMPDIR` set to a folder of this runtime's own, removed at
`close()`: TensorFlow's autograph files of a killed task go with it.

A task's output, both streams, goes to its log file where `rove logs` finds a torch
worker's (`<log_dir>/round<R>/rank<RANK>.stdout`, `rove.control.history.joblogs`);
the chief's is also echoed to the agent's stderr, prefixed `[chief]`, as are
the servers' own `rove:` lines. The last lines of a failed task are its
diagnosis's evidence.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import structlog

from rove.agent import progress, tf_spare
from rove.agent.diagnosis import Diagnosis, classify, port_in_use
from rove.agent.runtime import RootFailure, TaskRestart, WorkerRuntime, WorkersEnded
from rove.agent.sentinels import Sentinels
from rove.agent.tf_server import PORT_TAKEN
from rove.control.domain import tf_cluster
from rove.control.domain.words import counted
from rove.control.history import joblogs
from rove.control.process import tempdirs

log = structlog.get_logger("rove.agent")

#: Characters of blank command line a spare starts with, for its task's title.
TITLE_ROOM = 512
#: The module parameter servers and workers run.
SERVER = "rove.agent.tf_server"

#: Environment the agent gives each task (besides TF_CONFIG).
ROLE_ENV = "ROVE_TF_ROLE"
INDEX_ENV = "ROVE_TF_INDEX"
#: Lines of a task's output kept for its diagnosis.
TAIL_LINES = 60
#: Seconds the other tasks of a failed round get to exit before SIGKILL.
FAILED_ROUND_GRACE_S = 1.0
#: Seconds after a round's start before spares are started, where this node's tasks do
#: not all say sooner that they are at work.
SPARE_DELAY_S = 15.0
#: Spares that may end before they are given a task; after that, this node keeps none.
SPARE_FAILURES = 3


@dataclass
class _Task:
    local_rank: int
    role: str
    index: int
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    #: what a spare runs for it (`python -u -m module args`); None: a fresh process only
    handover: tf_spare.Handover | None = None
    proc: subprocess.Popen[bytes] | None = None
    reader: threading.Thread | None = None
    tail: collections.deque[str] = field(
        default_factory=lambda: collections.deque(maxlen=TAIL_LINES)
    )
    restarts: int = 0
    #: a server said it serves (`rove: ... serving at`): its start is done
    serving: bool = False

    @property
    def name(self) -> str:
        return self.role if self.role == tf_cluster.CHIEF else f"{self.role}{self.index}"


class TfRuntime(WorkerRuntime):
    """One TensorFlow round's tasks on this node (see the module and `WorkerRuntime`)."""

    def __init__(
        self,
        chief_argv: list[str],
        log_dir: Path,
        progress_dir: Path,
        *,
        max_restarts: int,
        python: str = sys.executable,
        echo: IO[str] | None = None,
        stop_timeout_s: float = 10.0,
        spares: bool = True,
    ) -> None:
        self.chief_argv = list(chief_argv)
        self.server_argv = [
            *(python, "-m", "rove.agent.child"),
            *(python, "-u", "-m", SERVER),
        ]
        # (blank room on the command line: a task's title is written over the spare's
        # own, never past it, see rove.agent.self_process.title)
        self.spare_argv = [python, "-u", "-m", "rove.agent.tf_spare", " " * TITLE_ROOM]
        # the chief runs from a spare when its command is `python -u -m MODULE ARGS`
        # (rove run's own: rove.agent.child --run script SCRIPT ...)
        head = self.chief_argv[:3]
        self._chief_module = (
            (self.chief_argv[3], self.chief_argv[4:])
            if head == [python, "-u", "-m"] and len(self.chief_argv) > 3
            else None
        )
        self.keep_spares = spares
        self._spares: list[subprocess.Popen[bytes]] = []
        self._want = 0  # spares to keep: this node's tasks
        self._refill_at: float | None = None
        self._spare_failures = 0
        self.log_dir = log_dir
        self.progress_dir = progress_dir
        self.max_restarts = max_restarts
        self.echo = echo if echo is not None else sys.stderr
        self.stop_timeout_s = stop_timeout_s
        self._round = 0
        self._tasks: dict[int, _Task] = {}
        self._progress_files: dict[int, Path] = {}
        self._lock = threading.Lock()
        #: every task's and spare's temporary folder (TMPDIR), removed at `close()`
        self._tmp: Path | None = None

    @property
    def running(self) -> bool:
        return bool(self._tasks)

    @property
    def round(self) -> int:
        return self._round

    def start(self, round_: int, envs: dict[int, dict[str, str]]) -> dict[int, int]:
        """Start every task (on the calling thread: a task dies with the thread that
        started it, see `rove.agent.child`)."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.progress_dir.mkdir(parents=True, exist_ok=True)
        with self._lock:
            assert not self._tasks, "the previous round's tasks still run"
            self._round = round_
            self._progress_files = {}
            for local_rank, env in sorted(envs.items()):
                role, index = env[ROLE_ENV], int(env[INDEX_ENV])
                full = {**os.environ, **env, "TMPDIR": self._tmpdir()}
                if role == tf_cluster.CHIEF:
                    path = self.progress_dir / f"round{round_}-chief"
                    progress.create(path)
                    self._progress_files[local_rank] = path
                    full[progress.ENV] = str(path)
                chief = role == tf_cluster.CHIEF
                argv = self.chief_argv if chief else self.server_argv
                module = self._chief_module if chief else (SERVER, [])
                task = _Task(
                    local_rank,
                    role,
                    index,
                    argv,
                    full,
                    joblogs.round_folder(self.log_dir, round_)
                    # (both streams: a task's stderr goes to its stdout)
                    / joblogs.file_name(env.get("RANK", local_rank), "stdout"),
                    None if module is None else tf_spare.Handover(full, module[0], module[1]),
                )
                self._tasks[local_rank] = task
                self._spawn(task)
            self._want = len(envs) if self.keep_spares else 0
            self._refill_at = time.monotonic() + SPARE_DELAY_S
            return self.pids()

    def _spawn(self, task: _Task) -> None:
        task.tail.clear()
        task.serving = False
        task.proc = self._from_spare(task) if task.handover is not None else None
        if task.proc is None:
            task.proc = subprocess.Popen(
                task.argv,
                env=task.env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # (a terminal's signal reaches it once, through rove)
            )
        task.reader = threading.Thread(
            target=self._read, args=(task, task.proc), name=f"tf-{task.name}-output", daemon=True
        )
        task.reader.start()

    # ------------------------------------------------------------------ spares

    def _from_spare(self, task: _Task) -> subprocess.Popen[bytes] | None:
        """A spare given `task`, or None when none is ready."""
        assert task.handover is not None
        while self._spares:
            proc = self._spares.pop(0)
            if proc.poll() is not None:
                self._spare_ended(proc)
                continue
            assert proc.stdin is not None
            try:
                proc.stdin.write(tf_spare.encode(task.handover))
                proc.stdin.close()
            except OSError:  # it ended as it was handed the task
                proc.wait()
                self._spare_ended(proc)
                continue
            log.info(f"{_title(task)} starts from a spare", round=self._round, pid=proc.pid)
            return proc
        return None

    def _spare_ended(self, proc: subprocess.Popen[bytes]) -> None:
        """A spare ended before it had a task: say why; after `SPARE_FAILURES`, keep none."""
        out = proc.stdout.read() if proc.stdout is not None else b""
        if proc.stdout is not None:
            proc.stdout.close()
        self._spare_failures += 1
        tail = out.decode(errors="replace").strip().splitlines()[-5:]
        if self._spare_failures >= SPARE_FAILURES:
            self.keep_spares, self._want = False, 0
        log.warning(
            f"a spare TensorFlow process ended before it had a task (code {proc.returncode})"
            + ("; this node starts its tasks fresh from now on" if not self.keep_spares else ""),
            round=self._round,
            output=tail,
        )

    def _spares_due(self) -> float | None:
        """Start the spares this node lacks if the round is at work; else the seconds to
        check again (None: none are wanted)."""
        if self._refill_at is None or len(self._spares) >= self._want:
            return None
        stepped = {lr for lr, p in self.progress().items() if p.step > 0}
        at_work = all(t.serving or t.local_rank in stepped for t in list(self._tasks.values()))
        now = time.monotonic()
        if not at_work and now < self._refill_at:
            return min(1.0, self._refill_at - now)
        # (on the event loop's thread, as the tasks: a spare dies with the thread that
        # started it, see rove.agent.child)
        while self.keep_spares and len(self._spares) < self._want:
            self._spares.append(
                subprocess.Popen(
                    self.spare_argv,
                    env={**os.environ, "TMPDIR": self._tmpdir()},
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # (as the tasks: a terminal's signal is rove's)
                )
            )
        log.info("TensorFlow spares ready to start", spares=len(self._spares), round=self._round)
        return None

    def close(self) -> None:
        """Let the spares go (the agent is ending), and remove the tasks' temporary
        folder."""
        spares, self._spares, self._want = self._spares, [], 0
        for proc in spares:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        for proc in spares:
            proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    with contextlib.suppress(OSError):
                        pipe.close()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def _tmpdir(self) -> str:
        """The temporary folder of this node's TensorFlow processes (made at first use, in
        the agent's own). TensorFlow's autograph writes a file there for each function
        it converts and removes it only when the process exits normally: a task that
        was killed left them in /tmp, a few every time, for good."""
        if self._tmp is None:
            self._tmp = tempdirs.make("rove-tf")
        return str(self._tmp)

    # ------------------------------------------------------------------ output

    def _read(self, task: _Task, proc: subprocess.Popen[bytes]) -> None:
        """Copy a task's output to its log file (and the chief's to the agent's stderr)."""
        assert proc.stdout is not None
        task.log_path.parent.mkdir(parents=True, exist_ok=True)
        with task.log_path.open("ab") as out:
            for raw in proc.stdout:
                out.write(raw)
                out.flush()
                line = raw.decode(errors="replace").rstrip("\n")
                task.tail.append(line)
                if line.startswith("rove:") and " serving at " in line:
                    task.serving = True
                if task.role == tf_cluster.CHIEF or line.startswith("rove:"):
                    self.echo.write(f"[{task.name}] {line}\n")
                    self.echo.flush()

    def pids(self) -> dict[int, int]:
        return {lr: t.proc.pid for lr, t in self._tasks.items() if t.proc is not None}

    async def wait(self) -> WorkersEnded:
        while True:
            for task in list(self._tasks.values()):
                if task.proc is None or task.proc.poll() is None:
                    continue
                ended = await self._ended(task)
                if ended is not None:
                    return ended
            live = {
                lr: t.proc.pid
                for lr, t in self._tasks.items()
                if t.proc is not None and t.proc.poll() is None
            }
            if not live:
                await asyncio.sleep(0.1)
                continue
            due = self._spares_due()
            watched = Sentinels(live, [])
            try:
                if due is None:
                    await watched.next_exit()
                else:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(watched.next_exit(), due)
            finally:
                watched.close()

    async def _ended(self, task: _Task) -> WorkersEnded | None:
        """What a task's end means: None when it was started again in place."""
        assert task.proc is not None
        code = task.proc.returncode
        if task.reader is not None:  # its last lines are the evidence
            await asyncio.to_thread(task.reader.join, 5.0)
        if task.role == tf_cluster.CHIEF and code == 0:
            log.info("the TensorFlow coordinator finished", round=self._round)
            return WorkersEnded(self._round, None)
        tail = "\n".join(task.tail)
        found = classify(code, None, tail)
        taken = 0  # (the port another process held, as tf_server named it)
        if code == PORT_TAKEN:  # (tf_server's own words, not gRPC's log line)
            said = [x.partition("cannot serve: ")[2] for x in task.tail if "cannot serve: " in x]
            found = Diagnosis(found.kind, said[-1]) if said else found
            taken = port_in_use(tail) or 0
        diagnosis = Diagnosis(found.kind, f"{_title(task)}: {found.reason}")
        again = code != PORT_TAKEN  # (on the same address: it would fail the same way)
        if task.role == tf_cluster.WORKER and again and task.restarts < self.max_restarts:
            task.restarts += 1
            log.warning(
                f"{_title(task)} ended ({found.reason}); starting it again on the same address",
                round=self._round,
                restarts=task.restarts,
                log=str(task.log_path),
            )
            self._spawn(task)  # on the event loop's thread, as the round's first start
            if self.listener is not None:
                self.listener(
                    TaskRestart(
                        task.local_rank, task.role, task.index, code, diagnosis, task.restarts
                    )
                )
            return None
        if task.role == tf_cluster.WORKER and again:
            diagnosis = Diagnosis(
                found.kind,
                f"{_title(task)} failed {counted(task.restarts + 1, 'time')} "
                f"in round {self._round} "
                f"(--max-worker-restarts {self.max_restarts}): {found.reason}",
            )
        failure = RootFailure(
            task.local_rank, task.proc.pid, code, diagnosis, tail, port_taken=taken
        )
        # The round is over and every checkpoint is durable already: nothing to wait for.
        # A coordinator that lost its parameter server can take long to exit on SIGTERM
        # (TensorFlow's threads), and every second here is a second of the recovery.
        began = time.monotonic()
        await asyncio.to_thread(self.stop, signal.SIGTERM, FAILED_ROUND_GRACE_S)
        log.info(
            f"the round's other tasks ended in {time.monotonic() - began:.2f}s",
            round=self._round,
            ended_after_s=round(time.monotonic() - began, 3),
        )
        return WorkersEnded(self._round, failure)

    def stop(self, sig: signal.Signals = signal.SIGTERM, timeout_s: float = 10.0) -> None:
        """`sig` to the chief, then, once it ended, to the servers (a coordinator whose
        servers went first waits for them to come back, past a Ctrl-C's
        KeyboardInterrupt); SIGKILL to any still alive `timeout_s` after the first."""
        with self._lock:
            tasks, self._tasks = list(self._tasks.values()), {}
        live = [(t, t.proc) for t in tasks if t.proc is not None and t.proc.poll() is None]
        deadline = time.monotonic() + timeout_s
        chiefs = [(t, p) for t, p in live if t.role == tf_cluster.CHIEF]
        for _, proc in chiefs:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(sig)
        for _, proc in chiefs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.0, deadline - time.monotonic()))
        for task, proc in live:
            if task.role != tf_cluster.CHIEF:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(sig)
        deadline = max(deadline, time.monotonic() + 1.0)  # (a server ends at once)
        for task, proc in live:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.info(
                    f"{_title(task)} did not end within {timeout_s:g}s of {sig.name}; killing it",
                    round=self._round,
                )
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                proc.wait()
        for task in tasks:
            if task.reader is not None:
                task.reader.join(5.0)

    def progress(self) -> dict[int, progress.Progress]:
        return progress.read_all(self._progress_files)


def _title(task: _Task) -> str:
    if task.role == tf_cluster.CHIEF:
        return "the chief"
    return f"{'parameter server' if task.role == tf_cluster.PS else 'worker'} {task.index}"
