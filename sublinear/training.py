"""The training step every prediction describes: forward, then a backward from the loss while the outputs are
held. Used by the profiler (on fake tensors), the measurement helpers and the examples."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

__all__ = ["DROPPED", "GRADIENT", "HELD", "PASSED", "combined_use", "default_loss", "gradient_receivers",
           "held_to_end", "receives_gradient", "step_backward", "training_step"]

# What a call does with a graph output (see profile()): GRADIENT, held to the step's end and handed a gradient;
# PASSED, handed a gradient but let go before backward reaches the graph (logits a later graph's loss read);
# HELD, held to the step's end without a gradient (a KV cache); DROPPED, let go when the graph returned.
GRADIENT, PASSED, HELD, DROPPED = "gradient", "passed", "held", "dropped"


def receives_gradient(use: str) -> bool:
    return use in (GRADIENT, PASSED)


def held_to_end(use: str) -> bool:
    return use in (GRADIENT, HELD)


def combined_use(a: str, b: str) -> str:
    """The use that demands what ``a`` and ``b`` each demand (a gradient, the output held to the step's end)."""
    gradient, held = receives_gradient(a) or receives_gradient(b), held_to_end(a) or held_to_end(b)
    return GRADIENT if gradient and held else PASSED if gradient else HELD if held else DROPPED


def _differentiable(outputs: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(outputs)
            if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()]


def default_loss(outputs: Any) -> torch.Tensor | None:
    """A loss for examples and tests: the sum of every floating output that requires grad (None if none). Its
    gradient is one for every output element, as in :func:`step_backward`."""
    parts = [t.sum() for t in _differentiable(outputs)]
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else torch.stack(parts).sum()


class _DenseOnes(torch.autograd.Function):
    """Identity whose backward hands on a dense gradient of ones, made inside the backward: autograd frees it once
    the output's producer has used it, as it frees the gradient a loss function computes."""

    @staticmethod
    def forward(ctx, t: torch.Tensor) -> torch.Tensor:
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return torch.ones(grad.shape, dtype=grad.dtype, device=grad.device)


def step_backward(outputs: Any, receives: Sequence[bool] | None = None) -> bool:
    """The backward every prediction describes, run while ``outputs`` are held.

    ``receives[k]``: whether the k-th tensor among ``outputs`` gets a gradient (what the call that ran this graph
    did with it: a later graph read it, or the loss did). By default, when outputs that require grad include
    scalars, those are the loss the forward computed (Hugging Face models given labels) and backward starts from
    them alone; otherwise every floating output gets one. A scalar's gradient is one; any other output gets a dense
    gradient of ones, as a loss computed from it hands autograd one gradient its size. False when nothing requires
    grad."""
    leaves = [t for t in tree_leaves(outputs) if isinstance(t, torch.Tensor)]
    receives = gradient_receivers(leaves) if receives is None else receives
    parts = [t if t.dim() == 0 else _DenseOnes.apply(t).sum()
             for t in _differentiable([t for t, r in zip(leaves, receives) if r])]
    if not parts:
        return False
    (parts[0] if len(parts) == 1 else torch.stack(parts).sum()).backward()
    return True


def gradient_receivers(tensors: Sequence[torch.Tensor]) -> list[bool]:
    """Per tensor, whether :func:`step_backward`'s default hands it a gradient: the scalars that require grad when
    there are any, else every floating tensor that requires grad."""
    differentiable = [t.requires_grad and t.is_floating_point() for t in tensors]
    scalars = [d and t.dim() == 0 for t, d in zip(tensors, differentiable)]
    return scalars if any(scalars) else differentiable


def training_step(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The step every prediction describes: forward, then :func:`step_backward` while the outputs are still held
    (as ``out = model(x); loss_fn(out).backward()`` does)."""
    outputs = module(*args, **kwargs)
    step_backward(outputs)
    return outputs
