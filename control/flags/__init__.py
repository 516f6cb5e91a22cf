"""Command-line flags shared by `rove run` (in the agent) and the `rove` CLI: the NATS
and job options, argument types and exit codes (`options`), and the nearest real flag
or command suggested for a mistyped one (`suggest`).

Imports the bus (to build its options), the catalogue and `rove.control.errors`;
the agent and the CLI import it (so neither imports the other for them).
"""
