"""A worker that records which signal stopped it, for the signal tests.

`OUT/<rank>.started` holds its pid once it runs. On SIGINT (KeyboardInterrupt) it
writes `OUT/<rank>.signal`, takes a second to clean up, then writes
`OUT/<rank>.cleaned`; on SIGTERM or SIGHUP it writes `OUT/<rank>.signal` (the
signal's name) and exits; on SIGUSR1 (a SLURM job's warning) it writes it and returns,
as a script that saved would. With
`ignore-term` it ignores SIGTERM (a worker that does not stop when asked).
"""

import os
import signal
import sys
import time
from pathlib import Path

out = Path(sys.argv[1])
rank = os.environ["RANK"]


def terminated(signum: int, _frame: object) -> None:
    (out / f"{rank}.signal").write_text(signal.Signals(signum).name)
    sys.exit(128 + signum)


if sys.argv[2:] == ["ignore-term"]:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
else:
    signal.signal(signal.SIGTERM, terminated)
signal.signal(signal.SIGHUP, terminated)


def saved(signum: int, _frame: object) -> None:
    (out / f"{rank}.signal").write_text(signal.Signals(signum).name)
    sys.exit(0)


signal.signal(signal.SIGUSR1, saved)
(out / f"{rank}.started").write_text(str(os.getpid()))
try:
    while True:
        time.sleep(0.05)
except KeyboardInterrupt:
    (out / f"{rank}.signal").write_text("SIGINT")
    time.sleep(1.0)  # clean-up that takes a while
    (out / f"{rank}.cleaned").write_text("yes")
    raise
