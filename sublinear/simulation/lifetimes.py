"""Storage lifetimes under a plan: where each slot of a step is (:class:`Layout`), the re-run copies a plan makes
(:class:`Copies`), and the slot after which each storage is released (:func:`lifetimes`). :mod:`.timeline` counts
the bytes over these slots."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sublinear.core.analysis import PlanAnalysis
from sublinear.core.profile import GraphProfile

__all__ = ["Copies", "Layout", "forward_release", "layout", "lifetimes"]


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
class Layout:
    """Where each slot of a step is: forward slots ``0..n-1``, then backward rank by rank from the last (two slots
    each, before and after it frees what it saved), each re-run op just before the backward of the rank that
    first needs it (its block's trigger, or where recomputes are shared its own), or between its two slots where
    only its part after the release needs it (:attr:`PlanAnalysis.recompute_late`), in op order; the end at
    ``end``. Per pair of :attr:`PlanAnalysis.recompute_pairs` its block, op, rank and slot, and the slot of the rank
    the backward kernel it runs in runs at."""

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
    c_kernel_end: np.ndarray  # per pair: the slot its backward kernel runs at, when it runs in one (-1: none)
    c_late_end: np.ndarray  # per pair re-run late in its rank: that slot for the kernel of the rank below (-1: none)


def layout(profile: GraphProfile, a: PlanAnalysis) -> Layout:
    """The slots of one step of ``profile``'s graph under the plan ``a`` analyses."""
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
    return Layout(n, n + int(width.sum()), backward_slot, group_start + width - 1, c_blocks, c_ops, c_ranks, c_slot,
                   frame_stop, group_start, _saved_read_slots(profile, backward_slot, c_ops, c_ranks, c_slot),
                   *_kernel_end_slots(profile, backward_slot, c_ops, c_ranks, c_slot, late))


def _kernel_end_slots(profile: GraphProfile, backward_slot: np.ndarray, c_ops: np.ndarray, c_ranks: np.ndarray,
                      c_slot: np.ndarray, late: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per recompute pair: the slot of the rank that the fused backward kernel it runs in runs at, where that is
    below its own rank (-1: none). Inductor's C++ backend runs every fused node between two library calls as one
    function, which allocates all its buffers before it runs and frees them, and what it read, after it. A fused op
    re-run for a rank whose first backward node is fused (``kernel_of_rank``), with no library call re-run after
    it for that rank, runs in that node's kernel; a library call re-run for a rank below ends the kernel above it.
    Also, per pair re-run late (after its rank's library call, ``late``; -1 for the others): the slot of the kernel
    of the rank below's first node, which it runs in (held there for the values no backward node reads,
    :func:`_copies`)."""
    end = np.full(len(c_ops), -1, dtype=np.int64)
    kernel_of = profile.kernel_of_rank
    if not profile.recompute_shared or not len(kernel_of) or not len(c_ops):
        return end, end.copy()
    library = np.zeros(profile.num_ops, dtype=bool)
    if len(profile.storage_library_made):
        library[profile.storage_producer[profile.storage_library_made]] = True
    called = library[c_ops]
    last_call = np.full(len(kernel_of), -1, dtype=np.int64)  # per rank: the slot of its last library re-run
    np.maximum.at(last_call, c_ranks[called], c_slot[called])
    # per rank: the highest rank at or below it with a library re-run (-1: none)
    below = np.maximum.accumulate(np.where(last_call >= 0, np.arange(len(kernel_of)), -1))
    cut = np.where(c_ranks > 0, below[np.maximum(c_ranks - 1, 0)], -1)

    def slots(kernel_ranks: np.ndarray) -> np.ndarray:
        ends = np.where(kernel_ranks >= 0, kernel_of[np.maximum(kernel_ranks, 0)], -1)
        inside = ~called & (ends >= 0) & (c_slot > last_call[c_ranks])
        ends = np.where(cut >= ends, cut + 1, ends)
        inside &= ends < c_ranks
        return np.where(inside, backward_slot[np.maximum(ends, 0)], -1)

    return slots(c_ranks), np.where(late, slots(c_ranks - 1), -1) if late.any() else end


@dataclass(frozen=True)
class _Reads:
    """Every read of a re-run op (one per storage of each value it reads from another op; where recomputes are
    shared, of those its needed values are made from, :func:`_read_for_needed_values`): the pair reading (an index
    into the recompute pairs), the storage, its producer, and whether the value read is re-run too (one of the
    recomputed copies: in the same block, or, where recomputes are shared, in any block, unless retained)."""

    pair: np.ndarray
    storage: np.ndarray
    producer: np.ndarray
    inside: np.ndarray


def _rerun_reads(profile: GraphProfile, a: PlanAnalysis, at: Layout) -> _Reads:
    pair, triple = _expand(profile.arrays.input_bounds, at.c_ops)
    triple_storages, _, triple_producers = profile.arrays.input_triples
    storage, producer = triple_storages[triple], triple_producers[triple]
    if profile.recompute_shared:
        needed = _read_for_needed_values(profile, a, at.c_ops[pair], storage)
        pair, storage, producer = pair[needed], storage[needed], producer[needed]
        _, inside = _find(np.unique(at.c_ops), producer)
        inside &= ~a.retained[storage]
    else:
        _, inside = _find(at.c_blocks * at.n + at.c_ops, at.c_blocks[pair] * at.n + producer)
    return _Reads(pair, storage, producer, inside)


def _read_for_needed_values(profile: GraphProfile, a: PlanAnalysis, ops: np.ndarray,
                            storages: np.ndarray) -> np.ndarray:
    """Per read (a re-run op, a storage it reads): the re-run reads it. A compiled backward re-runs the nodes that
    make the values it needs, not the op whole: a storage is read where a re-run value backward needs
    (:attr:`PlanAnalysis.storage_need`) is made from it (a dropout re-run for its random numbers reads the seeds,
    not the projection it drops). An op none of whose values is known to be needed reads all its inputs."""
    if not len(profile.storage_made_from) or not len(ops):
        return np.ones(len(ops), dtype=bool)
    made, source = profile.arrays.made_from_pairs
    needed = a.storage_need >= 0
    producer = profile.storage_producer
    span = len(producer)
    from_needed = needed[made]
    read_keys = np.unique(producer[made[from_needed]] * span + source[from_needed])
    with_need = np.zeros(profile.num_ops, dtype=bool)
    with_need[producer[needed]] = True
    return ~with_need[ops] | _find(read_keys, ops * span + storages)[1]


@dataclass(frozen=True)
class Copies:
    """The recomputed copies: per copy its storage, the pair that rebuilds it, and the slots it lives over: from
    its recompute (where recomputes are shared and the rank that needs it, :attr:`PlanAnalysis.storage_need`, is
    below its op's, from that rank's first slot) until the last re-run op that reads it or the last copy made from
    it is made (for a reader fused into the kernels that read its own values, that reader's last kernel), or the last
    backward that reads the dropped storage or computes a fused value from the copy (``storage_rebuilt_read_at``);
    in the same block or, shared, in any; a copy taking memory that a backward kernel makes, until that kernel has
    run. ``counted``: it takes memory (else it is fused into its readers)."""

    storage: np.ndarray
    pair: np.ndarray
    start: np.ndarray
    stop: np.ndarray
    counted: np.ndarray


def _copies(profile: GraphProfile, a: PlanAnalysis, at: Layout, reads: _Reads,
            reader_until: np.ndarray | None = None) -> Copies:
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
    kernel_end, late_end = at.c_kernel_end[copy_at], at.c_late_end[copy_at]
    if (late_end >= 0).any():  # re-run late: not where backward reads it (computed inside its reader)
        read_in_backward = np.zeros(len(producer), dtype=bool)
        read_in_backward[np.concatenate([saved, through])] = True
        kernel_end = np.maximum(kernel_end, np.where(read_in_backward[copy_storage], -1, late_end))
    copy_stop[counted] = np.maximum(copy_stop[counted], kernel_end[counted])  # a buffer of its kernel
    return Copies(copy_storage, copy_at, copy_start, copy_stop, counted)


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


def _rerun_until(profile: GraphProfile, at: Layout, reads: _Reads, copies: Copies) -> np.ndarray:
    """Per recompute pair: the slot until which what it reads is held. An op re-run into a buffer reads at its
    recompute; one fused into the kernels that read its values (shared recomputes none of whose copies take
    memory) is computed inside each of them, so what it reads is held until its values' last reader, and so on up
    a chain of such ops; one a backward kernel runs, until that kernel has run."""
    until = at.c_slot.copy()
    if not profile.recompute_shared or not len(at.c_ops):
        return until
    fused = np.ones(len(at.c_ops), dtype=bool)
    fused[copies.pair[copies.counted]] = False
    last_read = at.c_slot.copy()
    np.maximum.at(last_read, copies.pair, copies.stop)
    until[fused] = last_read[fused]
    until = np.maximum(until, at.c_kernel_end)  # a backward kernel frees what it read once it has run
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


def _storage_stops(profile: GraphProfile, a: PlanAnalysis, at: Layout, reads: _Reads,
                   until: np.ndarray, copies: Copies) -> np.ndarray:
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
    held_until = np.maximum(until, _late_kernel_end(at, a.recompute_late))[reads.pair] if shared else \
        at.frame_stop[at.c_blocks[reads.pair]]
    np.maximum.at(stop, reads.storage[outside], held_until[outside])
    if shared and len(profile.storage_made_from):
        _held_for_fused_copies(profile, copies, stop)
    return _taken_in_place(profile, at, np.arange(len(stop)), stop)


def _late_kernel_end(at: Layout, late: np.ndarray) -> np.ndarray:
    """Per recompute pair re-run ``late`` (after its rank's library call): the slot of the fused kernel after that
    call, which frees the buffers it read once it has run: the rank below's first kernel where it runs there, else
    the rest of its own rank's backward. -1 for the others. A copy it reads is not held there: inductor may compute
    that copy inside its reader."""
    return np.where(at.c_late_end >= 0, at.c_late_end, np.where(late, at.released_slot[at.c_ranks], -1))


def _held_for_fused_copies(profile: GraphProfile, copies: Copies, stop: np.ndarray) -> None:
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


def _taken_in_place(profile: GraphProfile, at: Layout, storages: np.ndarray, stops: np.ndarray) -> np.ndarray:
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


def forward_release(profile: GraphProfile, end: int) -> np.ndarray:
    """Per op: the forward slot after which its autograd nodes die when its values never reach the outputs
    (:attr:`ProfileArrays.op_release`), with the end of the step at slot ``end``."""
    release = profile.arrays.op_release
    return np.where(release >= profile.num_ops, end, release)


def lifetimes(profile: GraphProfile, a: PlanAnalysis, at: Layout) -> tuple[np.ndarray, Copies]:
    """Per storage the slot after which it is released, and the re-run copies with the slots they live over."""
    reads = _rerun_reads(profile, a, at)
    # Which re-run ops are fused depends on their copies alone; their readers' spans then extend what they read.
    copies = _copies(profile, a, at, reads)
    until = _rerun_until(profile, at, reads, copies)
    inside = reads.pair[reads.inside]
    if np.any(until[inside] > at.c_slot[inside]):
        copies = _copies(profile, a, at, reads, until)
    return _taken_by_copies(profile, a, at, copies, _storage_stops(profile, a, at, reads, until, copies)), copies


def _taken_by_copies(profile: GraphProfile, a: PlanAnalysis, at: Layout, copies: Copies,
                     stops: np.ndarray) -> np.ndarray:
    """``stops`` ended where a re-run writes its copy into the buffer of a kept storage (``storage_rerun_into``)
    that nothing holds beyond the kernel making the copy: inductor reuses the buffer its kernel reads last (a GPT-2
    residual sum re-run for the layers above, written over the kept attention projection its dropped output is made
    from), so the storage's bytes end as the copy's begin."""
    into = profile.storage_rerun_into
    if not len(into) or not len(copies.storage):
        return stops
    taker = np.flatnonzero(copies.counted & (into[copies.storage] >= 0))
    taken, start = into[copies.storage[taker]], copies.start[taker]
    kernel = np.maximum(start, at.c_kernel_end[copies.pair[taker]])
    ends = a.retained[taken] & (stops[taken] >= start) & (stops[taken] <= kernel)
    if not ends.any():
        return stops
    stops = stops.copy()
    np.minimum.at(stops, taken[ends], start[ends])
    return stops
