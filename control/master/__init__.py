"""The event-sourced job master.

`state` holds the folded job state, `evolve` folds one event into it (pure),
`decide` turns state and time into decisions (pure; the rendezvous policy in
`rendezvous` over `rdzv_state`, and `netcheck`, `data`, `checkpoints`, `scaling`,
`optimizer`, `streams`), `election` holds the leader lease and the server-enforced
fence, `snapshots` stores and loads folded state, and `runner` (with `replica`) does
the I/O around all of them. `service` is `JobService`, the base of every part that
follows one job through a replica (the runner, the scaler, the Kafka bridge).

The pure modules import only the catalogue and each other (no bus, no asyncio, no
clock: time is an argument); `runner`, `replica`, `election` and `snapshots` import
the bus and the process support. Nothing here imports the agent, the services, the
scaler or the CLI.
"""
