"""The shape of pytorch/examples' DDP tutorial with snapshots (multigpu_torchrun.py),
on CPU and gloo: a Trainer with a DDP model, a DistributedSampler, a snapshot file
written every epoch and resumed from on the next run. Prints each rank's per-epoch loss
so that two launchers' runs can be compared line for line.

    LAUNCHER --nproc-per-node 2 ddp_snapshot.py EPOCHS SNAPSHOT
"""

import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def say(line):
    """One write per line: two ranks share the launcher's stdout."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class Trainer:
    def __init__(self, model, data, optimizer, snapshot_path):
        self.rank = int(os.environ["RANK"])
        self.data = data
        self.optimizer = optimizer
        self.snapshot_path = snapshot_path
        self.epochs_run = 0
        if Path(snapshot_path).exists():
            snapshot = torch.load(snapshot_path, map_location="cpu")
            model.load_state_dict(snapshot["MODEL_STATE"])
            self.epochs_run = snapshot["EPOCHS_RUN"]
            say(f"[{self.rank}] resuming from snapshot at epoch {self.epochs_run}")
        self.model = DDP(model)

    def train(self, max_epochs):
        for epoch in range(self.epochs_run, max_epochs):
            self.data.sampler.set_epoch(epoch)
            total = 0.0
            for source, targets in self.data:
                self.optimizer.zero_grad()
                loss = F.mse_loss(self.model(source), targets)
                loss.backward()
                self.optimizer.step()
                total += loss.item()
            say(f"[{self.rank}] epoch {epoch} loss {total:.6f}")
            if self.rank == 0:
                torch.save(
                    {"MODEL_STATE": self.model.module.state_dict(), "EPOCHS_RUN": epoch + 1},
                    self.snapshot_path,
                )


def main(epochs, snapshot_path):
    init_process_group(backend="gloo")
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    dataset = TensorDataset(torch.rand(256, 20, generator=g), torch.rand(256, 1, generator=g))
    model = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    data = DataLoader(dataset, batch_size=32, shuffle=False, sampler=DistributedSampler(dataset))
    Trainer(model, data, optimizer, snapshot_path).train(epochs)
    destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
