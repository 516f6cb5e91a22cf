"""Run a training script with the file-size limit lifted (soft limit up to the hard one).

    python without_file_limit.py TRAIN_SCRIPT [ARGS...]

The full-disk test limits file sizes in the `rove run` process, so that the
agent's persisting fails as on a full disk; its workers inherit the limit and
would fail too on their shared-memory checkpoints. This shim lifts it for them.
"""

import resource
import runpy
import sys

_, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
