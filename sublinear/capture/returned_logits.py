"""The logits of a chunked LM head that the graph also returns: returned detached, their gradient attached outside.

A compiled graph's backward runs once for all its outputs, and an output no gradient reaches gets a zero gradient
(AOTAutograd materialises it): for returned logits that backward is two matmuls as large as the head's forward,
computing nothing, in every step whose loss is the chunked cross-entropy alone (Hugging Face models return the
logits beside the loss). So the graph returns the logits detached and, last, the head's input rows;
:func:`attach_returned_logits` gives the caller the logits through :class:`LogitsThroughHead`, whose backward
(eager, the head's linear by hand) runs only when the caller backpropagates through the logits themselves (a second
loss on them, distillation): then the rows' gradient flows into the graph's backward through the rows output.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, fx
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["LogitsThroughHead", "ReturnedLogits", "attach_returned_logits", "detach_returned_logits"]


@dataclass(frozen=True)
class ReturnedLogits:
    """A head's logits returned detached at ``outputs`` of the graph's flat outputs, its input rows returned at
    ``rows_output``; its weight, bias and added bias vector as placeholder indices (None: none); its soft-cap."""

    outputs: tuple[int, ...]
    rows_output: int
    weight: int
    bias: int | None
    added_bias: int | None
    softcap: float


def detach_returned_logits(graph: fx.Graph, top: fx.Node, chain: fx.Node, rows: fx.Node,
                           parameters: tuple[fx.Node, fx.Node | None, fx.Node | None],
                           softcap: float) -> tuple[fx.Node, ReturnedLogits | None]:
    """Where the head's output ``top`` is read by the loss's ``chain`` and otherwise only returned, as graph inputs
    ``parameters`` (weight, bias, added bias vector): return it detached and ``rows`` after the other outputs. The
    node the chunks should read the logits from, and what was done (None: nothing, the logits' gradient stays in
    the graph)."""
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    flat = output.args[0]
    placeholders = {n: i for i, n in enumerate(n for n in graph.nodes if n.op == "placeholder")}
    others = [user for user in top.users if user is not chain]
    if not others or any(user is not output for user in others) or not isinstance(flat, (tuple, list)) \
            or top not in flat or any(p is not None and p not in placeholders for p in parameters):
        return top, None
    with graph.inserting_after(top):
        detached = graph.call_method("detach", (top,))
    with _disable_current_modes():  # compile-time work: unseen by the caller's dispatch modes (a memory tracker)
        detached.meta = {**top.meta, "example_value": top.meta["example_value"].detach()}
    new_flat = [detached if value is top else value for value in flat] + [rows]
    output.args = (type(flat)(new_flat),)
    weight, bias, added = (placeholders.get(p) if p is not None else None for p in parameters)
    return detached, ReturnedLogits(tuple(i for i, value in enumerate(flat) if value is top), len(new_flat) - 1,
                                    weight, bias, added, softcap)


def attach_returned_logits(returned: Sequence[ReturnedLogits], out: Any, values: Sequence[Any]) -> tuple[Any, list]:
    """What the caller gets of a graph's outputs ``out`` (its logits attached to the head, the rows outputs left
    out), and every output the graph made as the caller holds it (the attached logits in place of the detached)."""
    if not returned:
        return out, list(out)
    held = list(out)
    for head in returned:
        rows = held[head.rows_output]
        weight, bias, added = (values[i] if i is not None else None for i in (head.weight, head.bias, head.added_bias))
        needs = torch.is_grad_enabled() and any(isinstance(t, Tensor) and t.requires_grad
                                                for t in (rows, weight, bias, added))
        attached: dict[int, Tensor] = {}  # the same logits returned twice are attached once
        for i in head.outputs:
            if needs:
                logits = held[i]
                if id(logits) not in attached:
                    attached[id(logits)] = LogitsThroughHead.apply(logits, rows, weight, bias, added, head.softcap)
                held[i] = attached[id(logits)]
    return type(out)(held[:len(held) - len(returned)]), held


class LogitsThroughHead(torch.autograd.Function):
    """``logits`` as made by ``rows @ weight.T + bias + added`` (soft-capped at ``softcap``), the gradient reaching
    them passed on to those inputs."""

    @staticmethod
    def forward(ctx, logits: Tensor, rows: Tensor, weight: Tensor, bias: Tensor | None, added: Tensor | None,
                softcap: float) -> Tensor:
        ctx.softcap = softcap
        ctx.bias_layouts = tuple((t.shape, t.dtype) if t is not None else None for t in (bias, added))
        ctx.dtype, ctx.vocabulary = logits.dtype, logits.shape[-1]
        ctx.save_for_backward(rows, weight, logits if softcap else None)
        return logits.detach()  # not a view: the caller may write into its logits, as into the head's output

    @staticmethod
    def backward(ctx, grad: Tensor):
        rows, weight, capped = ctx.saved_tensors
        dtype, vocabulary = ctx.dtype, ctx.vocabulary
        grad = grad.to(dtype)
        if ctx.softcap:  # through cap * tanh(x / cap): times 1 - tanh^2
            grad = grad * (1 - (capped / ctx.softcap).square())
        grad = grad.reshape(-1, vocabulary)
        needs = ctx.needs_input_grad
        grad_rows = (grad @ weight.to(dtype)).reshape(rows.shape).to(rows.dtype) if needs[1] else None
        grad_weight = (grad.t() @ rows.reshape(-1, rows.shape[-1]).to(dtype)).to(weight.dtype) if needs[2] else None
        bias_grads = [grad.sum(dim=0).reshape(layout[0]).to(layout[1]) if needs[3 + k] else None
                      for k, layout in enumerate(ctx.bias_layouts)]
        return None, grad_rows, grad_weight, *bias_grads, None
