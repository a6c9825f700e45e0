"""Matrix products keep their place in the partitioned graph (inductor's post-grad passes).

Inductor's post-grad patterns turn ``add(mm(a, b), c)`` into one library call, ``addmm(c, a, b)``, at the add.
Where ``c`` is made after the product, that moves the product to ``c``: a tied weight's gradient is the LM head's
product, made at the top of backward, plus the embedding's gradient, made at its end, so the call runs at the end
and holds ``a`` and ``b`` (the logits' gradient, tokens x vocabulary, and the hidden states) through the whole
backward instead of the product (vocabulary x hidden). Where the operands outweigh the product
(:func:`~sublinear.capture.joint.keeps_its_place`, which the profile's order follows too), the product stays where
the partitioned graph has it: before the patterns run, :class:`GuardDeferredProducts` gives it a second user (an
identity permute nothing reads), which the pattern does not match (its product has one user), and after them
:class:`DropProductGuards` removes those users again.
"""

from __future__ import annotations

import abc
from typing import Any

import torch
from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

try:
    from torch._inductor.custom_graph_pass import get_custom_graph_passes
except ImportError:  # torch 2.11 and earlier: a custom-pass setting holds one pass or None, never a list

    def get_custom_graph_passes(custom_pass: Any) -> tuple[Any, ...]:
        return () if custom_pass is None else (custom_pass,)

from sublinear.capture import joint
from sublinear.capture.joint import keeps_its_place, product_sum

__all__ = ["DropProductGuards", "GuardDeferredProducts", "product_passes"]

_GUARD = "sublinear_product_guard"


def _deferred_products(graph: fx.Graph) -> list[fx.Node]:
    """The products the post-grad pattern would move to a sum that :func:`keeps_its_place` keeps them apart from."""
    position = {node: i for i, node in enumerate(graph.nodes)}
    products = []
    for node in graph.nodes:
        total = product_sum(node)
        if total is not None and keeps_its_place(node, total, position):
            products.append(node)
    return products


class _ChainedPass(CustomGraphPass):
    """A pass that runs the user's own pass of the same config setting after its own."""

    def __init__(self, user_pass: Any = None) -> None:
        self.user_passes = get_custom_graph_passes(user_pass)

    def __call__(self, graph: fx.Graph) -> None:
        self.apply(graph)
        for user_pass in self.user_passes:
            user_pass(graph)

    @abc.abstractmethod
    def apply(self, graph: fx.Graph) -> None: ...

    def uuid(self) -> Any:
        """Inductor's cache key for the pass; None (no caching) where a user pass has none, as it would alone."""
        uuids = tuple(p.uuid() if isinstance(p, CustomGraphPass) else None for p in self.user_passes)
        return None if None in uuids else (type(self).__name__, get_hash_for_files((__file__, joint.__file__)), *uuids)


class GuardDeferredProducts(_ChainedPass):
    def apply(self, graph: fx.Graph) -> None:
        for product in _deferred_products(graph):
            with graph.inserting_after(product):
                guard = graph.call_function(torch.ops.aten.permute.default, (product, [0, 1]))
            guard.meta[_GUARD] = True
            if "val" in product.meta:
                guard.meta["val"] = product.meta["val"]


class DropProductGuards(_ChainedPass):
    def apply(self, graph: fx.Graph) -> None:
        for node in [n for n in graph.nodes if n.meta.get(_GUARD) and not n.users]:
            graph.erase_node(node)


def product_passes() -> dict[str, CustomGraphPass]:
    """The inductor settings that keep deferred products in place, chained before the user's own passes."""
    from torch._inductor import config  # noqa: PLC0415

    return {"post_grad_custom_pre_pass": GuardDeferredProducts(config.post_grad_custom_pre_pass),
            "post_grad_custom_post_pass": DropProductGuards(config.post_grad_custom_post_pass)}
