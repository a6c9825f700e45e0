"""The compiled step's costs: which storages inductor materialises, per op the most bytes its own allocations hold
at once, its FLOPs and estimated seconds, and per backward rank the gradient-side bytes, walked kernel by kernel.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from torch import fx

from sublinear.capture.dynamo import INPUT, PARAMETER
from sublinear.capture.joint import JointGraph, data_inputs
from sublinear.profiling.compiled_dataflow import OpGrouping, StorageReads, StepStorages
from sublinear.profiling.compiled_nodes import (
    InductorKinds, LibraryCalls, estimate_node_seconds, flops_of, storage_key_of, tensor_leaves,
)
from sublinear.profiling.compiled_inplace import InPlace
from sublinear.profiling.compiled_realize import (
    kernel_segments, kernel_starts, realized_by_lowering, stored_by_lowering,
)
from sublinear.profiling.costs import DeviceRates
from sublinear.tensors import size_hint as hint

# --- Forward: bytes inside each op, FLOPs and time -----------------------------------------------------------------

def materialized_predicate(storages: StepStorages, reads: StorageReads, kinds: InductorKinds, fw: list[fx.Node]):
    """The predicate ``materialized(key, rebuilt=False, saved=True)``: whether a produced storage is a buffer in
    forward: a library kernel or a reduction makes it, a library kernel reads it, the graph returns it, or (with
    ``saved``) backward reads it, so that forward saves it; a fused pointwise value read only by fused forward
    kernels is not, unless inductor's lowering stores it anyway (:mod:`.compiled_realize`). ``rebuilt``: as
    recomputed in backward, where neither returning nor saving counts, and backward's nodes read it too."""
    fusible = {key: kinds.fusible(fw[i]) for key, i in storages.produced_by.items()}
    in_forward = set(fw)

    def read_as_buffer(key: int, rebuilt: bool, saved: bool = True) -> bool:
        """A library kernel reads it, or (not rebuilt) the graph returns it or, with ``saved``, forward saves it."""
        return key in reads.needs_buffer or (not rebuilt and (key in reads.output_use
                                                              or (saved and key in reads.saved_at)))

    def stored_when(rebuilt: bool, readers) -> set[int]:
        return _keys(storages, stored_by_lowering(
            fw, kinds, readers, lambda n: any(read_as_buffer(k, rebuilt) for k in storages.keys_of(n))))

    stored = stored_when(False, lambda n: _readers(n, in_forward))
    stored_rebuilt = stored_when(True, lambda n: sum(u.op != "output" for u in n.users))

    def materialized(key: int, rebuilt: bool = False, saved: bool = True) -> bool:
        return key in storages.produced_by and (
            not fusible[key] or read_as_buffer(key, rebuilt, saved) or key in (stored_rebuilt if rebuilt else stored))
    return materialized


def _readers(node: fx.Node, graph: set[fx.Node]) -> int:
    """How many nodes of ``graph`` read ``node``, its output (what the graph returns or saves) counting as one."""
    inside = sum(u in graph for u in node.users)
    return inside + (inside < len(node.users))


def _keys(storages: StepStorages, nodes: set[fx.Node]) -> set[int]:
    return {key for node in nodes for key in storages.keys_of(node)}


@dataclass(frozen=True)
class ForwardCosts:
    """Per op: the most bytes its own allocations hold at once while it runs (its buffers, those that outlive it
    included, and a library call's scratch), its FLOPs, and its estimated seconds in forward and when backward
    re-runs it (fused into the kernels reading it: what is no buffer there is neither written nor launched). The
    outputs written into an earlier op's buffer (``in_place``), and per buffer an earlier op's kernel makes
    (``fused_from``), that op: from it until its own op, the ops hold its bytes."""

    extra: list[int]
    seconds: list[float]
    rerun: list[float]
    flops: list[int]
    in_place: set[int]
    fused_from: dict[int, int]
    rerun_extra: list[int]  # ``extra`` less the buffers only random library calls, never re-run, read
    rerun_into: dict[int, int]  # per value a re-run makes: the forward buffer it may take (_rerun_written_into)


def forward_costs(fw: list[fx.Node], grouping: OpGrouping, storages: StepStorages, reads: StorageReads,
                  tracked: set[int], materialized, scratch: dict[fx.Node, int], kinds: InductorKinds,
                  rates: DeviceRates) -> ForwardCosts:
    """The :class:`ForwardCosts` of every op of forward ``fw``."""
    last_reader: dict[int, int] = {}
    for i, node in enumerate(fw):
        for arg in data_inputs(node):
            for key in storages.keys_of(arg):
                last_reader[key] = i
    segments = kernel_segments(fw, kinds)
    kernel_first = {k: segment[0] for segment in segments for k in segment}
    kernel_last = {k: segment[-1] for segment in segments for k in segment}
    freed_at = {key: kernel_last[i] for key, i in last_reader.items()}  # the C++ backend frees after the call
    n_ops = len(grouping.nodes)
    extra, seconds, rerun, flops = [0] * n_ops, [0.0] * n_ops, [0.0] * n_ops, [0] * n_ops
    rebuilt = functools.partial(materialized, rebuilt=True)
    produced, size_of = storages.produced_by, storages.size_of
    for o, members in enumerate(grouping.nodes):
        live = peak = 0
        internal = {k for i in members for k in storages.keys_of(fw[i]) if k in produced and k not in tracked
                    and produced[k] == i and materialized(k)}
        for i in members:
            node = fw[i]
            live += sum(size_of[k] for k in dict.fromkeys(storages.keys_of(node))
                        if produced.get(k) == i and (k in internal or k in tracked and materialized(k)))
            peak = max(peak, live + scratch.get(node, 0))
            for key in [k for k in internal if freed_at.get(k, produced[k]) <= i and produced[k] <= i]:
                live -= size_of[key]
                internal.discard(key)
            node_flops = flops_of(node)
            flops[o] += node_flops
            seconds[o] += estimate_node_seconds(node, node_flops, storages.keys_of, materialized, size_of,
                                                storages.state, kinds, rates)
            rerun[o] += estimate_node_seconds(node, node_flops, storages.keys_of, rebuilt, size_of, storages.state,
                                              kinds, rates)
        extra[o] = peak
    in_place = _written_in_place(fw, grouping, storages, reads, materialized, kinds)
    in_forward = set(fw)
    may_take = _written_in_place(fw, grouping, storages, reads, materialized, kinds, alone=False,
                                 separate=frozenset(realized_by_lowering(fw, kinds, lambda n: _readers(n, in_forward))))
    fused_from = _fused_early(fw, grouping, storages, materialized, kinds, set(may_take), kernel_first)
    for key, first in fused_from.items():
        for o in range(first, grouping.op_of_node[produced[key]]):
            extra[o] += size_of[key]
    for key in in_place:
        o = grouping.op_of_node[produced[key]]
        extra[o] = max(0, extra[o] - size_of[key])
    if storages.layout_copies:  # made by the forward's first kernel, beside what its first op makes
        extra[0] += sum(size_of[key] for key in storages.layout_copies)
    rerun_extra = list(extra)
    for key in (reads.needs_buffer - reads.rerun_needs_buffer) & tracked:
        if materialized(key):
            o = grouping.op_of_node[produced[key]]
            rerun_extra[o] = max(0, rerun_extra[o] - size_of[key])
    for key, (after, until) in _held_to_kernel_end(grouping, storages, reads, tracked, materialized,
                                                    {*may_take, *may_take.values()}, last_reader, freed_at).items():
        for o in range(after + 1, until + 1):
            extra[o] += size_of[key]
    return ForwardCosts(extra, seconds, rerun, flops, set(in_place), fused_from, rerun_extra,
                        _rerun_written_into(fw, grouping, storages, reads, materialized, kinds))


def _held_to_kernel_end(grouping: OpGrouping, storages: StepStorages, reads: StorageReads, tracked: set[int],
                        materialized, written: set[int], last_reader: dict[int, int], freed_at: dict[int, int]
                        ) -> dict[int, tuple[int, int]]:
    """Per forward buffer that a fused kernel reads last before the kernel's last op, and that nothing else holds
    (not saved for backward, not returned, neither written over by a later value nor such a value, ``written``):
    the op of its last reader and that of the kernel's last node. Inductor's C++ backend frees a function's inputs
    and the buffers it makes after the call, so the buffer is held to the kernel's end, beyond its readers' ops."""
    op_of_node, produced = grouping.op_of_node, storages.produced_by
    held: dict[int, tuple[int, int]] = {}
    for key, i in last_reader.items():
        if key not in produced or not materialized(key) or key in reads.saved_at or key in reads.output_use \
                or key in written:
            continue
        after = op_of_node[i] if key in tracked else op_of_node[produced[key]]
        until = op_of_node[freed_at[key]]
        if until > after:
            held[key] = (after, until)
    return held


def _fused_early(fw: list[fx.Node], grouping: OpGrouping, storages: StepStorages, materialized,
                 kinds: InductorKinds, chained: set[int], kernel_first: dict[int, int]) -> dict[int, int]:
    """Per buffer that an earlier op's kernel already holds, that op. Inductor's C++ backend runs every fused node
    between two library calls as one function and allocates all the buffers it makes before calling it: each such
    buffer is held from the op of the function's first node on. Where the buffer may be written over one its
    kernel reads last (``chained``: a log-softmax over the logits), it takes memory where its computation starts
    instead: with the chain of pointwise values it is made from that are not buffers, but not before the buffers
    the chain reads are made (the log-softmax's sum), as its reads let go of what it may be written over.
    ``kernel_first``: per forward node, the first node of its function."""
    early: dict[int, int] = {}
    produced, op_of_node = storages.produced_by, grouping.op_of_node
    for key, i in produced.items():
        if key < 0 or not materialized(key) or not kinds.fusible(fw[i]):
            continue
        start = _chain_start(fw, i, storages, materialized, kinds, op_of_node) if key in chained \
            else op_of_node[kernel_first[i]]
        if start < op_of_node[i]:
            early[key] = start
    return early


def _chain_start(fw: list[fx.Node], i: int, storages: StepStorages, materialized, kinds: InductorKinds,
                 op_of_node) -> int:
    """The op where the computation of forward node ``i`` starts: the first op of the chain of pointwise values
    without a buffer it is made from, or the last op making a buffer the chain reads, whichever is later."""
    produced = storages.produced_by
    first, ready, stack, seen = op_of_node[i], 0, [fw[i]], set()
    while stack:
        for arg in data_inputs(stack.pop()):
            inner = [k for k in storages.keys_of(arg) if k in produced]
            fused = inner and all(not materialized(k) and kinds.fusible(fw[produced[k]]) for k in inner)
            if fused and arg not in seen:
                seen.add(arg)
                first = min(first, op_of_node[produced[inner[0]]])
                stack.append(arg)
            elif inner and not fused:
                ready = max(ready, *(op_of_node[produced[k]] for k in inner))
    return max(first, ready)


def _written_in_place(fw: list[fx.Node], grouping: OpGrouping, storages: StepStorages, reads: StorageReads,
                      materialized, kinds: InductorKinds, alone: bool = True,
                      separate: frozenset = frozenset()) -> dict[int, int]:
    """Per output inductor writes into an earlier op's buffer that its op reads last and alone (``alone``; else
    last, maybe through the fused values it is made from: the outputs it may write so), not saved for backward,
    not returned, of the same size: that buffer. It is counted until the op ends, so the op's own bytes leave the
    output out. Where other ops read the buffer too inductor may or may not (it writes a log-softmax into the
    logits its max and sum read; not a softmax over the scores its exponentials read, stored once for its sum and
    its division: ``separate``, the values inductor's lowering stores)."""
    def read_last(key: int, o: int) -> bool:
        readers = reads.readers.get(key, set())
        return (readers == {o} if alone else max(readers, default=-1) <= o) and key not in reads.saved_at \
            and key not in reads.output_use

    return _written_into(fw, grouping, storages, materialized, materialized, kinds, read_last, separate)


def _rerun_written_into(fw: list[fx.Node], grouping: OpGrouping, storages: StepStorages, reads: StorageReads,
                        materialized, kinds: InductorKinds) -> dict[int, int]:
    """Per value that is a buffer where a plan re-runs its op: the forward buffer of the same size its re-run's
    kernel would write it into (read through the values that are no buffers there), one backward never reads
    itself (saved for no backward node, not returned). Inductor does so where that re-run reads the buffer last,
    which the plan decides: a GPT-2 residual sum re-run for the layers above, written into the kept attention
    projection its dropped output is made from."""
    def backward_never_reads(key: int, o: int) -> bool:
        return key not in reads.saved_at and key not in reads.output_use

    return _written_into(fw, grouping, storages, functools.partial(materialized, rebuilt=True), materialized, kinds,
                         backward_never_reads)


def _written_into(fw: list[fx.Node], grouping: OpGrouping, storages: StepStorages, made, kept, kinds: InductorKinds,
                  free, separate: frozenset = frozenset()) -> dict[int, int]:
    """Per buffer a fused kernel makes (``made``: whether a value is a buffer there), the forward buffer (``kept``)
    of an earlier op it writes into: the first of the same size its kernel reads that ``free(key, op)`` allows and
    no other output took. A value in ``separate`` is a node of its own in inductor's kernel (its lowering stored
    it), so what it reads is not read by the values made from it."""
    produced, op_of_node, size_of = storages.produced_by, grouping.op_of_node, storages.size_of
    written: dict[int, int] = {}
    taken: set[int] = set()
    for key, i in produced.items():
        o = op_of_node[i]
        if not made(key) or not kinds.fusible(fw[i]) or kinds.extern(fw[i]):
            continue
        match = next((k for k in _kernel_reads(fw[i], storages, made, kinds, separate) if k not in taken
                      and op_of_node[produced[k]] < o and free(k, o) and kept(k) and size_of[k] == size_of[key]),
                     None)
        if match is not None:
            taken.add(match)
            written[key] = match
    return written


def _kernel_reads(node: fx.Node, storages: StepStorages, materialized, kinds: InductorKinds,
                  separate: frozenset = frozenset()) -> list[int]:
    """The buffers the kernel computing ``node`` reads: through the fused values (no buffer) it is made from, other
    than those ``separate``."""
    produced, found, stack, seen = storages.produced_by, [], [node], {node}
    while stack:
        for arg in data_inputs(stack.pop()):
            keys = [k for k in storages.keys_of(arg) if k in produced]
            fused = keys and all(not materialized(k) for k in keys) and kinds.fusible(arg) and arg not in separate
            if fused and arg not in seen:
                seen.add(arg)
                stack.append(arg)
            elif not fused:
                found += [k for k in keys if k not in found]
    return found


# --- Backward: the gradient side per rank --------------------------------------------------------------------------

@dataclass
class BackwardWalk:
    """Per rank: gradient-side bytes (the outputs' gradients and the buffers backward makes) at the start of its
    backward, at their peak before it releases the last forward value it reads, and after; its seconds; and the
    backward's FLOPs and the parameters' gradient bytes at its end."""

    start: list[int]
    before: list[int]
    after: list[int]
    seconds: list[float]
    flops: int
    gradient_bytes: int
    taken_at: dict[int, int]  # forward value -> the rank whose backward kernel writes its output into it
    # forward value -> the rank to which the fused kernel that reads it last holds it, below the rank of its last
    # reading node: the kernel allocates the buffers of all its ranks before it runs and frees its inputs after it.
    # Held to the kernel's last rank but one: what that rank re-runs, the compiled code re-runs after the kernel
    # (right before its reader), the simulation before the rank's backward; to the rank of the node storing a value
    # inlined from it where that is lower (:func:`_hold_to_storing_node`)
    kernel_end: dict[int, int]
    # forward value -> the (first rank, starts before that rank's release) of the fused kernel that re-runs it below
    # that rank, for itself or for the library call after it: the kernel allocates its buffers, the copy among them
    kernel_start: dict[int, tuple[int, bool]]
    entering: list[int]  # per backward node: the gradient-side bytes as its kernel starts
    freed_early: list[int]  # per rank: what its peak falls by where it holds what it reads (:class:`_FreedInsideRank`)
    kernel_of_rank: list[int]  # per rank: where the fused kernel of its first backward node runs (-1: a library's)


class GradientSide:
    """The buffers backward makes (not forward values), with their sizes and the backward node making each (-1:
    an output's gradient, handed to backward)."""

    def __init__(self, joint: JointGraph, storages: StepStorages, kinds: InductorKinds, granule: int,
                 graph_kinds: Sequence[str]) -> None:
        bw = joint.backward
        self.kinds, self.bw = kinds, bw
        self.sizes: dict[int, int] = {}
        self.born: dict[int, int] = {}
        self.outputs: dict[int, str] = {}  # gradients the graph returns -> the kind of primal they are for
        for k, grad in enumerate(joint.gradients):
            if isinstance(grad, fx.Node):
                for key in storages.keys_of(grad):
                    self.outputs[key] = graph_kinds[k] if k < len(graph_kinds) else INPUT
        for node in joint.tangents:
            for t in tensor_leaves(node.meta.get("val")):
                self.sizes.setdefault(storage_key_of(t), -(-hint(t.untyped_storage().nbytes()) // granule) * granule)
                self.born.setdefault(storage_key_of(t), -1)
        self.needs_buffer: set[int] = set()
        self.first: dict[int, int] = {}  # per storage backward reads: its first and last reading node
        self.last: dict[int, int] = {}
        for k, node in enumerate(bw):
            for t in tensor_leaves(node.meta.get("val")):
                key = storage_key_of(t)
                if key not in storages.produced_by and key not in storages.state and key not in self.born:
                    self.born[key] = k
                    self.sizes[key] = -(-hint(t.untyped_storage().nbytes()) // granule) * granule
            for arg in data_inputs(node):
                for key in storages.keys_of(arg):
                    self.first.setdefault(key, k)
                    self.last[key] = k
                    if kinds.extern(node):
                        self.needs_buffer.add(key)
        in_backward = set(bw)
        self.stored = _keys(storages, stored_by_lowering(
            bw, kinds, lambda n: _readers(n, in_backward),
            lambda n: any(self._made_or_read_as_buffer(k) for k in storages.keys_of(n))))
        self._read_through_fused_values(storages)

    def _read_through_fused_values(self, storages: StepStorages) -> None:
        """A backward value without a buffer is computed again inside every kernel that reads it (a ReLU's gradient
        read by its batch norm's backward and by the residual sum of the block before), so what it is made from is
        read until its last reader runs: ``last`` is moved there, last readers first."""
        for k in range(len(self.bw) - 1, -1, -1):
            own = [key for key in storages.keys_of(self.bw[k]) if self.born.get(key) == k]
            if not own or any(self.buffer(key) for key in own):
                continue
            end = max(self.last.get(key, k) for key in own)
            for arg in data_inputs(self.bw[k]):
                for key in storages.keys_of(arg):
                    if self.last.get(key, end) < end:
                        self.last[key] = end

    def buffer(self, key: int) -> bool:
        """Whether a gradient-side value takes memory: an output's gradient, made by a kernel that cannot be fused,
        read by a library kernel, returned, or stored by inductor's lowering anyway."""
        return self._made_or_read_as_buffer(key) or (key in self.born and key in self.stored)

    def _made_or_read_as_buffer(self, key: int) -> bool:
        k = self.born.get(key)
        return k is not None and (k < 0 or not self.kinds.fusible(self.bw[k]) or key in self.needs_buffer
                                  or key in self.outputs)

    def tangent_bytes(self) -> int:
        return sum(self.sizes[key] for key, k in self.born.items() if k < 0)


def walk_backward(joint: JointGraph, reads: StorageReads, n_ops: int, storages: StepStorages, side: GradientSide,
                  calls: LibraryCalls, rates: DeviceRates, fused_when_rebuilt: set[int]) -> BackwardWalk:
    """Walk backward kernel by kernel: inductor fuses the nodes between two library kernels into one kernel, which
    allocates what they make (the next library call's layout copies too) before it runs, unless it writes it into a
    buffer it reads (:class:`~sublinear.profiling.compiled_inplace.InPlace`), and frees what they read last after it
    (``fused_when_rebuilt``: the forward values that are no buffers where a plan re-runs them)."""
    bw, ranks = joint.backward, reads.rank_of_backward
    live = side.tangent_bytes()
    start: list[int | None] = [None] * n_ops
    before, after, left, seconds = [0] * n_ops, [0] * n_ops, [0] * n_ops, [0.0] * n_ops
    last_release = reads.release_nodes()
    released: set[int] = set()
    total_flops = 0
    all_sizes = {**storages.size_of, **side.sizes}
    in_place = InPlace(storages, side, reads, fused_when_rebuilt, calls, joint.forward)
    ending = _by_node(side.last)  # backward node -> the storages backward reads last there

    held_from, held_until = _held_past_saves(reads, side, storages)
    early = _FreedInsideRank(reads, side, storages, fused_when_rebuilt, in_place, last_release)
    read_last_at = _by_node(reads.last_backward_read)  # backward node -> the forward values it reads last
    kernel_end: dict[int, int] = {}

    def readable(key: int) -> bool:
        return key in storages.produced_by or side.buffer(key)

    entering: list[int] = []  # per backward node: the gradient-side bytes as its kernel starts
    runs_at_of: list[int] = []  # per kernel segment: the rank it runs at
    copies = calls.copies_made(segments := kernel_segments(bw, side.kinds), bw, side.kinds)
    for at, segment in enumerate(segments):
        entering += [live] * len(segment)
        for k in segment:
            if start[ranks[k]] is None:
                start[ranks[k]] = before[ranks[k]] = after[ranks[k]] = live
        made = [key for k in segment for key in dict.fromkeys(storages.keys_of(bw[k]))
                if side.born.get(key) == k and side.buffer(key)]
        taken = in_place.take(segment, made)
        live += sum(side.sizes[key] for key in made if key not in taken or taken[key] in storages.produced_by)
        inside = live + max((calls.scratch.get(bw[k], 0) for k in segment), default=0) + copies[at]
        runs_at = min((ranks[side.born[key]] for key in made), default=ranks[segment[0]])
        runs_at_of.append(runs_at)
        above = min((ranks[k] for k in segment if ranks[k] > runs_at), default=None)
        for k in segment:
            for key in read_last_at.get(k, ()):
                if above is not None and ranks[k] > above:
                    kernel_end[key] = above
        for r in {ranks[k] for k in segment if ranks[k] >= runs_at}:
            still_forward = in_place.held_forward(taken, r)
            if r in released:
                after[r] = max(after[r], inside - still_forward)
            else:
                before[r], after[r] = early.reached(r, before[r], inside - still_forward), live - still_forward
        freed = {key for k in segment for key in ending.get(k, ())}
        freed |= {key for key in made if key not in side.last}
        live -= sum(side.sizes[key] for key in freed if side.buffer(key) and key not in side.outputs
                    and key not in in_place.given)
        live += sum(held_from.get(k, 0) - held_until.get(k, 0) for k in segment)
        early.kernel_ran(segment, read_last_at, kernel_end)
        for r in {ranks[k] for k in segment if ranks[k] < runs_at}:  # reached once the kernel has run
            before[r], after[r] = early.reached(r, before[r], live, credited=False), max(after[r], live)
        for k in segment:
            left[ranks[k]] = live
            if last_release.get(ranks[k]) == k:
                released.add(ranks[k])
            node_flops = flops_of(bw[k])
            total_flops += node_flops
            seconds[ranks[k]] += estimate_node_seconds(bw[k], node_flops, storages.keys_of, readable, all_sizes,
                                                       storages.state, side.kinds, rates)
    carried = side.tangent_bytes()  # before the first backward node: the outputs' gradients
    for r in range(n_ops - 1, -1, -1):
        if start[r] is None:
            start[r] = before[r] = after[r] = carried
        else:
            carried = left[r]
    parameter_grads = sum(side.sizes[key] for key, kind in side.outputs.items() if kind == PARAMETER
                          and key in side.sizes)
    _hold_to_storing_node(kernel_end, reads, side, segments, storages, joint.forward)
    kernel_end = {key: r for key, r in kernel_end.items() if key not in in_place.forward_taken}
    return BackwardWalk(start, before, after, seconds, total_flops, parameter_grads, in_place.forward_taken,
                        kernel_end, kernel_starts(bw, reads, storages, side.kinds), entering,
                        early.falls(before, start), _kernel_of_rank(segments, runs_at_of, ranks, side, n_ops))


def _kernel_of_rank(segments: list[list[int]], runs_at_of: list[int], ranks: Sequence[int], side: GradientSide,
                    n_ops: int) -> list[int]:
    """Per rank whose first backward node is fused into a kernel: the rank that kernel runs at (``runs_at_of``, per
    segment: the lowest among its nodes that make a buffer, where it allocates its last); -1 where that node is a
    library call's."""
    kernel_of = [-1] * n_ops
    seen: set[int] = set()
    for segment, runs_at in zip(segments, runs_at_of):
        for k in segment:
            if ranks[k] not in seen and not side.kinds.extern(side.bw[k]):
                kernel_of[ranks[k]] = runs_at
            seen.add(ranks[k])
    return kernel_of


def _by_node(last: dict[int, int]) -> dict[int, list[int]]:
    """``last`` (storage -> backward node) inverted: per node, the storages."""
    found: dict[int, list[int]] = defaultdict(list)
    for key, k in last.items():
        found[k].append(key)
    return found


def _hold_to_storing_node(kernel_end: dict[int, int], reads: StorageReads, side: GradientSide,
                          segments: list[list[int]], storages: StepStorages, fw: list[fx.Node]) -> None:
    """Forward values read by a backward value without a buffer that a node of the same kernel stores (a GRN's
    input gradient, inlined into the GELU's backward after it), where that kernel's nodes at the storing node's rank
    read a library call's result (the GELU's input, a pointwise convolution's output): ``kernel_end`` gains that
    rank where it is lower. A plan that re-runs that call runs it right before the kernel, so the compiled code holds
    them through the re-run; the gradient side cannot, the kernel being one. A re-run the kernel does not read runs
    after it (right before its reader), and they are let go before it."""
    ranks, bw = reads.rank_of_backward, side.bw
    segment_of = {k: at for at, segment in enumerate(segments) for k in segment}

    def reads_library_result(at: int, rank: int) -> bool:
        return any(side.kinds.extern(fw[storages.produced_by[key]]) for k in segments[at] if ranks[k] == rank
                   for arg in data_inputs(bw[k]) for key in storages.keys_of(arg) if key in storages.produced_by)

    for key, k, last in _read_past_direct_reads(reads, side):
        if segment_of[last] == segment_of[k] and ranks[last] < kernel_end.get(key, ranks[k]) \
                and reads_library_result(segment_of[last], ranks[last]):
            kernel_end[key] = ranks[last]


def _read_past_direct_reads(reads: StorageReads, side: GradientSide):
    """(forward value, its last directly reading backward node, the last node reading a backward value without a
    buffer made from it) for each value, not returned, read so past its last direct read."""
    for key, k in reads.last_backward_read.items():
        last = side.last.get(key, k)
        if last > k and key not in reads.output_use:
            yield key, k, last


def _held_past_saves(reads: StorageReads, side: GradientSide, storages: StepStorages
                     ) -> tuple[dict[int, int], dict[int, int]]:
    """Forward values read by a backward value without a buffer, which every kernel reading that value computes again
    (a ReLU's output, read by its mask, read by the batch norm backward of both branches of a residual block), or
    by a product inductor runs at a later sum (a tied weight's output-projection gradient): the simulation releases
    them at the backward of the last rank that reads them directly, whatever the plan; the gradient side holds them
    from there to the last kernel that reads them, a lower rank's or one of the same rank after its release. Per
    backward node, the bytes taken on after it, and the bytes let go after it."""
    ranks = reads.rank_of_backward
    release = reads.release_nodes()
    held_from: dict[int, int] = defaultdict(int)
    held_until: dict[int, int] = defaultdict(int)
    for key, k, last in _read_past_direct_reads(reads, side):
        if ranks[last] < ranks[k] or last > release.get(ranks[k], last):
            held_from[k] += storages.size_of[key]
            held_until[last] += storages.size_of[key]
    return held_from, held_until


class _FreedInsideRank:
    """Forward values a rank's backward reads for the last time in a kernel before the kernel of its release node
    (an attention's backward: the dropped probabilities, read by the values' gradient product, before the scores'
    gradient is made): the compiled code frees each once its kernel has run, the simulation at the rank's release.
    ``credit``: per rank, the bytes so freed by the kernels run so far, which the rank's later kernels do not hold;
    ``peak``: per rank, its peak before the release with them let go. Only values that are buffers there whatever
    the plan (saved or rebuilt into a buffer, not fused where a plan re-runs them), written into by no kernel, read
    by no later backward value, not returned; the simulation lowers a rank's peak so only where the plan keeps what
    the rank's backward reads (re-run, a value is made again inside the rank's kernels)."""

    def __init__(self, reads: StorageReads, side: GradientSide, storages: StepStorages, fused_when_rebuilt: set[int],
                 in_place: InPlace, last_release: dict[int, int]) -> None:
        self.reads, self.side, self.storages = reads, side, storages
        self.fused_when_rebuilt, self.in_place, self.last_release = fused_when_rebuilt, in_place, last_release
        self.credit: dict[int, int] = defaultdict(int)
        self.peak: dict[int, int] = {}

    def reached(self, rank: int, before: int, held: int, credited: bool = True) -> int:
        """``before`` (the rank's peak so far) raised to ``held``, what one of its kernels holds; the rank's peak
        with the values let go early raised too (less what they take, ``credited``: the kernel runs after them)."""
        self.peak[rank] = max(self.peak.get(rank, 0), held - (self.credit[rank] if credited else 0))
        return max(before, held)

    def falls(self, before: list[int], start: list[int]) -> list[int]:
        """Per rank: its peak before its release (``before``) less its peak with the values let go early (never
        below what it holds as it starts, ``start``)."""
        return [peak - max(self.peak.get(r, peak), start[r]) for r, peak in enumerate(before)]

    def kernel_ran(self, segment: list[int], read_last_at: dict[int, list[int]], kernel_end: dict[int, int]) -> None:
        ranks = self.reads.rank_of_backward
        for k in segment:
            release = self.last_release.get(ranks[k])
            if release is None or release <= segment[-1]:
                continue
            for key in read_last_at.get(k, ()):
                if (key in self.storages.produced_by and key not in self.fused_when_rebuilt
                        and key not in self.in_place.forward_taken and key not in kernel_end
                        and key not in self.reads.output_use and self.side.last.get(key, k) <= k):
                    self.credit[ranks[k]] += self.storages.size_of[key]
