"""The joint forward+backward graph AOTAutograd traces for a captured graph, as inductor's partitioner receives it.

:func:`trace_joint` runs inductor's own front end (``compile_fx``: pre-grad passes, AOTAutograd's joint trace with
inductor's decompositions, the joint-graph pattern passes) on the graph's values, real or fake, and stops at the
partitioner, before any kernel is generated. Each captured node carries its position (``node.meta["custom"]``), and
AOTAutograd copies that field to every aten node it traces from the captured node, forward and backward, so each
joint node names the captured node it comes from. Nodes a pattern pass puts in place of others carry none.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx
from torch._inductor.custom_graph_pass import CustomPartitionerFn

from sublinear.capture.dynamo import CapturedGraph
from sublinear.tensors import size_hint

__all__ = ["JointGraph", "JointTraceError", "data_inputs", "is_size_query", "keeps_its_place", "labelled_copy",
           "normalise", "origin", "product_sum", "trace_joint"]

_SIZE_QUERIES = frozenset({torch.ops.aten.sym_size.int, torch.ops.aten.sym_stride.int, torch.ops.aten.sym_numel.default,
                           torch.ops.aten.sym_storage_offset.default})
NODE_KEY = "sublinear_node"  # key of a captured node's position in node.meta["custom"]


class JointTraceError(RuntimeError):
    """AOTAutograd or inductor could not trace the graph's joint forward and backward."""


def origin(node: fx.Node) -> int | None:
    """The position of the captured node that ``node`` was traced from (None: unknown)."""
    custom = node.meta.get("custom")
    return custom.get(NODE_KEY) if isinstance(custom, dict) else None


def is_backward(node: fx.Node) -> bool:
    return node.meta.get("partitioner_tag") == "is_backward"


def labelled_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` (inductor takes ownership of what it compiles) whose nodes carry their positions."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    for i, node in enumerate(graph.nodes):
        if node.op != "output":
            node.meta["custom"] = {**(node.meta.get("custom") or {}), NODE_KEY: i}
    return fx.GraphModule(gm, graph)


def normalise(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` as the min-cut partitioner reads it: dead nodes removed and common subexpressions merged (a backward
    node that computes what a forward node already has reads the forward node instead). The partitioner does the
    same again, which changes nothing, so the nodes planned are the nodes partitioned."""
    from torch._functorch import config as functorch_config  # noqa: PLC0415
    from torch._functorch.compile_utils import fx_graph_cse  # noqa: PLC0415

    gm.graph.eliminate_dead_code()
    if functorch_config.cse:
        gm.graph = fx_graph_cse(gm.graph)
    gm.recompile()
    return gm


@dataclass
class JointGraph:
    """A joint graph: forward nodes (the operators forward runs, in order), backward nodes (in the order autograd
    would run them), the placeholders (``primals``: the captured graph's inputs in order; ``tangents``: gradients of
    the forward's outputs) and the outputs (``forward_outputs``, then a gradient or None per primal)."""

    gm: fx.GraphModule
    forward: list[fx.Node]
    backward: list[fx.Node]
    primals: list[fx.Node]
    tangents: list[fx.Node]
    forward_outputs: list[Any]
    gradients: list[Any]
    runs_with: dict[fx.Node, fx.Node] = field(default_factory=dict)  # a backward node moved to the one it runs with

    @staticmethod
    def of(gm: fx.GraphModule, num_fwd_outputs: int) -> JointGraph:
        """The joint graph's parts. A node traced in forward that no forward output (nor a write into an input)
        needs runs in backward, before its first backward reader, as the partitioner places it; so does a backward
        node placed before the first reader of a gradient (a pattern pass's replacement for a backward reads only
        forward values, and the partitioner, ordering backward as autograd runs it, computes it where first read)."""
        nodes = list(gm.graph.nodes)
        placeholders = [n for n in nodes if n.op == "placeholder"]
        operators = [n for n in nodes if n.op == "call_function"]
        outputs = list(nodes[-1].args[0])
        needed: set[fx.Node] = set()
        stack = [n for n in outputs[:num_fwd_outputs] if isinstance(n, fx.Node)]
        stack += [n for n in operators if n.meta.get("partitioner_tag") == "must_be_in_forward"]
        while stack:
            node = stack.pop()
            if node not in needed and not is_backward(node):
                needed.add(node)
                stack.extend(node.all_input_nodes)
                if not isinstance(node.meta.get("val"), torch.Tensor):  # its outputs are taken where it runs
                    stack.extend(u for u in node.users if u.target is operator.getitem)
        forward = [n for n in operators if n in needed]
        backward: list[fx.Node] = []
        placed: set[fx.Node] = set()

        def place(node: fx.Node) -> None:
            if node in placed or node in needed or node.op != "call_function":
                return
            for arg in node.all_input_nodes:
                place(arg)
            placed.add(node)
            backward.append(node)

        tangents = [n for n in placeholders if is_backward(n)]
        first = next((i for i, n in enumerate(operators) if any(is_backward(a) for a in n.all_input_nodes
                                                                     if a.op == "placeholder")), len(operators))
        for i, node in enumerate(operators):
            if is_backward(node) and (i >= first or node.target is torch.ops.aten.copy_.default):
                place(node)
        for node in outputs[num_fwd_outputs:]:  # a gradient that reads no gradient, placed last as the output is
            if isinstance(node, fx.Node):
                place(node)
        backward, runs_with = _products_at_their_sums(backward)
        return JointGraph(gm, forward, backward, [n for n in placeholders if not is_backward(n)], tangents,
                          outputs[:num_fwd_outputs], outputs[num_fwd_outputs:], runs_with)


def _products_at_their_sums(backward: list[fx.Node]) -> tuple[list[fx.Node], dict[fx.Node, fx.Node]]:
    """``backward`` in the order inductor runs it: a matrix product :func:`product_sum` makes one ``addmm`` with a
    sum runs where the sum is, so its operands are held until then, unless the sum adds a value made after the
    product and the operands outweigh it (:func:`keeps_its_place`). Returns the order and, per product moved, the sum
    it runs with."""
    position = {node: i for i, node in enumerate(backward)}
    runs_with: dict[fx.Node, fx.Node] = {}
    for node in backward:
        total = product_sum(node)
        if total is not None and total in position and not keeps_its_place(node, total, position):
            runs_with[node] = total
    order = [n for n in backward if n not in runs_with]
    for node, total in runs_with.items():
        order.insert(order.index(total), node)
    return order, runs_with


def product_sum(node: fx.Node) -> fx.Node | None:
    """The sum that inductor's post-grad pass makes one ``addmm`` with the matrix product ``node`` (None: none): the
    product's only reader adds it to a tensor of its dtype, of a shape that broadcasts to the product's. On a GPU
    the pass leaves the pair apart where only pointwise ops read the sum."""
    if node.target is not torch.ops.aten.mm.default or len(node.users) != 1:
        return None
    from torch._inductor.utils import is_gpu, is_pointwise_use  # noqa: PLC0415
    from torch._prims_common import is_expandable_to  # noqa: PLC0415

    (total,) = node.users
    if total.target is not torch.ops.aten.add.Tensor or total.kwargs or len(total.args) != 2:
        return None
    other = _addend(node, total)
    values = [a.meta.get("val") if isinstance(a, fx.Node) else None for a in (other, *node.args)]
    if other is node or not all(isinstance(v, torch.Tensor) for v in values):
        return None
    inp, mat1, mat2 = values
    if len({inp.dtype, mat1.dtype, mat2.dtype}) != 1 or not is_expandable_to(inp.shape, (mat1.shape[0], mat2.shape[1])):
        return None
    if is_gpu(inp.device.type) and all(is_pointwise_use(u) for u in total.users):
        return None
    return total


def keeps_its_place(product: fx.Node, total: fx.Node, position: dict[fx.Node, int]) -> bool:
    """Whether sublinear's compile keeps matrix product ``product`` apart from its ``total`` (see
    :mod:`sublinear.execute.compiled.products`): the sum adds a value made after the product (``position``: the
    graph's order), and the product's operands outweigh it, so that running it at the sum would hold more memory
    until then (a tied weight's gradient: the logits' gradient and the hidden states against vocabulary x hidden)."""
    other = _addend(product, total)
    if position.get(other, -1) <= position[product]:
        return False
    return sum(_nbytes(a) for a in product.args) > _nbytes(product)


def _addend(product: fx.Node, total: fx.Node) -> Any:
    return total.args[1] if total.args[0] is product else total.args[0]


def _nbytes(node: Any) -> int:
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    if not isinstance(value, torch.Tensor):
        return 0
    return size_hint(value.numel()) * value.element_size()


class _Stop(Exception):
    """Raised by the recording partitioner once it holds the joint graph: nothing after it is wanted."""


class _Recorder(CustomPartitionerFn):
    def __init__(self) -> None:
        self.joint: JointGraph | None = None

    def __call__(self, gm: fx.GraphModule, joint_inputs: Sequence[Any], **kwargs: Any):
        self.joint = JointGraph.of(normalise(gm), kwargs["num_fwd_outputs"])
        raise _Stop

    def uuid(self) -> None:
        return None  # never cached: it compiles nothing


def trace_joint(graph: CapturedGraph, values: Sequence[Any]) -> JointGraph:
    """The joint graph inductor would partition for ``graph`` called on ``values`` (real or fake tensors)."""
    from torch._inductor.compile_fx import compile_fx

    recorder = _Recorder()
    try:
        compile_fx(labelled_copy(graph.graph_module), list(values),
                   config_patches={"custom_partitioner_fn": recorder})
    except Exception as exc:  # noqa: BLE001 - the recorder's stop, or a failure to report
        if not _stopped(exc):
            raise JointTraceError(f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc) else ''}") \
                from exc
    if recorder.joint is None:
        raise JointTraceError("inductor did not partition the graph (it has no backward)")
    return recorder.joint


def _stopped(exc: BaseException | None) -> bool:
    while exc is not None:
        if isinstance(exc, _Stop):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def is_size_query(node: fx.Node) -> bool:
    """``node`` reads a tensor's sizes, strides, element count or offset, not its data. Under dynamic shapes the
    partitioner computes such a query in forward and saves the symbol, not the tensor; inductor resolves it to a
    size expression, so it runs no kernel and holds no buffer."""
    return node.target in _SIZE_QUERIES


def data_inputs(node: fx.Node) -> list[fx.Node]:
    """The nodes whose data ``node`` reads: its inputs, none for a size query."""
    return [] if is_size_query(node) else node.all_input_nodes


def is_view(node: fx.Node) -> bool:
    """``node``'s value shares its input's storage (a view op, or an element of a view op's outputs)."""
    target = node.target
    if target is operator.getitem:
        parent = node.args[0]
        return isinstance(parent, fx.Node) and is_view(parent)
    return isinstance(target, torch._ops.OpOverload) and target.is_view
