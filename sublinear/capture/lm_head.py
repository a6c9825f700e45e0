"""LM heads and their losses in a captured graph, computed in chunks (:func:`chunk_lm_heads`).

A head is a linear (tokens x hidden -> tokens x vocabulary), its output soft-capped (``cap * tanh(logits / cap)``,
Gemma 2) or a bias vector added (BART's ``final_logits_bias``) or neither, whose output reaches ``F.cross_entropy``
through ops that only regroup or select its rows or change its dtype: views and reshapes that keep the last
dimension, row slices (the label shift of older Hugging Face code), ``contiguous``, ``float`` / ``to(dtype)`` (the
upcast). The cross-entropy is replaced by :func:`~sublinear.capture.lm_head_op.linear_cross_entropy` on the linear's
input rows, selected and regrouped as the logits were: its chunks never hold more than a chunk of tokens x vocabulary
values, and nothing vocabulary-sized is saved for backward. When the graph only returns the logits beside (the
model returns them), forward never makes them: the caller gets logits computed when first read, their gradient
attached outside the graph (:mod:`sublinear.capture.returned_logits`). When the graph reads them otherwise, the linear
still computes them and the chunks read them, so they are not computed twice.

A cross-entropy is left alone, and the reason recorded, when its input is not such a head, when it has class
weights, ``reduction="none"`` or class-probability targets, or when the vocabulary is no larger than the hidden size
(a classifier, where chunking saves nothing).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import fx

from sublinear.capture.dynamo import CapturedGraph, describe_node, module_path
from sublinear.capture.lm_head_op import LINEAR_CROSS_ENTROPY, REDUCTIONS, ROWS_ARGUMENT, chunked_linear_cross_entropy
from sublinear.capture.returned_logits import ReturnedLogits, return_logits_lazily
from sublinear.profiling.tracking import inside_peak
from sublinear.tensors import size_hint

__all__ = ["LMHead", "chunk_lm_heads", "device_type", "with_chunk_rows", "with_lm_heads_chunked"]

_CROSS_ENTROPY = (F.cross_entropy,)
_LINEAR = (F.linear, torch._C._nn.linear)
_REGROUP = ("view", "reshape", "flatten")
_SAME_VALUES = ("contiguous",)
_DTYPE = ("float", "to", "type")
_CE_SIGNATURE = inspect.signature(F.cross_entropy)
ROW_MULTIPLE = 8  # chunks of whole multiples of 8 rows keep the matmuls aligned
CHUNKING_COST = 0.05  # the most time chunking may add to the head's matrix products
FlopsPerByte = Callable[[int], float]  # a device's matrix-product FLOPs per byte moved, by operand itemsize


def chunk_rows(tokens: int, itemsize: int, flops_per_byte: float) -> int:
    """Tokens per chunk: the fewest (in whole multiples of 8 rows) whose chunking adds at most ``CHUNKING_COST`` of
    the head's matrix products' time on a device doing ``flops_per_byte`` FLOPs in the time it moves a byte. A chunk
    of ``r`` rows does ``6 r x hidden x vocabulary`` FLOPs (its logits, the hidden rows' gradient, the weight's) and
    reads the weight twice (``itemsize`` bytes a value) and the float32 weight gradient it adds into once each way:
    ``(2 itemsize + 8) x hidden x vocabulary`` bytes whatever ``r``. Fewer rows hold less (two chunks of logits at
    a time) and pass over the weight more often."""
    rows = (2 * itemsize + 8) * flops_per_byte / (6 * CHUNKING_COST)
    return min(tokens, max(ROW_MULTIPLE, math.ceil(rows / ROW_MULTIPLE) * ROW_MULTIPLE))


@dataclass(frozen=True)
class LMHead:
    """A cross-entropy found in a graph: chunked (``rows`` tokens per chunk) or left alone (``reason``)."""

    where: str  # the head's module path, or the cross-entropy's node and source line
    vocabulary: int = 0
    hidden: int = 0
    tokens: int = 0
    rows: int = 0
    reads_logits: bool = False  # the chunks read the logits the step computes anyway
    softcap: float = 0.0  # logits soft-capped as cap * tanh(logits / cap) (0: none)
    reason: str = ""
    returned: ReturnedLogits | None = None  # the logits the graph returns, detached, their gradient attached outside
    # the chunked op's arguments, each tensor as its dtype (its shape follows from the sizes above)
    arguments: tuple = field(default=(), compare=False, repr=False)
    # the token count as an expression of the graph's symbolic sizes, in TorchDynamo's names ("": fixed)
    token_expression: str = ""

    @property
    def chunked(self) -> bool:
        return not self.reason

    def scratch(self, rows: int, tokens: int | None = None) -> int:
        """The bytes the chunked op holds inside its call beyond its results, in chunks of ``rows`` tokens, over
        ``tokens`` tokens (None: the head's at capture)."""
        tokens = self.tokens if tokens is None else tokens
        shapes = ((tokens, self.hidden), (self.vocabulary, self.hidden), (self.vocabulary,), (tokens,),
                  (tokens, self.vocabulary))
        arguments = [torch.empty(shapes[k], dtype=a, device="meta") if isinstance(a, torch.dtype) and k < len(shapes)
                     else a for k, a in enumerate(self.arguments)]
        arguments[ROWS_ARGUMENT] = rows
        return inside_peak(LINEAR_CROSS_ENTROPY, arguments)

    def __str__(self) -> str:
        if not self.chunked:
            return f"cross-entropy at {self.where} left alone: {self.reason}"
        source = "reading the logits the step computes anyway" if self.reads_logits else \
            "computing each chunk's logits" + (", the logits the model returns computed only if read"
                                               if self.returned is not None else "")
        capped = f", soft-capped at {self.softcap:g}" if self.softcap else ""
        return (f"LM head {self.where} (vocabulary {self.vocabulary:,}, hidden {self.hidden}{capped}) and its "
                f"cross-entropy computed in chunks of {self.rows} of {self.tokens} tokens, {source}")


def with_lm_heads_chunked(graph: CapturedGraph, flops_per_byte: FlopsPerByte) -> CapturedGraph:
    """``graph`` with its LM heads' cross-entropies chunked (:func:`chunk_lm_heads`) in a copy of its module, and
    every cross-entropy found in ``lm_heads``; ``graph`` itself when it has no cross-entropy."""
    if not any(n.op == "call_function" and n.target in _CROSS_ENTROPY for n in graph.graph_module.graph.nodes):
        return graph
    module = graph.copied_module()
    heads = chunk_lm_heads(module, flops_per_byte)
    if not any(head.chunked for head in heads):
        return dataclasses.replace(graph, lm_heads=tuple(heads))
    return dataclasses.replace(graph, graph_module=module, lm_heads=tuple(heads),
                               returned_logits=tuple(head.returned for head in heads if head.returned is not None))


def with_chunk_rows(graph: CapturedGraph, rows: Sequence[int]) -> CapturedGraph:
    """``graph`` with its chunked heads computed in chunks of ``rows`` tokens (one count per chunked head, in graph
    order), in a copy of its module; its ``code`` is kept (the graph computes the same values)."""
    module = graph.copied_module()
    calls = [n for n in module.graph.nodes if n.op == "call_function" and n.target is chunked_linear_cross_entropy]
    chunked = [k for k, head in enumerate(graph.lm_heads) if head.chunked]
    if len(calls) != len(rows) or len(chunked) != len(rows):
        raise ValueError(f"{len(rows)} chunk sizes for a graph of {len(calls)} chunked LM heads")
    for call, count in zip(calls, rows):
        call.update_arg(ROWS_ARGUMENT, int(count))
    module.recompile()
    heads = list(graph.lm_heads)
    for k, count in zip(chunked, rows):
        heads[k] = dataclasses.replace(heads[k], rows=int(count))
    return dataclasses.replace(graph, graph_module=module, lm_heads=tuple(heads))


def device_type(graph: CapturedGraph) -> str:
    """The device type the graph's tensors are on (the model's, for a data-less capture)."""
    if graph.model_device:
        return torch.device(graph.model_device).type
    for node in graph.graph_module.graph.nodes:
        value = _value(node) if node.op == "placeholder" else None
        if value is not None:
            return value.device.type
    return "cpu"


def chunk_lm_heads(gm: fx.GraphModule, flops_per_byte: FlopsPerByte) -> list[LMHead]:
    """Replace, in place, each LM head's cross-entropy in ``gm`` by its chunked form, in chunks of
    :func:`chunk_rows` on a device doing ``flops_per_byte(itemsize)`` FLOPs of a matrix product on operands of
    ``itemsize`` bytes in the time it moves a byte; every cross-entropy found, chunked or left alone with its
    reason."""
    found = []
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in _CROSS_ENTROPY:
            found.append(_chunk(gm.graph, node, flops_per_byte))
    if any(head.chunked for head in found):
        gm.graph.lint()
        gm.recompile()
    return found


def _chunk(graph: fx.Graph, node: fx.Node, flops_per_byte: FlopsPerByte) -> LMHead:
    where = describe_node(node)
    bound = _CE_SIGNATURE.bind(*node.args, **node.kwargs)
    bound.apply_defaults()
    options = bound.arguments
    logits, target = options["input"], options["target"]
    if options["weight"] is not None or options["size_average"] is not None or options["reduce"] is not None:
        return LMHead(where, reason="class weights or the legacy size_average/reduce arguments")
    if options["reduction"] not in REDUCTIONS:
        return LMHead(where, reason=f"reduction={options['reduction']!r} (a loss per token)")
    if not isinstance(options["label_smoothing"], (int, float)) or not isinstance(options["ignore_index"], int):
        return LMHead(where, reason="label_smoothing or ignore_index is not a constant")
    value, target_value = _value(logits), _value(target)
    if value is None or target_value is None or value.dim() != 2 or target_value.dim() != 1 or \
            target_value.is_floating_point():
        return LMHead(where, reason="not (tokens, classes) logits with class-index targets")
    chain = _chain_to_head(logits)
    if isinstance(chain, str):
        return LMHead(where, reason=chain)
    head, steps = chain
    top = head.nodes[0]
    hidden, weight, bias = _linear_arguments(head.linear)
    vocabulary, width = (int(d) for d in _value(weight).shape)
    if vocabulary <= width:
        return LMHead(where, reason=f"{vocabulary} classes, no more than the hidden size {width}: nothing to save")
    tokens = size_hint(value.shape[0])
    if tokens < 2 * width:
        return LMHead(where, reason=f"{tokens} tokens, fewer than twice the hidden size {width}: the weight's "
                                    "gradient, computed in forward, would hold about as much as the logits")
    linear_dtype = _value(head.linear).dtype  # the dtype the product runs in (autocast's, under autocast)
    itemsize = linear_dtype.itemsize
    rows = chunk_rows(tokens, itemsize, flops_per_byte(itemsize))
    returned = return_logits_lazily(graph, top, steps[0] if steps else node, hidden, (weight, bias, head.added_bias),
                                    head.softcap, linear_dtype, _where(head.linear))
    reads_logits = returned is None and len(top.users) > 1 and all(s.target != operator.getitem for s in steps)
    with graph.inserting_before(node):
        rows_in, weight_in, bias_in = _head_inputs(graph, head, hidden, weight, bias, steps, width)
        logits_in = _replay(graph, top, steps, vocabulary) if reads_logits else None
        loss = graph.call_function(chunked_linear_cross_entropy, (
            rows_in, weight_in, bias_in, target, logits_in, options["ignore_index"], options["reduction"],
            float(options["label_smoothing"]), value.dtype, rows, head.softcap))
    loss.meta = dict(node.meta)
    # each tensor argument (hidden rows, weight, bias, targets, logits) as its dtype; a tensor held here would count
    # in a step measured on meta, and be held beside it
    arguments = tuple((target_value.dtype if k == 3 else linear_dtype) if isinstance(a, fx.Node) else a
                      for k, a in enumerate(loss.args))
    token_expression = str(value.shape[0].node.expr) if isinstance(value.shape[0], torch.SymInt) else ""
    node.replace_all_uses_with(loss)
    for dead in [node, *reversed(steps), *head.nodes]:  # the loss, the steps, the head's nodes, outermost first
        if not dead.users:
            graph.erase_node(dead)
    return LMHead(_where(head.linear), vocabulary, width, tokens, rows, reads_logits, head.softcap, returned=returned,
                  arguments=arguments, token_expression=token_expression)


@dataclass(frozen=True)
class _Head:
    """A head's nodes, outermost first, ending at its linear; its soft-cap (0: none) and a bias vector added to the
    linear's output (Hugging Face BART's ``final_logits_bias``)."""

    nodes: tuple[fx.Node, ...]
    softcap: float = 0.0
    added_bias: fx.Node | None = None

    @property
    def linear(self) -> fx.Node:
        return self.nodes[-1]


def _head_at(node: fx.Node) -> _Head | None:
    """The head whose output is ``node``: a linear, ``cap * tanh(linear / cap)`` (Gemma 2's logit soft-capping) or
    ``linear + vector``, each node read by the next alone; else None."""
    if _is_linear(node):
        return _Head((node,))
    if node.op != "call_function" or len(node.args) != 2:
        return None
    if node.target is operator.add:
        linear, vector = node.args if _is_linear(node.args[0]) else node.args[::-1]
        value = _value(vector)
        if _is_linear(linear) and len(linear.users) == 1 and value is not None and \
                value.shape[-1:] == _value(linear).shape[-1:] and value.numel() == value.shape[-1]:
            return _Head((node, linear), added_bias=vector)
        return None
    tanh, cap = node.args
    if not (node.target is operator.mul and isinstance(cap, (int, float)) and isinstance(tanh, fx.Node)
            and len(tanh.users) == 1 and (tanh.target is torch.tanh or tanh.target == "tanh")):
        return None
    divide = tanh.args[0]
    if not (isinstance(divide, fx.Node) and divide.target is operator.truediv and len(divide.users) == 1
            and divide.args[1] == cap and _is_linear(divide.args[0]) and len(divide.args[0].users) == 1):
        return None
    return _Head((node, tanh, divide, divide.args[0]), softcap=float(cap))


def _is_linear(node) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in _LINEAR


def _head_inputs(graph: fx.Graph, head: _Head, hidden: fx.Node, weight: fx.Node, bias: fx.Node | None,
                 steps: list[fx.Node], width: int) -> tuple[fx.Node, fx.Node, fx.Node | None]:
    """The op's hidden rows (selected and regrouped as the logits were), weight and bias (the linear's and the added
    vector's), in the dtype the linear ran in (under autocast, not the inputs')."""
    rows = _replay(graph, hidden, steps, width)
    if head.added_bias is not None:
        added = graph.call_method("reshape", (head.added_bias, -1))
        bias = added if bias is None else graph.call_function(operator.add, (bias, added))
    dtype = _value(head.linear).dtype

    def cast(node: fx.Node | None, source: fx.Node | None) -> fx.Node | None:
        value = _value(source)
        return graph.call_method("to", (node, dtype)) if node is not None and (value is None or value.dtype != dtype) \
            else node

    return cast(rows, hidden), cast(weight, weight), cast(bias, bias if head.added_bias is None else None)


def _chain_to_head(node: fx.Node) -> tuple[_Head, list[fx.Node]] | str:
    """The head ``node`` comes from (a linear, soft-capped or with a bias vector added), and the row-wise steps from
    it to ``node`` (in order); or why there is none. Every step but the head has ``node``'s chain as its only user."""
    steps = []
    while (head := _head_at(node)) is None:
        if node.op == "placeholder":
            return "the logits are an input of this graph (a graph break between the head and its loss)"
        if not _row_wise(node):
            return f"its input comes from {node.op} {getattr(node.target, '__name__', node.target)}, not an LM head"
        if len(node.users) > 1:
            return f"the logits' {node.name} is used elsewhere too"
        steps.append(node)
        node = node.args[0]
        if not isinstance(node, fx.Node):
            return "its input is not a tensor of the graph"
    return head, steps[::-1]


def _row_wise(node: fx.Node) -> bool:
    """Whether ``node`` keeps each row's values (the last dimension) and only regroups, selects or casts rows."""
    value, source = _value(node), _value(node.args[0]) if node.args and isinstance(node.args[0], fx.Node) else None
    if value is None or source is None or value.dim() == 0 or source.dim() == 0:
        return False
    if value.shape[-1] != source.shape[-1]:
        return False
    if node.op == "call_method" and node.target in (*_REGROUP, *_SAME_VALUES):
        return True
    if node.op == "call_method" and node.target in _DTYPE:
        return value.is_floating_point() and value.device == source.device
    if node.op == "call_function" and node.target is operator.getitem:
        index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
        if not all(isinstance(i, slice) or i is Ellipsis for i in index):
            return False
        covers_last = Ellipsis in index or len(index) == source.dim()
        return not covers_last or index[-1] == slice(None)
    return False


def _replay(graph: fx.Graph, base: fx.Node, steps: list[fx.Node], width: int) -> fx.Node:
    """``base`` (rows of ``width`` values) regrouped and selected as ``steps`` did to the logits, as
    (tokens, width)."""
    node = base
    for step in steps:
        if step.target is operator.getitem:
            node = graph.call_function(operator.getitem, (node, step.args[1]))
        elif step.target in _REGROUP and step.target != "flatten":
            node = graph.call_method("reshape", (node, *_with_last(step.args[1:], width)))
        elif step.target == "flatten":
            node = graph.call_method("flatten", (node, *step.args[1:]), dict(step.kwargs))
    return graph.call_method("reshape", (node, -1, width))


def _with_last(shape: tuple, width: int) -> tuple:
    """A view's shape arguments with the last dimension (the vocabulary) made ``width``."""
    if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
        return (tuple(_with_last(tuple(shape[0]), width)),)
    return (*shape[:-1], width) if shape else shape


def _linear_arguments(linear: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node | None]:
    args = list(linear.args) + [None] * (3 - len(linear.args))
    return args[0], linear.kwargs.get("weight", args[1]), linear.kwargs.get("bias", args[2])


def _value(node) -> torch.Tensor | None:
    value = node.meta.get("example_value") if isinstance(node, fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _where(node: fx.Node) -> str:
    return module_path(node) or describe_node(node)
