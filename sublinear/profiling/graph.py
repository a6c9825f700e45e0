"""Profile: run one training step of a captured graph on fake tensors and record, per op, per storage and per
backward node, what the simulator and the rewriter need (:class:`sublinear.core.profile.GraphProfile`).

The step runs on fake tensors made from the graph's own input values (parameters included) in a fresh
``FakeTensorMode``, on the values' own devices: device constants, ``.to(device)`` and tensors created in forward
behave as in the real step, and no memory is used. Every storage an aten op returns is tracked until it dies
(:class:`sublinear.profiling.tracking.StorageTracker`), so views and in-place results alias their base and a storage
saved
for backward and also kept for another reason counts once.

Each node's time comes from :mod:`sublinear.profiling.costs`: measured on the device (real CPU/CUDA values), or
estimated
from FLOPs and bytes moved (meta). Measuring also reads the allocator's peak per node, so kernel workspace that no
storage tracker sees (scratch inside ``convolution_backward``) is part of the simulation.
"""

from __future__ import annotations

import bisect
import itertools
import logging
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import torch
from torch.utils._pytree import tree_leaves

from sublinear.capture.dynamo import BUFFER, INPUT, PARAMETER, CapturedGraph, FakeTwin, describe_node
from sublinear.core.profile import AutocastState, GraphProfile, NodeFacts, OpProfile
from sublinear.profiling.costs import (
    REFERENCE_GPU, DeviceRates, aten_work, device_rates, estimate_seconds, measure_node_costs, measure_node_memory,
    spec_tree,
)
from sublinear.execute.program import NodeProgram
from sublinear.tensors import autocast_context, autocast_state, device_of, storage_key
from sublinear.profiling.record import StepRecord, assemble
from sublinear.profiling.tracking import StorageTracker
from sublinear.training import DROPPED, GRADIENT, HELD, gradient_receivers, step_backward

__all__ = ["ProfileError", "profile"]

log = logging.getLogger("sublinear.profiling.graph")

_COMMUNICATION_NAMESPACES = frozenset({"_c10d_functional", "c10d", "c10d_functional", "_dtensor"})
# Batch-norm kernels update running_mean/var (args 3 and 4) when training (arg 5) without declaring the write in
# their schema or bumping version counters.
_BATCH_NORMS = frozenset(getattr(torch.ops.aten, name) for name in (
    "native_batch_norm", "batch_norm", "_batch_norm_impl_index", "cudnn_batch_norm", "miopen_batch_norm",
    "_native_batch_norm_legit", "_batch_norm_with_update"))
CUDA_ALLOCATION_GRANULARITY = 512  # the CUDA caching allocator rounds every block up to a multiple of 512 bytes


class ProfileError(RuntimeError):
    """The profiled step failed at a node; the message names the node, its module path and source line."""


def _written_tensors(func, args, kwargs) -> list[torch.Tensor]:
    """Tensors an aten call writes in place."""
    written = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            written.extend(t for t in tree_leaves(value) if isinstance(t, torch.Tensor))
    if func._overloadpacket in _BATCH_NORMS and len(args) > 5 and args[5] is True:
        written.extend(t for t in args[3:5] if isinstance(t, torch.Tensor))
    return written



# ---------------------------------------------------------------------------------------------------------------
# Tracing the eager step


class StorageEvent(NamedTuple):
    """One allocation or free during the profiled step, and where it happened."""

    backward: bool  # during backward
    context: int  # the forward node running, or the backward autograd node's sequence number (-1: none)
    kind: str  # "alloc" or "free"
    serial: int  # the storage's number in allocation order (-1: a storage allocated before tracking began)
    nbytes: int


class _StepRecorder(StorageTracker):
    """Storage tracker that attributes every allocation and free to a forward node or a backward autograd node,
    with FLOPs and bytes moved per forward node and per backward autograd node."""

    def __init__(self) -> None:
        super().__init__(listener=self._on_event)
        self.node: int | None = None  # forward node being executed
        self.backward = False
        self.events: list[StorageEvent] = []
        self.serial: dict[int, int] = {}
        self.serial_bytes: list[int] = []
        self.random_nodes: set[int] = set()
        self.comm_nodes: set[int] = set()
        self.writes: dict[int, list[int]] = defaultdict(list)  # node -> serials written in place
        self.flops: dict[int, int] = defaultdict(int)  # node -> forward FLOPs (torch.utils.flop_counter's formulas)
        self.io_bytes: dict[int, int] = defaultdict(int)  # node -> bytes its aten calls read and write
        self.calls: dict[int, int] = defaultdict(int)  # node -> aten calls
        self.backward_work: list[tuple[int, int, int]] = []  # per backward aten call: (sequence nr, FLOPs, bytes)
        self.state_serials: set[int] = set()
        self.backward_flops = 0
        self.autocast_cached: set[int] = set()  # casts of parameters that autocast's cache holds until forward ends

    def serial_of(self, t: torch.Tensor) -> int:
        return self.serial[t.untyped_storage()._cdata]

    def _context(self) -> int:
        if not self.backward:
            return -1 if self.node is None else self.node
        node = torch._C._current_autograd_node()
        return -1 if node is None else node._sequence_nr()

    def _on_event(self, kind: str, key: int, nbytes: int) -> None:
        if kind == "alloc":
            self.serial[key] = len(self.serial_bytes)
            self.serial_bytes.append(nbytes)
            serial = self.serial[key]
        else:
            serial = self.serial.pop(key, -1)
        self.events.append(StorageEvent(self.backward, self._context(), kind, serial, nbytes))

    def on_op(self, func, args, kwargs, out) -> None:
        flops, moved = aten_work(func, args, kwargs, out)
        if self.backward:
            self.backward_flops += flops
            self.backward_work.append((self._context(), flops, moved))
            return
        if self.node is None:
            return
        if (func is torch.ops.aten._to_copy.default and torch.is_autocast_cache_enabled()
                and isinstance(args[0], torch.Tensor) and args[0].untyped_storage()._cdata in self.serial
                and self.serial_of(args[0]) in self.state_serials and args[0].requires_grad):
            self.autocast_cached.update(self.serial_of(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor)
                                        and t.untyped_storage()._cdata in self.serial)
        self.flops[self.node] += flops
        self.io_bytes[self.node] += moved
        self.calls[self.node] += 1
        if torch.Tag.nondeterministic_seeded in func.tags:
            self.random_nodes.add(self.node)
        if func.namespace in _COMMUNICATION_NAMESPACES:
            self.comm_nodes.add(self.node)
        for t in _written_tensors(func, args, kwargs):
            if t.untyped_storage()._cdata in self.serial:
                self.writes[self.node].append(self.serial_of(t))


@dataclass
class _Trace:
    program: NodeProgram
    recorder: _StepRecorder
    node_out: dict[int, list[int]]  # node -> serial of each tensor leaf of its output (-1: untracked)
    node_saved: dict[int, list[int]]  # node -> serials autograd saved while it ran
    node_seq: list[tuple[int, int]]  # (first sequence number, node) in creation order
    node_modes: dict[int, tuple[bool, AutocastState]]  # node -> grad mode and autocast state it ran under
    node_inputs: dict[int, tuple[Any, Any]]  # node -> its args and kwargs as TensorSpec trees
    state_serials: dict[int, str]  # serial -> "parameter"/"buffer"/"input"
    output_serials: set[int]
    output_uses: tuple[str, ...]  # what the step did with each tensor output (see profile())
    gradient_sizes: list[int]  # bytes of each parameter gradient's storage after backward


def _profiling_device(values: Sequence[Any]) -> torch.device | None:
    """Where fakes must live: the values' device, except that meta values under autocast become fakes on the
    autocast device (autocast dispatches on the device, and meta has none)."""
    devices = {t.device for t in tree_leaves(list(values)) if isinstance(t, torch.Tensor)}
    if devices and all(d.type == "meta" for d in devices):
        for device in ("cuda", "cpu"):
            if torch.is_autocast_enabled(device):
                return torch.device(device)
    return None


def _trace_step(graph: CapturedGraph, values: Sequence[Any], keep_inputs: bool,
                uses: Sequence[str] | None) -> _Trace:
    twin = FakeTwin()
    inputs = twin.value(list(values), _profiling_device(values))
    program = NodeProgram(graph.graph_module)
    recorder = _StepRecorder()
    state_serials: dict[int, str] = {}
    recorder.listener = None
    for kind, value in zip(graph.kinds, inputs):
        for t in (leaf for leaf in tree_leaves(value) if isinstance(leaf, torch.Tensor)):
            key = t.untyped_storage()._cdata
            if key not in recorder.live:
                recorder.track([t])
                recorder.serial[key] = len(recorder.serial_bytes)
                recorder.serial_bytes.append(recorder.live[key])
                state_serials[recorder.serial[key]] = kind if kind in (PARAMETER, BUFFER) else INPUT
                recorder.state_serials.add(recorder.serial[key])
    recorder.listener = recorder._on_event

    node_out: dict[int, list[int]] = {
        i: [recorder.serial_of(t) for t in tree_leaves(v) if isinstance(t, torch.Tensor)]
        for i, v in zip(program.placeholders, inputs)}
    node_saved: dict[int, list[int]] = defaultdict(list)
    node_seq: list[tuple[int, int]] = []
    node_modes: dict[int, tuple[bool, AutocastState]] = {}
    node_inputs: dict[int, tuple[Any, Any]] = {}

    def before(i: int, env: list[Any]) -> None:
        recorder.node = i
        node_seq.append((torch._C._autograd._get_sequence_nr(), i))
        node_modes[i] = (torch.is_grad_enabled(), autocast_state())
        if keep_inputs:
            node_inputs[i] = spec_tree(program.arguments(i, env))

    def after(i: int, value: Any) -> None:
        node_out[i] = [recorder.serial[key] if (key := storage_key(t)) in recorder.serial else -1
                       for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
        recorder.node = None

    def pack(t: torch.Tensor) -> torch.Tensor:
        if recorder.node is not None and (key := storage_key(t)) in recorder.serial:
            node_saved[recorder.node].append(recorder.serial[key])
        return t.detach()

    with twin.mode, recorder, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        try:
            outputs = program.run(inputs, after=after, before=before)
        except Exception as exc:
            node = program.nodes[recorder.node] if recorder.node is not None else None
            where = describe_node(node) if node is not None else "the graph's inputs"
            raise ProfileError(f"sublinear could not profile the step: {where} failed on fake tensors: "
                               f"{type(exc).__name__}: {exc}") from exc
        torch.clear_autocast_cache()  # the step's forward ends here, as when `with torch.autocast()` exits
        node_seq.append((torch._C._autograd._get_sequence_nr(), -1))
        outputs = [t for t in tree_leaves(outputs) if isinstance(t, torch.Tensor)]
        if uses is None:
            uses = tuple(GRADIENT if r else HELD for r in gradient_receivers(outputs))
        outputs = [t for t, use in zip(outputs, uses) if use != DROPPED]  # the caller lets the others go now
        receives = [use == GRADIENT for use in uses if use != DROPPED]
        output_serials = {recorder.serial_of(t) for t in outputs if t.untyped_storage()._cdata in recorder.serial}
        recorder.backward = True  # the output gradients step_backward makes belong to the backward
        step_backward(outputs, receives)
        recorder.backward = False
        leaves = [t for kind, v in zip(graph.kinds, inputs) if kind == PARAMETER
                  for t in tree_leaves(v) if isinstance(t, torch.Tensor)]
        gradient_sizes = [st.nbytes() for st in {p.grad.untyped_storage()._cdata: p.grad.untyped_storage()
                                                 for p in leaves if p.grad is not None}.values()]
    del outputs
    return _Trace(program, recorder, node_out, dict(node_saved), node_seq, node_modes, node_inputs, state_serials,
                  output_serials, tuple(uses), gradient_sizes)


def _distinct(items):
    return list(dict.fromkeys(items))


# ---------------------------------------------------------------------------------------------------------------
# From the trace to ops


def profile(graph: CapturedGraph, values: Sequence[Any] | None = None, *, cost_model: str = "auto",
            rates: DeviceRates | None = None, uses: Sequence[str] | None = None) -> GraphProfile:
    """Profile one forward+backward step of ``graph`` called with ``values`` (its placeholder values, real or fake;
    by default the values it was captured with).

    ``cost_model``: "measure" times every node on the values' device, "estimate" uses FLOPs and bytes moved over
    ``rates`` (default: the device's calibrated rates; on meta, the reference GPU's), "reference" estimates for the
    reference GPU whatever the device (plans for a GPU's budget made on fake CPU tensors), "auto" estimates: the
    same plan in every process, where measured times vary from run to run.
    ``uses``: per tensor output, what the call did with it: :data:`GRADIENT` (a later graph or the loss read it,
    so backward hands it a gradient), :data:`HELD` (held to the end of the step without a gradient, as a KV
    cache) or :data:`DROPPED` (let go as soon as the graph returned). By default every output is held and
    :func:`step_backward` decides which get gradients.
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
    trace = _trace_step(graph, values, keep_inputs=device.type in ("cpu", "cuda"), uses=uses)
    granule = CUDA_ALLOCATION_GRANULARITY if device.type == "cuda" else 1
    if granule > 1:
        trace.recorder.serial_bytes = [-(-b // granule) * granule for b in trace.recorder.serial_bytes]
    grouping = _group(trace)
    lifetimes = _lifetimes(trace, grouping)
    costs = _costs(trace, grouping, device, measure, rates, granule)
    return assemble(_record(trace, grouping, lifetimes, costs, granule, _rng_state_bytes(device)))


@dataclass(frozen=True)
class _Grouping:
    """Operator nodes grouped into ops: in-place runs merge with the node that made what they write."""

    facts: dict[int, NodeFacts]  # per operator node
    groups: list[list[int]]  # per op: its nodes
    op_of_node: dict[int, int]
    rank_of_node: dict[int, int]  # operator node -> its position among operator nodes (its backward rank)
    producer_node: dict[int, int]  # storage serial -> the forward node that allocated it


def _group(trace: _Trace) -> _Grouping:
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


def _lifetimes(trace: _Trace, grouping: _Grouping) -> _Lifetimes:
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
                      and (last_use.get(s, -1) > op_of_node[node] or s in saved_by or s in rec.autocast_cached))
    return _Lifetimes(op_inputs=op_inputs, last_use=last_use, saved_by=saved_by, saved_at=saved_at, reaches=reaches,
                      storages=storages, sid={s: k for k, s in enumerate(storages)})


@dataclass(frozen=True)
class _Costs:
    """Per op the bytes its forward holds beyond its outputs, per rank the gradient-side bytes of its backward
    (measured workspace included), and per node the seconds of its forward and backward."""

    forward_extra: list[int]
    grad_start: list[int]
    grad_peak: list[int]
    grad_after: list[int]
    times: _NodeTimes


def _costs(trace: _Trace, grouping: _Grouping, device: torch.device, measure: bool, rates: DeviceRates | None,
           granule: int) -> _Costs:
    rec, op_of_node, rank_of_node = trace.recorder, grouping.op_of_node, grouping.rank_of_node
    windows = _forward_windows(rec.events, op_of_node, len(grouping.groups))
    extra = _forward_extra(rec.events, windows, len(grouping.groups), rec.serial_bytes)
    grad_start, grad_peak, grad_after, ran = _backward_gradient_profile(rec.events, trace.node_seq, rank_of_node,
                                                                   len(trace.program.operators), rec.serial_bytes)
    times = _node_times(trace, rank_of_node, device, measure, rates, granule)
    for i, peak in times.forward_peak_bytes.items():  # measured workspace raises the tracked extra bytes
        extra[op_of_node[i]] = max(extra[op_of_node[i]], peak)
    for i, peak in times.backward_peak_bytes.items():  # a node whose outputs get no gradient runs no backward
        r = rank_of_node[i]
        if ran[r]:
            grad_peak[r] = max(grad_peak[r], grad_start[r] + peak)
    return _Costs(forward_extra=extra, grad_start=grad_start, grad_peak=grad_peak, grad_after=grad_after, times=times)


def _rng_state_bytes(device: torch.device) -> int:
    """Bytes of the generator state the eager executor saves on ``device`` for each random node it may replay
    (the CPU's Mersenne Twister state; a CUDA Philox seed and offset)."""
    return 16 if device.type == "cuda" else int(torch.get_rng_state().numel()) if device.type == "cpu" else 0


def _record(trace: _Trace, grouping: _Grouping, lifetimes: _Lifetimes, costs: _Costs, granule: int,
            rng_state_bytes: int) -> StepRecord:
    """What the traced step says, as the one profiling stage reads it (storages named by their serials)."""
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
        measured_peak_bytes=_peak(rec.events, rec.serial_bytes, sum(rec.serial_bytes[s] for s in trace.state_serials)),
        held_through_forward={s for s in storages if s in rec.autocast_cached},
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


@dataclass(frozen=True)
class _NodeTimes:
    """Forward and backward seconds per operator node, where they come from, and (measured only) the allocator's
    peak per node beyond its inputs in forward and in backward: workspace that storage tracking misses."""

    forward_seconds: dict[int, float]
    backward_seconds: dict[int, float]
    source: str
    forward_peak_bytes: dict[int, int] = field(default_factory=dict)
    backward_peak_bytes: dict[int, int] = field(default_factory=dict)


def _node_times(trace: _Trace, rank_of_node: dict[int, int], device: torch.device, measure: bool,
                rates: DeviceRates | None, granule: int) -> _NodeTimes:
    """Each operator node's time, measured on ``device`` or estimated from its FLOPs and bytes over ``rates``; and on
    a CPU or CUDA device, whatever times the ops, the allocator's peak while it runs (kernel workspace)."""
    program, rec = trace.program, trace.recorder
    operators = program.operators
    nodes = [i for i in operators if i in trace.node_inputs and i not in _state_nodes(trace)]
    grad_mode = {i: trace.node_modes[i] for i in nodes}

    def call(i: int, args: tuple, kwargs: dict) -> Any:
        enabled, autocast = grad_mode[i]
        with torch.set_grad_enabled(enabled), autocast_context(autocast):
            return program.call(i, args, kwargs)

    round_up = (lambda b: -(-b // granule) * granule) if granule > 1 else (lambda b: b)
    if measure:
        costs = measure_node_costs(nodes, call, trace.node_inputs, device)
        return _NodeTimes(costs.forward_seconds, costs.backward_seconds, f"measured on {device}",
                          {i: round_up(costs.forward_peak_bytes.get(i, 0)) for i in nodes},
                          {i: round_up(costs.backward_peak_bytes.get(i, 0)) for i in nodes})
    rates = rates or (device_rates(str(device)) if device.type in ("cpu", "cuda") else REFERENCE_GPU)
    forward = {i: estimate_seconds(rec.flops.get(i, 0), rec.io_bytes.get(i, 0), rec.calls.get(i, 0), rates)
               for i in operators}
    starts = [s for s, _ in trace.node_seq]
    owners = [n for _, n in trace.node_seq]
    backward: dict[int, float] = defaultdict(float)
    for seq, flops, moved in rec.backward_work:
        k = bisect.bisect_right(starts, seq) - 1
        if 0 <= k and seq < 2**62 and owners[k] in rank_of_node:
            backward[owners[k]] += estimate_seconds(flops, moved, 1, rates)
    if not nodes:
        return _NodeTimes(forward, dict(backward), f"estimated for {rates.describe()}")
    signatures = {i: f"{program.operation(i)}|{trace.node_inputs[i]}|{grad_mode[i]}" for i in nodes}
    peaks = measure_node_memory(nodes, call, trace.node_inputs, device, signatures)
    return _NodeTimes(forward, dict(backward), f"estimated for {rates.describe()}",
                      {i: round_up(b) for i, b in peaks[0].items()}, {i: round_up(b) for i, b in peaks[1].items()})


def _state_nodes(trace: _Trace) -> set[int]:
    """Operator nodes that cannot run alone: a ``torch.vmap`` region's (its values only exist between functorch's
    nesting increment and decrement, which change global state) and calls into torch's private C functions that
    set modes (grad mode, autocast) rather than compute."""
    found: set[int] = set()
    depth = 0
    for i in trace.program.operators:
        target = trace.program.nodes[i].target
        name = getattr(target, "__name__", "")
        if name == "_vmap_increment_nesting":
            depth += 1
        if depth or (name.startswith("_") and getattr(target, "__module__", "") in ("torch._C", "torch._C._functorch")):
            found.add(i)
        if name == "_vmap_decrement_nesting":
            depth = max(0, depth - 1)
    return found


def _node_facts(i: int, trace: _Trace) -> NodeFacts:
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


def _pin_readers_of_updated_state(facts: dict[int, NodeFacts], trace: _Trace) -> None:
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


def _arg_slots_holding(node, program: NodeProgram, trace: _Trace, serials: set[int]):
    """Positions/names of ``node``'s direct args whose storage is in ``serials``, if they cover all of them."""
    slots, covered = [], set()
    for slot, arg in itertools.chain(enumerate(node.args), node.kwargs.items()):
        if isinstance(arg, torch.fx.Node):
            mine = set(trace.node_out.get(program.index[arg], [])) & serials
            if mine:
                slots.append(slot)
                covered |= mine
    return tuple(slots) if covered == serials else None


def _merge_in_place_runs(operators: list[int], trace: _Trace, producer_node: dict[int, int]) -> list[list[int]]:
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


def _forward_windows(events, op_of_node, n_ops) -> list[tuple[int, int]]:
    first = [-1] * n_ops
    last = [-1] * n_ops
    for t, (backward, ctx, *_rest) in enumerate(events):
        if backward or ctx < 0 or ctx not in op_of_node:
            continue
        o = op_of_node[ctx]
        if first[o] < 0:
            first[o] = t
        last[o] = t
    return list(zip(first, last))


def _forward_extra(events, windows, n_ops, sizes: list[int]) -> list[int]:
    """Per op: peak of bytes allocated inside the op and alive at once (frees of older storages ignored)."""
    extra = [0] * n_ops
    for o, (a, b) in enumerate(windows):
        if a < 0:
            continue
        mine: set[int] = set()
        live = peak = 0
        for backward, ctx, kind, serial, nbytes in events[a:b + 1]:
            if kind == "alloc":
                mine.add(serial)
                live += sizes[serial]
                peak = max(peak, live)
            elif serial in mine:
                live -= sizes[serial]
        extra[o] = peak
    return extra


def _backward_gradient_profile(events, node_seq, rank_of_node, n_ranks, sizes: list[int]):
    """Per operator node (rank): gradient-side bytes (storages allocated in backward) at the start of its
    backward, at their peak before it frees the activations it saved, and at their peak after that.

    Autograd runs its nodes in decreasing sequence number, so each fx node's backward is one contiguous window;
    the last free of a forward storage inside it marks the release of what it saved (an fx node may own several
    autograd nodes, as cross_entropy owns NllLossBackward and LogSoftmaxBackward, and what the later ones saved
    stays until they have run). A node with no backward work sees the gradient side as the previous window left it;
    the last list says which nodes had backward work.
    """
    starts = [s for s, _ in node_seq]
    nodes = [n for _, n in node_seq]

    def op_for(seq: int) -> int | None:
        k = bisect.bisect_right(starts, seq) - 1
        return None if k < 0 or seq >= 2**62 else rank_of_node.get(nodes[k])

    walk: list[tuple[int | None, int]] = []  # per backward event: its window's rank and the gradient-side change
    last_release: dict[int, int] = {}  # rank -> position in walk of its window's last free of a forward storage
    born_in_backward: set[int] = set()
    current: int | None = None
    for backward, ctx, kind, serial, _nbytes in events:
        if not backward:
            continue
        o = op_for(ctx) if ctx >= 0 else None
        current = o if o is not None else current
        if kind == "alloc":
            born_in_backward.add(serial)
            walk.append((current, sizes[serial]))
        elif serial in born_in_backward:
            born_in_backward.discard(serial)
            walk.append((current, -sizes[serial]))
        else:
            if current is not None:
                last_release[current] = len(walk)
            walk.append((current, 0))
    grad_live = 0
    start: list[int | None] = [None] * n_ranks
    before = [0] * n_ranks
    after = [0] * n_ranks
    left = [0] * n_ranks  # gradient side when the op's window closed
    released: set[int] = set()
    for k, (o, change) in enumerate(walk):
        if o is not None and start[o] is None:
            start[o] = before[o] = after[o] = grad_live
        grad_live += change
        if o is None:
            continue
        left[o] = grad_live
        if o in released:
            after[o] = max(after[o], grad_live)
        else:
            before[o] = max(before[o], grad_live)
            after[o] = grad_live
        if last_release.get(o) == k:
            released.add(o)
    ran = [v is not None for v in start]
    carried = 0
    for o in range(n_ranks - 1, -1, -1):
        if start[o] is None:
            start[o] = before[o] = after[o] = carried
        else:
            carried = left[o]
    return [int(v) for v in start], [int(v) for v in before], [int(v) for v in after], ran


def _op_name(program: NodeProgram, group: list[int]) -> str:
    first = program.describe(group[0], with_line=False)
    return first if len(group) == 1 else f"{first} +{len(group) - 1}"
