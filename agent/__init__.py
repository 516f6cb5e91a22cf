"""The node agent and the `rove run` launcher (a drop-in for `torchrun`).

Planned here: rendezvous client, worker processes, monitoring and restart,
failure diagnosis, network check and resource metrics. The agent talks to the
master only through events on the bus (`rove.control.bus`).
"""
