"""A captured ``autograd.Function`` run eagerly with eager's lifetimes for what it saves.

TorchDynamo captures a user's ``autograd.Function`` as the higher-order op ``autograd_function_apply`` over two
traced bodies: ``fwd`` returns the outputs and the values backward reads, ``bwd`` takes the output gradients and
those values. torch's eager form of the op keeps those values in a closure of the backward node, so they live until
autograd frees the whole graph (the end of ``backward()``), where the user's own Function hands the tensors it
passes to ``ctx.save_for_backward`` to autograd, which frees them right after the Function's backward. Run by
:func:`apply_function`, the values the Function saved with ``ctx.save_for_backward`` (``saved_for_backward_idx``)
are saved the same way, so they also pass through saved-tensor hooks as the user's Function's do; values it kept
as ``ctx`` attributes stay with the node, as they do in eager.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

__all__ = ["AUTOGRAD_FUNCTION_APPLY", "apply_function"]

AUTOGRAD_FUNCTION_APPLY = getattr(torch.ops.higher_order, "autograd_function_apply", None)


class _CapturedFunction(torch.autograd.Function):
    """``fwd`` and ``bwd`` of a captured Function as one autograd node; ``spec``: the op's keyword arguments."""

    @staticmethod
    def forward(ctx: Any, fwd: fx.GraphModule, bwd: fx.GraphModule, spec: dict, *args: Any) -> Any:
        output, saved = fwd(*args)
        saved = tuple(saved)
        by_autograd = set(spec.get("saved_for_backward_idx", ()))
        ctx.bwd = bwd
        ctx.layout = tuple(i in by_autograd and isinstance(v, torch.Tensor) for i, v in enumerate(saved))
        ctx.kept = [None if through else v for through, v in zip(ctx.layout, saved)]
        ctx.save_for_backward(*(v for through, v in zip(ctx.layout, saved) if through))
        outputs = output if isinstance(output, (tuple, list)) else (output,)
        if spec.get("dirty_idx"):
            ctx.mark_dirty(*(outputs[i] for i in spec["dirty_idx"]))
        if spec.get("non_differentiable_idx"):
            ctx.mark_non_differentiable(*(outputs[i] for i in spec["non_differentiable_idx"]))
        return tuple(output) if isinstance(output, list) else output

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        through = iter(ctx.saved_tensors)
        saved = [next(through) if by_autograd else kept for by_autograd, kept in zip(ctx.layout, ctx.kept)]
        result = ctx.bwd(*grads, *saved)
        result = result if isinstance(result, (tuple, list)) else (result,)
        return (None, None, None, *result)


def apply_function(fwd: fx.GraphModule, bwd: fx.GraphModule, *args: Any, **spec: Any) -> Any:
    """What ``autograd_function_apply(fwd, bwd, *args, **spec)`` computes, its saved tensors freed as eager's."""
    return _CapturedFunction.apply(fwd, bwd, spec, *args)
