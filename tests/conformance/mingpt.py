"""A minGPT-like trainer, the shape of the public minGPT DDP examples, on CPU and gloo:
a tiny causal transformer, a `Trainer` class with a `DistributedSampler`, a tqdm bar
over each epoch's batches on rank 0 (carriage returns on stderr, as in a terminal),
and one line per rank and epoch with the mean loss. Data: a character sequence the
script makes itself.

    torchrun --standalone --nproc-per-node 2 mingpt.py EPOCHS
"""

from __future__ import annotations

import math
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm

TEXT = "to be or not to be that is the question " * 40
CHARS = sorted(set(TEXT))
BLOCK = 16


class CharDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self) -> None:
        self.data = torch.tensor([CHARS.index(c) for c in TEXT])

    def __len__(self) -> int:
        return len(self.data) - BLOCK - 1

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[i : i + BLOCK + 1]
        return chunk[:-1], chunk[1:]


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        mask = torch.triu(torch.ones(BLOCK, BLOCK, dtype=torch.bool), diagonal=1)
        self.register_buffer("mask", mask)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=self.mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, dim: int = 32, layers: int = 2, heads: int = 2) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(1, BLOCK, dim))
        self.blocks = nn.Sequential(*[Block(dim, heads) for _ in range(layers)])
        self.head = nn.Linear(dim, vocab)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.tok(idx) + self.pos))


class Trainer:
    def __init__(self, model: nn.Module, data: Dataset[tuple[torch.Tensor, torch.Tensor]]):
        self.rank = int(os.environ["RANK"])
        self.model = DDP(model)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        self.sampler = DistributedSampler(data, shuffle=True, seed=0)
        self.loader = DataLoader(data, batch_size=32, sampler=self.sampler)

    def epoch(self, epoch: int) -> float:
        self.sampler.set_epoch(epoch)
        losses = []
        bar = tqdm(self.loader, desc=f"epoch {epoch}", disable=self.rank != 0, file=sys.stderr)
        for x, y in bar:
            logits = self.model(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            losses.append(loss.item())
            bar.set_postfix(loss=f"{loss.item():.3f}")
        return sum(losses) / len(losses)


def main(epochs: int) -> None:
    init_process_group(backend="gloo")
    torch.manual_seed(1337)
    trainer = Trainer(GPT(len(CHARS)), CharDataset())
    for epoch in range(epochs):
        loss = trainer.epoch(epoch)
        assert math.isfinite(loss)
        sys.stdout.write(f"[{trainer.rank}] epoch {epoch} loss {loss:.6f}\n")  # one write
        sys.stdout.flush()
    destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]))
