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

__all__ = ["BACKWARD_SLOTS", "FORWARD_SLOT", "OwnTimeline", "Simulation", "StepTerms", "forward_release", "own_slots",
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


def _expand(bounds: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(position in ``rows``, index) for every index in ``bounds[row]:bounds[row + 1]`` of every row."""
    starts = bounds[rows]
    counts = bounds[rows + 1] - starts
    owner = np.repeat(np.arange(len(rows), dtype=np.int64), counts)
    return owner, starts[owner] + np.arange(int(counts.sum()), dtype=np.int64) - (np.cumsum(counts) - counts)[owner]


def _find(sorted_keys: np.ndarray, queries: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(position, found) of each query in ``sorted_keys``."""
    if not len(sorted_keys):
        return np.zeros(len(queries), dtype=np.int64), np.zeros(len(queries), dtype=bool)
    pos = np.minimum(np.searchsorted(sorted_keys, queries), len(sorted_keys) - 1)
    return pos, sorted_keys[pos] == queries


@dataclass(frozen=True)
class _Layout:
    """Where each slot of a step is: forward slots ``0..n-1``, then backward rank by rank from the last (two slots
    each, before and after it frees what it saved), each re-run op just before the backward of the rank that
    first needs it (its block's trigger, or where recomputes are shared its own), or between its two slots where
    only its part after the release needs it (:attr:`PlanAnalysis.recompute_late`), in op order; the end at
    ``end``. Per pair of :attr:`PlanAnalysis.recompute_pairs` its block, op, rank and slot."""

    n: int
    end: int
    backward_slot: np.ndarray  # per rank
    released_slot: np.ndarray  # per rank: its slot after it frees what it saved
    c_blocks: np.ndarray
    c_ops: np.ndarray
    c_ranks: np.ndarray
    c_slot: np.ndarray
    frame_stop: np.ndarray  # per block: the slot after which its group's frame is released (-1: none)
    rank_start: np.ndarray  # per rank: the first slot of its recomputes (its backward's where it has none)
    saved_read_at: np.ndarray  # per saved pair (``profile.arrays.saved_pairs``): the slot backward reads it at


def _layout(profile: GraphProfile, a: PlanAnalysis) -> _Layout:
    n, ranks = profile.num_ops, len(profile.node_op)
    c_blocks, c_ops = a.recompute_pairs
    c_ranks, late = a.recompute_ranks, a.recompute_late
    recomputes = np.bincount(c_ranks, minlength=ranks).astype(np.int64)
    width = recomputes + 2
    group_start = n + np.cumsum(width[::-1])[::-1] - width  # the ranks after r run before it
    backward_slot = group_start + recomputes - np.bincount(c_ranks[late], minlength=ranks)
    order = np.lexsort((c_ops, c_blocks, late, -c_ranks))  # slot order: by rank, highest first; early; block; op
    first_of_rank = np.cumsum(recomputes[::-1])[::-1] - recomputes  # pairs of higher ranks come first
    c_slot = np.empty(len(c_ops), dtype=np.int64)
    c_slot[order] = group_start[c_ranks[order]] + np.arange(len(c_ops)) - first_of_rank[c_ranks[order]] + late[order]
    frame_stop = np.full(len(a.frame_end), -1, dtype=np.int64)
    frame_stop[a.frame_end >= 0] = backward_slot[a.frame_end[a.frame_end >= 0]]
    return _Layout(n, n + int(width.sum()), backward_slot, group_start + width - 1, c_blocks, c_ops, c_ranks, c_slot,
                   frame_stop, group_start, _saved_read_slots(profile, backward_slot, c_ops, c_ranks, c_slot))


def _forward_extra(profile: GraphProfile, a: PlanAnalysis) -> np.ndarray:
    """Per op, its own bytes while it runs under the plan: a value that is a buffer only because forward saves it
    takes none where the plan does not retain it (it is fused into its readers, in forward and when rebuilt), at its
    op nor at the earlier ops whose kernel makes it."""
    extra = profile.forward_extra
    if not len(profile.saved_buffer) or not profile.saved_buffer.any():
        return extra
    unsaved = profile.saved_buffer & ~a.retained
    producer, sizes, n = profile.storage_producer, profile.storage_bytes, profile.num_ops
    fused = np.bincount(producer[unsaved], weights=sizes[unsaved], minlength=n).astype(np.float64)
    if len(profile.storage_fused_from):
        early = unsaved & (profile.storage_fused_from >= 0)
        span = np.zeros(n + 1)
        np.add.at(span, profile.storage_fused_from[early], sizes[early])
        np.add.at(span, producer[early], -sizes[early])
        fused += np.cumsum(span)[:n]
    return np.maximum(0, extra - fused.astype(np.int64))


def _rerun_extra(profile: GraphProfile, a: PlanAnalysis, forward_extra: np.ndarray) -> np.ndarray:
    """Per op, its own bytes while backward re-runs it under the plan: its forward bytes less the buffers only
    forward needs (those only random library calls read), and, where the profile knows which re-run values are
    buffers (a compiled step: the partitioned backward computes only the values it reads again), less its
    retained values and its values that are no buffers when re-run."""
    extra = np.maximum(0, forward_extra - (profile.forward_extra - profile.rerun_extra))
    if not len(profile.materialized_when_rebuilt):
        return extra
    n = len(profile.storage_bytes)
    in_forward = profile.materialized_in_forward if len(profile.materialized_in_forward) else np.ones(n, dtype=bool)
    unsaved = profile.saved_buffer & ~a.retained if len(profile.saved_buffer) else np.zeros(n, dtype=bool)
    not_made = in_forward & ~unsaved & (a.retained | ~profile.materialized_when_rebuilt)
    unmade = np.bincount(profile.storage_producer[not_made], weights=profile.storage_bytes[not_made],
                         minlength=profile.num_ops).astype(np.int64)
    return np.maximum(0, extra - unmade)


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


def _slot_terms(profile: GraphProfile, at: _Layout, forward_extra: np.ndarray, rerun_extra: np.ndarray,
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


@dataclass(frozen=True)
class _Reads:
    """Every read of a re-run op (one per storage of each value it reads from another op): the pair reading (an
    index into the recompute pairs), the storage, its producer, and whether the value read is re-run too (one of
    the recomputed copies: in the same block, or, where recomputes are shared, in any block, unless retained)."""

    pair: np.ndarray
    storage: np.ndarray
    producer: np.ndarray
    inside: np.ndarray


def _rerun_reads(profile: GraphProfile, a: PlanAnalysis, at: _Layout) -> _Reads:
    pair, triple = _expand(profile.arrays.input_bounds, at.c_ops)
    triple_storages, _, triple_producers = profile.arrays.input_triples
    storage, producer = triple_storages[triple], triple_producers[triple]
    if profile.recompute_shared:
        _, inside = _find(np.unique(at.c_ops), producer)
        inside &= ~a.retained[storage]
    else:
        _, inside = _find(at.c_blocks * at.n + at.c_ops, at.c_blocks[pair] * at.n + producer)
    return _Reads(pair, storage, producer, inside)


@dataclass(frozen=True)
class _Copies:
    """The recomputed copies: per copy its storage, the pair that rebuilds it, and the slots it lives over: from
    its recompute (where recomputes are shared and the rank that needs it, :attr:`PlanAnalysis.storage_need`, is
    below its op's, from that rank's first slot) until the last re-run op that reads it or the last copy made from
    it is made (for a reader fused into the kernels that read its own values, that reader's last kernel), or the last
    backward that reads the dropped storage or computes a fused value from the copy (``storage_rebuilt_read_at``);
    in the same block or, shared, in any. ``counted``: it takes memory (else it is fused into its readers)."""

    storage: np.ndarray
    pair: np.ndarray
    start: np.ndarray
    stop: np.ndarray
    counted: np.ndarray


def _copies(profile: GraphProfile, a: PlanAnalysis, at: _Layout, reads: _Reads,
            reader_until: np.ndarray | None = None) -> _Copies:
    """``reader_until``: per recompute pair, the slot until which what it reads is held (:func:`_rerun_until`);
    without it, each reader's own slot."""
    producer, shared = profile.storage_producer, profile.recompute_shared
    order, bounds = profile.arrays.produced_order
    copy_at, produced_at = _expand(bounds, at.c_ops)
    copy_storage = order[produced_at]
    copy_start = at.c_slot[copy_at]
    if shared:  # a value needed below its op's rank (another value of the op is needed above) is made there
        need, late = a.storage_need[copy_storage], a.storage_late[copy_storage]
        later = (need >= 0) & ((need < at.c_ranks[copy_at]) | late & ~a.recompute_late[copy_at])
        # counted from the rank's first slot on, or from its backward's on where only its part after that needs it
        copy_start[later] = np.where(late[later], at.backward_slot[need[later]], at.rank_start[need[later]] - 1)
    copy_stop = copy_start.copy()
    copy_keys = copy_storage if shared else at.c_blocks[copy_at] * len(producer) + copy_storage
    by_key = np.argsort(copy_keys)

    def extend(blocks: np.ndarray, storages: np.ndarray, slots: np.ndarray) -> None:
        pos, found = _find(copy_keys[by_key], storages if shared else blocks * len(producer) + storages)
        np.maximum.at(copy_stop, by_key[pos[found]], slots[found])

    if shared and len(profile.storage_made_from):  # a copy is read where what is made from it is made
        made, source = profile.arrays.made_from_pairs
        pos, found = _find(copy_keys[by_key], made)
        found &= a.read_rerun[source]
        extend(None, source[found], copy_start[by_key[pos[found]]])
    inside = reads.inside
    read_until = at.c_slot if reader_until is None else reader_until
    extend(at.c_blocks[reads.pair][inside], reads.storage[inside], read_until[reads.pair[inside]])
    saved, ranks = profile.arrays.saved_pairs
    savers = profile.node_op[ranks]
    own = a.dropped[saved] & profile.reaches_output[savers]
    extend(a.block_of[savers[own]], saved[own], at.saved_read_at[own])
    through, through_ranks = profile.arrays.rebuilt_read_pairs
    if len(through) and len(profile.storage_deadline):
        held = _rerun_deadlines(profile, a, copy_storage)[through] > through_ranks
        extend(a.block_of[profile.node_op[through_ranks[held]]], through[held], at.backward_slot[through_ranks[held]])
    copy_stop = _taken_in_place(profile, at, copy_storage, copy_stop)
    counted = copy_stop > copy_start
    if len(profile.materialized_when_rebuilt):  # fused into the backward kernels that read it
        counted &= profile.materialized_when_rebuilt[copy_storage]
    return _Copies(copy_storage, copy_at, copy_start, copy_stop, counted)


def _rerun_deadlines(profile: GraphProfile, a: PlanAnalysis, rebuilt: np.ndarray) -> np.ndarray:
    """Per storage: the highest rank by whose backward its re-run copy must have been made: a backward node
    reading it (``storage_deadline``) or the re-run of a storage made from it. A copy read by backward kernels
    through fused values is held until those kernels (``storage_rebuilt_read_at``) only where it must be made above
    them, in a kernel of its own: a layer re-run for the layers above it. Made no earlier than they run, inductor
    computes it inside the first of them, and the rank above runs its library calls that read the re-run values
    after that kernel."""
    deadline = profile.storage_deadline.copy()
    rerun = np.zeros(len(deadline), dtype=bool)
    rerun[rebuilt] = True
    rerun &= ~a.retained
    made, source = profile.arrays.made_from_pairs
    chain = rerun[made] & rerun[source]  # pairs by made storage, descending: every reader is done before its source
    for m, s in zip(made[chain].tolist(), source[chain].tolist()):
        if deadline[m] > deadline[s]:
            deadline[s] = deadline[m]
    return deadline


def _rerun_until(profile: GraphProfile, at: _Layout, reads: _Reads, copies: _Copies) -> np.ndarray:
    """Per recompute pair: the slot until which what it reads is held. An op re-run into a buffer reads at its
    recompute; one fused into the kernels that read its values (shared recomputes none of whose copies take
    memory) is computed inside each of them, so what it reads is held until its values' last reader, and so on up
    a chain of such ops."""
    until = at.c_slot.copy()
    if not profile.recompute_shared or not len(at.c_ops):
        return until
    fused = np.ones(len(at.c_ops), dtype=bool)
    fused[copies.pair[copies.counted]] = False
    last_read = at.c_slot.copy()
    np.maximum.at(last_read, copies.pair, copies.stop)
    until[fused] = last_read[fused]
    pair_of_op = np.full(at.n, -1, dtype=np.int64)
    last = len(at.c_ops) - 1 - np.unique(at.c_ops[::-1], return_index=True)[1]  # an op's last pair
    pair_of_op[at.c_ops[last]] = last
    readers, producers = reads.pair[reads.inside], pair_of_op[reads.producer[reads.inside]]
    chained = producers >= 0
    chained[chained] = fused[producers[chained]]
    readers, producers = readers[chained], producers[chained]
    order = np.lexsort((readers, -at.c_ops[readers]))  # readers after their producers: descending ops
    for k, p in zip(readers[order].tolist(), producers[order].tolist()):
        if until[k] > until[p]:
            until[p] = until[k]
    return until


def _storage_stops(profile: GraphProfile, a: PlanAnalysis, at: _Layout, reads: _Reads,
                   until: np.ndarray, copies: _Copies) -> np.ndarray:
    """Per storage the slot after which it is released. A storage lives from its producer until the last of: its
    last forward reader (the end of the step for outputs), autocast's cache (the end of forward), autograd (a node
    that never reaches the outputs dies in forward and keeps what it saved until then; a reaching node keeps a
    retained storage until its backward), the forward frame of a block whose recomputable op reads it, and
    whatever holds it for a re-run op: its block's frame, or, where recomputes are shared (no frames), backward
    until the re-run (:func:`_rerun_until`) or the last reader of a fused copy made from it."""
    n, end, node_op = at.n, at.end, profile.node_op
    retained, producer, shared = a.retained, profile.storage_producer, profile.recompute_shared
    stop = np.where(profile.storage_last_use >= n, end, profile.storage_last_use).astype(np.int64)
    if len(profile.materialized_in_forward):  # fused into its forward readers: no memory until something else holds it
        stop[~profile.materialized_in_forward] = producer[~profile.materialized_in_forward]
    if len(profile.held_through_forward):
        stop[profile.held_through_forward] = np.maximum(stop[profile.held_through_forward], n - 1)
    saved, ranks = profile.arrays.saved_pairs
    savers = node_op[ranks]
    if len(saved):
        lost = ~profile.reaches_output[savers]
        np.maximum.at(stop, saved[lost], forward_release(profile, end)[savers[lost]])
        held_by_autograd = ~lost & retained[saved]
        np.maximum.at(stop, saved[held_by_autograd], at.saved_read_at[held_by_autograd])
    read, readers = profile.arrays.read_pairs
    if len(read) and not shared:  # a forward frame holds what a recomputable op reads until its group ends
        framed = a.recomputed[readers] & retained[read]
        np.maximum.at(stop, read[framed], a.group_end[a.block_of[readers[framed]]])
    outside = ~reads.inside
    held_until = until[reads.pair] if shared else at.frame_stop[at.c_blocks[reads.pair]]
    np.maximum.at(stop, reads.storage[outside], held_until[outside])
    if shared and len(profile.storage_made_from):
        _held_for_fused_copies(profile, copies, stop)
    return _taken_in_place(profile, at, np.arange(len(stop)), stop)


def _held_for_fused_copies(profile: GraphProfile, copies: _Copies, stop: np.ndarray) -> None:
    """Hold each storage that is not re-run and that backward kernels read through fused values
    (``storage_rebuilt_read_at``) until the last reader of every fused copy made from it: a re-run value that takes
    no memory is computed inside each backward kernel that reads it, from the storages it is made from."""
    fused_until = np.full(len(stop), -1, dtype=np.int64)
    fused = ~copies.counted
    np.maximum.at(fused_until, copies.storage[fused], copies.stop[fused])
    through = np.zeros(len(stop), dtype=bool)
    through[profile.arrays.rebuilt_read_pairs[0]] = True
    through[copies.storage] = False
    made, source = profile.arrays.made_from_pairs
    held = (fused_until[made] >= 0) & through[source]
    np.maximum.at(stop, source[held], fused_until[made[held]])


def _saved_read_slots(profile: GraphProfile, backward_slot: np.ndarray, c_ops: np.ndarray, c_ranks: np.ndarray,
                      c_slot: np.ndarray) -> np.ndarray:
    """Per saved pair (storage, rank): the slot at which backward reads it: the rank's backward, or where the plan
    re-runs the op that ``storage_read_in_rerun`` names for the rank it names, that re-run (its kernel computes the
    reader of every rank below)."""
    saved, ranks = profile.arrays.saved_pairs
    slots = backward_slot[ranks]
    if not len(profile.storage_read_in_rerun) or not len(saved) or not len(c_ops):
        return slots
    op, made_for = profile.storage_read_in_rerun[saved, 1], profile.storage_read_in_rerun[saved, 2]
    span = len(profile.node_op)
    keys = c_ops * span + c_ranks
    by_key = np.argsort(keys)
    pos, found = _find(keys[by_key], op * span + made_for)
    moved = found & (op >= 0) & (ranks < made_for)
    slots[moved] = c_slot[by_key[pos[moved]]]
    return slots


def _taken_in_place(profile: GraphProfile, at: _Layout, storages: np.ndarray, stops: np.ndarray) -> np.ndarray:
    """``stops`` (slots after which ``storages`` or their copies are released), ended just before the backward of
    the rank that writes its output into their buffer, where nothing holds them beyond that backward: the output
    is counted on the gradient side from there."""
    if not len(profile.storage_taken_at) or not len(storages):
        return stops
    rank = profile.storage_taken_at[storages]
    taken = rank >= 0
    slot = np.where(taken, at.backward_slot[np.maximum(rank, 0)], -1)
    ends_there = taken & (stops >= slot) & (stops <= at.released_slot[np.maximum(rank, 0)])
    return np.where(ends_there, slot - 1, stops)


def _snapshots(profile: GraphProfile, a: PlanAnalysis, at: _Layout, held: np.ndarray) -> None:
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
    at = _layout(profile, a)
    forward_extra = _forward_extra(profile, a)
    extra, kinds, ops, ranks = _slot_terms(profile, at, forward_extra, _rerun_extra(profile, a, forward_extra),
                                           _grad_peak(profile, a))
    reads = _rerun_reads(profile, a, at)
    # Which re-run ops are fused depends on their copies alone; their readers' spans then extend what they read.
    copies = _copies(profile, a, at, reads)
    until = _rerun_until(profile, at, reads, copies)
    inside = reads.pair[reads.inside]
    if np.any(until[inside] > at.c_slot[inside]):
        copies = _copies(profile, a, at, reads, until)
    stop = _storage_stops(profile, a, at, reads, until, copies)
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


def forward_release(profile: GraphProfile, end: int) -> np.ndarray:
    """Per op: the forward slot after which its autograd nodes die when its values never reach the outputs
    (:attr:`ProfileArrays.op_release`), with the end of the step at slot ``end``."""
    release = profile.arrays.op_release
    return np.where(release >= profile.num_ops, end, release)
