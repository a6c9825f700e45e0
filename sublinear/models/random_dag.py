"""A random DAG of pointwise, matrix, normalisation and view ops: property tests and the compiled-prediction
benchmark (benchmarks/random_dags.py) draw models from it by seed."""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["RandomDAG"]


class RandomDAG(nn.Module):
    """A random DAG of width-``w`` features: each node applies one op to one or two earlier nodes.

    The structure is plain Python data, so symbolic_trace unrolls it; ops cover matmul, pointwise, in-place,
    views, dropout, normalisation with running statistics, multi-output and reductions.
    """

    OPS = ("linear", "relu_", "gelu", "add", "mul", "dropout", "bn", "ln", "transpose", "chunk_cat", "softmax")

    def __init__(self, seed: int, nodes: int = 12, width: int = 64) -> None:
        super().__init__()
        rng = random.Random(seed)
        self.structure: list[tuple[str, int, int]] = []
        self.linears = nn.ModuleList()
        self.norms = nn.ModuleList()
        for k in range(nodes):
            op = rng.choice(self.OPS)
            a = rng.randrange(k + 1)  # node 0 is the input
            b = rng.randrange(k + 1)
            if op == "linear":
                self.linears.append(nn.Linear(width, width))
                b = len(self.linears) - 1
            elif op in ("bn", "ln"):
                self.norms.append(nn.BatchNorm1d(width) if op == "bn" else nn.LayerNorm(width))
                b = len(self.norms) - 1
            self.structure.append((op, a, b))
        self.inp = nn.Linear(width, width)
        self.drop = nn.Dropout(0.25)
        self.width = width

    def forward(self, x):
        values = [self.inp(x)]
        for op, a, b in self.structure:
            u = values[a]
            if op == "linear":
                v = self.linears[b](u)
            elif op == "relu_":
                v = (u * 1.5).relu_()
            elif op == "gelu":
                v = F.gelu(u)
            elif op == "add":
                v = u + values[b]
            elif op == "mul":
                v = u * values[b]
            elif op == "dropout":
                v = self.drop(u)
            elif op in ("bn", "ln"):
                v = self.norms[b](u)
            elif op == "transpose":
                v = u.view(u.shape[0], 2, self.width // 2).transpose(1, 2).reshape(u.shape[0], self.width)
            elif op == "chunk_cat":
                p, q = u.chunk(2, dim=1)
                v = torch.cat([q, p], dim=1)
            else:
                v = torch.softmax(u, dim=1)
            values.append(v)
        return values[-1] + values[len(values) // 2]
