"""The event-sourced job master.

`state` holds the folded job state, `evolve` folds one event into it (pure),
`decide` turns state and time into decisions (pure), `election` holds the
leader lease and the server-enforced fence, `snapshots` stores and loads folded
state, and `runner` does the I/O around all of them.
"""
