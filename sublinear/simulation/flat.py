"""The flat memory and time model of plans without soft split points: per block start, the closure of every
block end, its recompute seconds and its local peak, from the simulator's timeline terms
(:func:`~sublinear.simulation.timeline.step_terms`). The optimal planner searches over it
(:mod:`sublinear.planners.optimal`); it never imports torch.

**Time is exact.** With a fixed ``kept`` set, a block ``[i..j]`` that is not the last recomputes exactly its
closure, and the closure depends on the span alone: a storage produced in ``[i..j]`` is retained iff its producer
is pinned or kept (or such an op outputs a view of it) or it is read after ``j``. Op ``o`` is in the closure of
``[i..j]`` iff ``j >= entry_i(o)``, an index computed per block start (:meth:`FlatModel._entries`). A plan's
recompute time is the sum of its blocks', as the simulator counts it.

**Memory: a model of the simulator's timeline** (``sublinear.simulation.timeline._timeline``), exact on chains and
an upper bound everywhere. For blocks ``b = 1..k`` (``k`` the last) :meth:`FlatModel.peak` is
``max(floor, max over b of P_b + L(b))`` with ``P_b = R(1) + ... + R(b - 1)``, where

- ``L(b)``, the local peak, is the most bytes live at a slot of block ``b`` (its forward ops, its recomputes, the
  backward of its nodes), counting as the timeline does the storages produced in ``b`` and those produced before
  it and read in it: readers, autograd's saves, forward and recompute frames, recomputed copies (held to their
  savers' backward, or to the backward kernels that compute fused values from them), snapshots,
  plan-independent lifetimes (graph outputs, autocast's cache, storages saved by nodes that never reach the
  outputs), kernel workspace, the gradient side, FSDP's layout and the other graphs of the call;
- ``R(b)``, the bytes ``b`` carries into every later block: its retained storages that a node reaching the outputs
  saves (held until that node's backward, after every later block's slots), its closure ops' snapshots (held until
  its backward), and unsaved storages read last in ``b`` that a recompute frame may hold;
- ``floor`` is the plan-independent slots (end of step, FSDP's collectives).

The model counts more than the timeline in three cases only: an unsaved storage read, before a block, by an op
that can be in its own block's closure is counted as held by that closure's frame; an unsaved storage held by a
frame before its last reader is counted both as carried and as read in the blocks up to that reader; a storage
held for autograd that autocast's cache or a non-reaching node also holds is counted both ways. None arises when
every storage read across a block boundary is saved by a reaching node and nothing else holds it (chains such as
Linear/GELU stacks); elsewhere it may be above the simulator (docs/optimal.md measures by how much). It counts less
in one case: a compiled backward node that runs after a later op's backward began (inductor's order) reads its
forward values there, below their producer's ranks, where the model releases them at the producer's backward.
Every plan proposed is scored by the simulator.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from sublinear.core.plan import Plan
from sublinear.core.profile import GraphProfile
from sublinear.simulation.lifetimes import forward_release
from sublinear.simulation.timeline import step_terms

__all__ = ["NEVER", "FlatModel"]

NEVER = np.iinfo(np.int64).max // 4  # beyond every index: "never" for entries, "end of step" for lifetimes
_LOW = -(1 << 62)
_CELLS = 1 << 20  # cells of one array of block ends by backward ranks


class FlatModel:
    """Block costs of flat plans with the kept set ``kept`` on one profile (see the module docstring).

    Invariants: ``block(i, j)[0]`` is the simulator's recompute seconds of block ``[i..j]`` in any such plan where
    it is not the last; ``peak(plan) >= simulate(profile, plan).peak_bytes`` (but for the one case the module
    docstring names), with equality on chains."""

    def __init__(self, profile: GraphProfile, kept: frozenset[int] = frozenset()) -> None:
        p = profile
        n = self.n = p.num_ops
        self.kept = frozenset(kept)
        node_op = np.asarray(p.node_op, dtype=np.int64)
        ops = np.arange(n)
        self.rank_lo = np.searchsorted(node_op, ops, side="left")
        self.rank_hi = np.searchsorted(node_op, ops, side="right") - 1
        self.rerun_grad_side = np.asarray(p.arrays.most_rerun_grad_side, dtype=np.int64)
        self.grad_peak = np.asarray(p.grad_peak, dtype=np.int64)
        self.grad_after = np.asarray(p.grad_after_release, dtype=np.int64)
        self.op_seconds = p.op_seconds
        self.rerun_extra = p.rerun_extra  # at a recompute (a forward lesson is the op's forward's only)
        self.forward_extra = p.forward_extra + p.forward_lesson  # at the op's forward
        self.snapshot = np.array([op.snapshot_bytes for op in p.ops], dtype=np.int64)
        stays = self.stays = np.zeros(n, dtype=bool)
        stays[p.pinned_ops] = True
        stays[list(self.kept)] = True

        size = self.size = np.asarray(p.storage_bytes, dtype=np.int64)
        producer = self.producer = np.asarray(p.storage_producer, dtype=np.int64)
        last_use = self.last_use = np.asarray(p.storage_last_use, dtype=np.int64)
        count = len(size)
        always_kept = stays[producer] if count else np.zeros(0, dtype=bool)
        for o in np.flatnonzero(stays):
            always_kept[list(p.op_storages[o])] = True
        self.always_kept = always_kept  # retained in every block: an op that is never recomputed holds it

        min_saver, max_saver, fixed_stop, rebuilt_until = _savers(p, self.rank_lo)
        self.min_saver, self.max_saver = min_saver, max_saver
        self.saved = max_saver >= 0
        self.to_end = fixed_stop >= NEVER  # live to the end of the step whatever the plan
        self.fixed_stop = np.minimum(fixed_stop, n - 1)  # in forward slots
        self.end_bytes = int(size[self.to_end].sum())
        self.droppable = self.saved & ~always_kept  # dropped once its block holds its last reader
        # a recomputed copy lives to its savers' backward, or to the backward kernels that read it through values
        # fused into them (``storage_rebuilt_read_at``)
        self.held_copy = (self.droppable | (rebuilt_until < NEVER)) & ~always_kept
        self.copy_rank = np.minimum(np.where(self.droppable, min_saver, NEVER), rebuilt_until)
        self.carried = self.saved & ~self.to_end  # held for autograd past every later block's slots

        reads = _reads(p)
        self.reader, self.source, self.read_storage = reads[:, 0], reads[:, 1], reads[:, 2]
        self.first_read = np.searchsorted(self.reader, np.arange(n + 1))
        last_free = np.full(count, -1)
        free = ~stays[self.reader]
        np.maximum.at(last_free, self.read_storage[free], self.reader[free])
        self.last_free_reader = last_free  # last reader that may be recomputed (-1: none)

        # Entries: a droppable storage drops its producer into the closure once its last reader is in the block;
        # a closure op pulls in the op whose value it reads once a storage of the value is no longer retained.
        self.seed = np.full(n, NEVER)
        np.minimum.at(self.seed, producer[self.droppable], np.maximum(last_use, producer)[self.droppable])
        self.edges, self.views = _closure_edges(n, reads, ~always_kept, last_use, producer)
        self.entries0 = self._sweep(0, n - 1, np.full(n, NEVER))

        terms = step_terms(p)
        self.forward_offset, self.backward_offset, self.held_offsets = terms.forward, terms.backward, terms.beyond_held
        self.floor = max(terms.head + terms.end(self.end_bytes + p.gradient_bytes))  # plan-independent slots
        self._starts: dict[int, _Start] = {}

    def _sweep(self, i: int, top: int, entry: np.ndarray) -> np.ndarray:
        """``entry`` with ops ``top`` down to ``i`` set for blocks that start at ``i``."""
        seed, stays = self.seed, self.stays
        for o in range(top, i - 1, -1):
            if stays[o]:
                continue
            best = int(seed[o])
            for c, last, producer in self.edges[o]:
                if producer >= i and entry[c] < best:
                    best = min(best, max(int(entry[c]), last))
            entry[o] = best
        return entry

    def _entries(self, i: int) -> np.ndarray:
        """Per op ``o >= i``: the least ``j`` with ``o`` in the closure of ``[i..j]`` (NEVER: none). It differs from
        ``entries0`` only below the last op that reads a view of a storage produced before ``i``."""
        crossing = self.views[(self.views[:, 1] < i) & (self.views[:, 0] >= i), 0]
        if not len(crossing):
            return self.entries0
        return self._sweep(i, int(crossing.max()), self.entries0.copy())

    def start(self, i: int) -> _Start:
        found = self._starts.get(i)
        if found is None:
            found = self._starts[i] = _Start(self, i)
        return found

    def block(self, i: int, j: int) -> tuple[float, int, int]:
        """(recompute seconds, carried bytes, local peak) of the non-last block ``[i..j]``."""
        start = self.start(i)
        start.evaluate(np.array([j]))
        k = j - i
        return float(start.seconds[k]), int(start.carried[k]), int(start.local[k])

    def last_block(self, i: int) -> int:
        """The local peak of the last block ``[i..n-1]``."""
        return self.start(i).last_block()

    def plan(self, points: Sequence[int]) -> Plan:
        """The plan with these split points and this model's kept set, in normal form."""
        return Plan.normal(points, self.kept)

    def peak(self, plan: Plan) -> int:
        """The model's peak for a flat plan with this model's kept set."""
        if self.n == 0:
            return self.floor
        peak, carried, start = self.floor, 0, 0
        for end in plan.split_points[:-1]:
            _, carries, local = self.block(start, end)
            peak = max(peak, carried + local)
            carried += carries
            start = end + 1
        return max(peak, carried + self.last_block(start))

    def seconds(self, plan: Plan) -> float:
        """The recompute seconds of a flat plan with this model's kept set (the simulator's)."""
        starts = (0, *(p + 1 for p in plan.split_points[:-1]))
        return float(sum(self.block(a, b)[0] for a, b in zip(starts, plan.split_points[:-1])))


def _savers(p: GraphProfile, rank_lo: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per storage: the lowest and the highest rank of a node reaching the outputs that saves it (NEVER and -1:
    none), its plan-independent stop: its last reader (NEVER: the end of the step, for outputs), autocast's
    cache, and the forward release of a node that saves it and never reaches the outputs; and the lowest rank
    whose backward kernels read its recomputed copy beyond the savers (NEVER: none)."""
    n, count = p.num_ops, len(p.storage_bytes)
    node_op = np.asarray(p.node_op, dtype=np.int64)
    reaches = np.asarray(p.reaches_output, dtype=bool)
    producer = np.asarray(p.storage_producer, dtype=np.int64)
    last_use = np.asarray(p.storage_last_use, dtype=np.int64)
    released = forward_release(p, NEVER)
    fixed_stop = np.where(last_use >= n, NEVER, last_use)
    if len(p.held_through_forward):
        fixed_stop = np.where(p.held_through_forward, np.maximum(fixed_stop, n - 1), fixed_stop)
    saved, ranks = p.arrays.saved_pairs
    savers = node_op[ranks]
    reaching = reaches[savers]
    min_saver = np.full(count, NEVER)
    max_saver = np.full(count, -1)
    np.minimum.at(min_saver, saved[reaching], ranks[reaching])
    np.maximum.at(max_saver, saved[reaching], ranks[reaching])
    np.maximum.at(fixed_stop, saved[~reaching], released[savers[~reaching]])
    # a compiled backward node that runs after a later op's backward began reads its values there, which may be
    # below their producer's ranks: the model releases such a value at its producer's backward
    first_rank = np.minimum(np.where(producer >= 0, rank_lo[np.maximum(producer, 0)], 0), len(node_op) - 1)
    saved = max_saver >= 0
    min_saver = np.where(saved, np.maximum(min_saver, first_rank), min_saver)
    max_saver = np.where(saved, np.maximum(max_saver, first_rank), max_saver)
    through, through_ranks = p.arrays.rebuilt_read_pairs
    rebuilt_until = np.full(count, NEVER)
    np.minimum.at(rebuilt_until, through, np.maximum(through_ranks, first_rank[through]))
    return min_saver, max_saver, fixed_stop, rebuilt_until


def _reads(p: GraphProfile) -> np.ndarray:
    """Every read: rows of (reader op, op whose value it reads, storage of the value), sorted by reader."""
    storages, readers, producers = p.arrays.input_triples
    rows = np.stack([readers, producers, storages], axis=1).astype(np.int64).reshape(-1, 3)
    return rows[np.lexsort(rows.T[::-1])]


def _closure_edges(n: int, reads: np.ndarray, eligible: np.ndarray, last_use: np.ndarray, producer: np.ndarray
                   ) -> tuple[list[list[tuple[int, int, int]]], np.ndarray]:
    """Per op, the (reader, last use, producer) of each read of its value through a storage not always kept (a
    closure op pulls in the op whose value it reads once that storage is no longer retained); and the views: rows
    of (op, producer of a storage of its value that another op produced)."""
    edges: list[list[tuple[int, int, int]]] = [[] for _ in range(n)]
    views = []
    for c, o, s in reads.tolist():
        if eligible[s]:
            edges[o].append((c, int(last_use[s]), int(producer[s])))
            if producer[s] != o:
                views.append((o, int(producer[s])))
    return edges, np.array(views, dtype=np.int64).reshape(-1, 2)


def _merge(storage: np.ndarray, first: np.ndarray, last: np.ndarray, n: int) -> tuple[np.ndarray, ...]:
    """Intervals ``[first, last]`` of block ends united per storage (ends >= n mean "to the last block"):
    (storage, first, last) of disjoint intervals."""
    if not len(storage):
        return storage, first, last
    last = np.minimum(last, n)
    order = np.lexsort((first, storage))
    storage, first, last = storage[order], first[order], last[order]
    key = storage * (n + 2)
    reach = np.maximum.accumulate(key + last) - key  # furthest end so far within the storage's intervals
    new = np.ones(len(storage), dtype=bool)
    new[1:] = (storage[1:] != storage[:-1]) | (first[1:] > reach[:-1] + 1)
    at = np.flatnonzero(new)
    return storage[at], first[at], np.maximum.reduceat(reach, at)


class _Start:
    """Blocks that begin at op ``i``: per-start arrays over block ends ``j = i..n-2`` (recompute seconds,
    carried bytes, a lower bound on the local peak), and the local peaks evaluated so far."""

    def __init__(self, m: FlatModel, i: int) -> None:
        self.m, self.i = m, i
        n = m.n
        entry = self.entry = m._entries(i)
        producer, last_use, size = m.producer, m.last_use, m.size
        live_in = (producer < i) & (last_use >= i)
        # Maybe held by an earlier block's recompute frame: read before i by an op that can be in its closure.
        earlier_frame = np.zeros(len(size), dtype=bool)
        earlier_frame[m.read_storage[(m.reader < i) & (m.entries0[m.reader] <= i - 1)]] = True
        self.earlier_frame = earlier_frame & live_in
        self.held_throughout = live_in & ((m.min_saver < m.rank_lo[i]) | earlier_frame)
        self.live_in = np.flatnonzero(live_in & ~m.to_end)
        self.live_in_bytes = int(size[live_in & m.carried].sum())  # what the carried bytes count of the live-in
        self._last: int | None = None

        rows = n - 1 - i
        own = producer >= i
        dropping = own & m.droppable & (last_use < n)
        drop_at = last_use[dropping]

        def by_end(values: np.ndarray, at: np.ndarray, reduce=np.add, empty=0) -> np.ndarray:
            out = np.full(n + 1, empty, dtype=values.dtype)
            reduce.at(out, np.minimum(at, n), values)
            return out[i:n - 1]

        joins = (np.arange(n) >= i) & (entry < n)
        self.seconds = np.cumsum(by_end(m.op_seconds[joins], entry[joins]))
        self.snapshots = np.cumsum(by_end(m.snapshot[joins], entry[joins]))
        self.trigger = np.maximum.accumulate(by_end(m.max_saver[dropping], drop_at, np.maximum, -1))
        self.frame_end = np.minimum.accumulate(by_end(m.min_saver[dropping], drop_at, np.minimum, NEVER))
        self.forward_max = np.maximum.accumulate(self.forward_bytes(last=False))
        # At the trigger's backward every dropped copy is live beside the gradient side; the least of that over
        # this and longer blocks is a lower bound non-decreasing in j.
        at_trigger = np.cumsum(by_end(size[dropping], drop_at)) + m.backward_offset + m.end_bytes + \
            np.where(self.trigger >= 0, m.grad_peak[np.maximum(self.trigger, 0)], 0)
        self.lower = np.maximum(self.forward_max[:rows], np.minimum.accumulate(at_trigger[::-1])[::-1]) - \
            self.live_in_bytes

        # Carried bytes: retained storages held for autograd, closure snapshots, and unsaved storages past their
        # last reader that this block's frame (or maybe an earlier block's) holds.
        carried = own & m.carried
        released = carried & ~m.always_kept & (last_use < n)
        self.carried = np.cumsum(by_end(size[carried], producer[carried])) - \
            np.cumsum(by_end(size[released], last_use[released])) + self.snapshots
        self.framed = _framed(m, i, entry)
        s, a, b = self.framed
        unsaved = ~m.saved[s]
        early = np.flatnonzero(self.earlier_frame & ~m.saved & ~m.to_end)
        s, a, b = _merge(np.concatenate([s[unsaved], early]), np.concatenate([a[unsaved], np.full(len(early), i)]),
                         np.concatenate([b[unsaved], np.full(len(early), n)]), n)
        a = np.maximum(a, last_use[s])
        keep = a <= b
        held = np.zeros(rows + 1, dtype=np.int64)
        np.add.at(held, np.clip(a[keep] - i, 0, rows), size[s[keep]])
        np.add.at(held, np.clip(b[keep] - i + 1, 0, rows), -size[s[keep]])
        self.carried = self.carried + np.cumsum(held)[:rows]

        # Held storages: rows a..b (block ends), released by the backward of rank `rank` (-1: held throughout).
        kept_own = np.flatnonzero(own & ~m.to_end & (m.min_saver < NEVER))
        incoming = np.flatnonzero(live_in & ~m.to_end & (self.held_throughout | (m.min_saver < NEVER)))
        self.held = (np.concatenate([producer[kept_own], np.full(len(incoming), i)]),
                     np.concatenate([np.where(m.always_kept[kept_own], NEVER, last_use[kept_own] - 1),
                                     np.full(len(incoming), NEVER)]),
                     np.concatenate([m.min_saver[kept_own],
                                     np.where(self.held_throughout[incoming], -1, m.min_saver[incoming])]),
                     size[np.concatenate([kept_own, incoming])])
        dropped = np.flatnonzero(own & m.held_copy & (last_use < n))  # from the block holding its op and readers
        self.dropped = (np.maximum(last_use, entry[np.maximum(producer, 0)])[dropped], producer[dropped],
                        m.copy_rank[dropped], size[dropped])
        self.copies = _copies(m, i, entry, self.dropped)
        self.local = np.zeros(rows, dtype=np.int64)
        self.done = np.zeros(rows, dtype=bool)

    def forward_bytes(self, last: bool) -> np.ndarray:
        """Live bytes at forward slots i..n-1 when ``[i..]`` is one block (the last one if ``last``); for a
        non-last block ``[i..j]`` the slots i..j are exact."""
        m, i, n = self.m, self.i, self.m.n
        producer, last_use, size = m.producer, m.last_use, m.size
        own = producer >= i
        live_in = (producer < i) & (last_use >= i)
        if last:
            held = m.saved
        else:  # retained storages stay for autograd or for a recomputable reader's frame
            held = np.where(own, m.always_kept & (m.saved | (m.last_free_reader >= 0)),
                            m.saved | (m.last_free_reader >= i))
        stop = np.where((own | live_in) & held | self.earlier_frame, n - 1, m.fixed_stop)
        begin = np.where(own, producer + 1, i)
        alive = stop >= begin
        diff = np.zeros(n + 1, dtype=np.int64)
        np.add.at(diff, begin[alive], size[alive])
        np.add.at(diff, stop[alive] + 1, -size[alive])
        if not last:
            snaps = np.flatnonzero((m.snapshot > 0) & ~m.stays)
            snaps = snaps[snaps >= i]
            np.add.at(diff, snaps, m.snapshot[snaps])  # taken before the op runs
            diff[n] -= m.snapshot[snaps].sum()
        if i > 0 and m.snapshot[i - 1] and not m.stays[i - 1] and m.seed[i - 1] > i - 1:
            diff[i] += m.snapshot[i - 1]  # a block's last op outside its closure: its snapshot outlives it a slot
            diff[i + 1] -= m.snapshot[i - 1]
        return np.cumsum(diff)[i:n] + m.forward_extra[i:n] + m.forward_offset

    def evaluate(self, ends: np.ndarray) -> None:
        """Make ``local`` exact at the block ends ``ends`` (ascending)."""
        m, i = self.m, self.i
        ends = ends[~self.done[ends - i]]
        while len(ends):
            widths = (m.rank_hi[ends] - m.rank_lo[i] + 2) + (ends - i + 2)
            count = max(1, int(np.searchsorted(np.arange(1, len(ends) + 1) * widths, _CELLS, side="right")))
            batch, ends = ends[:count], ends[count:]
            self.local[batch - i] = _local_peaks(self, batch)
            self.done[batch - i] = True

    def last_block(self) -> int:
        if self._last is None:
            self._last = _last_block_peak(self)
        return self._last


def _framed(m: FlatModel, i: int, entry: np.ndarray) -> tuple[np.ndarray, ...]:
    """(storage, first j, last j): block ends at which the closure of [i..j] reads the storage from outside the
    closure (its frame holds it), united per storage, for blocks that start at ``i`` (``entry``: their
    :meth:`FlatModel._entries`); storages live to the end are left out."""
    at = slice(m.first_read[i], None)
    reader, source, storage = m.reader[at], m.source[at], m.read_storage[at]
    first = entry[reader]
    last = np.where(source >= i, entry[np.maximum(source, i)] - 1, NEVER)
    keep = (first <= last) & (first < m.n) & ~m.to_end[storage]
    return _merge(storage[keep], first[keep], last[keep], m.n)


def _copies(m: FlatModel, i: int, entry: np.ndarray, dropped: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
    """Recomputed copies in (block end, recomputed op) space: rows a..b, ops lo..hi, bytes. A copy lives from
    its producer's recompute through its last closure reader's, or, once dropped, to its savers' backward."""
    at = slice(m.first_read[i], None)
    reader, source, storage = m.reader[at], m.source[at], m.read_storage[at]
    producer = m.producer[storage]
    keep = (producer >= i) & (source >= i)
    reader, source, storage, producer = reader[keep], source[keep], storage[keep], producer[keep]
    first = np.maximum(np.maximum(entry[reader], entry[source]), entry[producer])
    last = np.where(m.held_copy[storage] & (m.last_use[storage] < m.n),
                    np.maximum(m.last_use[storage], entry[producer]) - 1, NEVER)
    keep = (first <= last) & (first < m.n)
    reader, storage, producer, first, last = reader[keep], storage[keep], producer[keep], first[keep], last[keep]
    order = np.lexsort((first, storage))
    reader, storage, producer, first, last = (x[order] for x in (reader, storage, producer, first, last))
    # From row `first` on, the copy also lives through the recomputes of ops (reach before, reader].
    key = storage * (m.n + 1)
    reach = np.maximum.accumulate(key + reader) - key
    before = np.empty_like(reach)
    before[:1] = producer[:1]
    before[1:] = np.where(storage[1:] == storage[:-1], reach[:-1], producer[1:])
    grows = reader > before
    drop_row, drop_producer, _, drop_size = dropped
    return (np.concatenate([first[grows], drop_row]),
            np.concatenate([last[grows], np.full(len(drop_row), NEVER)]),
            np.concatenate([before[grows] + 1, drop_producer + 1]),
            np.concatenate([reader[grows], np.full(len(drop_row), NEVER)]),
            np.concatenate([m.size[storage[grows]], drop_size]))


def _local_peaks(start: _Start, ends: np.ndarray) -> np.ndarray:
    """Local peaks of the blocks [i..j] that ``start`` begins, j in ``ends`` (ascending)."""
    m, i = start.m, start.i
    rows, top = len(ends), int(ends[-1])
    lo, hi = int(m.rank_lo[i]), int(m.rank_hi[top])
    cols = hi - lo + 2  # column 0: held throughout; column r - lo + 1: released by the backward of rank r
    trigger, frame_end, snapshots = start.trigger[ends - i], start.frame_end[ends - i], start.snapshots[ends - i]
    framing = trigger >= 0

    def add(grid: np.ndarray, row_a, row_b, col_a, weight, col_b=None) -> None:
        """Add ``weight`` over rows whose block end is in row_a..row_b, from column col_a (to col_b)."""
        a, b = np.searchsorted(ends, row_a, side="left"), np.searchsorted(ends, row_b, side="right")
        keep = (a < b) & (col_a < grid.shape[1] - 1)
        a, b, ca, w = a[keep], b[keep], col_a[keep], weight[keep]
        np.add.at(grid, (a, ca), w)
        np.add.at(grid, (b, ca), -w)
        if col_b is not None:
            cb = np.minimum(col_b[keep] + 1, grid.shape[1] - 1)
            np.add.at(grid, (a, cb), -w)
            np.add.at(grid, (b, cb), w)

    # Held storages, framed storages and closure snapshots, by the rank whose backward releases them.
    grid = np.zeros((rows + 1, cols + 1), dtype=np.int64)
    row_a, row_b, rank, weight = start.held
    add(grid, row_a, row_b, np.where(rank < 0, 0, rank - lo + 1), weight)
    grid = np.cumsum(grid, axis=0)[:rows]
    frame_col = np.where(framing, frame_end - lo + 1, cols)
    s, a, b = start.framed
    a, b = np.searchsorted(ends, a, side="left"), np.searchsorted(ends, b, side="right")
    span = np.maximum(b - a, 0)
    row = np.repeat(a, span) + np.arange(span.sum()) - np.repeat(np.cumsum(span) - span, span)
    s = np.repeat(s, span)
    release = np.where(start.held_throughout[s], 0, np.minimum(m.min_saver[s] - lo + 1, cols))
    at = frame_col[row]
    sooner = at < release
    np.add.at(grid, (row[sooner], at[sooner]), m.size[s[sooner]])
    np.add.at(grid, (row[sooner], release[sooner]), -m.size[s[sooner]])
    grid[np.arange(rows), frame_col] += np.where(framing, snapshots, 0)
    held = np.cumsum(grid, axis=1)[:, :cols]
    copies = np.zeros((rows + 1, cols + 1), dtype=np.int64)
    drop_row, _, drop_rank, drop_size = start.dropped
    add(copies, drop_row, np.full(len(drop_row), NEVER), drop_rank - lo + 1, drop_size)
    with_copies = held + np.cumsum(np.cumsum(copies, axis=0)[:rows], axis=1)[:, :cols]

    # Backward of each rank, before and after it releases what it saved; copies live from the trigger on.
    ranks = np.arange(lo, hi + 1)
    recomputed = ranks[None, :] <= trigger[:, None]
    live = np.where(recomputed, with_copies[:, 1:], held[:, 1:])
    live_after = np.where(recomputed, with_copies[:, :-1], held[:, :-1])
    values = np.maximum(live + m.grad_peak[lo:hi + 1], live_after + m.grad_after[lo:hi + 1])
    values = np.where(ranks[None, :] <= m.rank_hi[ends][:, None], values, _LOW)
    backward = values.max(axis=1, initial=_LOW)

    # Recompute slots, one per closure op in op order, just before the trigger's backward.
    ops = top - i + 1
    grid = np.zeros((rows + 1, ops + 2), dtype=np.int64)
    row_a, row_b, op_lo, op_hi, weight = start.copies
    add(grid, row_a, row_b, op_lo - i, weight, np.minimum(op_hi, top) - i)
    alive = np.cumsum(np.cumsum(grid, axis=0)[:rows], axis=1)[:, :ops]
    before = held[np.arange(rows), np.where(framing, trigger - lo + 1, 0)] + \
        np.where(framing, m.rerun_grad_side[np.maximum(trigger, 0)], 0)
    values = np.where(start.entry[i:top + 1][None, :] <= ends[:, None],
                      alive + m.rerun_extra[i:top + 1] + before[:, None], _LOW)
    backward = np.maximum(backward, values.max(axis=1, initial=_LOW)) + m.backward_offset + m.end_bytes
    return np.maximum(start.forward_max[ends - i], backward) - start.live_in_bytes


def _last_block_peak(start: _Start) -> int:
    """The local peak of the last block ``[i..n-1]`` that ``start`` begins."""
    m, i = start.m, start.i
    forward = int(start.forward_bytes(last=True).max())
    lo, hi = int(m.rank_lo[i]), len(m.grad_peak) - 1
    slots = 2 * (hi - lo + 1)
    own = np.flatnonzero((m.producer >= i) & ~m.to_end)
    stop = np.full(len(m.size), -1, dtype=np.int64)
    saver = m.min_saver[own]
    stop[own] = np.where(saver <= hi, 2 * (hi - saver), -1)
    saver = m.min_saver[start.live_in]
    stop[start.live_in] = np.where(start.held_throughout[start.live_in], slots - 1,
                                   np.where((saver >= lo) & (saver <= hi), 2 * (hi - saver), -1))
    held = np.concatenate([own, start.live_in])
    held = held[stop[held] >= 0]
    diff = np.zeros(slots + 1, dtype=np.int64)
    diff[0] += m.size[held].sum()
    np.add.at(diff, stop[held] + 1, -m.size[held])
    ranks = np.arange(hi, lo - 1, -1)
    extra = np.empty(slots, dtype=np.int64)
    extra[2 * (hi - ranks)] = m.grad_peak[ranks]
    extra[2 * (hi - ranks) + 1] = m.grad_after[ranks]
    live = np.cumsum(diff)[:slots]
    peak = max(forward, int((live + extra).max()) + m.backward_offset + m.end_bytes) if slots else forward
    held_after_forward = (int(live[0]) if slots else 0) + m.end_bytes
    for offset in m.held_offsets:
        peak = max(peak, held_after_forward + offset)
    return peak - start.live_in_bytes
