"""A job's past, as people read it: the jobs kept on this machine and which folders
to keep (`jobs`), where a job's workers' output is kept (`joblogs`), and the runs of
a job in its event stream (`runs`, for `rove events`, `rove status`, `rove goodput`).

Reads folders and the bus; imports the bus, the domain, the catalogue and
`rove.control.errors`. The CLI and the agent's launcher import it.
"""
