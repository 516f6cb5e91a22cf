"""The pure rules that are not the master's own: how a dataset is cut into shards and
its position merged (`shards`), where a job's time went (`goodput`, and its picture
`goodput_svg`), a TensorFlow cluster's spec from a round (`tf_cluster`), and the
exactly-once rules of a stream's offsets (`streaming`), and the counts in rove's
sentences (`words`: "1 node", "ranks 0-3", "killed by SIGKILL").

Pure functions of events (no NATS, asyncio, clock, torch, TensorFlow, Kafka or
Kubernetes): imports only `rove.control.catalogue` and `rove.control.errors`.
Everything above it may import it.
"""
