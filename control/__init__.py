"""rove's control plane: the event catalogue, subjects, the JetStream bus client,
the event-sourced master (state, evolve, decide, election, snapshots) and the CLI.

Agents, masters, the scaler and the CLI never call each other: they publish typed
events (``rove.control.events``) to JetStream subjects (``rove.control.subjects``)
through ``rove.control.bus`` and consume the subjects they care about.
"""
