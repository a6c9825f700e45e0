"""The joint graph's forward as ops and storages: forward nodes grouped into ops, the storages forward makes
(channels-last copies of convolution inputs included), and who reads each storage: later ops, the graph's outputs
and the backward ranks (per backward node, the op whose backward it runs in).
"""

from __future__ import annotations

import bisect
import functools
import operator
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import fx
from torch.utils._pytree import tree_leaves

from sublinear.capture.dynamo import INPUT, CapturedGraph
from sublinear.capture.joint import JointGraph, data_inputs, is_size_query, is_view, origin
from sublinear.profiling.compiled_nodes import (
    CONVOLUTION_OPS, InductorKinds, communicates, draws_random, storage_key_of, tensor_leaves, writes_input,
)
from sublinear.tensors import size_hint as hint
from sublinear.training import DROPPED, GRADIENT, HELD, combined_use, gradient_receivers

# --- Ops -----------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class OpGrouping:
    """Forward nodes grouped into ops: per op its node positions and the captured node it comes from, and why an op
    is pinned."""

    nodes: list[list[int]]
    origins: list[int | None]
    pinned: dict[int, str]
    op_of_node: dict[int, int]

    @functools.cached_property
    def _labelled(self) -> tuple[list[int], list[int]]:
        """The captured node of every op that has one, ascending, and those ops."""
        pairs = [(o, op) for op, o in enumerate(self.origins) if o is not None]
        return [o for o, _ in pairs], [op for _, op in pairs]

    def op_of_origin(self, orig: int | None) -> int | None:
        """The op a captured node's forward runs in: its own, or for a node a pattern pass replaced, the op just
        before the first op of a later captured node (where the replacement runs)."""
        origins, ops = self._labelled
        if orig is None or not origins:
            return None
        k = bisect.bisect_right(origins, orig)
        if k and origins[k - 1] == orig:
            return ops[k - 1]
        return ops[k] - 1 if k < len(ops) else len(self.nodes) - 1


def group_ops(fw: list[fx.Node], kinds: InductorKinds) -> OpGrouping:
    """Runs of forward nodes from one captured node; random and state-writing nodes alone, pinned. A run is split
    where a reduction starts (:func:`_reduction_size`) and where the small values after it end, so that a plan can
    keep a normalisation's or softmax's statistics and recompute only the pointwise part, which inductor fuses into
    the backward kernel that reads it, instead of re-running the reduction over its whole input; and a library
    kernel with its views is an op apart (:func:`_beside_library`)."""
    nodes: list[list[int]] = []
    origins: list[int | None] = []
    pinned: dict[int, str] = {}
    previous = ""  # why the previous node was pinned ("": it was not)
    small = 0  # > 0: the current op holds a reduction's values, each at most this many elements
    for i, node in enumerate(fw):
        o = origin(node)
        pin = (f"{node.name} draws random numbers" if draws_random(node) else
               f"{node.name} communicates" if communicates(node) else
               "writes into the graph's inputs (BatchNorm's running statistics)" if writes_input(node) else "")
        joins = nodes and (pin == previous if pin else
                           not previous and (o == origins[-1] or o is None and origins[-1] is None))
        reduced = 0 if pin else _reduction_size(node, kinds)
        if joins and not pin:
            elements = _elements(node)
            joins = ((elements <= small or is_view(node)) if small else not reduced) and \
                not _beside_library(fw, nodes[-1], node, kinds)
        if not joins or (pin and draws_random(node)):
            nodes.append([])
            origins.append(o)
            small = 0
        if reduced and (small or not nodes[-1]):
            small = max(small, reduced)
        nodes[-1].append(i)
        previous = pin
        if pin:
            pinned[len(nodes) - 1] = pin
    return OpGrouping(nodes, origins, pinned, {i: o for o, members in enumerate(nodes) for i in members})


def _beside_library(fw: list[fx.Node], members: list[int], node: fx.Node, kinds: InductorKinds) -> bool:
    """Whether ``node`` starts an op of its own beside a library kernel: it is one and the op computes values before
    it, or the op holds one and ``node`` computes a value (:func:`_computes_nothing` is false). Inductor runs a
    library kernel alone and fuses the pointwise values around it into other kernels, so a plan must be able to
    keep or recompute those values (a scaled query, a dropout mask) without re-running the library kernel, and the
    kernel's result (a product read through a later sum) without recomputing the values made from it."""
    if kinds.extern(node):
        return not all(_computes_nothing(fw[i]) for i in members)
    return not _computes_nothing(node) and any(kinds.extern(fw[i]) for i in members)


def _computes_nothing(node: fx.Node) -> bool:
    """``node`` makes no tensor (a size or its arithmetic), is a view or an element of a node's outputs."""
    return is_view(node) or node.target is operator.getitem or not tensor_leaves(node.meta.get("val"))


REDUCTION_RATIO = 8  # a reduction's largest input has at least this many times the elements of its largest output


def _elements(node: fx.Node) -> int:
    return max((hint(t.numel()) for t in tensor_leaves(node.meta.get("val"))), default=0)


def _reduction_size(node: fx.Node, kinds: InductorKinds) -> int:
    """The elements of the largest value ``node`` makes when it is a reduction inductor computes in its own kernels
    (an aten op, not a library call, not a view) over an input of :data:`REDUCTION_RATIO` times as many; else 0."""
    if not isinstance(node.target, torch._ops.OpOverload) or is_view(node) or kinds.fusible(node) or kinds.extern(node):
        return 0
    made = _elements(node)
    read = max((_elements(arg) for arg in node.all_input_nodes), default=0)
    return made if 0 < made * REDUCTION_RATIO <= read else 0


# --- Storages ------------------------------------------------------------------------------------------------------

@dataclass
class StepStorages:
    """The step's storages by key: state (the primals': parameters, buffers, inputs), and what forward produces
    (with the node producing it) including the channels-last copies inductor makes for convolutions (negated
    keys of the primal they copy)."""

    state: dict[int, tuple[str, int]]
    produced_by: dict[int, int]
    size_of: dict[int, int]
    node_keys: dict[fx.Node, list[int]]
    layout_copies: dict[int, tuple[int, int]]

    def keys_of(self, node: fx.Node) -> list[int]:
        if node in self.node_keys:
            return self.node_keys[node]
        return [storage_key_of(t) for t in tensor_leaves(node.meta.get("val"))]

    def read_keys(self, node: fx.Node, arg: fx.Node) -> list[int]:
        """The storages ``node`` reads through ``arg``: a convolution reads the layout copy of a primal."""
        keys = self.keys_of(arg)
        if node.target in CONVOLUTION_OPS:
            keys = [-key if -key in self.layout_copies else key for key in keys]
        return keys


def step_storages(joint: JointGraph, graph: CapturedGraph, fw: list[fx.Node], granule: int,
                  channels_last: bool) -> StepStorages:
    """The primals' storages (state) and those ``fw`` produces, sizes rounded up to ``granule``; with
    ``channels_last``, the layout copies of the primals convolutions read too."""
    def rounded(nbytes: int) -> int:
        return -(-nbytes // granule) * granule

    state: dict[int, tuple[str, int]] = {}
    for k, node in enumerate(joint.primals):
        kind = graph.kinds[k] if k < len(graph.kinds) else INPUT
        for t in tensor_leaves(node.meta.get("val")):
            state.setdefault(storage_key_of(t), (kind, rounded(hint(t.untyped_storage().nbytes()))))
    produced_by: dict[int, int] = {}
    size_of: dict[int, int] = {}
    node_keys: dict[fx.Node, list[int]] = {}
    for i, node in enumerate(fw):
        leaves = tensor_leaves(node.meta.get("val"))
        base = node.args[0] if is_view(node) and node.args and isinstance(node.args[0], fx.Node) else None
        if base is not None and len(node_keys.get(base, ())) == 1:
            # a view is its base's storage, whatever storage its traced value was given (an expand of a softmax's
            # output, traced apart from it, made a phantom copy that backward seemed to read)
            node_keys[node] = node_keys[base] * len(leaves)
            continue
        keys = []
        for t in leaves:
            key = storage_key_of(t)
            keys.append(key)
            if key not in state and key not in produced_by:
                produced_by[key] = i
                size_of[key] = rounded(hint(t.untyped_storage().nbytes()))
        node_keys[node] = keys
    found = StepStorages(state, produced_by, size_of, node_keys, {})
    if channels_last:
        found.layout_copies = _layout_copies(fw, found)
        for key, (i, nbytes) in found.layout_copies.items():
            produced_by[key] = i
            size_of[key] = rounded(nbytes)
    return found


def _layout_copies(fw: list[fx.Node], storages: StepStorages) -> dict[int, tuple[int, int]]:
    """Per primal storage a forward convolution reads in a layout other than channels-last: (where the copy is
    made, the copy's bytes), keyed by the negated storage key. Inductor makes every such copy in the forward's
    first kernel (they read nothing else, and it fuses them together)."""
    copies: dict[int, tuple[int, int]] = {}
    for node in fw:
        if node.target is not torch.ops.aten.convolution.default:
            continue
        for arg in node.args[:2]:
            value = arg.meta.get("val") if isinstance(arg, fx.Node) else None
            if not isinstance(value, torch.Tensor) or value.dim() != 4 or \
                    value.is_contiguous(memory_format=torch.channels_last):
                continue
            for key in storages.keys_of(arg):
                if key in storages.state and -key not in copies:
                    copies[-key] = (0, hint(value.numel()) * value.element_size())
    return copies


# --- Reads: forward readers, outputs, backward ranks and saves -----------------------------------------------------

@dataclass
class StorageReads:
    """Per storage: the ops that read it (backward ranks count as readers of the op they run in), whether a
    library kernel reads it (it needs a buffer), what the call does with it when the graph returns it, the ranks
    whose backward reads it and the last backward node that does; per backward node its rank."""

    readers: dict[int, set[int]]
    needs_buffer: set[int]
    output_use: dict[int, str]
    saved_at: dict[int, set[int]]
    last_backward_read: dict[int, int]
    rank_of_backward: list[int]
    uses: tuple[str, ...]
    output_keys: tuple[int, ...]  # per tensor output, the storage forward made for it (-1: none)
    # those of ``needs_buffer`` that a library kernel other than a random op reads: random ops are never re-run, so
    # a value only they read among library kernels (aten's dropout under inductor's fallback_random) is no buffer
    # where backward re-runs the op making it
    rerun_needs_buffer: set[int]

    def release_nodes(self) -> dict[int, int]:
        """Per rank: its last backward node that reads a forward value for the last time; after it, the rank's
        backward holds none of what it read last."""
        last: dict[int, int] = {}
        for k in self.last_backward_read.values():
            last[self.rank_of_backward[k]] = max(last.get(self.rank_of_backward[k], -1), k)
        return last


def storage_reads(joint: JointGraph, graph: CapturedGraph, grouping: OpGrouping, storages: StepStorages,
                  kinds: InductorKinds, uses: Sequence[str] | None) -> StorageReads:
    """Who reads each storage forward produces: later ops, library kernels, the call (per output ``uses``; None:
    as the eager profile's step) and the backward ranks."""
    fw, bw, op_of_node = joint.forward, joint.backward, grouping.op_of_node
    n_ops = len(grouping.nodes)
    produced = storages.produced_by
    readers: dict[int, set[int]] = defaultdict(set)
    needs_buffer: set[int] = set()
    rerun_needs_buffer: set[int] = set()
    for i, node in enumerate(fw):
        for arg in data_inputs(node):
            for key in storages.read_keys(node, arg):
                if key in produced:
                    readers[key].add(op_of_node[i])
                    if kinds.extern(node):
                        needs_buffer.add(key)
                        if not draws_random(node):
                            rerun_needs_buffer.add(key)
    for key in storages.layout_copies:  # forward returns the copy for backward whatever the plan
        readers[key].add(n_ops - 1)
    output_use, uses, output_keys = _output_uses(joint, graph, storages, uses)
    rank_of_backward, natural = _backward_ranks(bw, grouping, storages, joint.runs_with)
    last_of_rank = {rank: k for k, rank in enumerate(rank_of_backward)}
    saved_at: dict[int, set[int]] = defaultdict(set)
    last_backward_read: dict[int, int] = {}
    for k, node in enumerate(bw):
        # a node run with a later one reads forward values as saved for its own rank; the gradient side holds them
        # from that rank's end to the node (see compiled_costs._held_past_saves)
        rank = natural.get(k, rank_of_backward[k])
        at = last_of_rank.get(rank, k) if k in natural else k
        for arg in data_inputs(node):
            for key in storages.read_keys(node, arg):
                if key in produced:
                    saved_at[key].add(rank)
                    readers[key].add(rank)  # held for that op's backward, as if read in forward
                    last_backward_read[key] = max(last_backward_read.get(key, at), at)
                    if kinds.extern(node):
                        needs_buffer.add(key)
                        rerun_needs_buffer.add(key)
    return StorageReads(readers, needs_buffer, output_use, saved_at, last_backward_read, rank_of_backward, uses,
                        output_keys, rerun_needs_buffer)


def _output_uses(joint: JointGraph, graph: CapturedGraph, storages: StepStorages,
                 uses: Sequence[str] | None) -> tuple[dict[int, str], tuple[str, ...], tuple[int, ...]]:
    """Per storage the graph returns, what the call does with it (the most demanding use of its outputs); the
    uses per tensor output (by default as the eager profile's step: the scalars get a gradient when there are any,
    else every output; the others are held); and the storage forward made for each tensor output (-1: none)."""
    out_nodes = [a for a in joint.forward_outputs if isinstance(a, fx.Node)]
    tensor_outputs = [n for n in out_nodes if tensor_leaves(n.meta.get("val"))]
    returned = [t.meta["example_value"] for n in graph.graph_module.graph.nodes if n.op == "output"
                for t in tree_leaves(n.args[0])
                if isinstance(t, fx.Node) and isinstance(t.meta.get("example_value"), torch.Tensor)]
    user_outputs = tensor_outputs[-len(returned):] if returned else []
    if uses is None:
        uses = [GRADIENT if r else HELD for r in gradient_receivers(returned)]
    output_use: dict[int, str] = {}
    for k, node in enumerate(user_outputs):
        use = uses[k] if k < len(uses) else GRADIENT
        for key in storages.keys_of(node):
            if key in storages.produced_by:
                output_use[key] = combined_use(output_use.get(key, DROPPED), use)
    keys = tuple(next((k for k in storages.keys_of(node) if k in storages.produced_by), -1) for node in user_outputs)
    return output_use, tuple(uses[:len(user_outputs)]), keys


def _backward_ranks(bw: list[fx.Node], grouping: OpGrouping, storages: StepStorages,
                    runs_with: dict[fx.Node, fx.Node]) -> tuple[list[int], dict[int, int]]:
    """Per backward node its rank: the op it was traced from, at least the ops that made what it reads, folded
    into the op running at the time when that is later (autograd's order is kept); a size query takes the rank of
    the op running. A node inductor runs with a later one (``runs_with``) has that node's rank; its own rank (where
    autograd runs it) is returned beside, per such node."""
    ranks: list[int] = []
    natural: dict[int, int] = {}
    current = len(grouping.nodes) - 1
    for k, node in enumerate(bw):
        if is_size_query(node):  # computed in forward, as a symbol: it runs at no rank
            ranks.append(max(current, 0))
            continue
        made_by = [grouping.op_of_node[storages.produced_by[key]] for arg in data_inputs(node)
                   for key in storages.keys_of(arg) if key in storages.produced_by]
        own = grouping.op_of_origin(origin(node))
        rank = max([own if own is not None else current, *made_by])
        if node in runs_with:
            natural[k] = max(rank, 0)
            ranks.append(-1)  # the rank of the node after it, set below
            continue
        current = min(current, rank)
        ranks.append(max(current, 0))
    for k in sorted(natural, reverse=True):
        ranks[k] = ranks[k + 1]
    return ranks, natural


def sources_of(fw: list[fx.Node], storages: StepStorages, key: int, stops: Callable[[int], bool]) -> set[int]:
    """The storages forward produces that the nodes computing ``key`` read, walked back through the values that are
    not ``stops`` (those computed inside the same kernels), ``key`` left out."""
    produced, found, seen, stack = storages.produced_by, set(), set(), [fw[storages.produced_by[key]]]
    while stack:
        for arg in data_inputs(stack.pop()):
            for inner in storages.keys_of(arg):
                if inner == key or inner in seen or inner not in produced:
                    continue
                seen.add(inner)
                if stops(inner):
                    found.add(inner)
                else:
                    stack.append(fw[produced[inner]])
    return found


def made_from(fw: list[fx.Node], storages: StepStorages, tracked: Sequence[int]) -> dict[int, set[int]]:
    """Per tracked storage: the tracked storages the nodes computing it read, through values that are not tracked
    (the values computed inside its op's kernels)."""
    tracked_keys = set(tracked)
    return {key: sources_of(fw, storages, key, tracked_keys.__contains__) for key in tracked}


def backward_deadlines(bw: list[fx.Node], storages: StepStorages, reads: StorageReads,
                       kinds: InductorKinds) -> dict[int, int]:
    """Per storage backward reads: the highest rank by whose backward a node reading it must have run. A fused
    kernel runs at its rank; a library call, as late as the first fused kernel that reads its result (through
    views and other library calls) allows: a weight's gradient at the end (-1), the gradient of a matrix product's
    second operand where the gradient of that operand's producer is summed. A view reads where its readers do."""
    index = {node: k for k, node in enumerate(bw)}
    ranks = reads.rank_of_backward
    when = [-1] * len(bw)
    for k in range(len(bw) - 1, -1, -1):
        node = bw[k]
        if is_view(node) or kinds.extern(node) or is_size_query(node):
            when[k] = max([when[index[u]] for u in node.users if u in index], default=-1)
        else:
            when[k] = ranks[k]
    deadline: dict[int, int] = {}
    for k, node in enumerate(bw):
        for arg in data_inputs(node):
            for key in storages.read_keys(node, arg):
                if key in storages.produced_by:
                    deadline[key] = max(deadline.get(key, -1), when[k])
    return deadline
