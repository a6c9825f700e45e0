"""A small GPT-2-style decoder-only transformer (in the style of nanoGPT).

Invariants (checked by ``tests/test_models.py``):

* Pre-LN blocks; eager causal attention whose mask comes from the
  non-persistent bool buffer ``tril`` narrowed to the sequence length, so
  position ``t`` never sees positions ``> t``.
* ``lm_head.weight`` *is* ``transformer.wte.weight`` (tied).
* ``forward(idx [B, T] long)`` returns logits ``[B, T, vocab_size]`` for
  ``T <= block_size`` and is traceable by ``torch.fx.symbolic_trace``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor, nn

__all__ = ["GPTConfig", "CausalSelfAttention", "MLP", "Block", "GPT"]


@dataclass
class GPTConfig:
    """Hyper-parameters; defaults are a ~45M-parameter GPT-2-style model."""

    vocab_size: int = 50257
    block_size: int = 1024
    n_layer: int = 6
    n_head: int = 8
    n_embd: int = 512
    dropout: float = 0.1
    bias: bool = True

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head})"
            )


class CausalSelfAttention(nn.Module):
    """Fused-QKV multi-head attention with a causal mask and eager softmax."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.head_dim = config.n_embd // config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        # [1, 1, block_size, block_size]; True where attending is allowed (j <= i).
        tril = torch.tril(torch.ones(config.block_size, config.block_size, dtype=torch.bool))
        self.register_buffer(
            "tril", tril.view(1, 1, config.block_size, config.block_size), persistent=False
        )

    def _split_heads(self, x: Tensor) -> Tensor:
        """[B, T, C] -> [B, nh, T, hd]."""
        return x.unflatten(-1, (self.n_head, self.head_dim)).transpose(1, 2)

    def forward(self, x: Tensor) -> Tensor:
        T = x.size(1)
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q = self._split_heads(q)
        k = self._split_heads(k)
        v = self._split_heads(v)

        att = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
        # tril[:, :, :T, :T]; narrow because fx cannot slice a buffer by a traced T.
        causal = torch.narrow(torch.narrow(self.tril, 2, 0, T), 3, 0, T)
        att = att.masked_fill(causal.logical_not(), float("-inf"))
        att = nn.functional.softmax(att, dim=-1)
        att = self.attn_dropout(att)
        y = torch.matmul(att, v)  # [B, nh, T, hd]
        y = y.transpose(1, 2).contiguous().flatten(2)  # [B, T, C]
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """Linear(C, 4C) -> GELU (exact) -> Linear(4C, C) -> dropout."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LN transformer block: ``x + attn(ln_1(x))`` then ``x + mlp(ln_2(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    """Token + position embeddings, dropout, ``n_layer`` blocks, final LN, tied LM head.

    Init (GPT-2): Linear/Embedding weights N(0, 0.02), biases zero, and the
    residual projections (``c_proj``) N(0, 0.02 / sqrt(2 * n_layer)).
    """

    def __init__(self, config: Optional[GPTConfig] = None) -> None:
        super().__init__()
        self.config = config = config if config is not None else GPTConfig()
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        # [block_size]; narrowed to the sequence length in forward (no arange in the graph).
        self.register_buffer("position_ids", torch.arange(config.block_size), persistent=False)

        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: Tensor) -> Tensor:
        T = idx.size(1)
        pos = torch.narrow(self.position_ids, 0, 0, T)
        tok_emb = self.transformer.wte(idx)  # [B, T, C]
        pos_emb = self.transformer.wpe(pos)  # [T, C]
        x = self.transformer.drop(tok_emb + pos_emb)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        return self.lm_head(x)
