"""The `rove` command line: `run` (the launcher, in `rove.agent`), `master`, `scaler`,
`agent`, `kafka-bridge`, and the readers `events`, `status`, `goodput`, `logs`,
`jobs`, with `stop`, `submit` and `auth`. It may import everything else; nothing else
imports it (options shared with the agent live in `rove.control.flags.options`).
"""
