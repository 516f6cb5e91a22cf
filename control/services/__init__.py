"""Parts beside the master and the scaler: the Kafka bridge (`kafka_bridge`, a service
that follows one streaming job and feeds it records), and the registry of pooled
`rove agent` daemons a scaler may assign to jobs (`pool`).

Imports the master (its fold and the `JobService` base), the bus, the domain and the
catalogue; the CLI, the scaler and the agent's daemon import it.
"""
