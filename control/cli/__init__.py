"""The `rove` command line: master, events, status, stop (and run, with the agent)."""
