"""Small facts about tensors and torch's modes that several stages need (a leaf module: of sublinear it imports only
the torch-free core)."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
from torch._prims_common import is_non_overlapping_and_dense_or_false
from torch.utils._pytree import tree_leaves

from sublinear.core.profile import AutocastState

__all__ = ["autocast_context", "autocast_state", "device_of", "size_hint", "stand_in_for_grad", "storage_key"]

_AUTOCAST_DEVICES = ("cpu", "cuda")


def device_of(values: Sequence[Any]) -> torch.device:
    """The device of the first tensor among ``values`` (nested), CPU when there is none."""
    return next((t.device for t in tree_leaves(list(values)) if isinstance(t, torch.Tensor)), torch.device("cpu"))


def size_hint(size: int | torch.SymInt) -> int:
    """An integer size; a symbolic size (traced for every size at once) at the size it was traced at."""
    return int(size.node.hint) if isinstance(size, torch.SymInt) else int(size)


def stand_in_for_grad(empty: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``empty`` (a data-less tensor laid out as ``like``) as a graph input that requires grad as ``like`` does. An
    input computed by earlier code (an activation of the previous graph) is not a leaf, so the graph may write into
    it in place, as it may into the real one: it stands in as a copy of a leaf (its history, like the real one's, lies
    outside), with ``like``'s strides: code compiled for it asserts them. A clone of a tensor with gaps or overlaps
    (a slice of a wider one, an expanded one) is contiguous, so there the copy is of the whole storage and the stand-in
    a view of it."""
    if not like.requires_grad:
        return empty
    if like.is_leaf:
        return empty.requires_grad_(True)
    if is_non_overlapping_and_dense_or_false(like) or like.numel() == 0:
        return empty.requires_grad_(True).clone()
    extent = 1 + sum((size - 1) * stride for size, stride in zip(empty.shape, empty.stride()))
    storage = torch.empty(extent, dtype=empty.dtype, device=empty.device, requires_grad=True)
    return storage.clone().as_strided(empty.shape, empty.stride())


def storage_key(t: torch.Tensor) -> int | None:
    """The key of ``t``'s storage; None for a tensor whose storage cannot be reached (``torch.vmap``'s batched
    wrappers inside a vmap region): such a tensor is never split from the op that makes it, nor tracked apart."""
    try:
        return t.untyped_storage()._cdata
    except (NotImplementedError, RuntimeError):
        return None


def autocast_state() -> AutocastState:
    """The autocast modes in force, per device type, as plain data."""
    return tuple((d, torch.is_autocast_enabled(d), str(torch.get_autocast_dtype(d)).removeprefix("torch."))
                 for d in _AUTOCAST_DEVICES)


def autocast_context(state: AutocastState):
    """Enter the autocast modes of ``state`` (without the cast cache: a replay's inputs are fresh tensors, which the
    cache would keep alive until the outermost autocast exits)."""
    stack = contextlib.ExitStack()
    for device, enabled, dtype in state:
        if device == "cuda" and not torch.cuda.is_available():
            continue
        stack.enter_context(torch.autocast(device, dtype=getattr(torch, dtype), enabled=enabled,
                                           cache_enabled=False))
    return stack
