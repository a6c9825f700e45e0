"""The compiled front end: one training step as inductor compiles it, read off the joint forward and backward graph
(:mod:`sublinear.capture.joint`) with no run of the step.

- **Ops** are runs of consecutive forward nodes traced from one captured node; nodes a pattern pass made run as an op
  of their own, and so does every random node (inductor's seed draw) and every write into an input (BatchNorm's
  running statistics), which are pinned: never recomputed.
- **Storages** are the storages of the forward nodes' values (views share their base's), each with the op that
  produces it, the ops that read it, and the ranks whose backward reads it (what forward saves). Inductor lays
  convolutions out channels-last where it judges that faster (always with oneDNN on CPU): a convolution's input or
  weight in another layout is copied in forward and backward reads the copy, which is a storage of its own.
- **Ranks** are the ops: backward runs in the joint graph's order, each backward node counted in the op it was
  traced from, folded into the op running at the time when that op is later (autograd's order is kept).
- **What inductor materialises**: a buffer exists for a value that a kernel inductor cannot fuse produces (matrix
  products, convolutions, reductions, fallbacks), that such a kernel reads (it needs its inputs in memory), or that
  the graph returns; a pointwise value read only by other fused kernels is computed inside them and takes no memory.
  Backward runs kernel by kernel: the nodes between two library kernels are one fused kernel, which allocates what
  they make before it runs and frees what they read last after it. A compiled backward recomputes each op once and
  keeps its values until the last kernel that reads them.
- **Library scratch**: each library kernel's own allocations inside the call (oneDNN reorders, attention buffers),
  measured on the device (:mod:`.kernels`) whatever model times the ops.
- **Time** is estimated per node: FLOPs over the device's matmul rate, plus the bytes of the buffers it reads and
  writes over its bandwidth, plus a kernel's launch per buffer written (a fused chain is one kernel).
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from sublinear.capture.dynamo import BUFFER, INPUT, PARAMETER, CapturedGraph, module_path
from sublinear.capture.joint import JointGraph, is_view, origin
from sublinear.core.plan import Plan
from sublinear.core.profile import GraphProfile, NodeFacts, OpProfile
from sublinear.profiling.costs import REFERENCE_GPU, DeviceRates, device_rates, estimate_seconds
from sublinear.profiling.kernels import KernelMemory, KernelRun, TensorLayout, kernel_memory
from sublinear.profiling.record import StepRecord, assemble
from sublinear.tensors import size_hint as hint
from sublinear.training import DROPPED, GRADIENT, HELD, gradient_receivers

__all__ = ["CompiledProfile", "profile_joint"]

CUDA_ALLOCATION_GRANULARITY = 512

# Ops that inductor lowers to loads and stores it can fuse, although torch does not tag them pointwise.
_FUSIBLE = ("aten.embedding.default", "aten.index.Tensor", "aten.full.default", "aten.scalar_tensor.default",
            "prims.iota.default", "aten.constant_pad_nd.default", "aten.slice_scatter.default",
            "aten.select_scatter.default", "prims.inductor_random.default", "prims.inductor_lookup_seed.default",
            "aten.zeros.default", "aten.ones.default")
# Matrix products inductor calls as library kernels although they are not in its needs-realized set.
_EXTERN = ("aten.addmm.default", "aten.baddbmm.default", "aten.addbmm.default", "aten._addmm_activation.default")
_CONVOLUTIONS = (torch.ops.aten.convolution.default, torch.ops.aten.convolution_backward.default)


@dataclass(frozen=True)
class CompiledProfile:
    """A profile of the compiled step, with per forward node of the joint graph (the profile's node indices) its
    name, so that a plan can be turned into tags on the joint graph inductor traces again when it compiles, and per
    backward node its rank."""

    profile: GraphProfile
    node_names: tuple[str, ...]
    backward_ranks: dict[str, int] = dataclasses.field(default_factory=dict)


def _ops(names: Sequence[str]) -> frozenset:
    """The op overloads of ``names`` that this torch has (inductor's prims once inductor registered them)."""
    import torch._inductor.inductor_prims  # noqa: F401, PLC0415 - registers prims.inductor_*

    found = set()
    for name in names:
        namespace, op, overload = name.split(".")
        packet = getattr(getattr(torch.ops, namespace), op, None)
        if packet is not None and hasattr(packet, overload):
            found.add(getattr(packet, overload))
    return frozenset(found)


class _Kinds:
    """What inductor does with each node: fuse it (pointwise), call a library kernel that needs its inputs in memory
    (extern), or make a buffer of its result with its inputs fused in (reductions and the rest)."""

    def __init__(self) -> None:
        from torch._inductor import lowering  # noqa: PLC0415

        self.realized_inputs, self.fallbacks = frozenset(lowering.needs_realized_inputs), frozenset(lowering.fallbacks)
        self.fusible_ops, self.extern_ops = _ops(_FUSIBLE), _ops(_EXTERN)

    def fusible(self, node: fx.Node) -> bool:
        target = node.target
        if not isinstance(target, torch._ops.OpOverload):
            return False
        return torch.Tag.pointwise in target.tags or target in self.fusible_ops or target.is_view

    def extern(self, node: fx.Node) -> bool:
        target = node.target
        return isinstance(target, torch._ops.OpOverload) and (
            target in self.realized_inputs or target in self.fallbacks or target in self.extern_ops)


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _random(node: fx.Node) -> bool:
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags


def _writes_input(node: fx.Node) -> bool:
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return False
    return any(a.alias_info is not None and a.alias_info.is_write for a in target._schema.arguments)


def _communicates(node: fx.Node) -> bool:
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and target.namespace in ("_c10d_functional", "c10d_functional")


def _flops(node: fx.Node) -> int:
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return 0
    count = flop_registry.get(target.overloadpacket)
    if count is None:
        return 0
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda a: a.meta.get("val"))
    try:
        return hint(count(*args, **kwargs, out_val=node.meta.get("val")))
    except Exception:  # noqa: BLE001 - a formula that cannot read symbolic or missing values counts nothing
        return 0


# --- Ops ---------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Grouping:
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


def _group(fw: list[fx.Node]) -> _Grouping:
    """Runs of forward nodes from one captured node; random and state-writing nodes alone, pinned."""
    nodes: list[list[int]] = []
    origins: list[int | None] = []
    pinned: dict[int, str] = {}
    previous = ""  # why the previous node was pinned ("": it was not)
    for i, node in enumerate(fw):
        o = origin(node)
        pin = (f"{node.name} draws random numbers" if _random(node) else
               f"{node.name} communicates" if _communicates(node) else
               "writes into the graph's inputs (BatchNorm's running statistics)" if _writes_input(node) else "")
        joins = nodes and (pin == previous if pin else
                           not previous and (o == origins[-1] or o is None and origins[-1] is None))
        if not joins or (pin and _random(node)):
            nodes.append([])
            origins.append(o)
        nodes[-1].append(i)
        previous = pin
        if pin:
            pinned[len(nodes) - 1] = pin
    return _Grouping(nodes, origins, pinned, {i: o for o, members in enumerate(nodes) for i in members})


# --- Storages ----------------------------------------------------------------------------------------------------

@dataclass
class _Storages:
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
        return [_key(t) for t in _tensors(node.meta.get("val"))]

    def read_keys(self, node: fx.Node, arg: fx.Node) -> list[int]:
        """The storages ``node`` reads through ``arg``: a convolution reads the layout copy of a primal."""
        keys = self.keys_of(arg)
        if node.target in _CONVOLUTIONS:
            keys = [-key if -key in self.layout_copies else key for key in keys]
        return keys


def _storages(joint: JointGraph, graph: CapturedGraph, fw: list[fx.Node], granule: int,
              channels_last: bool) -> _Storages:
    def rounded(nbytes: int) -> int:
        return -(-nbytes // granule) * granule

    state: dict[int, tuple[str, int]] = {}
    for k, node in enumerate(joint.primals):
        kind = graph.kinds[k] if k < len(graph.kinds) else INPUT
        for t in _tensors(node.meta.get("val")):
            state.setdefault(_key(t), (kind, rounded(hint(t.untyped_storage().nbytes()))))
    produced_by: dict[int, int] = {}
    size_of: dict[int, int] = {}
    node_keys: dict[fx.Node, list[int]] = {}
    for i, node in enumerate(fw):
        keys = []
        for t in _tensors(node.meta.get("val")):
            key = _key(t)
            keys.append(key)
            if key not in state and key not in produced_by:
                produced_by[key] = i
                size_of[key] = rounded(hint(t.untyped_storage().nbytes()))
        node_keys[node] = keys
    found = _Storages(state, produced_by, size_of, node_keys, {})
    if channels_last:
        found.layout_copies = _layout_copies(fw, found)
        for key, (i, nbytes) in found.layout_copies.items():
            produced_by[key] = i
            size_of[key] = rounded(nbytes)
    return found


def _layout_copies(fw: list[fx.Node], storages: _Storages) -> dict[int, tuple[int, int]]:
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


def _channels_last(gm: fx.GraphModule) -> bool:
    """Whether inductor will lay this graph's convolutions out channels-last (its own heuristic)."""
    from torch._inductor.graph import GraphLowering  # noqa: PLC0415

    try:
        return bool(GraphLowering.decide_layout_opt(gm, is_inference=False))
    except Exception:  # noqa: BLE001 - a heuristic that cannot read this graph: inductor's default layout
        return False


# --- Reads: forward readers, outputs, backward ranks and saves ---------------------------------------------------

@dataclass
class _Reads:
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


def _reads(joint: JointGraph, graph: CapturedGraph, grouping: _Grouping, storages: _Storages, kinds: _Kinds,
           uses: Sequence[str] | None) -> _Reads:
    fw, bw, op_of_node = joint.forward, joint.backward, grouping.op_of_node
    n_ops = len(grouping.nodes)
    produced = storages.produced_by
    readers: dict[int, set[int]] = defaultdict(set)
    needs_buffer: set[int] = set()
    for i, node in enumerate(fw):
        for arg in node.all_input_nodes:
            for key in storages.read_keys(node, arg):
                if key in produced:
                    readers[key].add(op_of_node[i])
                    if kinds.extern(node):
                        needs_buffer.add(key)
    for key in storages.layout_copies:  # forward returns the copy for backward whatever the plan
        readers[key].add(n_ops - 1)
    output_use, uses = _output_uses(joint, graph, storages, uses)
    rank_of_backward = _backward_ranks(bw, grouping, storages)
    saved_at: dict[int, set[int]] = defaultdict(set)
    last_backward_read: dict[int, int] = {}
    for k, node in enumerate(bw):
        for arg in node.all_input_nodes:
            for key in storages.read_keys(node, arg):
                if key in produced:
                    saved_at[key].add(rank_of_backward[k])
                    readers[key].add(rank_of_backward[k])  # held for that op's backward, as if read in forward
                    last_backward_read[key] = k
                    if kinds.extern(node):
                        needs_buffer.add(key)
    return _Reads(readers, needs_buffer, output_use, saved_at, last_backward_read, rank_of_backward, uses)


def _output_uses(joint: JointGraph, graph: CapturedGraph, storages: _Storages,
                 uses: Sequence[str] | None) -> tuple[dict[int, str], tuple[str, ...]]:
    """Per storage the graph returns, what the call does with it (the most demanding use of its outputs); and the
    uses per tensor output (by default as the eager profile's step: the scalars get a gradient when there are any,
    else every output; the others are held)."""
    out_nodes = [a for a in joint.forward_outputs if isinstance(a, fx.Node)]
    tensor_outputs = [n for n in out_nodes if _tensors(n.meta.get("val"))]
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
                output_use[key] = min(output_use.get(key, DROPPED), use, key=(GRADIENT, HELD, DROPPED).index)
    return output_use, tuple(uses[:len(user_outputs)])


def _backward_ranks(bw: list[fx.Node], grouping: _Grouping, storages: _Storages) -> list[int]:
    """Per backward node its rank: the op it was traced from, at least the ops that made what it reads, folded
    into the op running at the time when that is later (autograd's order is kept)."""
    ranks: list[int] = []
    current = len(grouping.nodes) - 1
    for node in bw:
        made_by = [grouping.op_of_node[storages.produced_by[key]] for arg in node.all_input_nodes
                   for key in storages.keys_of(arg) if key in storages.produced_by]
        own = grouping.op_of_origin(origin(node))
        rank = max([own if own is not None else current, *made_by])
        current = min(current, rank)
        ranks.append(max(rank, 0))
    return ranks


# --- Costs: forward bytes inside each op, time, library scratch --------------------------------------------------

def _materialized(storages: _Storages, reads: _Reads, kinds: _Kinds, fw: list[fx.Node]):
    """Whether a produced storage is a buffer in forward: a library kernel or a reduction makes it, a library
    kernel reads it, or the graph returns it (a fused pointwise value read only by fused kernels is not)."""
    fusible = {key: kinds.fusible(fw[i]) for key, i in storages.produced_by.items()}

    def materialized(key: int, rebuilt: bool = False) -> bool:
        return key in storages.produced_by and (not fusible[key] or key in reads.needs_buffer
                                                or (not rebuilt and key in reads.output_use))
    return materialized


def _forward_costs(fw: list[fx.Node], grouping: _Grouping, storages: _Storages, tracked: set[int], materialized,
                   scratch: dict[fx.Node, int], kinds: _Kinds, rates: DeviceRates):
    """Per op: the most bytes its own allocations hold at once while it runs (its buffers, those that outlive it
    included, and a library call's scratch), its FLOPs and its estimated seconds."""
    last_reader: dict[int, int] = {}
    for i, node in enumerate(fw):
        for arg in node.all_input_nodes:
            for key in storages.keys_of(arg):
                last_reader[key] = i
    n_ops = len(grouping.nodes)
    extra, seconds, flops = [0] * n_ops, [0.0] * n_ops, [0] * n_ops
    produced, size_of = storages.produced_by, storages.size_of
    for o, members in enumerate(grouping.nodes):
        live = peak = 0
        internal = {k for i in members for k in storages.keys_of(fw[i]) if k in produced and k not in tracked
                    and produced[k] == i and materialized(k)}
        for i in members:
            node = fw[i]
            live += sum(size_of[k] for k in dict.fromkeys(storages.keys_of(node))
                        if produced.get(k) == i and (k in internal or k in tracked and materialized(k)))
            peak = max(peak, live + scratch.get(node, 0))
            for key in [k for k in internal if last_reader.get(k, produced[k]) <= i and produced[k] <= i]:
                live -= size_of[key]
                internal.discard(key)
            node_flops = _flops(node)
            flops[o] += node_flops
            seconds[o] += _node_seconds(node, node_flops, storages.keys_of, materialized, size_of, storages.state,
                                        kinds, rates)
        extra[o] = peak
    for o, nbytes in _fused_early(fw, grouping, storages, materialized, kinds).items():
        extra[o] += nbytes
    if storages.layout_copies:  # made by the forward's first kernel, beside what its first op makes
        extra[0] += sum(size_of[key] for key in storages.layout_copies)
    return extra, seconds, flops


def _fused_early(fw: list[fx.Node], grouping: _Grouping, storages: _Storages, materialized,
                 kinds: _Kinds) -> dict[int, int]:
    """Per op: the bytes of buffers a later op makes that its kernel already holds. A pointwise value that is a
    buffer is computed by one kernel together with the chain of pointwise values it is made from that are not
    buffers: the kernel, and the buffer, run where the chain starts, at an earlier op."""
    early: dict[int, int] = defaultdict(int)
    produced, op_of_node = storages.produced_by, grouping.op_of_node
    for key, i in produced.items():
        if key < 0 or not materialized(key) or not kinds.fusible(fw[i]):
            continue
        first, stack, seen = op_of_node[i], [fw[i]], set()
        while stack:
            node = stack.pop()
            for arg in node.all_input_nodes:
                inner = [k for k in storages.keys_of(arg) if k in produced]
                if inner and arg not in seen and all(not materialized(k) and kinds.fusible(fw[produced[k]])
                                                     for k in inner):
                    seen.add(arg)
                    first = min(first, op_of_node[produced[inner[0]]])
                    stack.append(arg)
        for o in range(first, op_of_node[i]):
            early[o] += storages.size_of[key]
    return early


def _node_seconds(node: fx.Node, node_flops: int, keys_of, materialized, size_of: dict[int, int],
                  state: dict[int, tuple[str, int]], kinds: _Kinds, rates: DeviceRates) -> float:
    """One node's estimated time: its FLOPs, the buffers it reads (materialised values, state) and writes."""
    if is_view(node):
        return 0.0
    read = 0
    for arg in node.all_input_nodes:
        for key in keys_of(arg):
            if key in state:
                read += state[key][1]
            elif materialized(key):
                read += size_of[key]
    written = [key for key in keys_of(node) if materialized(key)]
    wrote = sum(size_of[key] for key in written)
    kernels = 1 if (written or kinds.extern(node)) else 0
    return estimate_seconds(node_flops, read + wrote, kernels, rates)


def _library_scratch(nodes: Sequence[fx.Node], kinds: _Kinds, channels_last: bool,
                     kernels: KernelMemory | None) -> dict[fx.Node, int]:
    """Per library node: the bytes its kernel allocates inside the call beyond its results, measured on the
    device, with convolutions' tensors channels-last where inductor lays them out so."""
    if kernels is None:
        return {}
    runs = {node: run for node in nodes if kinds.extern(node) and (run := _library_run(node, channels_last))}
    kernels.measure(list(runs.values()))
    scratch = {}
    for node, run in runs.items():
        measured = kernels.get(run.key)
        if measured is not None:
            results = sum(hint(t.untyped_storage().nbytes()) for t in _tensors(node.meta.get("val")))
            scratch[node] = max(0, measured.inside_peak - results)
    return scratch


_TENSOR = "<tensor>"


def _library_run(node: fx.Node, channels_last: bool) -> KernelRun | None:
    """``node`` run alone on tensors of its arguments' layouts (None when an argument's value is unknown)."""
    if not isinstance(node.target, torch._ops.OpOverload):
        return None
    inputs: dict[str, TensorLayout] = {}

    def described(arg: fx.Node) -> Any:
        value = arg.meta.get("val")
        if not isinstance(value, torch.Tensor):
            if isinstance(value, torch.SymInt):
                return hint(value)
            raise LookupError(arg.name)
        shape = tuple(hint(s) for s in value.shape)
        stride = tuple(hint(s) for s in value.stride())
        if channels_last and node.target in _CONVOLUTIONS and len(shape) == 4:
            stride = torch.empty(shape, device="meta").to(memory_format=torch.channels_last).stride()
        name = f"t{len(inputs)}"
        inputs[name] = TensorLayout(shape, tuple(stride), str(value.dtype).removeprefix("torch."))
        return (_TENSOR, name)

    try:
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), described)
    except LookupError:
        return None
    target = node.target
    key = f"{target}{args}{kwargs}{sorted((n, tuple(layout.__dict__.values())) for n, layout in inputs.items())}"

    def run(tensors: dict[str, torch.Tensor]) -> Any:
        def real(value: Any) -> Any:
            return tensors[value[1]] if isinstance(value, tuple) and value[:1] == (_TENSOR,) else value
        is_tensor = lambda v: isinstance(v, tuple) and v[:1] == (_TENSOR,)  # noqa: E731
        from torch.utils._pytree import tree_map  # noqa: PLC0415
        return target(*tree_map(real, args, is_leaf=is_tensor), **tree_map(real, kwargs, is_leaf=is_tensor))

    return KernelRun(key, inputs, run)


# --- Backward: the gradient side per rank -------------------------------------------------------------------------

@dataclass
class _Backward:
    """Per rank: gradient-side bytes (the outputs' gradients and the buffers backward makes) at the start of its
    backward, at their peak before it releases the last forward value it reads, and after; its seconds; and the
    backward's FLOPs and the parameters' gradient bytes at its end."""

    start: list[int]
    before: list[int]
    after: list[int]
    seconds: list[float]
    flops: int
    gradient_bytes: int


class _GradientSide:
    """The buffers backward makes (not forward values), with their sizes and the backward node making each (-1:
    an output's gradient, handed to backward)."""

    def __init__(self, joint: JointGraph, storages: _Storages, kinds: _Kinds, granule: int,
                 graph_kinds: Sequence[str]) -> None:
        bw = joint.backward
        self.kinds, self.bw = kinds, bw
        self.sizes: dict[int, int] = {}
        self.born: dict[int, int] = {}
        self.outputs: dict[int, str] = {}  # gradients the graph returns -> the kind of primal they are for
        for k, grad in enumerate(joint.gradients):
            if isinstance(grad, fx.Node):
                for key in storages.keys_of(grad):
                    self.outputs[key] = graph_kinds[k] if k < len(graph_kinds) else INPUT
        for node in joint.tangents:
            for t in _tensors(node.meta.get("val")):
                self.sizes.setdefault(_key(t), -(-hint(t.untyped_storage().nbytes()) // granule) * granule)
                self.born.setdefault(_key(t), -1)
        self.needs_buffer: set[int] = set()
        self.last: dict[int, int] = {}
        for k, node in enumerate(bw):
            for t in _tensors(node.meta.get("val")):
                key = _key(t)
                if key not in storages.produced_by and key not in storages.state and key not in self.born:
                    self.born[key] = k
                    self.sizes[key] = -(-hint(t.untyped_storage().nbytes()) // granule) * granule
            for arg in node.all_input_nodes:
                for key in storages.keys_of(arg):
                    self.last[key] = k
                    if kinds.extern(node):
                        self.needs_buffer.add(key)

    def buffer(self, key: int) -> bool:
        """Whether a gradient-side value takes memory: an output's gradient, made by a kernel that cannot be fused,
        read by a library kernel, or returned."""
        k = self.born.get(key)
        return k is not None and (k < 0 or not self.kinds.fusible(self.bw[k]) or key in self.needs_buffer
                                  or key in self.outputs)

    def tangent_bytes(self) -> int:
        return sum(self.sizes[key] for key, k in self.born.items() if k < 0)


def _backward(joint: JointGraph, reads: _Reads, n_ops: int, storages: _Storages, side: _GradientSide,
              scratch: dict[fx.Node, int], rates: DeviceRates) -> _Backward:
    """Walk backward kernel by kernel: inductor fuses the nodes between two library kernels into one kernel, which
    allocates what they make before it runs and frees what they read last after it."""
    bw, ranks = joint.backward, reads.rank_of_backward
    live = side.tangent_bytes()
    start: list[int | None] = [None] * n_ops
    before, after, left, seconds = [0] * n_ops, [0] * n_ops, [0] * n_ops, [0.0] * n_ops
    last_release: dict[int, int] = {}  # rank -> its last node that reads a forward value for the last time
    for k in reads.last_backward_read.values():
        last_release[ranks[k]] = max(last_release.get(ranks[k], -1), k)
    released: set[int] = set()
    total_flops = 0
    all_sizes = {**storages.size_of, **side.sizes}

    def readable(key: int) -> bool:
        return key in storages.produced_by or side.buffer(key)

    for segment in _segments(bw, side.kinds):
        for k in segment:
            if start[ranks[k]] is None:
                start[ranks[k]] = before[ranks[k]] = after[ranks[k]] = live
        made = [key for k in segment for key in dict.fromkeys(storages.keys_of(bw[k]))
                if side.born.get(key) == k and side.buffer(key)]
        live += sum(side.sizes[key] for key in made)
        inside = live + max((scratch.get(bw[k], 0) for k in segment), default=0)
        for r in {ranks[k] for k in segment}:
            if r in released:
                after[r] = max(after[r], inside)
            else:
                before[r], after[r] = max(before[r], inside), live
        members = set(segment)
        freed = {key for k in segment for arg in bw[k].all_input_nodes for key in storages.keys_of(arg)
                 if side.last.get(key) in members}
        freed |= {key for key in made if key not in side.last}
        live -= sum(side.sizes[key] for key in freed if side.buffer(key) and key not in side.outputs)
        for k in segment:
            left[ranks[k]] = live
            if last_release.get(ranks[k]) == k:
                released.add(ranks[k])
            node_flops = _flops(bw[k])
            total_flops += node_flops
            seconds[ranks[k]] += _node_seconds(bw[k], node_flops, storages.keys_of, readable, all_sizes,
                                               storages.state, side.kinds, rates)
    carried = side.tangent_bytes()  # before the first backward node: the outputs' gradients
    for r in range(n_ops - 1, -1, -1):
        if start[r] is None:
            start[r] = before[r] = after[r] = carried
        else:
            carried = left[r]
    parameter_grads = sum(side.sizes[key] for key, kind in side.outputs.items() if kind == PARAMETER
                          and key in side.sizes)
    return _Backward(start, before, after, seconds, total_flops, parameter_grads)


def _segments(nodes: list[fx.Node], kinds: _Kinds) -> list[list[int]]:
    """Positions of ``nodes`` cut into what inductor runs as one kernel: each library kernel alone, and every run of
    other nodes between two of them together."""
    segments: list[list[int]] = []
    for k, node in enumerate(nodes):
        alone = kinds.extern(node)
        if alone or not segments or kinds.extern(nodes[segments[-1][-1]]):
            segments.append([])
        segments[-1].append(k)
    return segments


# --- The profile ---------------------------------------------------------------------------------------------------

def profile_joint(joint: JointGraph, graph: CapturedGraph, uses: Sequence[str] | None,
                  rates: DeviceRates | None = None, measure_scratch: bool = True) -> CompiledProfile:
    """The profile of ``graph``'s training step as inductor compiles it from ``joint``.

    ``uses``: per tensor output of the graph, what the call does with it (gradient, held, dropped; see
    :func:`sublinear.profiling.graph.profile`); None: as :func:`sublinear.training.step_backward` by default.
    ``measure_scratch``: run each library kernel once on the device for its scratch space (CPU and CUDA).
    """
    kinds = _Kinds()
    fw, bw = joint.forward, joint.backward
    device = next((t.device for n in joint.primals for t in _tensors(n.meta.get("val"))), torch.device("cpu"))
    granule = CUDA_ALLOCATION_GRANULARITY if device.type == "cuda" else 1
    rates = rates or (device_rates(str(device)) if device.type in ("cpu", "cuda") else REFERENCE_GPU)
    channels_last = _channels_last(joint.gm)
    grouping = _group(fw)
    storages = _storages(joint, graph, fw, granule, channels_last)
    reads = _reads(joint, graph, grouping, storages, kinds, uses)
    tracked = _tracked(grouping, storages, reads)
    measured = measure_scratch and device.type in ("cpu", "cuda")
    scratch = _library_scratch(fw + bw, kinds, channels_last, kernel_memory(str(device)) if measured else None)
    materialized = _materialized(storages, reads, kinds, fw)
    extra, seconds, flops = _forward_costs(fw, grouping, storages, set(tracked), materialized, scratch, kinds, rates)
    side = _GradientSide(joint, storages, kinds, granule, graph.kinds)
    backward = _backward(joint, reads, len(grouping.nodes), storages, side, scratch, rates)
    record = _record(joint, graph, grouping, storages, reads, tracked, materialized, extra, seconds, flops, backward,
                     rates)
    profile = assemble(record)
    from sublinear.simulation.timeline import simulate  # noqa: PLC0415 - the unplanned step's peak, for reports

    profile = dataclasses.replace(profile, measured_peak_bytes=simulate(profile, Plan.no_split(profile.num_ops))
                                  .peak_bytes)
    return CompiledProfile(profile, tuple(node.name for node in fw),
                           {node.name: reads.rank_of_backward[k] for k, node in enumerate(bw)})


def _tracked(grouping: _Grouping, storages: _Storages, reads: _Reads) -> list[int]:
    """The storages that outlive their op (read by a later op or backward) or that the graph returns, in order."""
    def outlives(key: int) -> bool:
        o = grouping.op_of_node[storages.produced_by[key]]
        return any(r > o for r in reads.readers.get(key, ())) or key in reads.saved_at or key in reads.output_use

    return sorted((k for k in storages.produced_by if outlives(k)), key=lambda k: (storages.produced_by[k], k))


def _record(joint: JointGraph, graph: CapturedGraph, grouping: _Grouping, storages: _Storages, reads: _Reads,
            tracked: list[int], materialized, extra: list[int], seconds: list[float], flops: list[int],
            backward: _Backward, rates: DeviceRates) -> StepRecord:
    fw, n_ops = joint.forward, len(grouping.nodes)
    op_of_node, produced = grouping.op_of_node, storages.produced_by
    captured = list(graph.graph_module.graph.nodes)
    ops = [OpProfile(index=o, nodes=tuple(members), name=_op_name(grouping.origins[o], members, fw, captured),
                     flops=flops[o], forward_extra_bytes=extra[o], snapshot_bytes=0,
                     random=any(_random(fw[i]) for i in members),
                     mutates_state=any(_writes_input(fw[i]) for i in members), pin_reason=grouping.pinned.get(o, ""),
                     forward_seconds=seconds[o])
           for o, members in enumerate(grouping.nodes)]
    op_inputs: list[dict[int, set[int]]] = [defaultdict(set) for _ in range(n_ops)]
    for key, readers in reads.readers.items():
        p = op_of_node[produced[key]]
        for o in readers:
            if o != p:
                op_inputs[o][p].add(key)
    last_use = {k: n_ops if reads.output_use.get(k, DROPPED) != DROPPED else
                max([op_of_node[produced[k]], *reads.readers.get(k, ())]) for k in tracked}

    def state_bytes(kind: str) -> int:
        return sum(b for k, b in storages.state.values() if k == kind)

    return StepRecord(
        ops=ops,
        node_facts={i: NodeFacts(random=_random(fw[i]), pin_reason=grouping.pinned.get(op_of_node[i], ""))
                    for i in range(len(fw)) if op_of_node[i] in grouping.pinned},
        op_of_node=op_of_node,
        node_keys={i: tuple(k for k in storages.keys_of(node) if k not in storages.state) for i, node in enumerate(fw)},
        storage_bytes=dict(storages.size_of), producer={k: op_of_node[i] for k, i in produced.items()},
        last_use=last_use, saved_by=reads.saved_at, saved_at=reads.saved_at,
        op_inputs=[sorted((p, sorted(keys)) for p, keys in inputs.items()) for inputs in op_inputs],
        tracked=tracked, reaches_output=[True] * n_ops, node_op=list(range(n_ops)),
        grad_start=backward.start, grad_peak=backward.before, grad_after=backward.after,
        backward_seconds=backward.seconds,
        parameter_bytes=state_bytes(PARAMETER), buffer_bytes=state_bytes(BUFFER), input_bytes=state_bytes(INPUT),
        gradient_bytes=backward.gradient_bytes, backward_flops=backward.flops,
        cost_source=f"estimated for inductor's kernels on {rates.describe()}", output_uses=reads.uses,
        materialized_in_forward={k for k in tracked if materialized(k)},
        materialized_when_rebuilt={k for k in tracked if materialized(k, rebuilt=True)},
        recompute_shared=True,
    )


def _op_name(orig: int | None, members: list[int], fw: list[fx.Node], captured: list[fx.Node]) -> str:
    if orig is not None and 0 <= orig < len(captured):
        node = captured[orig]
        path = module_path(node)
        text = f"{path} ({node.name})" if path else node.name
    else:
        text = f"{fw[members[0]].name} (inductor pattern)"
    return text if len(members) == 1 else f"{text} +{len(members) - 1}"
