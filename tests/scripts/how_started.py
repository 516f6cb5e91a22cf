"""Writes how this worker was started to OUT/<rank>.json, then exits (or raises).

Checked before anything is imported: whether torch was already imported (warm
start forks workers from a server that imported it), `__name__`, `sys.argv`,
`sys.path[0]`, its session. At exit (an atexit handler) it writes OUT/<rank>.atexit,
and it leaves OUT/<rank>.unclosed open with buffered text, which a fresh interpreter
flushes as it ends. `--raise` makes rank 1 raise after writing, to test the error
path of a worker.
"""

import atexit
import sys

preloaded = "torch" in sys.modules

import json  # noqa: E402
import os  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

out = Path(sys.argv[1])
rank = os.environ["RANK"]
(out / f"{rank}.json").write_text(
    json.dumps(
        {
            "torch_preloaded": preloaded,
            "name": __name__,
            "argv": sys.argv,
            "path0": sys.path[0],
            "threads": torch.get_num_threads(),
            "pid": os.getpid(),
            "ppid": os.getppid(),
            "start_method": __import__("multiprocessing").get_start_method(),
            "cmdline": Path("/proc/self/cmdline").read_bytes().replace(b"\0", b" ").decode(),
            "sid": os.getsid(0),
            "draws": [
                torch.initial_seed(),
                torch.rand(1).item(),
                __import__("numpy").random.rand(),
            ],
        }
    )
)
atexit.register(lambda: (out / f"{rank}.atexit").write_text("ran"))
unclosed = open(out / f"{rank}.unclosed", "w")  # noqa: SIM115 - left open on purpose
unclosed.write("flushed at the end")
print(f"rank {rank} says hello", flush=True)
sys.stderr.write(f"rank {rank} at 1/2\rrank {rank} at 2/2\n")  # a progress bar's redraw
if "--raise" in sys.argv and rank == "1":
    raise ValueError("rank 1 refuses on purpose")
