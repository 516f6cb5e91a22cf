"""A module whose import takes a minute: a full warm server preloading it keeps
importing, for the starved-server tests of tests/test_warm.py."""

import time

time.sleep(60)
