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

:func:`profile_joint` assembles the record from :mod:`.compiled_dataflow` (ops, storages, reads and ranks),
:mod:`.compiled_costs` (what inductor materialises, forward bytes and time, the backward walk) and
:mod:`.compiled_nodes` (one node's kind, FLOPs and time, a library kernel's scratch).
"""

from __future__ import annotations

import dataclasses
import logging
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import fx

from sublinear.capture.dynamo import BUFFER, INPUT, PARAMETER, CapturedGraph, module_path
from sublinear.capture.joint import JointGraph
from sublinear.core.plan import Plan
from sublinear.core.profile import GraphProfile, NodeFacts, OpProfile
from sublinear.core.units import format_bytes
from sublinear.profiling.compiled_costs import (
    BackwardWalk, ForwardCosts, GradientSide, forward_costs, materialized_predicate, walk_backward,
)
from sublinear.profiling.compiled_dataflow import (
    OpGrouping, StepStorages, StorageReads, backward_deadlines, group_ops, made_from, sources_of, step_storages,
    storage_reads,
)
from sublinear.profiling.compiled_nodes import (
    InductorKinds, channels_last_convolutions, draws_random, is_constant, library_scratch, tensor_leaves,
    writes_input,
)
from sublinear.profiling.compiled_reruns import reads_fused_into_reruns, rerun_grad_sides
from sublinear.profiling.costs import REFERENCE_GPU, DeviceRates, device_rates
from sublinear.profiling.kernels import blas_workspace_bytes, kernel_memory, runs_cublaslt
from sublinear.profiling.record import StepRecord, assemble
from sublinear.training import DROPPED, held_to_end

__all__ = ["CompiledProfile", "profile_compiled_step", "profile_joint"]

CUDA_ALLOCATION_GRANULARITY = 512

log = logging.getLogger("sublinear")


@dataclass(frozen=True)
class CompiledProfile:
    """A profile of the compiled step, with per forward node of the joint graph (the profile's node indices) its
    name, so that a plan can be turned into tags on the joint graph inductor traces again when it compiles, and per
    backward node that a gradient flows into its rank (where the compiled code runs it). ``fallback``: the step's
    profile in the other convolution layout, to plan in when no plan in this one meets the memory budget."""

    profile: GraphProfile
    node_names: tuple[str, ...]
    backward_ranks: dict[str, int] = dataclasses.field(default_factory=dict)
    channels_last: bool = False  # convolutions channels-last (inductor's layout optimization on; off: as traced)
    fallback: CompiledProfile | None = None


def profile_compiled_step(joint: JointGraph, graph: CapturedGraph, uses: Sequence[str] | None,
                          channels_last: bool | None = None, budgeted: bool = False) -> CompiledProfile:
    """The profile of ``graph``'s step under the convolution layout the config asks for (``channels_last``: True,
    inductor's own choice; False, the layouts as traced). None: inductor's choice unless the layouts as traced
    predict a lower peak of the unplanned step; then, without a memory budget (``budgeted`` False), the layouts as
    traced, and under one, inductor's with the layouts as traced as its fallback. Channels-last convolutions copy
    every activation and weight they read that is laid out otherwise, and forward keeps the copies backward reads,
    so inductor's choice can raise the step's memory above eager's; it is made for speed (always with oneDNN on the
    CPU), and a budget asks for the least time within it."""
    if channels_last is False:
        return profile_joint(joint, graph, uses, layout_optimization=False)
    inductors = profile_joint(joint, graph, uses)
    if channels_last or not inductors.channels_last:
        return inductors
    as_traced = profile_joint(joint, graph, uses, layout_optimization=False)
    lower = as_traced.profile.measured_peak_bytes < inductors.profile.measured_peak_bytes
    chosen = "channels-last" if budgeted or not lower else "as traced"
    log.info("sublinear: convolutions %s%s: the unplanned step's peak is predicted at %s channels-last (inductor's "
             "layout), %s as traced (channels_last=%s sets it)", chosen,
             ", as traced where no plan meets the budget" if budgeted and lower else "",
             format_bytes(inductors.profile.measured_peak_bytes), format_bytes(as_traced.profile.measured_peak_bytes),
             chosen == "channels-last")
    if not lower:
        return inductors
    return dataclasses.replace(inductors, fallback=as_traced) if budgeted else as_traced


def profile_joint(joint: JointGraph, graph: CapturedGraph, uses: Sequence[str] | None,
                  rates: DeviceRates | None = None, measure_scratch: bool = True,
                  layout_optimization: bool = True) -> CompiledProfile:
    """The profile of ``graph``'s training step as inductor compiles it from ``joint`` (with its
    ``layout_optimization`` setting).

    ``uses``: per tensor output of the graph, what the call does with it (gradient, held, dropped; see
    :func:`sublinear.profiling.graph.profile`); None: as :func:`sublinear.training.step_backward` by default.
    ``measure_scratch``: run each library kernel once on the device for its scratch space (CPU and CUDA).
    """
    kinds = InductorKinds()
    fw, bw = joint.forward, joint.backward
    device = next((t.device for n in joint.primals for t in tensor_leaves(n.meta.get("val"))), torch.device("cpu"))
    granule = CUDA_ALLOCATION_GRANULARITY if device.type == "cuda" else 1
    rates = rates or (device_rates(str(device)) if device.type in ("cpu", "cuda") else REFERENCE_GPU)
    channels_last = layout_optimization and channels_last_convolutions(joint.gm)
    grouping = group_ops(fw, kinds)
    storages = step_storages(joint, graph, fw, granule, channels_last)
    reads = storage_reads(joint, graph, grouping, storages, kinds, uses)
    measured = measure_scratch and device.type in ("cpu", "cuda")
    side = GradientSide(joint, storages, kinds, granule, graph.kinds)
    calls = library_scratch(fw + bw, kinds, channels_last, kernel_memory(str(device)) if measured else None,
                            set(fw), _released_by_copy(bw, storages, reads, side))
    materialized = materialized_predicate(storages, reads, kinds, fw)
    through = _read_through_rebuilt(fw, storages, reads, materialized)
    tracked = _tracked(grouping, storages, reads, through)
    dataflow = (made_from(fw, storages, tracked), backward_deadlines(bw, storages, reads, kinds))
    costs = forward_costs(fw, grouping, storages, reads, set(tracked), materialized, calls.scratch, kinds, rates)
    backward = walk_backward(joint, reads, len(grouping.nodes), storages, side, calls, rates,
                             {k for k in storages.produced_by if not materialized(k, rebuilt=True)})
    record = dataclasses.replace(_record(joint, graph, grouping, storages, reads, tracked, materialized, costs,
                                         backward, rates, _constants(storages, fw, kinds), through, dataflow),
                                 workspace_bytes=blas_workspace_bytes(device, runs_cublaslt(n.target for n in fw + bw)),
                                 library_made={k for k in tracked if kinds.extern(fw[storages.produced_by[k]])},
                                 read_in_rerun=reads_fused_into_reruns(joint, reads, storages, side,
                                                                       grouping.op_of_node),
                                 rerun_grad_side=rerun_grad_sides(joint, reads, storages, side, grouping.op_of_node,
                                                                  backward))
    profile = assemble(record)
    from sublinear.simulation.timeline import simulate  # noqa: PLC0415 - the unplanned step's peak, for reports

    profile = dataclasses.replace(profile, measured_peak_bytes=simulate(profile, Plan.no_split(profile.num_ops))
                                  .peak_bytes)
    flows = _gradient_flows(joint)
    return CompiledProfile(profile, tuple(node.name for node in fw),
                           {node.name: reads.rank_of_backward[k] for k, node in enumerate(bw) if node in flows},
                           channels_last)


def _released_by_copy(bw: list[fx.Node], storages: StepStorages, reads: StorageReads, side: GradientSide):
    """Whether a backward library call's argument is freed by the kernel that copies it into the layout the call
    takes (the copy takes its place): the call reads it last, and neither the caller nor the graph's outputs hold
    it."""
    index = {node: k for k, node in enumerate(bw)}

    def released(node: fx.Node, arg: fx.Node) -> bool:
        keys = storages.read_keys(node, arg)
        return node in index and bool(keys) and all(
            side.last.get(key) == index[node] and key not in reads.output_use and key not in side.outputs
            and key not in storages.state for key in keys)
    return released


def _constants(storages: StepStorages, fw: list[fx.Node], kinds: InductorKinds) -> set[int]:
    """The storages of constants (fusible nodes of no inputs: ``full``, ``zeros``, ``iota``). The graph's
    common-subexpression pass shares one between layers; making one again needs nothing, so no op reads a constant
    from the op that made it: a later layer re-run in backward does not re-run the first layer's op with it."""
    return {key for key, i in storages.produced_by.items() if is_constant(fw[i], kinds)}


def _gradient_flows(joint: JointGraph) -> set[fx.Node]:
    """The backward nodes an output's gradient flows into. The others are computed from forward values alone
    (a max-pool's indices from its window offsets, a ReLU's mask), and inductor may run them wherever those values
    are: fused into the kernel that recomputes them, many ranks before the backward that reads them."""
    flows = set(joint.tangents)
    for node in joint.backward:
        if any(arg in flows for arg in node.all_input_nodes):
            flows.add(node)
    return flows


def _read_through_rebuilt(fw: list[fx.Node], storages: StepStorages, reads: StorageReads,
                          materialized) -> dict[int, set[int]]:
    """Per storage, the ranks whose backward kernels read it through re-run values that backward reads and that are
    no buffers when re-run (beyond the ranks that save it): inductor computes such a value inside each backward
    kernel reading it, from the buffers it is made of (a dropout's mask from the random numbers its op draws, a
    softmax's output from the exponentials). Where the values are kept instead, they are buffers in forward, and
    backward reads them."""
    def rebuilt_buffer(key: int) -> bool:
        return materialized(key, rebuilt=True)

    through: dict[int, set[int]] = defaultdict(set)
    for key, ranks in reads.saved_at.items():
        if key in storages.produced_by and not rebuilt_buffer(key):
            for source in sources_of(fw, storages, key, rebuilt_buffer):
                through[source] |= ranks
    beyond = {key: ranks - reads.saved_at.get(key, set()) for key, ranks in through.items()}
    return {key: ranks for key, ranks in beyond.items() if ranks}


def _tracked(grouping: OpGrouping, storages: StepStorages, reads: StorageReads,
             through: dict[int, set[int]]) -> list[int]:
    """The storages that outlive their op (read by a later op or backward, also through the op's fused values when
    re-run) or that the graph returns, in order."""
    def outlives(key: int) -> bool:
        o = grouping.op_of_node[storages.produced_by[key]]
        return any(r > o for r in reads.readers.get(key, ())) or key in reads.saved_at or key in reads.output_use \
            or key in through

    return sorted((k for k in storages.produced_by if outlives(k)), key=lambda k: (storages.produced_by[k], k))


def _record(joint: JointGraph, graph: CapturedGraph, grouping: OpGrouping, storages: StepStorages, reads: StorageReads,
            tracked: list[int], materialized, costs: ForwardCosts, backward: BackwardWalk,
            rates: DeviceRates, constants: set[int], through: dict[int, set[int]],
            dataflow: tuple[dict[int, set[int]], dict[int, int]]) -> StepRecord:
    """``costs``: :func:`forward_costs`; ``constants``: storages no op reads from the op that made them;
    ``through``: :func:`_read_through_rebuilt`; ``dataflow``: per storage what it is made from and its backward
    deadline (:func:`made_from`, :func:`backward_deadlines`)."""
    fw, n_ops = joint.forward, len(grouping.nodes)
    op_of_node, produced = grouping.op_of_node, storages.produced_by
    captured = list(graph.graph_module.graph.nodes)
    ops = [OpProfile(index=o, nodes=tuple(members), name=_op_name(grouping.origins[o], members, fw, captured),
                     flops=costs.flops[o], forward_extra_bytes=costs.extra[o], snapshot_bytes=0,
                     random=any(draws_random(fw[i]) for i in members),
                     mutates_state=any(writes_input(fw[i]) for i in members), pin_reason=grouping.pinned.get(o, ""),
                     forward_seconds=costs.seconds[o], rerun_seconds=costs.rerun[o],
                     rerun_extra_bytes=costs.rerun_extra[o])
           for o, members in enumerate(grouping.nodes)]
    op_inputs: list[dict[int, set[int]]] = [defaultdict(set) for _ in range(n_ops)]
    for key, readers in reads.readers.items():
        if key in constants:
            continue
        p = op_of_node[produced[key]]
        for o in readers:
            if o != p:
                op_inputs[o][p].add(key)
    last_use = {k: n_ops if held_to_end(reads.output_use.get(k, DROPPED)) else
                max([op_of_node[produced[k]], *reads.readers.get(k, ())]) for k in tracked}

    def state_bytes(kind: str) -> int:
        return sum(b for k, b in storages.state.values() if k == kind)

    return StepRecord(
        ops=ops,
        node_facts={i: NodeFacts(random=draws_random(fw[i]), pin_reason=grouping.pinned.get(op_of_node[i], ""))
                    for i in range(len(fw)) if op_of_node[i] in grouping.pinned},
        op_of_node=op_of_node,
        node_keys={i: tuple(k for k in storages.keys_of(node) if k not in storages.state) for i, node in enumerate(fw)},
        storage_bytes=dict(storages.size_of), producer={k: op_of_node[i] for k, i in produced.items()},
        last_use=last_use, saved_by=reads.saved_at, saved_at=_held_to_kernel_end(reads.saved_at, backward.kernel_end),
        rebuilt_read_at=through,
        made_from=dataflow[0], deadline=dataflow[1],
        op_inputs=[sorted((p, sorted(keys)) for p, keys in inputs.items()) for inputs in op_inputs],
        tracked=tracked, reaches_output=[True] * n_ops, node_op=list(range(n_ops)),
        grad_start=backward.start, grad_peak=backward.before, grad_after=backward.after,
        grad_peak_freed=backward.freed_early,
        backward_seconds=backward.seconds,
        parameter_bytes=state_bytes(PARAMETER), buffer_bytes=state_bytes(BUFFER), input_bytes=state_bytes(INPUT),
        gradient_bytes=backward.gradient_bytes, backward_flops=backward.flops,
        cost_source=f"estimated for inductor's kernels on {rates.describe()}", output_uses=reads.uses,
        materialized_in_forward={k for k in tracked if materialized(k)},
        materialized_when_rebuilt={k for k in tracked if materialized(k, rebuilt=True)},
        saved_buffer={k for k in tracked if materialized(k) and not materialized(k, saved=False)
                      and k not in costs.in_place},
        fused_from={k: o for k, o in costs.fused_from.items() if k in tracked},
        kernel_start=backward.kernel_start,
        kernel_of_rank=backward.kernel_of_rank,
        taken_at=backward.taken_at,
        rerun_into=costs.rerun_into,
        # outputs the caller lets go before backward: the graph holds them until forward returns them
        held_through_forward={k for k in tracked if k in reads.output_use and not held_to_end(reads.output_use[k])},
        output_storages=reads.output_keys,
        recompute_shared=True,
        views_hold_bases=False,
    )


def _held_to_kernel_end(saved_at: dict[int, set[int]], kernel_end: dict[int, int]) -> dict[int, set[int]]:
    """The ranks whose backward reads each saved value, with the rank its last reading kernel runs down to."""
    return {k: ranks | {kernel_end[k]} if k in kernel_end else ranks for k, ranks in saved_at.items()}


def _op_name(orig: int | None, members: list[int], fw: list[fx.Node], captured: list[fx.Node]) -> str:
    if orig is not None and 0 <= orig < len(captured):
        node = captured[orig]
        path = module_path(node)
        text = f"{path} ({node.name})" if path else node.name
    else:
        text = f"{fw[members[0]].name} (inductor pattern)"
    return text if len(members) == 1 else f"{text} +{len(members) - 1}"
