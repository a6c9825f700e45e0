"""Chen's long chain: ``depth`` Linear+GELU layers of one width, the model on which sqrt(n) checkpointing is
exact and where planning time grows with the op count (2,000 layers are 4,000 ops)."""

import torch.nn.functional as F
from torch import nn


class Chain(nn.Module):
    def __init__(self, depth: int = 100, width: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = F.gelu(layer(x))
        return x
