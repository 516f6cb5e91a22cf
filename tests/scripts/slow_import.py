"""A module whose import takes a minute: `--preload slow_import` keeps the warm server
importing, for the signal tests."""

import time

time.sleep(60)
