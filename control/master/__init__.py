"""The event-sourced job master.

`state` holds the folded job state, `evolve` folds one event into it (pure),
`decide` turns state and time into decisions (pure; the rendezvous policy in
`rendezvous` over `rdzv_state`, and `netcheck`, `data`, `checkpoints`, `scaling`,
`optimizer`, `streams`), `election` holds the leader lease and the server-enforced
fence, `snapshots` stores and loads folded state, and `runner` (with `replica`) does
the I/O around all of them.

The pure modules import only the catalogue and each other (no bus, no asyncio, no
clock: time is an argument); `runner`, `replica`, `election` and `snapshots` import
the bus. Nothing here imports the agent or the CLI.
"""
