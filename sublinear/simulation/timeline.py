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

__all__ = ["Simulation", "StepTerms", "forward_release", "simulate", "step_terms", "timeline"]


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
        peak_slot=_describe(slots, peak_at, profile),
        held_after_forward_bytes=held_after_forward,
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


def _timeline(profile: GraphProfile, plan: Plan, a: PlanAnalysis) -> tuple[np.ndarray, Slots, int]:
    """The timeline with what happens at each slot, and the activation bytes still held when backward starts."""
    n = profile.num_ops
    node_op = profile.node_op

    # Timeline: forward slots 0..n-1, then backward node by node from the last rank (two slots each: before and
    # after it frees what it saved), with each block's recompute just before the backward of the node that first
    # needs it (its trigger), one slot per closure op.
    c_blocks, c_ops = a.recompute_pairs
    trigger = a.trigger
    lengths = np.bincount(c_blocks, minlength=len(trigger))
    recomputes = np.zeros(len(node_op), dtype=np.int64)
    recomputes[trigger[trigger >= 0]] = lengths[trigger >= 0]
    width = recomputes + 2
    group_start = n + np.cumsum(width[::-1])[::-1] - width  # the ranks after r run before it
    backward_slot = group_start + recomputes
    end = n + int(width.sum())
    c_slot = group_start[trigger[c_blocks]] + np.arange(len(c_ops)) - (np.cumsum(lengths) - lengths)[c_blocks]

    extra = np.empty(end + 1, dtype=np.int64)
    kinds = np.empty(end + 1, dtype=np.int8)
    slot_ops = np.empty(end + 1, dtype=np.int64)
    extra[:n], kinds[:n], slot_ops[:n] = profile.forward_extra, _FORWARD, np.arange(n)
    extra[c_slot] = profile.forward_extra[c_ops] + profile.grad_start[trigger[c_blocks]]
    kinds[c_slot], slot_ops[c_slot] = _RECOMPUTE, c_ops
    extra[backward_slot], kinds[backward_slot], slot_ops[backward_slot] = profile.grad_peak, _BACKWARD, node_op
    extra[backward_slot + 1], kinds[backward_slot + 1], slot_ops[backward_slot + 1] = \
        profile.grad_after_release, _RELEASED, node_op
    extra[end], kinds[end], slot_ops[end] = profile.gradient_bytes, _END, -1
    held = np.zeros(end + 2, dtype=np.int64)

    retained, dropped = a.retained, a.dropped
    producer, sizes = profile.storage_producer, profile.storage_bytes
    reaches = profile.reaches_output
    frame_end = a.frame_end
    frame_stop = np.full(len(frame_end), -1, dtype=np.int64)
    frame_stop[frame_end >= 0] = backward_slot[frame_end[frame_end >= 0]]
    # Each storage lives from its producer until the last of: its last forward reader (the end of the step for
    # outputs), autocast's cache (the end of forward), autograd (a node that never reaches the outputs dies in
    # forward and keeps what it saved until then; a reaching node keeps a retained storage until its backward),
    # the forward frame of a block whose recomputable op reads it, and the frame of a block whose closure reads it.
    stop = np.where(profile.storage_last_use >= n, end, profile.storage_last_use).astype(np.int64)
    if len(profile.materialized_in_forward):  # fused into its forward readers: no memory until something else holds it
        stop[~profile.materialized_in_forward] = producer[~profile.materialized_in_forward]
    if len(profile.held_through_forward):
        stop[profile.held_through_forward] = np.maximum(stop[profile.held_through_forward], n - 1)
    saved, ranks = profile.saved_pairs
    savers = node_op[ranks]
    if len(saved):
        lost = ~reaches[savers]
        np.maximum.at(stop, saved[lost], forward_release(profile, end)[savers[lost]])
        held_by_autograd = ~lost & retained[saved]
        np.maximum.at(stop, saved[held_by_autograd], backward_slot[ranks[held_by_autograd]])
    read, readers = profile.read_pairs
    if len(read):
        framed = a.recomputed[readers] & retained[read]
        np.maximum.at(stop, read[framed], a.group_end[a.block_of[readers[framed]]])
    # What closure ops read: values of the same closure are its recomputed copies; anything else its frame holds.
    reader_at, triple = _expand(profile.input_bounds, c_ops)
    triple_storages, _, triple_producers = profile.input_triples
    read_storage, read_block = triple_storages[triple], c_blocks[reader_at]
    if profile.recompute_shared:  # one recomputed copy of each op's values, whichever block rebuilt it; what is
        _, inside = _find(np.unique(c_ops), triple_producers[triple])  # kept is read as kept
        inside &= ~retained[read_storage]
    else:
        _, inside = _find(c_blocks * n + c_ops, read_block * n + triple_producers[triple])
    np.maximum.at(stop, read_storage[~inside], frame_stop[read_block[~inside]])
    lives = stop > producer
    np.add.at(held, producer[lives] + 1, sizes[lives])
    np.add.at(held, stop[lives] + 1, -sizes[lives])

    # Recomputed copies: live from their recompute until the last closure reader or the last dropped-save holder
    # of the same block.
    order, bounds = profile.produced_order
    copy_at, produced_at = _expand(bounds, c_ops)
    copy_storage = order[produced_at]
    copy_start = c_slot[copy_at]
    copy_stop = copy_start.copy()
    shared = profile.recompute_shared
    copy_keys = copy_storage if shared else c_blocks[copy_at] * len(producer) + copy_storage
    by_key = np.argsort(copy_keys)

    def extend(blocks: np.ndarray, storages: np.ndarray, slots: np.ndarray) -> None:
        pos, found = _find(copy_keys[by_key], storages if shared else blocks * len(producer) + storages)
        np.maximum.at(copy_stop, by_key[pos[found]], slots[found])

    extend(read_block[inside], read_storage[inside], c_slot[reader_at[inside]])
    own = dropped[saved] & reaches[savers]
    extend(a.block_of[savers[own]], saved[own], backward_slot[ranks[own]])
    copied = copy_stop > copy_start
    if len(profile.materialized_when_rebuilt):  # fused into the backward kernels that read it
        copied &= profile.materialized_when_rebuilt[copy_storage]
    np.add.at(held, copy_start[copied] + 1, sizes[copy_storage[copied]])
    np.add.at(held, copy_stop[copied] + 1, -sizes[copy_storage[copied]])

    # Snapshots of state a recomputable op writes: held until its block's frame ends (or its group ends in forward).
    snapshot_ops, snapshot_bytes = profile.snapshots
    snapshotted = a.recomputed[snapshot_ops]
    if snapshotted.any():
        o, nbytes = snapshot_ops[snapshotted], snapshot_bytes[snapshotted]
        in_closure = np.zeros(n, dtype=bool)
        in_closure[c_ops] = True
        b = a.block_of[o]
        until = np.maximum(np.where(in_closure[o], frame_stop[b], a.group_end[b]), o + 1)
        np.add.at(held, o + 1, nbytes)
        np.add.at(held, until + 1, -nbytes)

    live = np.cumsum(held)[: end + 1]
    own = live + extra
    held_after_forward = int(live[n])
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
    return totals, _joined(*(labels for _, labels in parts)), held_after_forward


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
    (:attr:`GraphProfile.op_release`), with the end of the step at slot ``end``."""
    release = profile.op_release
    return np.where(release >= profile.num_ops, end, release)
