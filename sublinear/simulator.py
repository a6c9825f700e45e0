"""Simulate: predicted peak memory and step time of one training step under a plan.

The one scoring function every planner uses. It needs only a :class:`GraphProfile` (plain numbers, no torch) and
follows the plan's analysis (:func:`sublinear.core.analysis.analyse`) to the storage: each storage lives from
the op that produced it until its last holder lets go (the forward values reading it, autograd for retained
saves, a block's frame, the recompute of its block, the caller for outputs). The gradient side of backward is plan-independent and taken
from the profiled eager step. Under FSDP2 the parameters and gradients are counted as FSDP holds them per rank
(:class:`sublinear.core.profile.ShardedParameters`), and when TorchDynamo split the call into several graphs, what
the other graphs keep live beside this one is added (:class:`sublinear.core.profile.StepContext`). Time is the eager
step's predicted time plus the forward time of every op a recompute closure re-runs.
"""

from __future__ import annotations

import numpy as np

from .core.analysis import PlanAnalysis, analyse
from .core.objective import Simulation
from .core.plan import Plan
from .core.profile import GraphProfile

__all__ = ["Simulation", "forward_release", "simulate", "timeline"]


def simulate(profile: GraphProfile, plan: Plan) -> Simulation:
    """Predict the step's peak bytes, recompute FLOPs and recompute time under ``plan``."""
    n = profile.num_ops
    if n == 0:
        base = profile.baseline_bytes + profile.gradient_bytes
        return Simulation(base, 0, 0.0, profile.step_seconds, base, base, "empty graph", 0)
    a = analyse(profile, plan)
    totals, slots, held_after_forward = _timeline(profile, plan, a)
    peak_at = int(np.argmax(totals))
    return Simulation(
        peak_bytes=int(totals[peak_at]),
        recompute_flops=a.recompute_flops(profile),
        recompute_seconds=a.recompute_seconds(profile),
        eager_seconds=profile.step_seconds,
        forward_peak_bytes=int(totals[:n].max()),
        backward_peak_bytes=int(totals[n:].max()),
        peak_slot=_describe(slots[peak_at], profile),
        held_after_forward_bytes=held_after_forward,
    )


def timeline(profile: GraphProfile, plan: Plan, a: PlanAnalysis | None = None) -> tuple[np.ndarray, list[str]]:
    """Predicted live bytes at every slot of the step (forward ops, recomputes, backward ops), with labels."""
    totals, slots, _ = _timeline(profile, plan, a or analyse(profile, plan))
    return totals, [_describe(slot, profile) for slot in slots]


Slot = tuple[str, int]  # (what happens, op index or -1): labels are made only for the slots someone reads
_SLOT_TEXT = {"forward": "forward {}", "recompute": "recompute {}", "backward": "backward {}",
              "released": "backward {}, after release"}


def _describe(slot: Slot, profile: GraphProfile) -> str:
    kind, op = slot
    return _SLOT_TEXT[kind].format(profile.ops[op].name) if op >= 0 else kind


def _timeline(profile: GraphProfile, plan: Plan, a: PlanAnalysis) -> tuple[np.ndarray, list[Slot], int]:
    """The timeline with what happens at each slot, and the activation bytes still held when backward starts."""
    n = profile.num_ops
    ops = profile.ops

    # Timeline: forward slots 0..n-1, then backward node by node (two slots each: before and after it frees what
    # it saved), with each block's recompute just before the backward of the node that first needs it.
    node_op = profile.node_op
    backward_slot = np.zeros(len(node_op), dtype=np.int64)
    recompute_slot: dict[tuple[int, int], int] = {}  # (block, op) -> slot: an op may be re-run by several blocks
    extra: list[int] = [op.forward_extra_bytes for op in ops]
    labels: list[Slot] = [("forward", o) for o in range(n)]
    triggers = {r: b for b, r in enumerate(a.trigger) if r >= 0}
    t = n
    for r in range(len(node_op) - 1, -1, -1):
        o = int(node_op[r])
        b = triggers.get(r)
        if b is not None:
            for j in a.closure[b]:
                recompute_slot[b, j] = t
                extra.append(ops[j].forward_extra_bytes + int(profile.grad_start[r]))
                labels.append(("recompute", j))
                t += 1
        backward_slot[r] = t
        extra.extend((int(profile.grad_peak[r]), int(profile.grad_after_release[r])))
        labels.extend((("backward", o), ("released", o)))
        t += 2
    end = t
    extra.append(profile.gradient_bytes)
    labels.append(("end of step", -1))
    held = np.zeros(end + 2, dtype=np.int64)

    def hold(start: int, stop: int, nbytes: int) -> None:
        # Allocated during slot `start` (counted there by `extra`), released after slot `stop`.
        if stop > start:
            held[start + 1] += nbytes
            held[stop + 1] -= nbytes

    retained, dropped = a.retained, a.dropped
    producer, sizes = profile.storage_producer, profile.storage_bytes
    reaches = profile.reaches_output
    frame_stop = np.array([backward_slot[e] if e >= 0 else -1 for e in a.frame_end], dtype=np.int64)
    # Each storage lives from its producer until the last of: its last forward reader (the end of the step for
    # outputs), autocast's cache (the end of forward), autograd (a node that never reaches the outputs dies in
    # forward and keeps what it saved until then; a reaching node keeps a retained storage until its backward),
    # the forward frame of a block whose recomputable op reads it, and the frame of a block whose closure reads it.
    stop = np.where(profile.storage_last_use >= n, end, profile.storage_last_use).astype(np.int64)
    if len(profile.held_through_forward):
        stop[profile.held_through_forward] = np.maximum(stop[profile.held_through_forward], n - 1)
    saved, ranks = profile.saved_pairs
    if len(saved):
        savers = node_op[ranks]
        lost = ~reaches[savers]
        np.maximum.at(stop, saved[lost], forward_release(profile, end)[savers[lost]])
        held_by_autograd = ~lost & retained[saved]
        np.maximum.at(stop, saved[held_by_autograd], backward_slot[ranks[held_by_autograd]])
    read, readers = profile.read_pairs
    if len(read):
        framed = a.recomputed[readers] & retained[read]
        np.maximum.at(stop, read[framed], np.asarray(a.group_end, dtype=np.int64)[a.block_of[readers[framed]]])
    for s, blocks in _frame_inputs(profile, a).items():
        stop[s] = max(int(stop[s]), *(int(frame_stop[b]) for b in blocks))
    lives = stop > producer
    np.add.at(held, producer[lives] + 1, sizes[lives])
    np.add.at(held, stop[lives] + 1, -sizes[lives])

    # Recomputed copies: live from their recompute until the last closure reader or the last dropped-save holder.
    for b, members in enumerate(a.closure):
        if not members:
            continue
        readers = _closure_readers(profile, members)
        for s in np.concatenate([profile.produced[j] for j in members]):
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
    context = profile.step_context
    if context is not None:
        totals[:n] += context.beside_forward
        totals[n:] += context.beside_backward
    if profile.sharding is not None:
        totals, labels = _with_sharded_parameters(profile, totals, int(live[n]) + profile.baseline_bytes, labels, n)
    if context is not None and context.later_beyond_held is not None:
        totals = np.append(totals, int(live[n]) + context.later_beyond_held)
        labels.append(("later graphs of the call, beside what this graph holds", -1))
    return totals, labels, int(live[n])


def _with_sharded_parameters(profile: GraphProfile, totals: np.ndarray, after_forward: int, labels: list[Slot],
                             n: int):
    """The timeline with FSDP's parameter and gradient memory in place of the profiled full parameters.

    The step starts with an all-gather slot. Through forward and backward the rank holds its shards and the
    gathered parameters (padded), plus the all-gather buffer while the forward runs (and again when the outputs'
    gradients arrive, if FSDP resharded after forward). After backward FSDP frees the gathered parameters, copies the
    gradients into the reduce-scatter input, frees them, and keeps the reduce-scatter output as the rank's gradient
    shards. A backend workspace (gloo) is a copy of the collective's full buffer while it runs.
    """
    s = profile.sharding
    shards_for_parameters = s.sharded_bytes - profile.parameter_bytes
    step = totals[:-1] + shards_for_parameters + s.unsharded_bytes
    step[:n] += s.all_gather_bytes
    head = [profile.baseline_bytes + shards_for_parameters + s.all_gather_bytes + s.workspace(s.all_gather_bytes)]
    labels = [("FSDP all-gather", -1)] + labels
    if s.reshard_after_forward and len(step) > n:
        regather = after_forward + profile.output_gradient_bytes + shards_for_parameters + s.backward_gather_bytes()
        step = np.concatenate([step[:n], [regather], step[n:]])
        labels.insert(n + 1, ("FSDP all-gather for backward", -1))
    after = totals[-1] + shards_for_parameters - profile.gradient_bytes
    tail = [after + profile.gradient_bytes + s.reduce_scatter_bytes,
            after + s.reduce_scatter_bytes + s.workspace(s.reduce_scatter_bytes) + s.sharded_gradient_bytes,
            after + s.sharded_gradient_bytes]
    return (np.concatenate([head, step, tail]).astype(np.int64),
            labels[:-1] + [("FSDP reduce-scatter copy-in", -1), ("FSDP reduce-scatter", -1), labels[-1]])


def forward_release(profile: GraphProfile, end: int) -> np.ndarray:
    """Per op: the forward slot after which its autograd nodes die when its values never reach the outputs
    (:attr:`GraphProfile.op_release`), with the end of the step at slot ``end``."""
    release = profile.op_release
    return np.where(release >= profile.num_ops, end, release)


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
