"""Simulate: predicted peak memory and step time of one training step under a plan.

The one scoring function every planner uses. It needs only a :class:`GraphProfile` (plain numbers, no torch) and
follows the plan's analysis (:func:`sublinear.core.analysis.analyse`) to the storage: each storage lives from
the op that produced it until its last holder lets go (the forward values reading it, autograd for retained
saves, a block's frame, the recompute of its block, the caller for outputs). The gradient side of backward is
plan-independent and taken from the profiled eager step. Under FSDP2 the parameters and gradients are counted as
FSDP holds them per process (:class:`sublinear.core.profile.ShardedParameters`), and when TorchDynamo split the call
into several graphs, what the other graphs keep live beside this one is added
(:class:`sublinear.core.profile.StepContext`).
Time is the eager step's predicted time plus the forward time of every op a recompute closure re-runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sublinear.core.analysis import PlanAnalysis, analyse
from sublinear.core.objective import Simulation
from sublinear.core.plan import Plan
from sublinear.core.profile import GraphProfile, ShardedParameters
from sublinear.simulation.lifetimes import Layout, layout, lifetimes

__all__ = ["BACKWARD_SLOTS", "FORWARD_SLOT", "OwnTimeline", "Simulation", "StepTerms", "own_slots",
           "own_timeline", "peak_beside", "simulate", "simulate_beside", "step_terms", "timeline"]


def simulate(profile: GraphProfile, plan: Plan) -> Simulation:
    """Predict the step's peak bytes, recompute FLOPs and recompute time under ``plan``."""
    n = profile.num_ops
    if n == 0:
        base = profile.baseline_bytes + profile.gradient_bytes
        return Simulation(base, 0, 0.0, profile.step_seconds, base, base, "empty graph", 0)
    a = analyse(profile, plan)
    return _simulation(profile, own_timeline(profile, plan, a), a.recompute_flops(profile),
                       a.recompute_seconds(profile))


def simulate_beside(profile: GraphProfile, own: OwnTimeline, simulation: Simulation) -> Simulation:
    """``simulation`` of a plan (in any step context) in ``profile``'s context, from the plan's ``own`` timeline:
    what :func:`simulate` gives, without simulating the graph again."""
    return _simulation(profile, own, simulation.recompute_flops, simulation.recompute_seconds)


def _simulation(profile: GraphProfile, own: OwnTimeline, recompute_flops: int, recompute_seconds: float) -> Simulation:
    n = profile.num_ops
    totals, slots = _totals(profile, own)
    peak_at = int(np.argmax(totals))
    return Simulation(
        peak_bytes=int(totals[peak_at]),
        recompute_flops=recompute_flops,
        recompute_seconds=recompute_seconds,
        eager_seconds=profile.step_seconds,
        forward_peak_bytes=int(totals[:n].max()),
        backward_peak_bytes=int(totals[n:].max()),
        peak_slot=_describe(slots, peak_at, profile),
        held_after_forward_bytes=own.held_after_forward,
    )


def timeline(profile: GraphProfile, plan: Plan, a: PlanAnalysis | None = None) -> tuple[np.ndarray, list[str]]:
    """Predicted live bytes at every slot of the step (forward ops, recomputes, backward ops), with labels."""
    totals, slots, _ = _timeline(profile, plan, a or analyse(profile, plan))
    return totals, [_describe(slots, i, profile) for i in range(len(totals))]


# What happens at a slot: an index into _SLOT_TEXT, with the op it names (-1: none). Labels are made only for the
# slots someone reads.
_SLOT_TEXT = ("forward {}", "recompute {}", "backward {}", "backward {}, after release", "end of step",
              "FSDP all-gather", "FSDP all-gather for backward", "FSDP reduce-scatter copy-in", "FSDP reduce-scatter",
              "later graphs of the call, beside what this graph holds")
(_FORWARD, _RECOMPUTE, _BACKWARD, _RELEASED, _END, _GATHER, _REGATHER, _SCATTER_COPY, _SCATTER,
 _LATER) = range(len(_SLOT_TEXT))
Slots = tuple[np.ndarray, np.ndarray]  # per slot: what happens, and the op
FORWARD_SLOT = _FORWARD
BACKWARD_SLOTS = (_RECOMPUTE, _BACKWARD, _RELEASED)  # the slots of a rank's backward (its recomputes included)


def _describe(slots: Slots, i: int, profile: GraphProfile) -> str:
    kind, op = int(slots[0][i]), int(slots[1][i])
    return _SLOT_TEXT[kind].format(profile.ops[op].name) if op >= 0 else _SLOT_TEXT[kind]


def _special(kind: int) -> Slots:
    return np.array([kind], dtype=np.int8), np.array([-1], dtype=np.int64)


def _none() -> Slots:
    return np.array([], dtype=np.int8), np.array([], dtype=np.int64)


def _joined(*parts: Slots) -> Slots:
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def _forward_extra(profile: GraphProfile, a: PlanAnalysis) -> np.ndarray:
    """Per op, its own bytes while it runs under the plan: a value that is a buffer only because forward saves it
    takes none where the plan does not retain it (it is fused into its readers, in forward and when rebuilt), at its
    op nor at the earlier ops whose kernel makes it."""
    extra = profile.forward_extra
    if not len(profile.saved_buffer) or not profile.saved_buffer.any():
        return extra
    return np.maximum(0, extra - _made_by_ops(profile, profile.saved_buffer & ~a.retained))


def _made_by_ops(profile: GraphProfile, storages: np.ndarray, at_producer: bool = True) -> np.ndarray:
    """Per op, the bytes of the ``storages`` (a mask) its forward kernel holds: each at its producer (unless not
    ``at_producer``), and from the op whose kernel makes it early (``storage_fused_from``) on to its producer."""
    producer, sizes, n = profile.storage_producer, profile.storage_bytes, profile.num_ops
    made = np.zeros(n, dtype=np.float64)
    if at_producer:
        made += np.bincount(producer[storages], weights=sizes[storages], minlength=n)
    if len(profile.storage_fused_from):
        early = storages & (profile.storage_fused_from >= 0)
        span = np.zeros(n + 1)
        np.add.at(span, profile.storage_fused_from[early], sizes[early])
        np.add.at(span, producer[early], -sizes[early])
        made += np.cumsum(span)[:n]
    return made.astype(np.int64)


def _rerun_extra(profile: GraphProfile, a: PlanAnalysis, forward_extra: np.ndarray) -> np.ndarray:
    """Per op, its own bytes while backward re-runs it under the plan: its forward bytes less the buffers only
    forward needs (those only random library calls read), and, where the profile knows which re-run values are
    buffers (a compiled step: the partitioned backward computes only the values it reads again), less its
    retained values and its values that are no buffers when re-run. Backward's kernels, not forward's, compute
    what it re-runs: no buffer is made there early for a later op, as forward's kernel does."""
    extra = np.maximum(0, forward_extra - (profile.forward_extra - profile.rerun_extra))
    if not len(profile.materialized_when_rebuilt):
        return extra
    n = len(profile.storage_bytes)
    in_forward = profile.materialized_in_forward if len(profile.materialized_in_forward) else np.ones(n, dtype=bool)
    unsaved = profile.saved_buffer & ~a.retained if len(profile.saved_buffer) else np.zeros(n, dtype=bool)
    not_made = in_forward & ~unsaved & (a.retained | ~profile.materialized_when_rebuilt)
    made_early = _made_by_ops(profile, ~unsaved & ~not_made, at_producer=False)
    return np.maximum(0, extra - _made_by_ops(profile, not_made) - made_early)


def _grad_peak(profile: GraphProfile, a: PlanAnalysis) -> np.ndarray:
    """Per rank, the gradient side at its peak before it releases what it read, less what its earlier kernels let
    go of (``grad_peak_freed``) where the plan keeps every storage its backward reads: a value the plan re-runs is
    made inside the rank's kernels, where the compiled code holds it past its own reader."""
    freed = profile.grad_peak_freed
    if not len(freed) or not freed.any():
        return profile.grad_peak
    saved, ranks = profile.arrays.saved_pairs
    rebuilt = np.zeros(len(freed), dtype=bool)
    rebuilt[ranks[~a.retained[saved]]] = True
    return profile.grad_peak - np.where(rebuilt, 0, freed)


def _slot_terms(profile: GraphProfile, at: Layout, forward_extra: np.ndarray, rerun_extra: np.ndarray,
                grad_peak: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per slot: bytes beside the storages (an op's own buffers and scratch under the plan, the gradient side), what
    happens, its op and its rank (-1: none)."""
    n, end, node_op = at.n, at.end, profile.node_op
    extra = np.empty(end + 1, dtype=np.int64)
    kinds = np.empty(end + 1, dtype=np.int8)
    ops = np.empty(end + 1, dtype=np.int64)
    ranks = np.full(end + 1, -1, dtype=np.int64)
    extra[:n], kinds[:n], ops[:n] = forward_extra + profile.forward_lesson, _FORWARD, np.arange(n)
    extra[at.c_slot] = rerun_extra[at.c_ops] + profile.arrays.rerun_grad_side(at.c_ops, at.c_ranks)
    kinds[at.c_slot], ops[at.c_slot], ranks[at.c_slot] = _RECOMPUTE, at.c_ops, at.c_ranks
    every_rank = np.arange(len(node_op))
    for slot, kind, side in ((at.backward_slot, _BACKWARD, grad_peak),
                             (at.released_slot, _RELEASED, profile.grad_after_release)):
        extra[slot], kinds[slot], ops[slot], ranks[slot] = side, kind, node_op, every_rank
    extra[end], kinds[end], ops[end] = profile.gradient_bytes, _END, -1
    return extra, kinds, ops, ranks


def _snapshots(profile: GraphProfile, a: PlanAnalysis, at: Layout, held: np.ndarray) -> None:
    """Add to ``held`` the snapshots a recomputable op takes (the state it writes, its RNG state): taken before the
    op runs, so held from its own slot until its block's frame ends (or its group ends in forward)."""
    snapshot_ops, snapshot_bytes = profile.arrays.snapshots
    snapshotted = a.recomputed[snapshot_ops]
    if snapshotted.any():
        o, nbytes = snapshot_ops[snapshotted], snapshot_bytes[snapshotted]
        in_closure = np.zeros(at.n, dtype=bool)
        in_closure[at.c_ops] = True
        b = a.block_of[o]
        until = np.maximum(np.where(in_closure[o], at.frame_stop[b], a.group_end[b]), o + 1)
        np.add.at(held, o, nbytes)
        np.add.at(held, until + 1, -nbytes)


def own_slots(profile: GraphProfile, plan: Plan, a: PlanAnalysis | None = None
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The graph's own slots of one step under ``plan`` (forward, recomputes, backward, end): per slot the bytes
    the graph itself holds (its storages and what its slot adds, without the baseline, other graphs or FSDP's
    layout), what happens, its op and its rank (-1: none)."""
    live, extra, kinds, ops, ranks, _, _ = _own(profile, a or analyse(profile, plan))
    return live + extra, kinds, ops, ranks


def _own(profile: GraphProfile, a: PlanAnalysis):
    at = layout(profile, a)
    forward_extra = _forward_extra(profile, a)
    extra, kinds, ops, ranks = _slot_terms(profile, at, forward_extra, _rerun_extra(profile, a, forward_extra),
                                           _grad_peak(profile, a))
    stop, copies = lifetimes(profile, a, at)
    producer, sizes = profile.storage_producer, profile.storage_bytes
    held = np.zeros(at.end + 2, dtype=np.int64)
    lives = stop > producer
    np.add.at(held, producer[lives] + 1, sizes[lives])
    np.add.at(held, stop[lives] + 1, -sizes[lives])
    counted = copies.counted
    np.add.at(held, copies.start[counted] + 1, sizes[copies.storage[counted]])
    np.add.at(held, copies.stop[counted] + 1, -sizes[copies.storage[counted]])
    _snapshots(profile, a, at, held)
    live = np.cumsum(held)[: at.end + 1]
    held_after_forward = lives & (producer < at.n) & (stop >= at.n)
    return live, extra, kinds, ops, ranks, at, held_after_forward


@dataclass(frozen=True)
class OwnTimeline:
    """A graph's own bytes per slot under one plan (its storages and what each slot adds, without the baseline, the
    call's other graphs or FSDP's layout): the same in every step context, so one serves every context a call puts
    the graph in (:func:`peak_beside`)."""

    own: np.ndarray
    kinds: np.ndarray
    ops: np.ndarray
    n: int  # slots of forward
    end: int  # the end-of-step slot
    held_after_forward: int  # activation bytes still held when backward starts
    held_storages: np.ndarray  # per storage: held when backward starts


def own_timeline(profile: GraphProfile, plan: Plan, a: PlanAnalysis | None = None) -> OwnTimeline:
    live, extra, kinds, ops, _, at, held = _own(profile, a or analyse(profile, plan))
    return OwnTimeline(live + extra, kinds, ops, at.n, at.end, int(live[at.n]), held)


def peak_beside(profile: GraphProfile, own: OwnTimeline) -> int:
    """:func:`simulate`'s peak in ``profile``'s step context, from ``own`` (the same graph and plan, in any
    context) without simulating the graph again."""
    return int(_totals(profile, own)[0].max())


def _timeline(profile: GraphProfile, plan: Plan, a: PlanAnalysis) -> tuple[np.ndarray, Slots, int]:
    """The timeline with what happens at each slot, and the activation bytes still held when backward starts."""
    own = own_timeline(profile, plan, a)
    totals, labels = _totals(profile, own)
    return totals, labels, own.held_after_forward


def _totals(profile: GraphProfile, timeline_: OwnTimeline) -> tuple[np.ndarray, Slots]:
    """The step's bytes per slot: the graph's own, the step's plan-independent terms added, with their labels."""
    own, kinds, slot_ops, n, end = timeline_.own, timeline_.kinds, timeline_.ops, timeline_.n, timeline_.end
    held_after_forward = timeline_.held_after_forward
    terms = step_terms(profile)
    ending = terms.end(int(own[end]))
    parts = [(np.array(terms.head, dtype=np.int64), _special(_GATHER) if terms.head else _none()),
             (own[:n] + terms.forward, (kinds[:n], slot_ops[:n]))]
    if terms.regather is not None:
        parts.append((np.array([held_after_forward + terms.regather]), _special(_REGATHER)))
    parts.append((own[n:end] + terms.backward, (kinds[n:end], slot_ops[n:end])))
    if len(ending) > 1:
        parts.append((np.array(ending[:-1]), _joined(_special(_SCATTER_COPY), _special(_SCATTER))))
    parts.append((np.array(ending[-1:]), (kinds[end:], slot_ops[end:])))
    if terms.later is not None:
        parts.append((np.array([held_after_forward + terms.later]), _special(_LATER)))
    totals = np.concatenate([values for values, _ in parts]).astype(np.int64)
    return totals, _joined(*(labels for _, labels in parts))


@dataclass(frozen=True)
class StepTerms:
    """What a step's timeline holds beyond the graph's own storages: the same under every plan. The simulator
    builds its slots from it and the optimal planner its bounds, so the memory model lives here once.

    ``forward``/``backward``: added to every forward/backward slot (the baseline, what the call's other graphs keep
    beside this one, FSDP's shards and gathered parameters and, in forward, its all-gather buffer). ``head``: slots
    before forward (FSDP's all-gather). ``beyond_held``: slots after forward, each the bytes forward leaves held
    plus a constant (FSDP gathering again for backward, the call's later graphs). :meth:`end` gives the slots that
    end the step from what the graph itself holds then.
    """

    forward: int
    backward: int
    head: tuple[int, ...]
    regather: int | None  # FSDP gathering the parameters again for backward (None: no such slot)
    later: int | None  # the call's later graphs at their peak (None: no later graphs, or not yet known)
    sharding: ShardedParameters | None
    gradient_bytes: int

    @property
    def beyond_held(self) -> tuple[int, ...]:
        """The constants of the slots after forward, in timeline order."""
        return tuple(v for v in (self.regather, self.later) if v is not None)

    def end(self, own_bytes: int) -> tuple[int, ...]:
        """The step's last slots, from the bytes the graph itself holds at its end (gradients included): the end
        slot, or under FSDP the reduce-scatter of the gradients into shards (copy, collective, shards kept)."""
        total = own_bytes + self.backward
        s = self.sharding
        if s is None:
            return (total,)
        after = total - s.unsharded_bytes - self.gradient_bytes
        scatter = s.reduce_scatter_bytes
        return (after + self.gradient_bytes + scatter,
                after + scatter + s.workspace(scatter) + s.sharded_gradient_bytes,
                after + s.sharded_gradient_bytes)


def step_terms(profile: GraphProfile) -> StepTerms:
    """The plan-independent terms of ``profile``'s step (:class:`StepTerms`)."""
    context, s = profile.step_context, profile.sharding
    forward = backward = profile.baseline_bytes
    if context is not None:
        forward += context.beside_forward
        backward += context.beside_backward
    head: tuple[int, ...] = ()
    regather = None
    if s is not None:
        shards = s.sharded_bytes - profile.parameter_bytes
        forward += shards + s.unsharded_bytes + s.all_gather_bytes
        backward += shards + s.unsharded_bytes
        head = (profile.baseline_bytes + shards + s.all_gather_bytes + s.workspace(s.all_gather_bytes),)
        if s.reshard_after_forward and len(profile.node_op):
            regather = profile.baseline_bytes + profile.output_gradient_bytes + shards + s.backward_gather_bytes()
    later = context.later_beyond_held if context is not None else None
    return StepTerms(forward, backward, head, regather, later, s, profile.gradient_bytes)
