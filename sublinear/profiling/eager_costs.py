"""The eager step's costs, read off its trace (:mod:`.eager_trace`): per op the bytes its forward holds beyond its
outputs, per backward rank the gradient-side bytes through its backward, and per node the seconds of its forward and
backward, measured on the device or estimated from FLOPs and bytes moved (:mod:`.costs`). On a CPU or CUDA device
either way, the allocator's peak per node adds the kernel workspace no storage tracker sees.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch

from sublinear.profiling.costs import (
    REFERENCE_GPU, DeviceRates, device_rates, estimate_seconds, measure_node_costs, measure_node_memory,
)
from sublinear.profiling.eager_trace import StepTrace
from sublinear.tensors import autocast_context


@dataclass(frozen=True)
class EagerStepCosts:
    """Per op the bytes its forward holds beyond its outputs, per rank the gradient-side bytes of its backward
    (measured workspace included), and per node the seconds of its forward and backward."""

    forward_extra: list[int]
    grad_start: list[int]
    grad_peak: list[int]
    grad_after: list[int]
    times: _NodeTimes


def eager_step_costs(trace: StepTrace, op_of_node: dict[int, int], rank_of_node: dict[int, int], n_ops: int,
                     device: torch.device, measure: bool, rates: DeviceRates | None, granule: int) -> EagerStepCosts:
    """The step's costs, with operator nodes grouped into ``n_ops`` ops by ``op_of_node`` and ranked by
    ``rank_of_node``."""
    rec = trace.recorder
    windows = _forward_windows(rec.events, op_of_node, n_ops)
    extra = _forward_extra(rec.events, windows, n_ops, rec.serial_bytes)
    grad_start, grad_peak, grad_after, ran = _backward_gradient_profile(rec.events, trace.node_seq, rank_of_node,
                                                                        len(trace.program.operators), rec.serial_bytes)
    times = _node_times(trace, rank_of_node, device, measure, rates, granule)
    for i, peak in times.forward_peak_bytes.items():  # measured workspace raises the tracked extra bytes
        extra[op_of_node[i]] = max(extra[op_of_node[i]], peak)
    for i, peak in times.backward_peak_bytes.items():  # a node whose outputs get no gradient runs no backward
        r = rank_of_node[i]
        if ran[r]:
            grad_peak[r] = max(grad_peak[r], grad_start[r] + peak)
    return EagerStepCosts(forward_extra=extra, grad_start=grad_start, grad_peak=grad_peak, grad_after=grad_after,
                          times=times)


def saved_rng_state_bytes(device: torch.device) -> int:
    """Bytes of the generator state the eager executor saves on ``device`` for each random node it may replay
    (the CPU's Mersenne Twister state; a CUDA Philox seed and offset)."""
    return 16 if device.type == "cuda" else int(torch.get_rng_state().numel()) if device.type == "cpu" else 0


@dataclass(frozen=True)
class _NodeTimes:
    """Forward and backward seconds per operator node, where they come from, and (measured only) the allocator's
    peak per node beyond its inputs in forward and in backward: workspace that storage tracking misses."""

    forward_seconds: dict[int, float]
    backward_seconds: dict[int, float]
    source: str
    forward_peak_bytes: dict[int, int] = field(default_factory=dict)
    backward_peak_bytes: dict[int, int] = field(default_factory=dict)


def _node_times(trace: StepTrace, rank_of_node: dict[int, int], device: torch.device, measure: bool,
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
    forward = {i: estimate_seconds(rec.flops.get(i, 0), rec.io_bytes.get(i, 0), rec.calls.get(i, 0), rates,
                                   rec.half_flops.get(i, 0)) for i in operators}
    starts = [s for s, _ in trace.node_seq]
    owners = [n for _, n in trace.node_seq]
    backward: dict[int, float] = defaultdict(float)
    for seq, flops, moved, half in rec.backward_work:
        k = bisect.bisect_right(starts, seq) - 1
        if 0 <= k and seq < 2**62 and owners[k] in rank_of_node:
            backward[owners[k]] += estimate_seconds(flops, moved, 1, rates, flops if half else 0)
    if not nodes:
        return _NodeTimes(forward, dict(backward), f"estimated for {rates.describe()}")
    signatures = {i: f"{program.operation(i)}|{trace.node_inputs[i]}|{grad_mode[i]}" for i in nodes}
    peaks = measure_node_memory(nodes, call, trace.node_inputs, device, signatures)
    return _NodeTimes(forward, dict(backward), f"estimated for {rates.describe()}",
                      {i: round_up(b) for i, b in peaks[0].items()}, {i: round_up(b) for i, b in peaks[1].items()})


def _state_nodes(trace: StepTrace) -> set[int]:
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
