"""A short DDP job shaped like pytorch/examples' DDP tutorial series (multigpu_torchrun),
on CPU and gloo: a Trainer object holds the DDP model, one epoch of a random dataset,
`destroy_process_group()` at the end of `main`, and the DDP module dropped as `main`
returns. Under torch 2.13 such a job can hang on its way out (rove.agent.groups).

    rove run --standalone --nproc-per-node 2 benchmarks/ddp_tutorial.py 1
    torchrun --standalone --nproc-per-node 2 benchmarks/ddp_tutorial.py 1
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class RandomDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, size: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.data = [(torch.rand(20, generator=g), torch.rand(1, generator=g)) for _ in range(size)]

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[index]


class Trainer:
    def __init__(
        self,
        model: torch.nn.Module,
        data: DataLoader[tuple[torch.Tensor, torch.Tensor]],
        optimizer: torch.optim.Optimizer,
    ):
        self.rank = int(os.environ["LOCAL_RANK"])
        self.data = data
        self.optimizer = optimizer
        self.model = DDP(model)

    def _run_batch(self, source: torch.Tensor, targets: torch.Tensor) -> None:
        self.optimizer.zero_grad()
        loss = F.mse_loss(self.model(source), targets)
        loss.backward()  # type: ignore[no-untyped-call]
        self.optimizer.step()

    def train(self, epochs: int) -> None:
        for epoch in range(epochs):
            sampler = self.data.sampler
            assert isinstance(sampler, DistributedSampler)
            sampler.set_epoch(epoch)
            steps = 0
            for source, targets in self.data:
                self._run_batch(source, targets)
                steps += 1
            print(f"[rank {self.rank}] epoch {epoch} | steps {steps}", flush=True)


def main(epochs: int, batch_size: int) -> None:
    init_process_group(backend="gloo")
    dataset = RandomDataset(2048)
    model = torch.nn.Linear(20, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    loader = DataLoader(
        dataset, batch_size=batch_size, shuffle=False, sampler=DistributedSampler(dataset)
    )
    trainer = Trainer(model, loader, optimizer)
    trainer.train(epochs)
    destroy_process_group()
    print(f"[rank {trainer.rank}] finished", flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("epochs", type=int)
    p.add_argument("--batch-size", type=int, default=32)
    args = p.parse_args()
    main(args.epochs, args.batch_size)
