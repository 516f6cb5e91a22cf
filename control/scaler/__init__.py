"""The scaler: applies a managed job's scale plans through a backend (local processes,
a pool of agents, Kubernetes). It reads plans from the bus and reports what it did as
events; it imports the catalogue, the bus and its backends' clients, never the agent
or the master's runtime.
"""
