"""The user's ``torch.utils.checkpoint`` regions in a captured graph, inlined so that the plan decides what is
recomputed there (:func:`inline_checkpoints`)."""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx

__all__ = ["inline_checkpoints"]


def inline_checkpoints(gm: fx.GraphModule) -> None:
    """Replace, in place, each ``torch.utils.checkpoint`` region TorchDynamo captured (a
    ``tag_activation_checkpoint`` node calling a subgraph) by the subgraph's own nodes.

    The plan then decides what is recomputed there, as everywhere else, and recomputes it with the forward's random
    numbers. Run as the region itself, the region draws new random numbers when it recomputes (TorchDynamo's
    region leaves the random state to inductor, and an eager run of it does not restore it), so a dropout in it
    would get another mask in backward: wrong gradients. A region whose result is used other than by position is
    left as it is (it then runs under inductor only correctly)."""
    hop = getattr(torch.ops.higher_order, "tag_activation_checkpoint", None)
    changed = False
    for node in list(gm.graph.nodes):
        if hop is None or node.op != "call_function" or node.target is not hop:
            continue
        body = getattr(gm, node.args[0].target)
        if not all(u.op == "call_function" and u.target is operator.getitem for u in node.users):
            continue
        inline_checkpoints(body)
        values: dict[fx.Node, Any] = dict(zip([n for n in body.graph.nodes if n.op == "placeholder"], node.args[1:]))
        with gm.graph.inserting_before(node):
            for inner in body.graph.nodes:
                if inner.op == "placeholder":
                    continue
                if inner.op == "output":
                    results = fx.node.map_arg(inner.args[0], lambda n: values[n])
                    break
                if inner.op == "get_attr":
                    name = f"{node.args[0].target}_{inner.target}"
                    setattr(gm, name, getattr(body, inner.target))
                    values[inner] = gm.graph.get_attr(name)
                    continue
                values[inner] = gm.graph.node_copy(inner, lambda n: values[n])
        for user in list(node.users):
            user.replace_all_uses_with(results[user.args[1]] if isinstance(results, (tuple, list)) else results)
            gm.graph.erase_node(user)
        region = node.args[0]
        gm.graph.erase_node(node)
        if not region.users:
            gm.graph.erase_node(region)
        changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()
