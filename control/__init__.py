"""rove's control plane: the event catalogue, subjects, the JetStream bus client, the
event-sourced master (`master`), the scaler (`scaler`), the job services (Kafka
bridge) and the `rove` command line (`cli`).

Agents, masters, the scaler and the CLI never call each other: they publish typed
events (``rove.control.catalogue.events``) to JetStream subjects
(``rove.control.catalogue.subjects``) through ``rove.control.bus.client`` and consume the
subjects they care about.

What may import what (docs/architecture.md, "Layers and contracts"; `make lint`
checks it): the pure domain here (the catalogue, `subjects`, `shards`, `streaming`,
`tf_cluster`, `goodput`) imports no NATS, asyncio, clock or framework, nor the bus;
the bus client (`bus`, `bus_options`, `connection`, `feed`, ...) imports the domain;
runtimes and the CLI import both. Nothing here imports torch, and only the CLI
imports the agent (`rove run`, `rove agent`, `rove submit`).
"""
