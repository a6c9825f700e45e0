"""The eager front end: :func:`profile` traces one training step of a captured graph on fake tensors
(:mod:`.eager_trace`), groups its operator nodes into ops (an in-place write joins the op that made what it writes),
follows each storage's lifetime and saves at op granularity, and records the step with its costs (:mod:`.eager_costs`)
as the :class:`~sublinear.profiling.record.StepRecord` that :func:`~sublinear.profiling.record.assemble` turns into
a :class:`~sublinear.core.profile.GraphProfile`.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from sublinear.capture.dynamo import BUFFER, INPUT, PARAMETER, CapturedGraph
from sublinear.core.profile import GraphProfile, NodeFacts, OpProfile
from sublinear.execute.program import NodeProgram
from sublinear.profiling.costs import REFERENCE_GPU, DeviceRates
from sublinear.profiling.kernels import blas_workspace_bytes, runs_cublaslt
from sublinear.profiling.eager_costs import EagerStepCosts, eager_step_costs, saved_rng_state_bytes
from sublinear.profiling.eager_trace import StepTrace, trace_step
from sublinear.profiling.record import StepRecord, assemble
from sublinear.tensors import device_of

__all__ = ["profile"]

CUDA_ALLOCATION_GRANULARITY = 512  # the CUDA caching allocator rounds every block up to a multiple of 512 bytes


def profile(graph: CapturedGraph, values: Sequence[Any] | None = None, *, cost_model: str = "auto",
            rates: DeviceRates | None = None, uses: Sequence[str] | None = None) -> GraphProfile:
    """Profile one forward+backward step of ``graph`` called with ``values`` (its placeholder values, real or fake;
    by default the values it was captured with).

    ``cost_model``: "measure" times every node on the values' device, "estimate" uses FLOPs and bytes moved over
    ``rates`` (default: the device's calibrated rates; on meta, the reference GPU's), "reference" estimates for the
    reference GPU whatever the device (plans for a GPU's budget made on fake CPU tensors), "auto" estimates: the
    same plan in every process, where measured times vary from run to run.
    ``uses``: per tensor output, what the call did with it: :data:`GRADIENT` (a later graph or the loss read it,
    so backward hands it a gradient), :data:`PASSED` (the same, but the caller let it go before backward reached
    the graph), :data:`HELD` (held to the end of the step without a gradient, as a KV cache) or :data:`DROPPED`
    (let go as soon as the graph returned). By default every output is held and
    :func:`step_backward` decides which get gradients.
    Raises :class:`~sublinear.profiling.eager_trace.ProfileError` when a node fails on the fake tensors.
    """
    values = graph.example_values if values is None else list(values)
    if values is None:
        raise ValueError("profile() needs the graph's input values: this graph was not captured with examples")
    device = torch.device(graph.model_device) if graph.model_device else device_of(values)
    measure = cost_model == "measure"
    if cost_model == "reference":
        rates = REFERENCE_GPU
    if measure and device.type not in ("cpu", "cuda"):
        raise ValueError(f"cost_model='measure' needs CPU or CUDA tensors; these are on {device}")
    trace = trace_step(graph, values, keep_inputs=device.type in ("cpu", "cuda"), uses=uses)
    granule = CUDA_ALLOCATION_GRANULARITY if device.type == "cuda" else 1
    if granule > 1:
        trace.recorder.serial_bytes = [-(-b // granule) * granule for b in trace.recorder.serial_bytes]
    grouping = _group(trace)
    lifetimes = _lifetimes(trace, grouping)
    costs = eager_step_costs(trace, grouping.op_of_node, grouping.rank_of_node, len(grouping.groups), device, measure,
                             rates, granule)
    return assemble(_record(trace, grouping, lifetimes, costs, granule, saved_rng_state_bytes(device),
                            blas_workspace_bytes(device, runs_cublaslt(trace.recorder.ops))))


@dataclass(frozen=True)
class _Grouping:
    """Operator nodes grouped into ops: in-place runs merge with the node that made what they write."""

    facts: dict[int, NodeFacts]  # per operator node
    groups: list[list[int]]  # per op: its nodes
    op_of_node: dict[int, int]
    rank_of_node: dict[int, int]  # operator node -> its position among operator nodes (its backward rank)
    producer_node: dict[int, int]  # storage serial -> the forward node that allocated it


def _group(trace: StepTrace) -> _Grouping:
    program, rec = trace.program, trace.recorder
    producer_node: dict[int, int] = {}
    for backward, ctx, kind, serial, _ in rec.events:
        if kind == "alloc" and not backward and ctx >= 0:
            producer_node[serial] = ctx
    facts = {i: _node_facts(i, trace) for i in program.operators}
    _pin_readers_of_updated_state(facts, trace)
    groups = _merge_in_place_runs(program.operators, trace, producer_node)
    return _Grouping(facts=facts, groups=groups,
                     op_of_node={node: o for o, group in enumerate(groups) for node in group},
                     rank_of_node={node: r for r, node in enumerate(program.operators)}, producer_node=producer_node)


@dataclass(frozen=True)
class _Lifetimes:
    """Value reads, storage lifetimes and saves, at op granularity, and the storages that can outlive their op."""

    op_inputs: list[list[tuple[int, tuple[int, ...]]]]  # per op: (producer op, serials) of each value it reads
    last_use: dict[int, int]  # serial -> the last op that reads it (the op count: a graph output)
    saved_by: dict[int, set[int]]  # serial -> ops whose autograd saves it
    saved_at: dict[int, set[int]]  # serial -> operator ranks that save it
    reaches: list[bool]  # per node: whether its values flow into the graph's outputs
    storages: list[int]  # the serials that can outlive the op that produced them, in serial order
    sid: dict[int, int]  # serial -> its index among ``storages``


def _lifetimes(trace: StepTrace, grouping: _Grouping) -> _Lifetimes:
    program, rec = trace.program, trace.recorder
    groups, op_of_node, producer_node = grouping.groups, grouping.op_of_node, grouping.producer_node
    value_serials = {i: _distinct(s for s in trace.node_out.get(i, []) if s >= 0) for i in range(len(program.nodes))}
    last_use: dict[int, int] = {}
    op_inputs: list[list[tuple[int, tuple[int, ...]]]] = [[] for _ in groups]
    for o, group in enumerate(groups):
        seen = set()
        for i in group:
            for j in program.inputs[i]:
                for s in value_serials[j]:
                    last_use[s] = max(last_use.get(s, -1), o)
                p = op_of_node.get(j)
                if p is not None and p != o and j not in seen:
                    seen.add(j)
                    op_inputs[o].append((p, tuple(value_serials[j])))
    for s in trace.output_serials:
        last_use[s] = len(groups)
    saved_by: dict[int, set[int]] = defaultdict(set)
    saved_at: dict[int, set[int]] = defaultdict(set)
    for i, serials in trace.node_saved.items():
        for s in serials:
            saved_by[s].add(op_of_node[i])
            saved_at[s].add(grouping.rank_of_node[i])
    # An op whose values never flow into the outputs has its autograd nodes freed in forward, with its outputs.
    reaches = [False] * len(program.nodes)
    for i in range(len(program.nodes) - 1, -1, -1):
        reaches[i] = any(u == program.output or reaches[u] for u in program.users[i])
    storages = sorted(s for s, node in producer_node.items()
                      if node in op_of_node and s not in trace.state_serials
                      and (last_use.get(s, -1) > op_of_node[node] or s in saved_by or s in rec.autocast_cached
                           or s in trace.dropped_serials))
    return _Lifetimes(op_inputs=op_inputs, last_use=last_use, saved_by=saved_by, saved_at=saved_at, reaches=reaches,
                      storages=storages, sid={s: k for k, s in enumerate(storages)})


def _record(trace: StepTrace, grouping: _Grouping, lifetimes: _Lifetimes, costs: EagerStepCosts, granule: int,
            rng_state_bytes: int, workspace_bytes: int) -> StepRecord:
    """What the traced step says, as the one profiling stage reads it (storages named by their serials);
    ``workspace_bytes``: the library workspaces held beside the step (:func:`~.kernels.blas_workspace_bytes`)."""
    program, rec = trace.program, trace.recorder
    operators, groups, facts = program.operators, grouping.groups, grouping.facts
    op_of_node, producer_node = grouping.op_of_node, grouping.producer_node
    storages = lifetimes.storages
    forward_seconds, backward_seconds = costs.times.forward_seconds, costs.times.backward_seconds
    ops = []
    for o, group in enumerate(groups):
        node_facts = [facts[i] for i in group]
        snapshot = sum(rec.serial_bytes[s] for i in group for s in set(rec.writes.get(i, []))
                       if s in trace.state_serials) + rng_state_bytes * sum(f.random for f in node_facts)
        ops.append(OpProfile(
            index=o, nodes=tuple(group), name=_op_name(program, group),
            flops=sum(rec.flops.get(i, 0) for i in group),
            forward_extra_bytes=costs.forward_extra[o],
            snapshot_bytes=snapshot,
            random=any(f.random for f in node_facts),
            mutates_state=any(f.state_args for f in node_facts),
            pin_reason="; ".join(f.pin_reason for f in node_facts if f.pin_reason),
            forward_seconds=float(sum(forward_seconds.get(i, 0.0) for i in group)),
        ))

    def kind_bytes(kind: str) -> int:
        return sum(rec.serial_bytes[s] for s, k in trace.state_serials.items() if k == kind)

    return StepRecord(
        ops=ops, node_facts=facts, op_of_node=op_of_node,
        node_keys={i: tuple(trace.node_out.get(i, [])) for i in operators},
        storage_bytes={s: rec.serial_bytes[s] for s in storages},
        producer={s: op_of_node[producer_node[s]] for s in storages},
        last_use=lifetimes.last_use, saved_by=lifetimes.saved_by, saved_at=lifetimes.saved_at,
        op_inputs=lifetimes.op_inputs, tracked=storages,
        reaches_output=[any(lifetimes.reaches[i] for i in group) for group in groups],
        node_op=[op_of_node[i] for i in operators],
        grad_start=costs.grad_start, grad_peak=costs.grad_peak, grad_after=costs.grad_after,
        backward_seconds=[backward_seconds.get(i, 0.0) for i in operators],
        parameter_bytes=kind_bytes(PARAMETER), buffer_bytes=kind_bytes(BUFFER), input_bytes=kind_bytes(INPUT),
        gradient_bytes=sum(-(-b // granule) * granule for b in trace.gradient_sizes),
        backward_flops=rec.backward_flops, cost_source=costs.times.source, output_uses=trace.output_uses,
        measured_peak_bytes=_peak(rec.events, rec.serial_bytes, sum(rec.serial_bytes[s] for s in trace.state_serials))
        + workspace_bytes, workspace_bytes=workspace_bytes,
        # autocast's cache, and the outputs the caller drops: the graph holds them until forward returns them
        held_through_forward={s for s in storages if s in rec.autocast_cached or s in trace.dropped_serials},
        output_storages=trace.output_keys,
        saved_inputs=trace.saved_inputs,
    )


def _peak(events, sizes: list[int], baseline: int) -> int:
    """The eager step's peak from the recorded events, at the (possibly rounded) storage sizes."""
    live = peak = baseline
    for _backward, _ctx, kind, serial, _nbytes in events:
        if serial < 0:
            continue
        live += sizes[serial] if kind == "alloc" else -sizes[serial]
        peak = max(peak, live)
    return peak


def _node_facts(i: int, trace: StepTrace) -> NodeFacts:
    program, rec = trace.program, trace.recorder
    node = program.nodes[i]
    writes = set(rec.writes.get(i, []))
    state_writes = {s for s in writes if s in trace.state_serials}
    pin = []
    if i in rec.comm_nodes:
        pin.append(f"{node.name} communicates")
    arg_slots: tuple[int | str, ...] = ()
    if state_writes:
        slots = _arg_slots_holding(node, program, trace, state_writes)
        if slots is None:
            pin.append(f"{node.name} writes state it does not receive as an argument")
        else:
            arg_slots = slots
    grad_enabled, autocast = trace.node_modes.get(i, (True, ()))
    return NodeFacts(random=i in rec.random_nodes, state_args=arg_slots, pin_reason="; ".join(pin),
                     grad_enabled=grad_enabled, autocast=autocast)


def _pin_readers_of_updated_state(facts: dict[int, NodeFacts], trace: StepTrace) -> None:
    """A node reading state that another node updates in place cannot be replayed later: pin it."""
    program, rec = trace.program, trace.recorder
    writers: dict[int, set[int]] = defaultdict(set)
    for i, serials in rec.writes.items():
        for s in serials:
            if s in trace.state_serials:
                writers[s].add(i)
    if not writers:
        return
    for i in facts:
        reads: set[int] = set()
        for j in program.inputs[i]:
            reads.update(trace.node_out.get(j, []))
        others = {w for s in reads if s in writers for w in writers[s] if w != i}
        if others:
            names = ", ".join(sorted(program.nodes[w].name for w in others))
            reason = f"{program.nodes[i].name} reads state that {names} updates in place"
            old = facts[i]
            facts[i] = replace(old, pin_reason="; ".join(r for r in (old.pin_reason, reason) if r))


def _arg_slots_holding(node, program: NodeProgram, trace: StepTrace, serials: set[int]):
    """Positions/names of ``node``'s direct args whose storage is in ``serials``, if they cover all of them."""
    slots, covered = [], set()
    for slot, arg in itertools.chain(enumerate(node.args), node.kwargs.items()):
        if isinstance(arg, torch.fx.Node):
            mine = set(trace.node_out.get(program.index[arg], [])) & serials
            if mine:
                slots.append(slot)
                covered |= mine
    return tuple(slots) if covered == serials else None


def _merge_in_place_runs(operators: list[int], trace: StepTrace, producer_node: dict[int, int]) -> list[list[int]]:
    """Group operator nodes so that every in-place write lands in the op that produced the storage, and every
    ``torch.vmap`` region (from functorch's nesting increment to its decrement) is one op: its values are batched
    wrappers with no storage of their own, and its nodes only run between the two."""
    position = {node: k for k, node in enumerate(operators)}
    reach = list(range(len(operators)))  # reach[k]: last operator position that must join k's group
    for node, serials in trace.recorder.writes.items():
        for s in serials:
            p = producer_node.get(s)
            if p is not None and p in position and node in position and p != node:
                a, b = position[p], position[node]
                reach[a] = max(reach[a], b)
    opened: list[int] = []
    for k, node in enumerate(operators):
        target = getattr(trace.program.nodes[node].target, "__name__", "")
        if target == "_vmap_increment_nesting":
            opened.append(k)
        elif target == "_vmap_decrement_nesting" and opened:
            start = opened.pop()
            reach[start] = max(reach[start], k)
    groups, current, end = [], [], -1
    for k, node in enumerate(operators):
        if current and k > end:
            groups.append(current)
            current = []
        current.append(node)
        end = max(end, reach[k])
    if current:
        groups.append(current)
    return groups


def _op_name(program: NodeProgram, group: list[int]) -> str:
    first = program.describe(group[0], with_line=False)
    return first if len(group) == 1 else f"{first} +{len(group) - 1}"


def _distinct(items):
    return list(dict.fromkeys(items))
