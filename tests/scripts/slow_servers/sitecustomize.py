"""On PYTHONPATH for a signal test: a multiprocessing forkserver (a warm server) takes a
minute to start, so a round waits for it (every other interpreter starts as usual)."""

import sys
import time

if any("multiprocessing.forkserver" in arg for arg in getattr(sys, "orig_argv", [])):
    time.sleep(60)
