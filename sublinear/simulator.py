"""Simulate: predicted peak memory and recompute FLOPs of one training step under a plan.

The one scoring function every planner uses. It needs only a :class:`GraphProfile` (plain numbers) and follows
the plan semantics in :mod:`sublinear.plan` to the storage: each storage lives from the op that produced it until
its last holder lets go (the forward values reading it, autograd for retained saves, a block's frame, the
recompute of its block, the caller for outputs). The gradient side of backward is plan-independent and taken
from the profiled eager step. Under FSDP2 the parameters and gradients are counted as FSDP holds them per rank
(:mod:`sublinear.sharding`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .plan import Plan
from .profiler import GraphProfile

__all__ = ["PlanAnalysis", "Simulation", "analyse", "simulate", "timeline"]


@dataclass(frozen=True)
class Simulation:
    peak_bytes: int  # everything live at the peak: parameters, buffers, inputs, gradients, activations
    recompute_flops: int
    forward_peak_bytes: int
    backward_peak_bytes: int
    peak_slot: str  # where the peak happens, for humans

    @property
    def activation_peak_bytes(self) -> int:
        return self.peak_bytes


@dataclass(frozen=True)
class PlanAnalysis:
    """Derived facts of a plan that both the simulator and ``sublinear plan`` report."""

    block_of: np.ndarray
    group_of: np.ndarray  # per block: its group (blocks joined by soft split points share retained inputs)
    recomputed: np.ndarray  # per op: may be recomputed (not kept, not pinned, not in the last block)
    retained: np.ndarray  # per storage
    dropped: np.ndarray  # per storage: saved by autograd but not retained (rebuilt in backward)
    closure: list[list[int]]  # per block: ops re-run in backward, ascending (may reach into earlier blocks of its group)
    trigger: list[int]  # per block: operator node (rank) whose backward first needs a dropped storage (-1: none)
    frame_end: list[int]  # per block: rank after whose backward its group's frame is released (-1: none)
    group_end: list[int]  # per block: the last op of its group


def analyse(profile: GraphProfile, plan: Plan) -> PlanAnalysis:
    n = profile.num_ops
    plan.validate(n)
    splits = np.asarray(plan.split_points, dtype=np.int64)
    ops = np.arange(n)
    block_of = np.searchsorted(splits, ops) if n else np.zeros(0, dtype=np.int64)
    last_block = len(splits) - 1
    recomputed = block_of != last_block
    for o in plan.kept:
        recomputed[o] = False
    for op in profile.ops:
        if op.pinned:
            recomputed[op.index] = False

    group_of = np.asarray(plan.group_of_blocks(), dtype=np.int64)
    group_of_op = group_of[block_of] if n else block_of
    last_group = int(group_of[-1]) if len(group_of) else 0
    producer = profile.storage_producer
    last_use = profile.storage_last_use
    producer_group = group_of_op[producer] if len(producer) else producer
    reader_group = np.where(last_use >= n, last_group + 1, group_of_op[np.minimum(last_use, max(n - 1, 0))]) \
        if len(producer) else producer
    retained = (~recomputed[producer]) | (reader_group > producer_group) if len(producer) else producer.astype(bool)
    for o in np.flatnonzero(~recomputed):  # a kept op's values stay, and so do the storages they view
        retained[list(profile.op_storages[o])] = True
    reaches = profile.reaches_output
    saved = np.array([any(reaches[o] for o in ops_) for ops_ in profile.storage_saved_by], dtype=bool)
    dropped = saved & ~retained

    num_blocks = len(splits)
    closure_sets: list[set[int]] = [set() for _ in range(num_blocks)]
    trigger = [-1] * num_blocks
    group_frame_end: dict[int, int] = {}
    node_op = profile.node_op
    for s in np.flatnonzero(dropped):
        for r in profile.storage_saved_at[s]:  # each saving block rebuilds its own copy
            if not reaches[node_op[r]]:
                continue
            b = int(block_of[node_op[r]])
            closure_sets[b].add(int(producer[s]))
            trigger[b] = max(trigger[b], r)
            g = int(group_of[b])
            group_frame_end[g] = min(group_frame_end.get(g, r), r)
    frame_end = [group_frame_end.get(int(g), -1) for g in group_of]
    group_last = {int(g): splits[b] for b, g in enumerate(group_of)}
    group_end = [int(group_last[int(g)]) for g in group_of]
    closure = []
    for members in closure_sets:
        stack = list(members)
        while stack:
            j = stack.pop()
            for p, storages in profile.op_inputs[j]:
                if p not in members and any(not retained[s] for s in storages):
                    members.add(p)
                    stack.append(p)
        closure.append(sorted(members))
    return PlanAnalysis(block_of, group_of, recomputed, retained, dropped, closure, trigger, frame_end, group_end)


def simulate(profile: GraphProfile, plan: Plan) -> Simulation:
    """Predict the step's peak bytes and recompute FLOPs under ``plan``."""
    n = profile.num_ops
    if n == 0:
        base = profile.baseline_bytes + profile.gradient_bytes
        return Simulation(base, 0, base, base, "empty graph")
    a = analyse(profile, plan)
    totals, labels = timeline(profile, plan, a)
    peak_at = int(np.argmax(totals))
    recompute_flops = sum(profile.ops[j].flops for members in a.closure for j in members)
    return Simulation(
        peak_bytes=int(totals[peak_at]),
        recompute_flops=int(recompute_flops),
        forward_peak_bytes=int(totals[:n].max()),
        backward_peak_bytes=int(totals[n:].max()),
        peak_slot=labels[peak_at],
    )


def timeline(profile: GraphProfile, plan: Plan, a: PlanAnalysis | None = None) -> tuple[np.ndarray, list[str]]:
    """Predicted live bytes at every slot of the step (forward ops, recomputes, backward ops), with labels."""
    n = profile.num_ops
    a = a or analyse(profile, plan)
    ops = profile.ops

    # Timeline: forward slots 0..n-1, then backward node by node (two slots each: before and after it frees what
    # it saved), with each block's recompute just before the backward of the node that first needs it.
    node_op = profile.node_op
    backward_slot = np.zeros(len(node_op), dtype=np.int64)
    recompute_slot: dict[tuple[int, int], int] = {}  # (block, op) -> slot: an op may be re-run by several blocks
    extra: list[int] = [op.forward_extra_bytes for op in ops]
    labels: list[str] = [f"forward {op.name}" for op in ops]
    triggers = {r: b for b, r in enumerate(a.trigger) if r >= 0}
    t = n
    for r in range(len(node_op) - 1, -1, -1):
        name = ops[node_op[r]].name
        b = triggers.get(r)
        if b is not None:
            for j in a.closure[b]:
                recompute_slot[b, j] = t
                extra.append(ops[j].forward_extra_bytes + int(profile.grad_start[r]))
                labels.append(f"recompute {ops[j].name}")
                t += 1
        backward_slot[r] = t
        extra.extend((int(profile.grad_peak[r]), int(profile.grad_after_release[r])))
        labels.extend((f"backward {name}", f"backward {name}, after release"))
        t += 2
    end = t
    extra.append(profile.gradient_bytes)
    labels.append("end of step")
    held = np.zeros(end + 2, dtype=np.int64)

    def hold(start: int, stop: int, nbytes: int) -> None:
        # Allocated during slot `start` (counted there by `extra`), released after slot `stop`.
        if stop > start:
            held[start + 1] += nbytes
            held[stop + 1] -= nbytes

    retained, dropped = a.retained, a.dropped
    producer, last_use = profile.storage_producer, profile.storage_last_use
    sizes = profile.storage_bytes
    frame_stop = [backward_slot[e] if e >= 0 else -1 for e in a.frame_end]
    frame_inputs = _frame_inputs(profile, a)
    in_forward_frame = _forward_frame_inputs(profile, a)
    reaches = profile.reaches_output
    released = _forward_release(profile, end)
    cached = profile.held_through_forward
    for s in range(len(sizes)):
        p = int(producer[s])
        stop = end if last_use[s] >= n else int(last_use[s])
        if len(cached) and cached[s]:
            stop = max(stop, n - 1)
        for r in profile.storage_saved_at[s]:
            o = node_op[r]
            if not reaches[o]:
                stop = max(stop, int(released[o]))  # stored: its node dies in forward, never recomputed
            elif retained[s]:
                stop = max(stop, int(backward_slot[r]))
        for b in in_forward_frame.get(s, ()):
            stop = max(stop, a.group_end[b])
        for b in frame_inputs.get(s, ()):
            stop = max(stop, frame_stop[b])
        hold(p, stop, int(sizes[s]))

    # Recomputed copies: live from their recompute until the last closure reader or the last dropped-save holder.
    for b, members in enumerate(a.closure):
        if not members:
            continue
        readers = _closure_readers(profile, members)
        for s in _storages_of_ops(profile, members):
            j = int(producer[s])
            start = recompute_slot[b, j]
            stop = start
            for k in readers.get(s, ()):
                stop = max(stop, recompute_slot[b, k])
            if dropped[s]:  # this block's copy serves the block's own savers
                stop = max(stop, *(int(backward_slot[r]) for r in profile.storage_saved_at[s]
                                   if reaches[node_op[r]] and a.block_of[node_op[r]] == b), 0)
            hold(start, stop, int(sizes[s]))

    in_closure = {j for members in a.closure for j in members}
    for op in ops:
        if op.snapshot_bytes and a.recomputed[op.index]:
            b = int(a.block_of[op.index])
            stop = frame_stop[b] if op.index in in_closure else a.group_end[b]
            hold(op.index, max(stop, op.index + 1), op.snapshot_bytes)

    live = np.cumsum(held)[: end + 1]
    totals = live + np.asarray(extra, dtype=np.int64) + profile.baseline_bytes
    if profile.sharding is not None:
        return _with_sharded_parameters(profile, totals, int(live[n]) + profile.baseline_bytes, labels, n)
    return totals, labels


def _with_sharded_parameters(profile: GraphProfile, totals: np.ndarray, after_forward: int, labels: list[str],
                             n: int):
    """The timeline with FSDP's parameter and gradient memory in place of the profiled full parameters.

    The step starts with an all-gather slot. Through forward and backward the rank holds its shards and the
    gathered parameters (padded), plus the all-gather buffer while the forward runs (and again when backward
    starts, if FSDP resharded after forward). After backward FSDP frees the gathered parameters, copies the
    gradients into the reduce-scatter input, frees them, and keeps the reduce-scatter output as the rank's gradient
    shards. A backend workspace (gloo) is a copy of the collective's full buffer while it runs.
    """
    s = profile.sharding
    shards_for_parameters = s.sharded_bytes - profile.parameter_bytes
    step = totals[:-1] + shards_for_parameters + s.unsharded_bytes
    step[:n] += s.all_gather_bytes
    head = [profile.baseline_bytes + shards_for_parameters + s.all_gather_bytes + s.workspace(s.all_gather_bytes)]
    labels = ["FSDP all-gather"] + labels
    if s.reshard_after_forward and len(step) > n:
        regather = after_forward + shards_for_parameters + s.all_gather_bytes + \
            max(s.unsharded_bytes, s.workspace(s.all_gather_bytes))
        step = np.concatenate([step[:n], [regather], step[n:]])
        labels.insert(n + 1, "FSDP all-gather for backward")
    after = totals[-1] + shards_for_parameters - profile.gradient_bytes
    tail = [after + profile.gradient_bytes + s.reduce_scatter_bytes,
            after + s.reduce_scatter_bytes + s.workspace(s.reduce_scatter_bytes) + s.sharded_gradient_bytes,
            after + s.sharded_gradient_bytes]
    return (np.concatenate([head, step, tail]).astype(np.int64),
            labels[:-1] + ["FSDP reduce-scatter copy-in", "FSDP reduce-scatter", labels[-1]])


def _forward_release(profile: GraphProfile, end: int) -> np.ndarray:
    """Per op: the forward slot after which its autograd nodes die when its values never reach the outputs.

    A node lives while any tensor downstream of it does, so the release of an op is the latest of its own values'
    last use and the release of every op that reads them.
    """
    n = profile.num_ops
    release = np.arange(n, dtype=np.int64)
    last = np.where(profile.storage_last_use >= n, end, profile.storage_last_use)
    np.maximum.at(release, profile.storage_producer, last)
    consumers: list[list[int]] = [[] for _ in range(n)]
    for c, inputs in enumerate(profile.op_inputs):
        for p, _ in inputs:
            consumers[p].append(c)
    for o in range(n - 1, -1, -1):
        for c in consumers[o]:
            release[o] = max(release[o], release[c])
    return release


def _storages_of_ops(profile: GraphProfile, members: list[int]) -> np.ndarray:
    return np.flatnonzero(np.isin(profile.storage_producer, members))


def _closure_readers(profile: GraphProfile, members: list[int]) -> dict[int, list[int]]:
    """storage -> ops of one closure that read it from a producer in the same closure."""
    readers: dict[int, list[int]] = {}
    inside = set(members)
    for j in members:
        for p, storages in profile.op_inputs[j]:
            if p in inside:
                for s in storages:
                    readers.setdefault(s, []).append(j)
    return readers


def _frame_inputs(profile: GraphProfile, a: PlanAnalysis) -> dict[int, list[int]]:
    """storage -> blocks whose frame holds it until the block's backward ends (closure inputs from outside)."""
    holds: dict[int, list[int]] = {}
    for b, members in enumerate(a.closure):
        inside = set(members)
        for j in members:
            for p, storages in profile.op_inputs[j]:
                if p not in inside:
                    for s in storages:
                        holds.setdefault(s, []).append(b)
    return holds


def _forward_frame_inputs(profile: GraphProfile, a: PlanAnalysis) -> dict[int, list[int]]:
    """storage -> blocks whose frame holds it during the block's forward (inputs of recomputable ops)."""
    holds: dict[int, list[int]] = {}
    for j in np.flatnonzero(a.recomputed):
        b = int(a.block_of[j])
        for p, storages in profile.op_inputs[j]:
            for s in storages:
                if a.retained[s]:
                    holds.setdefault(s, []).append(b)
    return holds
