"""The logits of a chunked LM head that the graph also returns: computed when the caller reads them, not in forward.

The chunked cross-entropy never needs the logits whole, and most training loops never read the logits a Hugging
Face model returns beside its loss; made in forward, they would be the largest value of the step (tokens x
vocabulary). So the graph returns a placeholder in their place and, last, the head's input rows; the caller gets
:class:`LazyLogits`, which computes ``rows @ weight.T`` (plus the bias, the added bias vector, the soft-cap) in the
dtype the head ran in at the first operation on it, and keeps the result. Their gradient reaches the model through
:class:`LogitsThroughHead` (eager, the head's linear by hand) only when the caller backpropagates through them (a
second loss on them, distillation): the rows' gradient then flows into the graph's backward through the rows output.

The rows and the head's parameters must hold forward's values when the logits are read: a read after an optimizer
step (or any in-place change of them) raises an error that says so, never returns other logits. Logits read during
the step take memory the plan did not count (the step's peak assumed they are never made); that is logged once.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, fx
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_map

from sublinear.core.units import format_bytes

__all__ = ["LazyLogits", "LogitsThroughHead", "ReturnedLogits", "attach_returned_logits", "return_logits_lazily"]

log = logging.getLogger("sublinear")


@dataclass(frozen=True)
class ReturnedLogits:
    """A head's logits returned as a placeholder at ``outputs`` of the graph's flat outputs, its input rows returned
    at ``rows_output``; its weight, bias and added bias vector as placeholder indices (None: none); its soft-cap;
    the dtype the linear ran in and the logits' dtype; where the head is, for messages."""

    outputs: tuple[int, ...]
    rows_output: int
    weight: int
    bias: int | None
    added_bias: int | None
    softcap: float
    linear_dtype: torch.dtype
    dtype: torch.dtype
    where: str


def return_logits_lazily(graph: fx.Graph, top: fx.Node, chain: fx.Node, rows: fx.Node,
                         parameters: tuple[fx.Node, fx.Node | None, fx.Node | None], softcap: float,
                         linear_dtype: torch.dtype, where: str) -> ReturnedLogits | None:
    """Where the head's output ``top`` is read by the loss's ``chain`` and otherwise only returned, with graph
    inputs ``parameters`` (weight, bias, added bias vector): return an empty placeholder in its place and ``rows``
    after the other outputs. What was done (None: nothing, the graph computes and returns the logits)."""
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    flat = output.args[0]
    placeholders = {n: i for i, n in enumerate(n for n in graph.nodes if n.op == "placeholder")}
    others = [user for user in top.users if user is not chain]
    if not others or any(user is not output for user in others) or not isinstance(flat, (tuple, list)) \
            or top not in flat or any(p is not None and p not in placeholders for p in parameters):
        return None
    example = top.meta["example_value"]
    with graph.inserting_before(output):
        empty = graph.call_method("new_empty", (rows, (0,)), {"dtype": example.dtype})
    with _disable_current_modes():  # compile-time work: unseen by the caller's dispatch modes (a memory tracker)
        empty.meta = {**top.meta, "example_value": example.new_empty((0,))}
    new_flat = [empty if value is top else value for value in flat] + [rows]
    output.args = (type(flat)(new_flat),)
    weight, bias, added = (placeholders.get(p) if p is not None else None for p in parameters)
    return ReturnedLogits(tuple(i for i, value in enumerate(flat) if value is top), len(new_flat) - 1, weight, bias,
                          added, softcap, linear_dtype, example.dtype, where)


def attach_returned_logits(returned: Sequence[ReturnedLogits], out: Any, values: Sequence[Any]) -> tuple[Any, list]:
    """What the caller gets of a graph's outputs ``out`` (its logits computed when read, attached to the head, the
    rows outputs left out), and every output the graph made as the caller holds it."""
    if not returned:
        return out, list(out)
    held = list(out)
    for head in returned:
        rows = held[head.rows_output]
        weight, bias, added = (values[i] if i is not None else None for i in (head.weight, head.bias, head.added_bias))
        logits = LazyLogits(head, rows, weight, bias, added)
        if torch.is_grad_enabled() and any(isinstance(t, Tensor) and t.requires_grad
                                           for t in (rows, weight, bias, added)):
            logits = LogitsThroughHead.apply(logits, rows, weight, bias, added, head.softcap)
        for i in head.outputs:  # the same logits returned twice are one tensor
            held[i] = logits
    return type(out)(held[:len(held) - len(returned)]), held


class LazyLogits(Tensor):
    """A head's logits, computed from its input rows and parameters at the first operation on them (see the module
    docstring); every operation runs on the computed logits and returns plain tensors."""

    @staticmethod
    def __new__(cls, head: ReturnedLogits, rows: Tensor, weight: Tensor, bias: Tensor | None,
                added: Tensor | None) -> LazyLogits:
        shape = (*rows.shape[:-1], weight.shape[0])
        self = Tensor._make_wrapper_subclass(cls, shape, dtype=head.dtype, device=rows.device)
        self.head, self.sources = head, (rows, weight, bias, added)
        self.versions = tuple(t._version if t is not None else None for t in self.sources)
        self.value: Tensor | None = None
        self.origin: LazyLogits | None = None  # an alias's: the logits it shares the computed value of
        return self

    def __init__(self, *args: Any) -> None:
        super().__init__()

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return repr(self.computed())

    def alias(self) -> LazyLogits:
        """The same logits, computed once for both."""
        twin = LazyLogits(self.head, *self.sources)
        twin.versions, twin.origin = self.versions, self if self.origin is None else self.origin
        return twin

    def computed(self) -> Tensor:
        """The logits, computed at the first call."""
        origin = self if self.origin is None else self.origin
        if origin.value is None:
            origin.value = _logits(self.head, *self.sources, self.versions)
        return origin.value

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def real(t: Any) -> Any:
            return t.computed() if isinstance(t, LazyLogits) else t
        return func(*tree_map(real, args), **tree_map(real, kwargs or {}))


def _logits(head: ReturnedLogits, rows: Tensor, weight: Tensor, bias: Tensor | None, added: Tensor | None,
            versions: tuple) -> Tensor:
    changed = [name for name, t, version in zip(("rows", "weight", "bias", "added bias"), (rows, weight, bias, added),
                                                 versions) if t is not None and t._version != version]
    if changed:
        raise RuntimeError(
            f"sublinear: the logits of the chunked LM head {head.where} are computed when first read, from the "
            f"head's {', '.join(changed)} as forward saw them, and those changed in place since (an optimizer step "
            "runs between the forward and this read). Read the logits before optimizer.step(), or pass "
            "SublinearMemoryConfig(chunk_lm_heads=False) to have forward compute them.")
    _say_read_once(head.where, rows.shape[:-1].numel() * weight.shape[0] * head.dtype.itemsize)
    dtype = head.linear_dtype
    with torch.no_grad(), torch.autocast(rows.device.type, enabled=False):
        logits = F.linear(rows.to(dtype), weight.to(dtype), bias.to(dtype) if bias is not None else None)
        if added is not None:
            logits = logits + added.reshape(-1)
        if head.softcap:
            logits = torch.tanh(logits / head.softcap) * head.softcap
        return logits.to(head.dtype)


def _say_read_once(where: str, nbytes: int) -> None:
    """Warn at the first read of a head's logits in this process (their size then: sequence lengths change)."""
    if where not in _READ_HEADS:
        _READ_HEADS.add(where)
        log.warning("sublinear: the logits of the chunked LM head %s were read, so they are computed now (%s here): "
                    "memory the plan did not count; a training loop that reads only the loss never makes them", where,
                    format_bytes(nbytes))


_READ_HEADS: set[str] = set()


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
        return logits.alias() if isinstance(logits, LazyLogits) else logits.detach()

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
