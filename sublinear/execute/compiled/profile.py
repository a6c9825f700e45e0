"""The profile of a training step as inductor runs it: a :class:`~sublinear.core.profile.GraphProfile` read off the
joint graph inductor partitions (:mod:`sublinear.execute.compiled.joint`), with no run of the step.

- **Ops** are runs of consecutive forward nodes traced from one captured node; nodes a pattern pass made run as an op
  of their own, and so does every random node (inductor's seed draw) and every write into an input (BatchNorm's
  running statistics), which are pinned: never recomputed.
- **Storages** are the storages of the forward nodes' values (views share their base's), each with the op that
  produces it, the ops that read it, and the ops whose backward reads it (what the forward would save).
- **Ranks** are the ops: backward runs in the joint graph's order, each backward node counted in the op it was
  traced from, folded into the op running at the time when that op is later (autograd's order is kept).
- **What inductor materialises**: a buffer exists for a value that a kernel inductor cannot fuse produces (matrix
  products, convolutions, reductions, fallbacks), that such a kernel reads (it needs its inputs in memory), or that
  the graph returns; a pointwise value read only by other fused kernels is computed inside them and takes no memory
  (``GraphProfile.materialized_in_forward`` and ``materialized_when_rebuilt`` say so per storage).
- **Time** is estimated per node: FLOPs over the device's matmul rate, plus the bytes of the buffers it reads and
  writes over its bandwidth, plus a kernel's launch per buffer written (a fused chain is one kernel).
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import fx
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from sublinear.capture.dynamo import BUFFER, INPUT, PARAMETER, CapturedGraph, module_path
from sublinear.core.profile import GraphProfile, NodeFacts, OpProfile
from sublinear.profiling.costs import REFERENCE_GPU, DeviceRates, device_rates, estimate_seconds
from sublinear.training import DROPPED, GRADIENT, HELD, gradient_receivers
from sublinear.execute.compiled.joint import JointGraph, is_view, origin
from sublinear.execute.compiled.wrapper import hint

__all__ = ["CompiledProfile", "profile_joint"]

log = logging.getLogger("sublinear.execute.compiled")

CUDA_ALLOCATION_GRANULARITY = 512

# Ops that inductor lowers to loads and stores it can fuse, although torch does not tag them pointwise.
_FUSIBLE = ("aten.embedding.default", "aten.index.Tensor", "aten.full.default", "aten.scalar_tensor.default",
            "prims.iota.default", "aten.constant_pad_nd.default", "aten.slice_scatter.default",
            "aten.select_scatter.default", "prims.inductor_random.default", "prims.inductor_lookup_seed.default",
            "aten.zeros.default", "aten.ones.default")
# Matrix products inductor calls as library kernels although they are not in its needs-realized set.
_EXTERN = ("aten.addmm.default", "aten.baddbmm.default", "aten.addbmm.default", "aten._addmm_activation.default")


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


def _inductor_sets() -> tuple[frozenset, frozenset]:
    from torch._inductor import lowering  # noqa: PLC0415

    return frozenset(lowering.needs_realized_inputs), frozenset(lowering.fallbacks)


@dataclass(frozen=True)
class CompiledProfile:
    """A profile of the compiled step, and per forward node of the joint graph (the profile's node indices) its name,
    so that a plan can be turned into tags on the joint graph inductor traces again when it compiles."""

    profile: GraphProfile
    node_names: tuple[str, ...]


class _Kinds:
    """What inductor does with each node: fuse it (pointwise), call a library kernel that needs its inputs in memory
    (extern), or make a buffer of its result with its inputs fused in (reductions and the rest)."""

    def __init__(self) -> None:
        self.realized_inputs, self.fallbacks = _inductor_sets()
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


def profile_joint(joint: JointGraph, graph: CapturedGraph, uses: Sequence[str] | None,
                  rates: DeviceRates | None = None) -> CompiledProfile:
    """The profile of ``graph``'s training step as inductor compiles it from ``joint``.

    ``uses``: per tensor output of the graph, what the call does with it (gradient, held, dropped; see
    :func:`sublinear.profiling.graph.profile`); None: as :func:`sublinear.training.step_backward` by default (the scalar
    outputs get a gradient when there are any, else every floating output), the others are held.
    """
    kinds = _Kinds()
    fw, bw = joint.forward, joint.backward
    device = next((t.device for n in joint.primals for t in _tensors(n.meta.get("val"))), torch.device("cpu"))
    granule = CUDA_ALLOCATION_GRANULARITY if device.type == "cuda" else 1
    rates = rates or (device_rates(str(device)) if device.type in ("cpu", "cuda") else REFERENCE_GPU)

    def rounded(nbytes: int) -> int:
        return -(-nbytes // granule) * granule

    # --- Ops: runs of forward nodes from one captured node; random and state-writing nodes alone.
    captured = list(graph.graph_module.graph.nodes)
    op_nodes: list[list[int]] = []
    op_origin: list[int | None] = []
    pinned: dict[int, str] = {}
    previous = ""  # why the previous node was pinned ("": it was not)
    for i, node in enumerate(fw):
        o = origin(node)
        pin = (f"{node.name} draws random numbers" if _random(node) else
               f"{node.name} communicates" if _communicates(node) else
               "writes into the graph's inputs (BatchNorm's running statistics)" if _writes_input(node) else "")
        joins = op_nodes and (pin == previous if pin else
                              not previous and (o == op_origin[-1] or o is None and op_origin[-1] is None))
        if not joins or (pin and _random(node)):
            op_nodes.append([])
            op_origin.append(o)
        op_nodes[-1].append(i)
        previous = pin
        if pin:
            pinned[len(op_nodes) - 1] = pin
    n_ops = len(op_nodes)
    op_of_node = {i: o for o, members in enumerate(op_nodes) for i in members}
    labelled = [(orig, o) for o, orig in enumerate(op_origin) if orig is not None]
    labelled_origins = [orig for orig, _ in labelled]

    def op_of_origin(orig: int | None) -> int | None:
        """The op a captured node's forward runs in: its own, or for a node a pattern pass replaced, the op just
        before the first op of a later captured node (where the replacement runs)."""
        if orig is None or not labelled:
            return None
        k = bisect.bisect_right(labelled_origins, orig)
        if k and labelled_origins[k - 1] == orig:
            return labelled[k - 1][1]
        return labelled[k][1] - 1 if k < len(labelled) else n_ops - 1

    # --- Storages: the primals' (state, not planned) and those forward nodes produce.
    state: dict[int, tuple[str, int]] = {}
    for k, node in enumerate(joint.primals):
        kind = graph.kinds[k] if k < len(graph.kinds) else INPUT
        for t in _tensors(node.meta.get("val")):
            state.setdefault(_key(t), (kind, rounded(hint(t.untyped_storage().nbytes()))))
    produced_by: dict[int, int] = {}  # storage key -> producing forward node
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

    def keys_of(node: fx.Node) -> list[int]:
        if node in node_keys:
            return node_keys[node]
        return [_key(t) for t in _tensors(node.meta.get("val"))]

    # Inductor lays convolutions out channels-last where it judges that faster (always with mkldnn on CPU): a
    # convolution's input or weight in another layout is copied in forward, and backward reads the copy.
    layout_copies = _layout_copies(joint, fw, keys_of, state) if _channels_last(joint.gm) else {}
    for key, (i, nbytes) in layout_copies.items():
        produced_by[key] = i
        size_of[key] = rounded(nbytes)

    def read_keys(node: fx.Node, arg: fx.Node) -> list[int]:
        """The storages ``node`` reads through ``arg``: a convolution reads the layout copy of a primal."""
        keys = keys_of(arg)
        if node.target in _CONVOLUTIONS:
            keys = [-key if -key in layout_copies else key for key in keys]
        return keys

    # Forward reads: per storage its forward readers' ops, and whether a kernel that needs it in memory reads it.
    readers: dict[int, set[int]] = defaultdict(set)
    needs_buffer: set[int] = set()
    for i, node in enumerate(fw):
        o = op_of_node[i]
        for arg in node.all_input_nodes:
            for key in read_keys(node, arg):
                if key in produced_by:
                    readers[key].add(o)
                    if kinds.extern(node):
                        needs_buffer.add(key)
    for key in layout_copies:  # forward returns the copy for backward whatever the plan: held to forward's end
        readers[key].add(n_ops - 1)
    # Outputs of the forward: the graph's outputs (after any mutated inputs' new values).
    out_nodes = [a for a in joint.forward_outputs if isinstance(a, fx.Node)]
    tensor_outputs = [n for n in out_nodes if _tensors(n.meta.get("val"))]
    returned = [t.meta["example_value"] for n in graph.graph_module.graph.nodes if n.op == "output"
                for t in tree_leaves(n.args[0])
                if isinstance(t, fx.Node) and isinstance(t.meta.get("example_value"), torch.Tensor)]
    user_outputs = tensor_outputs[-len(returned):] if returned else []
    if uses is None:  # as the eager profile's step: the scalars get a gradient when there are any, else every output
        uses = [GRADIENT if r else HELD for r in gradient_receivers(returned)]
    output_use: dict[int, str] = {}
    for k, node in enumerate(user_outputs):
        use = uses[k] if k < len(uses) else GRADIENT
        for key in keys_of(node):
            if key in produced_by:
                output_use[key] = min(output_use.get(key, DROPPED), use, key=(GRADIENT, HELD, DROPPED).index)

    # Backward: ranks, what it reads of the forward (saved), and its own buffers.
    rank_of_bw: list[int] = []
    current = n_ops - 1
    out_of_order = 0
    for node in bw:
        # A backward node reads what its forward op read or made: its rank is at least their producers'.
        made_by = [op_of_node[produced_by[key]] for arg in node.all_input_nodes for key in keys_of(arg)
                   if key in produced_by]
        own = op_of_origin(origin(node))
        rank = max([own if own is not None else current, *made_by])
        if rank > current:
            out_of_order += 1
        current = min(current, rank)
        rank_of_bw.append(max(rank, 0))
    log.debug("%d of %d backward nodes run after a later op's", out_of_order, len(bw))
    saved_at: dict[int, set[int]] = defaultdict(set)
    last_bw_read: dict[int, int] = {}
    for k, node in enumerate(bw):
        for arg in node.all_input_nodes:
            for key in read_keys(node, arg):
                if key in produced_by:
                    saved_at[key].add(rank_of_bw[k])
                    readers[key].add(rank_of_bw[k])  # held for that op's backward, as if it read it in forward
                    last_bw_read[key] = k
                    if kinds.extern(node):
                        needs_buffer.add(key)

    # Tracked storages: those that outlive their op, are saved, or are returned.
    def outlives(key: int) -> bool:
        o = op_of_node[produced_by[key]]
        return any(r > o for r in readers.get(key, ())) or key in saved_at or key in output_use

    tracked = sorted((k for k in produced_by if outlives(k)), key=lambda k: (produced_by[k], k))
    sid = {k: s for s, k in enumerate(tracked)}
    producer = np.array([op_of_node[produced_by[k]] for k in tracked], dtype=np.int64)
    last_use = np.array([n_ops if output_use.get(k, DROPPED) != DROPPED else
                         max([op_of_node[produced_by[k]], *readers.get(k, ())]) for k in tracked], dtype=np.int64)
    producer_fusible = {k: kinds.fusible(fw[produced_by[k]]) for k in produced_by}
    materialized_in_forward = np.array([not producer_fusible[k] or k in output_use or k in needs_buffer
                                        for k in tracked], dtype=bool)
    materialized_when_rebuilt = np.array([not producer_fusible[k] or k in needs_buffer for k in tracked], dtype=bool)

    op_inputs: list[dict[int, set[int]]] = [defaultdict(set) for _ in range(n_ops)]
    for key, ops in readers.items():
        if key not in sid:
            continue
        p = op_of_node[produced_by[key]]
        for o in ops:
            if o != p:
                op_inputs[o][p].add(sid[key])

    # --- Forward transients inside each op, FLOPs, and time.
    def materialized(key: int) -> bool:
        return key in produced_by and (not producer_fusible[key] or key in needs_buffer or key in output_use)

    last_reader: dict[int, int] = {}
    for i, node in enumerate(fw):
        for arg in node.all_input_nodes:
            for key in keys_of(arg):
                last_reader[key] = i
    forward_extra = [0] * n_ops
    forward_seconds = [0.0] * n_ops
    flops = [0] * n_ops
    for o, members in enumerate(op_nodes):
        live = peak = 0
        internal = {k for i in members for k in keys_of(fw[i]) if k in produced_by and k not in sid
                    and produced_by[k] == i and materialized(k)}
        for i in members:
            node = fw[i]
            for key in keys_of(node):
                if key in internal and produced_by[key] == i:
                    live += size_of[key]
            peak = max(peak, live)
            for key in list(internal):
                if last_reader.get(key, produced_by[key]) <= i and produced_by[key] <= i:
                    live -= size_of[key]
                    internal.discard(key)
            node_flops = _flops(node)
            flops[o] += node_flops
            forward_seconds[o] += _node_seconds(node, node_flops, keys_of, materialized, size_of, state, kinds,
                                                rates)
        forward_extra[o] = peak

    # --- Backward: the gradient side (buffers backward makes) per rank, and backward time.
    grad_start, grad_peak, grad_after, backward_seconds, backward_flops, gradient_bytes = \
        _backward(joint, bw, rank_of_bw, n_ops, keys_of, produced_by, size_of, state, kinds, rates, rounded,
                  last_bw_read, graph.kinds)

    facts = {i: NodeFacts(random=_random(fw[i]), pin_reason=pinned.get(op_of_node[i], ""))
             for i in range(len(fw)) if op_of_node[i] in pinned}
    ops = [OpProfile(index=o, nodes=tuple(members), name=_op_name(op_origin[o], members, fw, captured),
                     flops=flops[o], forward_extra_bytes=forward_extra[o], snapshot_bytes=0,
                     random=any(_random(fw[i]) for i in members), mutates_state=any(_writes_input(fw[i])
                                                                                    for i in members),
                     pin_reason=pinned.get(o, ""), forward_seconds=forward_seconds[o])
           for o, members in enumerate(op_nodes)]
    saved_ops = [tuple(sorted(saved_at.get(k, ()))) for k in tracked]

    def state_bytes(kind: str) -> int:
        return sum(b for k, b in state.values() if k == kind)

    baseline = state_bytes(PARAMETER) + state_bytes(BUFFER) + state_bytes(INPUT)
    profile = GraphProfile(
        ops=ops,
        storage_bytes=np.array([size_of[k] for k in tracked], dtype=np.int64),
        storage_producer=producer,
        storage_last_use=last_use,
        storage_saved_by=saved_ops,
        op_inputs=[tuple((p, tuple(sorted(ss))) for p, ss in sorted(ins.items())) for ins in op_inputs],
        baseline_bytes=baseline,
        parameter_bytes=state_bytes(PARAMETER),
        buffer_bytes=state_bytes(BUFFER),
        input_bytes=state_bytes(INPUT),
        gradient_bytes=gradient_bytes,
        measured_peak_bytes=0,
        backward_flops=backward_flops,
        node_facts=facts,
        op_of_node=op_of_node,
        node_storages={i: tuple(sid.get(k, -1) for k in keys_of(node) if k not in state)
                       for i, node in enumerate(fw)},
        reaches_output=np.ones(n_ops, dtype=bool),
        op_storages=[tuple(sorted({sid[k] for i in members for k in keys_of(fw[i]) if k in sid}))
                     for members in op_nodes],
        held_through_forward=np.zeros(len(tracked), dtype=bool),
        storage_saved_at=saved_ops,
        node_op=np.arange(n_ops, dtype=np.int64),
        grad_start=np.array(grad_start, dtype=np.int64),
        grad_peak=np.array(grad_peak, dtype=np.int64),
        grad_after_release=np.array(grad_after, dtype=np.int64),
        backward_seconds=np.array(backward_seconds, dtype=float),
        cost_source=f"estimated for inductor's kernels on {rates.describe()}",
        output_uses=tuple(uses[:len(user_outputs)]),  # as assumed, as the eager profile's: what calls are checked by
        materialized_in_forward=materialized_in_forward,
        materialized_when_rebuilt=materialized_when_rebuilt,
        recompute_shared=True,
    )
    from sublinear.simulation.timeline import simulate  # noqa: PLC0415 - the eager plan's peak, for the summary
    from sublinear.core.plan import Plan  # noqa: PLC0415

    profile = dataclasses.replace(profile, measured_peak_bytes=simulate(profile, Plan.no_split(n_ops)).peak_bytes)
    return CompiledProfile(profile, tuple(node.name for node in fw))


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


def _backward(joint: JointGraph, bw: list[fx.Node], rank_of_bw: list[int], n_ops: int, keys_of, produced_by,
              size_of: dict[int, int], state, kinds: _Kinds, rates: DeviceRates, rounded,
              last_bw_read: dict[int, int], graph_kinds: tuple[str, ...]):
    """Per rank: gradient-side bytes (tangents and the buffers backward makes) at the start of its backward, at their
    peak before it releases the last forward value it reads, and after; per rank its backward seconds; the
    backward's FLOPs, and the parameters' gradient bytes at the end."""
    outputs: dict[int, str] = {}
    for k, grad in enumerate(joint.gradients):
        if isinstance(grad, fx.Node):
            kind = graph_kinds[k] if k < len(graph_kinds) else INPUT
            for key in keys_of(grad):
                outputs[key] = kind
    sizes: dict[int, int] = {}
    born: dict[int, int] = {}  # gradient-side storage -> the backward node making it (-1: a tangent)
    for node in joint.tangents:
        for t in _tensors(node.meta.get("val")):
            sizes.setdefault(_key(t), rounded(hint(t.untyped_storage().nbytes())))
            born.setdefault(_key(t), -1)
    needs_buffer: set[int] = set()
    last: dict[int, int] = {}
    for k, node in enumerate(bw):
        for t in _tensors(node.meta.get("val")):
            key = _key(t)
            if key not in produced_by and key not in state and key not in born:
                born[key] = k
                sizes[key] = rounded(hint(t.untyped_storage().nbytes()))
        for arg in node.all_input_nodes:
            for key in keys_of(arg):
                last[key] = k
                if kinds.extern(node):
                    needs_buffer.add(key)

    def buffer(key: int) -> bool:
        k = born.get(key)
        return k is not None and (k < 0 or not kinds.fusible(bw[k]) or key in needs_buffer or key in outputs)

    def readable(key: int) -> bool:
        return key in produced_by or buffer(key)

    all_sizes = {**size_of, **sizes}
    live = sum(sizes[key] for key, k in born.items() if k < 0)
    start: list[int | None] = [None] * n_ops
    before, after, left = [0] * n_ops, [0] * n_ops, [0] * n_ops
    seconds = [0.0] * n_ops
    last_release: dict[int, int] = {}  # rank -> its last backward node that reads a forward value for the last time
    for k in last_bw_read.values():
        last_release[rank_of_bw[k]] = max(last_release.get(rank_of_bw[k], -1), k)
    released: set[int] = set()
    total_flops = 0
    # Inductor fuses the nodes between two library kernels into one kernel: it allocates what they make before it
    # runs, and frees what they read last after it.
    for segment in _segments(bw, kinds):
        for k in segment:
            r = rank_of_bw[k]
            if start[r] is None:
                start[r] = before[r] = after[r] = live
        made = [key for k in segment for key in dict.fromkeys(keys_of(bw[k])) if born.get(key) == k and buffer(key)]
        live += sum(sizes[key] for key in made)
        for r in {rank_of_bw[k] for k in segment}:
            if r in released:
                after[r] = max(after[r], live)
            else:
                before[r] = max(before[r], live)
                after[r] = live
        inside = set(segment)
        freed = {key for k in segment for arg in bw[k].all_input_nodes for key in keys_of(arg)
                 if last.get(key) in inside}
        freed |= {key for key in made if key not in last}
        live -= sum(sizes[key] for key in freed if buffer(key) and key not in outputs)
        for k in segment:
            r = rank_of_bw[k]
            left[r] = live
            if last_release.get(r) == k:
                released.add(r)
            node_flops = _flops(bw[k])
            total_flops += node_flops
            seconds[r] += _node_seconds(bw[k], node_flops, keys_of, readable, all_sizes, state, kinds, rates)
    carried = sum(sizes[key] for key, k in born.items() if k < 0)  # before the first backward node: the tangents
    for r in range(n_ops - 1, -1, -1):
        if start[r] is None:
            start[r] = before[r] = after[r] = carried
        else:
            carried = left[r]
    parameter_grads = sum(sizes[key] for key, kind in outputs.items() if kind == PARAMETER and key in sizes)
    return start, before, after, seconds, total_flops, parameter_grads


_CONVOLUTIONS = (torch.ops.aten.convolution.default, torch.ops.aten.convolution_backward.default)


def _channels_last(gm: fx.GraphModule) -> bool:
    """Whether inductor will lay this graph's convolutions out channels-last (its own heuristic)."""
    from torch._inductor.graph import GraphLowering  # noqa: PLC0415

    try:
        return bool(GraphLowering.decide_layout_opt(gm, is_inference=False))
    except Exception:  # noqa: BLE001 - a heuristic that cannot read this graph: inductor's default layout
        return False


def _layout_copies(joint: JointGraph, fw: list[fx.Node], keys_of, state) -> dict[int, tuple[int, int]]:
    """Per primal storage a forward convolution reads in a layout other than channels-last: (the first such
    convolution's position, the copy's bytes), keyed by the negated storage key."""
    copies: dict[int, tuple[int, int]] = {}
    for i, node in enumerate(fw):
        if node.target is not torch.ops.aten.convolution.default:
            continue
        for arg in node.args[:2]:
            value = arg.meta.get("val") if isinstance(arg, fx.Node) else None
            if not isinstance(value, torch.Tensor) or value.dim() != 4 or \
                    value.is_contiguous(memory_format=torch.channels_last):
                continue
            for key in keys_of(arg):
                if key in state and -key not in copies:
                    copies[-key] = (i, hint(value.numel()) * value.element_size())
    return copies


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


def _op_name(orig: int | None, members: list[int], fw: list[fx.Node], captured: list[fx.Node]) -> str:
    if orig is not None and 0 <= orig < len(captured):
        node = captured[orig]
        path = module_path(node)
        text = f"{path} ({node.name})" if path else node.name
    else:
        text = f"{fw[members[0]].name} (inductor pattern)"
    return text if len(members) == 1 else f"{text} +{len(members) - 1}"
