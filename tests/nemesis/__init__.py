"""The nemesis: faults injected into a real training job on a 3-node NATS cluster.

`world` starts the job (masters, agents, torch workers, a witness); `faults` injects
each fault and heals it; `checks` says what must hold after every run; `run` draws a
scenario's order and moments from a seed; `report` keeps the rows and prints the table
(`python -m tests.nemesis --report`). The suite runs one seed of each scenario
(`tests/nemesis/test_nemesis.py`, marker `nemesis`); `make test-nemesis` runs more.
"""
