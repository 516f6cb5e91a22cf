"""What every rove process runs on: its event loop and task supervisor (`aio`), its
structured log and console (`logs`), its Prometheus metrics (`metrics`), and the
cgroup it lives in (`cgroups`), its temporary folders (`tempdirs`) and whether it can
write the folders it needs (`folders`).

Imports the catalogue and `rove.control.errors` only; the bus and everything above
it may import it.
"""
