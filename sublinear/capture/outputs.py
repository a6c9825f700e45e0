"""What a graph run returned, watched without keeping it alive (:class:`GraphOutputs`)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

__all__ = ["GraphOutputs"]


@dataclass(frozen=True)
class GraphOutputs:
    """The tensors a graph run returned, in order, watched without keeping them alive: after the call,
    :meth:`alive` says which ones the caller kept (the code after a graph may drop some), and
    :attr:`alive_at_backward` which ones it still held when backward reached the graph (a loss computed from an
    output often drops the output before backward).

    A weak reference to the output tensor itself dies when the caller lets it and its views go, even while autograd
    holds its storage for backward: graphs run with saved-tensor hooks that store a detached alias.
    """

    storages: tuple[int, ...]  # storage key per tensor output
    nbytes: tuple[int, ...]
    _refs: tuple[weakref.ref, ...]
    awaits_backward: bool = False  # some output leads backward into the graph, and its arrival is watched
    _at_backward: list[tuple[bool, ...]] = field(default_factory=list, compare=False, repr=False)

    @staticmethod
    def of(outputs: Any, watch_backward: bool = False) -> GraphOutputs:
        """``watch_backward``: note, when backward first reaches any output's autograd node, which outputs are
        alive then."""
        tensors = [t for t in tree_leaves(outputs) if isinstance(t, torch.Tensor)]
        nodes = {id(t.grad_fn): t.grad_fn for t in tensors if t.grad_fn is not None} if watch_backward else {}
        watched = GraphOutputs(tuple(t.untyped_storage()._cdata for t in tensors),
                               tuple(t.untyped_storage().nbytes() for t in tensors),
                               tuple(weakref.ref(t) for t in tensors), awaits_backward=bool(nodes))
        for node in nodes.values():
            node.register_prehook(watched._backward_arrives)
        return watched

    def alive(self) -> tuple[bool, ...]:
        return tuple(ref() is not None for ref in self._refs)

    @property
    def alive_at_backward(self) -> tuple[bool, ...] | None:
        """Which outputs were alive when backward first reached the graph (None: it has not)."""
        return self._at_backward[0] if self._at_backward else None

    def _backward_arrives(self, _gradients: Any) -> None:
        if not self._at_backward:
            self._at_backward.append(self.alive())
