"""A training script with a bug and no `@record`: it raises while it is imported."""

import torch

raise ValueError(f"learning rate must be positive, got -0.1 (torch {torch.__version__[:1]})")
