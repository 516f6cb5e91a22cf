"""rove's control plane, one package per room (docs/architecture.md, "Layers and
contracts"):

- `catalogue`: every event type and the subjects they travel on;
- `domain`: pure rules beside the master's (shards, goodput, tf_cluster, streaming,
  and the counts in rove's sentences);
- `process`: what every process runs on (event loop, supervisor, logs, metrics);
- `bus`: the JetStream client and its plumbing, the embedded server;
- `flags`: command-line flags shared by `rove run` and the CLI;
- `master`: the event-sourced master, and `JobService`, the base of every service;
- `services`: the Kafka bridge, the registry of pooled agents;
- `history`: a job's past as people read it (jobs kept, their logs, their runs);
- `scaler`: plans carried out on processes, pooled daemons or Kubernetes;
- `cli`: the `rove` command line.

Agents, masters, the scaler and the CLI never call each other: they publish typed
events (`catalogue.events`) to JetStream subjects (`catalogue.subjects`) through
`bus` and consume the subjects they care about. Each layer imports only those below
it in that list (`make lint` checks it); `errors` is the root every layer may
import. Nothing here imports torch, and only the CLI imports the agent.
"""
