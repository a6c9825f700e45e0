"""Small facts about tensors that several stages need (a leaf module: it imports nothing of sublinear's)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

__all__ = ["device_of", "stand_in_for_grad", "storage_key"]


def device_of(values: Sequence[Any]) -> torch.device:
    """The device of the first tensor among ``values`` (nested), CPU when there is none."""
    return next((t.device for t in tree_leaves(list(values)) if isinstance(t, torch.Tensor)), torch.device("cpu"))


def stand_in_for_grad(empty: torch.Tensor, requires_grad: bool, is_leaf: bool) -> torch.Tensor:
    """``empty`` (a data-less tensor) as a graph input that requires grad as the real one does. An input computed
    by earlier code (an activation of the previous graph) is not a leaf, so the graph may write into it in place, as
    it may into the real one: it stands in as a copy of a leaf (its history, like the real one's, lies outside)."""
    if not requires_grad:
        return empty
    leaf = empty.requires_grad_(True)
    return leaf if is_leaf else leaf.clone()


def storage_key(t: torch.Tensor) -> int | None:
    """The key of ``t``'s storage; None for a tensor whose storage cannot be reached (``torch.vmap``'s batched
    wrappers inside a vmap region): such a tensor is never split from the op that makes it, nor tracked apart."""
    try:
        return t.untyped_storage()._cdata
    except (NotImplementedError, RuntimeError):
        return None
