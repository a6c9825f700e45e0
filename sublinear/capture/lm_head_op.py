"""The chunked linear cross-entropy an LM head and its loss are replaced by (:mod:`sublinear.capture.lm_head`).

``sublinear::linear_cross_entropy`` takes the head's input rows (tokens x hidden), its weight and bias, the targets,
and optionally the head's logits when the step computes them anyway (the model returns them); it returns the loss
and the gradients of the loss with respect to the hidden rows, the weight and the bias. The rows are processed in
chunks: a chunk's logits (computed from the hidden rows, or read from the given logits), their log-sum-exp, the
loss and the logits' gradient, which goes at once into the hidden rows' and the weight's gradients. So no more than
two chunk-sized values (a chunk's logits and their log-softmax, which becomes the gradient in place) are held at a
time, and nothing vocabulary-sized is saved for backward: the gradients are computed in forward and backward scales
them by the loss's gradient. The FLOPs are those of the unchunked step (no recompute).

The arithmetic is that of ``F.cross_entropy(F.linear(hidden, weight, bias).to(dtype), target, ...)`` (the linear's
output soft-capped first where asked): the loss of a row is ``-log_softmax(z)[target]`` (with label smoothing ``e``,
``(1 - e)`` of it plus ``e`` times ``-mean(log_softmax(z))``), rows whose target is ``ignore_index`` count for
nothing, the mean divides by the rows that count; the logits' gradient is ``softmax(z) - (1 - e) onehot - e / V``
times the reduction's scale, cast to the weight's dtype before the matmuls, as autograd casts it back through the
upcast. The weight's and bias's gradients accumulate over chunks in float32.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from sublinear.profiling.tracking import count_inside

__all__ = ["LINEAR_CROSS_ENTROPY", "ROWS_ARGUMENT", "chunked_linear_cross_entropy", "linear_cross_entropy"]

REDUCTIONS = ("mean", "sum")
ROWS_ARGUMENT = 9  # the position of ``rows`` (tokens per chunk) among the op's arguments


@torch.library.custom_op("sublinear::linear_cross_entropy", mutates_args=())
def linear_cross_entropy(hidden: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor, logits: Tensor | None,
                         ignore_index: int, reduction: str, label_smoothing: float, dtype: torch.dtype,
                         rows: int, softcap: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(loss, d loss / d hidden, d loss / d weight, d loss / d bias (empty without a bias)); ``hidden`` is
    (tokens, hidden), ``weight`` (vocabulary, hidden), ``target`` (tokens,), ``logits`` None or (tokens,
    vocabulary, soft-capped already); ``dtype`` the logits' dtype the loss is computed in; ``rows`` the tokens per
    chunk; ``softcap``: the logits are ``softcap * tanh(linear / softcap)`` (0: the linear's output)."""
    return _implementation(hidden, weight, bias, target, logits, ignore_index, reduction, label_smoothing, dtype, rows,
                           softcap)


def _implementation(hidden: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor, logits: Tensor | None,
                    ignore_index: int, reduction: str, label_smoothing: float, dtype: torch.dtype, rows: int,
                    softcap: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    device = hidden.device.type  # the inputs come in the dtype the linear ran in (meta has no autocast)
    with torch.autocast(device, enabled=False) if device != "meta" else contextlib.nullcontext():
        return _chunked(hidden, weight, bias, target, logits, ignore_index, reduction, label_smoothing, dtype, rows,
                        softcap)


def _chunked(hidden: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor, logits: Tensor | None,
             ignore_index: int, reduction: str, label_smoothing: float, dtype: torch.dtype, rows: int,
             softcap: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    valid = target != ignore_index
    count = valid.sum()
    scale = 1.0 / count.to(torch.float32) if reduction == "mean" else torch.ones((), device=target.device)
    grad_hidden = torch.empty_like(hidden)
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    grad_bias = torch.zeros(weight.shape[0] if bias is not None else 0, dtype=torch.float32, device=weight.device)
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for start in range(0, hidden.shape[0], rows):
        chunk = slice(start, min(start + rows, hidden.shape[0]))
        keep = valid[chunk]
        # no name here holds the chunk's logits: a half-precision product dies at its cast, the cast inside
        # _logits_gradient, so a chunk's values never outlive it into the next chunk
        given = logits[chunk] if logits is not None else None
        grad = _logits_gradient(_chunk_logits(hidden[chunk], weight, bias, given, softcap).to(dtype), target[chunk],
                                keep, label_smoothing, softcap, total)
        grad = grad.to(weight.dtype)
        # each row's scale (the reduction's, 0 for an ignored row) is applied to the hidden-sized operands and
        # results of the matmuls, not to the vocabulary-wide gradient: one pass over the chunk fewer
        row_scale = (keep * scale).to(weight.dtype)[:, None]
        torch.mm(grad, weight, out=grad_hidden[chunk])
        grad_hidden[chunk].mul_(row_scale)
        scaled_rows = hidden[chunk] * row_scale
        if grad_weight.dtype == grad.dtype:
            grad_weight.addmm_(grad.t(), scaled_rows)
        else:  # a half-precision chunk's product, accumulated in float32
            grad_weight.add_(torch.mm(grad.t(), scaled_rows))
        if bias is not None:
            grad_bias.add_(torch.mm(row_scale.t(), grad)[0].to(torch.float32))
        del grad
    loss = (total * scale).to(dtype)
    return loss, grad_hidden, grad_weight.to(weight.dtype), grad_bias.to(weight.dtype)


def _logits_gradient(z: Tensor, target: Tensor, keep: Tensor, label_smoothing: float, softcap: float,
                     total: Tensor) -> Tensor:
    """The loss's gradient with respect to a chunk's logits ``z`` (before the reduction's scale), adding the
    chunk's loss to ``total``. At most two chunk-sized values are live: ``z`` and its log-softmax, which becomes the
    gradient in place."""
    picked_at = target.masked_fill(~keep, 0)[:, None]
    cap_factor = 1 - (z / softcap).square() if softcap else None  # through cap * tanh(x / cap): 1 - tanh^2
    log_probabilities = torch.log_softmax(z, dim=-1)
    vocabulary = z.shape[-1]
    del z
    loss_rows = -log_probabilities.gather(1, picked_at)[:, 0]
    if label_smoothing:
        loss_rows = (1 - label_smoothing) * loss_rows - label_smoothing * log_probabilities.mean(dim=-1)
    total += loss_rows.masked_fill(~keep, 0).sum(dtype=torch.float32)
    grad = log_probabilities.exp_()  # the softmax, in the log-probabilities' place
    del log_probabilities
    grad.scatter_add_(1, picked_at, torch.full_like(picked_at, -(1 - label_smoothing), dtype=grad.dtype))
    if label_smoothing:
        grad.sub_(label_smoothing / vocabulary)
    if cap_factor is not None:
        grad.mul_(cap_factor)
    return grad


def _chunk_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None, given: Tensor | None, softcap: float) -> Tensor:
    """A chunk's logits: ``given`` (read from the logits the model returns), or made from its hidden rows."""
    return given if given is not None else _capped(F.linear(hidden, weight, bias), softcap)


def _capped(logits: Tensor, softcap: float) -> Tensor:
    return logits if not softcap else torch.tanh(logits / softcap) * softcap


@linear_cross_entropy.register_fake
def _(hidden, weight, bias, target, logits, ignore_index, reduction, label_smoothing, dtype, rows, softcap):
    return (hidden.new_empty((), dtype=dtype), torch.empty_like(hidden), torch.empty_like(weight),
            weight.new_empty(weight.shape[0] if bias is not None else 0))


def _setup_context(ctx, inputs, output) -> None:
    _loss, grad_hidden, grad_weight, grad_bias = output
    ctx.has_bias = inputs[2] is not None
    ctx.mark_non_differentiable(grad_hidden, grad_weight, grad_bias)
    # autograd would otherwise hand backward a zero "gradient" for each of those outputs, allocated as backward
    # reaches the op and held through its recompute: as large as the weight and the hidden rows
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)


def _backward(ctx, grad_loss, *_unused):
    grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
    return (grad_hidden * grad_loss.to(grad_hidden.dtype), grad_weight * grad_loss.to(grad_weight.dtype),
            grad_bias * grad_loss.to(grad_bias.dtype) if ctx.has_bias else None,
            None, None, None, None, None, None, None, None)


linear_cross_entropy.register_autograd(_backward, setup_context=_setup_context)
LINEAR_CROSS_ENTROPY = torch.ops.sublinear.linear_cross_entropy.default  # as traced graphs call it
# a memory tracker runs the implementation, so that the op's chunks count wherever it is measured, meta included
count_inside(LINEAR_CROSS_ENTROPY, _implementation)


@register_flop_formula(torch.ops.sublinear.linear_cross_entropy)
def _flops(hidden_shape, weight_shape, _bias_shape, _target_shape, logits_shape, *_args, out_shape=None,
           **_kwargs) -> int:
    """Three products of tokens x hidden x vocabulary (the logits, unless given, and the hidden rows' and the
    weight's gradients), two FLOPs per multiply-add."""
    tokens, width = hidden_shape
    products = 2 if logits_shape is not None else 3
    return 2 * products * tokens * width * weight_shape[0]


def chunked_linear_cross_entropy(hidden: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor,
                                 logits: Tensor | None, ignore_index: int, reduction: str, label_smoothing: float,
                                 dtype: torch.dtype, rows: int, softcap: float = 0.0) -> Tensor:
    """The loss of :func:`linear_cross_entropy`, as the rewritten graph calls it."""
    return linear_cross_entropy(hidden, weight, bias, target, logits, ignore_index, reduction, label_smoothing, dtype,
                                rows, softcap)[0]
