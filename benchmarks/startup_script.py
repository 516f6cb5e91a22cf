"""What `benchmarks/startup.py` starts: imports torch, as a training script does, and
prints one line per rank."""

import os

import torch

print(f"rank {os.environ['RANK']} started, torch {torch.__version__}", flush=True)
