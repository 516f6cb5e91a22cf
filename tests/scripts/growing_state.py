"""Flash-saves a state every step that grows 200,000 times at step GROW_AT (6) and
shrinks back at step SHRINK_AT (10), for the test that every later step is persisted.
Saves on every rank; no collectives."""

import sys
import time

import torch

from rove.agent.progress import report
from rove.checkpoint.api import FlashCheckpointer

STEPS, GROW_AT, SHRINK_AT = 14, 6, 10
ckpt = FlashCheckpointer()
for step in range(1, STEPS + 1):
    size = 2_000_000 if GROW_AT <= step < SHRINK_AT else 10
    ckpt.save(step, {"w": torch.full((size,), float(step)), "step": step})
    report(step)
    time.sleep(0.3)  # the agent persists each step before the next
print("saved", STEPS, "steps", file=sys.stderr, flush=True)
