"""The node agent and the `rove run` launcher (a drop-in for `torchrun`).

The agent joins rounds, runs its workers (torch, forked from a warm server or fresh;
TensorFlow tasks), watches and diagnoses them, persists their flash checkpoints,
heartbeats, and runs the network check. It talks to the master only through events
on the bus (`rove.control.bus.client`). It imports the control plane's catalogue, bus and
options and `rove.checkpoint`, never the CLI; TensorFlow's runtime and server import
no torch.
"""
