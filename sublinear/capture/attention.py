"""Attention written out as its matrices, computed by ``F.scaled_dot_product_attention`` (:func:`fuse_attention`).

Eager attention (Hugging Face's ``attn_implementation="eager"``, hand-written transformers) makes the scores
``q @ kᵀ``, their softmax and the product with ``v``: heads x queries x keys values, made and saved for backward in
every layer, and in backward their gradients beside them. No checkpoint plan removes them: one op makes each and the
next reads it. ``F.scaled_dot_product_attention`` computes the same function in blocks of keys (the CPU and CUDA
fused kernels) and saves only a value per query for backward.

A site is ``matmul(q, k.transpose(-2, -1))``, optionally multiplied or divided by a number, optionally plus a mask
tensor, then ``softmax`` over the last dimension (in any dtype), casts, a dropout of probability 0 or not training
(which draws no random numbers), and ``matmul(·, v)``; every value between the two products is read by the next only.
It becomes ``F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=s)``: equal to float rounding, not bit
for bit (the fused kernels sum the keys in blocks; a query whose every key a mask sets to ``-inf`` gets zeros there,
NaN from the softmax). A site is left alone, and the reason recorded, when its
probabilities are read elsewhere (returned, as with ``output_attentions``), when its dropout draws random numbers
(the fused kernel would draw others), or when ``q``, ``k``, ``v`` and the result differ in dtype (autocast's mixed
precision, whose roundings the fused kernel does not repeat).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import fx

from sublinear.capture.dynamo import CapturedGraph, describe_node, module_path
from sublinear.tensors import size_hint

__all__ = ["AttentionSite", "describe_sites", "fuse_attention", "with_attention_fused"]

_MATMUL = (torch.matmul, operator.matmul)
_SOFTMAX = (F.softmax, torch.softmax)
_CASTS = ("to", "type", "float")
_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class AttentionSite:
    """An attention found in a graph: computed by ``F.scaled_dot_product_attention`` or left alone (``reason``)."""

    where: str  # the attention's module path, or its softmax node and source line
    reason: str = ""

    @property
    def fused(self) -> bool:
        return not self.reason

    def __str__(self) -> str:
        return describe_sites([self])[0]


def describe_sites(sites: Sequence[AttentionSite]) -> tuple[str, ...]:
    """One line per outcome (fused, or each reason for leaving sites alone), naming its sites."""
    by_outcome: dict[str, list[str]] = {}
    for site in sites:
        by_outcome.setdefault(site.reason, []).append(site.where)
    lines = []
    for reason, places in by_outcome.items():
        named = places[0] if len(places) == 1 else f"{len(places)} sites ({places[0]} .. {places[-1]})"
        lines.append(f"attention at {named} " + (f"left alone: {reason}" if reason
                                                 else "computed by F.scaled_dot_product_attention"))
    return tuple(lines)


@dataclass
class _Site:
    """The nodes of one attention, from the scores' product to the output product."""

    q: fx.Node
    k: fx.Node
    v: fx.Node
    mask: fx.Node | None
    scale: float
    chain: list[fx.Node]  # scores' product .. output product, in graph order
    reason: str = ""


def with_attention_fused(graph: CapturedGraph) -> CapturedGraph:
    """``graph`` with its attentions fused (:func:`fuse_attention`) in a copy of its module, and every attention
    found in ``attention``; ``graph`` itself when it has no softmax."""
    if not any(_is_softmax(n) for n in graph.graph_module.graph.nodes):
        return graph
    module = graph.copied_module()
    sites = tuple(fuse_attention(module))
    if not any(site.fused for site in sites):
        return dataclasses.replace(graph, attention=sites)
    return dataclasses.replace(graph, graph_module=module, attention=sites)


def fuse_attention(module: fx.GraphModule) -> list[AttentionSite]:
    """Every attention of ``module``'s graph, each site rewritten in place to ``F.scaled_dot_product_attention``
    unless it is left alone; the module is recompiled when one is."""
    found: list[AttentionSite] = []
    for softmax in [n for n in module.graph.nodes if _is_softmax(n)]:
        site = _match(softmax)
        if site is None:
            continue
        where = module_path(softmax) or describe_node(softmax)
        if not site.reason:
            _rewrite(module.graph, site)
        found.append(AttentionSite(where, site.reason))
    if any(site.fused for site in found):
        module.graph.lint()
        module.recompile()
    return found


def _is_softmax(node: fx.Node) -> bool:
    return (node.op == "call_function" and node.target in _SOFTMAX) or (node.op == "call_method"
                                                                      and node.target == "softmax")


def _value(node) -> torch.Tensor | None:
    value = node.meta.get("example_value") if isinstance(node, fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _argument(node: fx.Node, position: int, name: str, default=None):
    return node.args[position] if len(node.args) > position else node.kwargs.get(name, default)


def _match(softmax: fx.Node) -> _Site | None:
    """The site around ``softmax``, None when it is no attention's (its input is no product of the pattern)."""
    scores, scale, mask = _argument(softmax, 0, "input"), 1.0, None
    inward = [softmax]
    if _is_add(scores):
        chain_side, mask = _split_add(scores)
        if chain_side is None:
            return None
        inward.append(scores)
        scores = chain_side
    if _is_scaling(scores):
        inward.append(scores)
        scale = _scaling(scores)
        scores = scores.args[0]
    if not (isinstance(scores, fx.Node) and scores.op == "call_function" and scores.target in _MATMUL):
        return None
    q, kt = scores.args[:2]
    k = _transposed_last(kt)
    if k is None:
        return None
    inward.append(scores)
    outward, reason = _after_softmax(softmax)
    if outward is None:
        return None
    chain = inward[::-1] + outward
    product = chain[-1]
    site = _Site(q, k, product.args[1], mask, scale, chain)
    site.reason = reason or _refusal(site, softmax)
    return site


def _is_add(node) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in (operator.add, torch.add)


def _split_add(node: fx.Node) -> tuple[fx.Node | None, fx.Node | None]:
    """(the scores' side, the mask) of ``scores + mask``, the scores' side being the product's chain."""
    if len(node.args) != 2 or node.kwargs:
        return None, None
    a, b = node.args
    for chain_side, mask in ((a, b), (b, a)):
        if isinstance(mask, fx.Node) and isinstance(chain_side, fx.Node) and (
                _is_scaling(chain_side) or (chain_side.op == "call_function" and chain_side.target in _MATMUL)):
            return chain_side, mask
    return None, None


def _is_scaling(node) -> bool:
    return (isinstance(node, fx.Node) and node.op == "call_function"
            and node.target in (operator.mul, operator.truediv, torch.mul, torch.div)
            and len(node.args) == 2 and not node.kwargs and isinstance(node.args[1], (int, float))
            and not isinstance(node.args[1], bool) and node.args[1] != 0)


def _scaling(node: fx.Node) -> float:
    factor = float(node.args[1])
    return factor if node.target in (operator.mul, torch.mul) else 1.0 / factor


def _transposed_last(node) -> fx.Node | None:
    """``k`` of ``k.transpose(a, b)`` or ``torch.transpose(k, a, b)`` swapping its last two dimensions, else None."""
    if not isinstance(node, fx.Node) or len(node.args) != 3 or not (
            (node.op == "call_method" and node.target == "transpose")
            or (node.op == "call_function" and node.target is torch.transpose)):
        return None
    value = _value(node)
    if value is None or value.dim() < 2:
        return None
    dims = {d % value.dim() for d in node.args[1:] if isinstance(d, int)}
    return node.args[0] if dims == {value.dim() - 2, value.dim() - 1} else None


def _after_softmax(softmax: fx.Node) -> tuple[list[fx.Node] | None, str]:
    """The nodes from ``softmax`` (left out) to the output product, and why the site must be left alone ("" when
    it need not); None when no product reads the probabilities through casts and a dropout."""
    chain, node, reason = [], softmax, ""
    while True:
        users = list(node.users)
        product = next((u for u in users if u.op == "call_function" and u.target in _MATMUL and u.args[0] is node),
                       None)
        if len(users) != 1:
            if product is None:
                return None, ""
            return chain + [product], "its probabilities are read elsewhere (returned, as with output_attentions)"
        if product is not None:
            return chain + [product], reason
        node = users[0]
        if node.op == "call_method" and node.target in _CASTS:
            chain.append(node)
        elif node.op == "call_function" and node.target is F.dropout:
            chain.append(node)
            p, training = _argument(node, 1, "p", 0.5), _argument(node, 2, "training", True)
            if not isinstance(p, (int, float)) or not isinstance(training, bool):
                reason = reason or "its dropout's probability or training flag is not a constant"
            elif p > 0 and training:
                reason = reason or (f"its dropout (p={p:g}) draws random numbers, which the fused kernel would "
                                    f"draw otherwise")
        else:
            return None, ""


def _refusal(site: _Site, softmax: fx.Node) -> str:
    """Why ``site`` cannot be rewritten ("" when it can)."""
    if any(len(node.users) != 1 for node in site.chain[:site.chain.index(softmax)]):
        return "its scores are read elsewhere"
    dim = _argument(softmax, 1, "dim")
    values = [_value(n) for n in (site.q, site.k, site.v, site.chain[-1])]
    if any(v is None for v in values):
        return "its values' shapes are not known"
    q, k, v = (tuple(size_hint(d) for d in t.shape) for t in values[:3])
    if not isinstance(dim, int) or dim % len(q) != len(q) - 1:
        return f"its softmax is over dimension {dim!r}, not the keys'"
    dtype = values[0].dtype
    if len({t.dtype for t in values}) != 1 or dtype not in _FLOATS:
        return (f"its queries, keys, values and result are {', '.join(str(t.dtype) for t in values)} (mixed "
                f"precision, whose roundings the fused kernel does not repeat)")
    if not (len(q) == len(k) == len(v) >= 3 and q[:-2] == k[:-2] == v[:-2] and q[-1] == k[-1] and k[-2] == v[-2]):
        return f"its operands' shapes {q}, {k}, {v} are not one attention's"
    if site.mask is not None:
        mask = _value(site.mask)
        if mask is None or mask.dtype != dtype:
            return "its mask is not a tensor of the queries' dtype"
        scores, shape = (*q[:-1], k[-2]), tuple(size_hint(d) for d in mask.shape)
        try:
            widened = tuple(torch.broadcast_shapes(shape, scores)) != scores
        except RuntimeError:
            widened = True
        if widened:
            return f"its mask's shape {shape} does not broadcast to the scores' {scores}"
    return ""


def _rewrite(graph: fx.Graph, site: _Site) -> None:
    """``site``'s output product replaced by one fused call; the nodes it made unread are erased."""
    product = site.chain[-1]
    kwargs: dict[str, object] = {"scale": site.scale}
    if site.mask is not None:
        kwargs["attn_mask"] = site.mask
    with graph.inserting_before(product):
        fused = graph.call_function(F.scaled_dot_product_attention, (site.q, site.k, site.v), kwargs)
    fused.meta = dict(product.meta)
    product.replace_all_uses_with(fused)
    transpose = site.chain[0].args[1]
    for node in [*reversed(site.chain), transpose]:
        if not node.users:
            graph.erase_node(node)

