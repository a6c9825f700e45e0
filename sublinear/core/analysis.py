"""What a plan means for every op, storage and node: the one reading of a plan that the simulator, the rewriter
and the reports share.

A storage's :class:`StorageState` under a plan:

- ``RETAINED``: it stays in memory from its producer until its last holder lets go (forward readers, autograd, a
  block's frame, the caller). Storages produced by ops that are never recomputed (the last block, pinned ops,
  ``kept`` ops), and storages read by a later group or returned, are retained.
- ``REBUILT``: autograd saves it, but it is dropped in forward and rebuilt in backward by the recompute closure of
  every block that saves it (``rebuilt_by``).
- ``TRANSIENT``: neither retained nor saved: it dies in forward after its last reader (a compiled step's value
  that its op's re-run makes again, :func:`made_again_by_its_op`, even where a later block reads it in forward).

The enum leaves room for further states (such as offloaded to host memory) without changing its readers.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from enum import IntEnum
from functools import cached_property

import numpy as np

from sublinear.core.plan import Plan
from sublinear.core.profile import GraphProfile

__all__ = ["PlanAnalysis", "StorageState", "analyse", "keeping", "made_again_by_its_op"]


class StorageState(IntEnum):
    TRANSIENT = 0
    RETAINED = 1
    REBUILT = 2


@dataclass(frozen=True)
class PlanAnalysis:
    plan: Plan
    block_of: np.ndarray  # per op
    group_of: np.ndarray  # per block: its group (blocks joined by soft split points share retained inputs)
    recomputed: np.ndarray  # per op: may be re-run in backward (not kept, not pinned, not in the last block)
    state: np.ndarray  # per storage: StorageState
    closure: list[list[int]]  # per block: ops re-run in backward, ascending (may reach earlier blocks of its group)
    trigger: np.ndarray  # per block: rank whose backward first needs a rebuilt storage (-1: none)
    frame_end: np.ndarray  # per block: rank after whose backward its group's frame is released (-1: none)
    group_end: np.ndarray  # per block: the last op of its group
    profile: GraphProfile = field(repr=False, compare=False)

    @cached_property
    def retained(self) -> np.ndarray:
        return self.state == StorageState.RETAINED

    @cached_property
    def dropped(self) -> np.ndarray:
        return self.state == StorageState.REBUILT

    @cached_property
    def node_retained(self) -> dict[int, bool]:
        """Per operator node: every storage of its value that the profile lists is kept (vacuously so for values
        on parameters, inputs or no storage). This is the closure's rule read per node: a recompute re-runs a
        producer exactly when a value it reads has a storage that is not kept; so such a value is read from the
        frame, never re-run."""
        retained = self.retained
        return {node: bool(all(retained[s] for s in self.profile.node_storages.get(node, ()) if s >= 0))
                for node in self.profile.op_of_node}

    @cached_property
    def closure_pairs(self) -> tuple[np.ndarray, np.ndarray]:
        """(block, op) for every op of every closure, by block and then ascending op: ``closure`` as two arrays."""
        lengths = [len(members) for members in self.closure]
        ops = np.fromiter(itertools.chain.from_iterable(self.closure), dtype=np.int64, count=sum(lengths))
        return np.repeat(np.arange(len(lengths), dtype=np.int64), lengths), ops

    @cached_property
    def recompute_pairs(self) -> tuple[np.ndarray, np.ndarray]:
        """(block, op) for every op a recompute runs, ordered as :attr:`closure_pairs`: every closure's ops, or,
        where recomputes are shared (``GraphProfile.recompute_shared``), each op once, in the block whose
        recompute runs first in backward (the highest trigger)."""
        blocks, ops = self.closure_pairs
        if not self.profile.recompute_shared or not len(ops):
            return blocks, ops
        order = np.lexsort((-self.trigger[blocks], ops))
        first = np.ones(len(order), dtype=bool)
        first[1:] = ops[order][1:] != ops[order][:-1]
        keep = np.sort(order[first])
        return blocks[keep], ops[keep]

    @cached_property
    def recompute_ranks(self) -> np.ndarray:
        """Per pair of :attr:`recompute_pairs`: the rank before whose backward the op is re-run. Where recomputes
        are shared (a compiled backward, which recomputes each value just before the first kernel that needs it)
        it is the highest rank that needs one of the op's values: its backward reads a rebuilt storage the op
        makes, or a re-run op that reads a value of it re-run (:attr:`read_rerun`) runs before it. Otherwise it is
        the trigger of the pair's block (a block's recompute runs whole)."""
        blocks, ops = self.recompute_pairs
        if not self.profile.recompute_shared or not len(ops):
            return self.trigger[blocks]
        return self.recompute_moments // 2

    @cached_property
    def recompute_moments(self) -> np.ndarray:
        """Per pair, where recomputes are shared: the :func:`_moment` its op is re-run at."""
        return _recompute_moments(self)

    @cached_property
    def recompute_late(self) -> np.ndarray:
        """Per pair of :attr:`recompute_pairs`: it is re-run after its rank's backward let go of what it read last
        (in a fused kernel after that rank's library call, :attr:`kernel_late`), not before that backward."""
        if not self.profile.recompute_shared or not len(self.recompute_pairs[1]):
            return np.zeros(len(self.recompute_pairs[1]), dtype=bool)
        return _late(self.recompute_moments)

    @cached_property
    def read_rerun(self) -> np.ndarray:
        """Per storage: the partitioned backward reads it re-run where its producer is re-run: a value the plan
        keeps is saved, but for the parts of a tuple (a max-pool's values beside its indices), which the min-cut
        partitioner recomputes with the tuple."""
        return ~self.retained | (self.profile.arrays.tuple_of >= 0)

    @cached_property
    def storage_need(self) -> np.ndarray:
        """Per storage, where recomputes are shared: the highest rank that needs its re-run copy (-1: none): a
        backward node that saves it, a backward kernel that reads it through fused values, or the re-run of a
        storage made from it. A compiled backward makes each re-run value just before the first kernel that needs
        it, so the values of one op are made at their own ranks, each no earlier than its readers need it (the op
        making the mask every attention layer reads makes its other values at its own layer)."""
        return self.storage_moments // 2

    @cached_property
    def storage_moments(self) -> np.ndarray:
        """Per storage: the :func:`_moment` its re-run copy is first needed at (-1: never, or not shared)."""
        return _storage_moments(self)

    @cached_property
    def storage_late(self) -> np.ndarray:
        """Per storage, where recomputes are shared: its re-run copy is first needed after the backward of the rank
        of :attr:`storage_need` let go of what it read last (:attr:`kernel_late`)."""
        return _late(self.storage_moments)

    @cached_property
    def rerun_storages(self) -> np.ndarray:
        """Per storage, where recomputes are shared: backward reads a re-run copy of it."""
        return self.read_rerun & np.isin(self.profile.storage_producer, self.recompute_pairs[1])

    @cached_property
    def kernel_start(self) -> np.ndarray:
        """Per storage, where recomputes are shared: the rank from whose backward on its re-run copy takes memory
        because a fused backward kernel starting at a higher rank re-runs it (``storage_kernel_start``), -1 where
        none does. Not a library kernel's result, nor a value re-run from one that is re-run too: inductor runs
        that call on its own, before the fused kernel that reads it, and where the kernel then runs is not known;
        such a value keeps the ranks that read it."""
        return _kernel_start(self.profile, self.rerun_storages)

    @cached_property
    def kernel_late(self) -> np.ndarray:
        """Per storage with a :attr:`kernel_start`: the kernel re-running it runs after that rank's backward let go
        of what it read last (``storage_kernel_late``: a library call reading its input last runs before it)."""
        late = self.profile.storage_kernel_late
        return (self.kernel_start >= 0) & late if len(late) else np.zeros(len(self.kernel_start), dtype=bool)

    @cached_property
    def _kernel_moment(self) -> np.ndarray:
        return np.where(self.kernel_start >= 0, _moment(self.kernel_start, self.kernel_late), -1)

    @cached_property
    def made_again(self) -> np.ndarray:
        """Per storage: its op's re-run makes it again (:func:`made_again_by_its_op`), so the plan neither keeps
        nor saves it."""
        return made_again_by_its_op(self.profile, self.block_of, _rerun_ops(self.profile.num_ops, self.closure))

    @property
    def num_blocks(self) -> int:
        return len(self.plan.split_points)

    @property
    def framed(self) -> np.ndarray:
        """Per op: it belongs to a block that is not the last, so its block keeps a frame in forward."""
        return self.block_of != self.num_blocks - 1

    def recompute_seconds(self, profile: GraphProfile) -> float:
        return float(profile.op_seconds[self.recompute_pairs[1]].sum())

    def recompute_flops(self, profile: GraphProfile) -> int:
        return int(profile.op_flops[self.recompute_pairs[1]].sum())


def _recompute_moments(a: PlanAnalysis) -> np.ndarray:
    """:attr:`PlanAnalysis.recompute_moments`."""
    p, ops = a.profile, a.recompute_pairs[1]
    need = np.full(p.num_ops, -1, dtype=np.int64)
    rebuilt, moments = _rebuilt_saves(a)
    np.maximum.at(need, p.storage_producer[rebuilt], moments)
    fused = a.kernel_start >= 0
    np.maximum.at(need, p.storage_producer[fused], a._kernel_moment[fused])
    rerun = np.zeros(p.num_ops, dtype=bool)
    rerun[ops] = True
    read_rerun = a.read_rerun
    for c in sorted(set(ops.tolist()), reverse=True):  # consumers come after their producers
        for producer, storage in p.arrays.inputs_by_reader[c]:
            if rerun[producer] and read_rerun[storage]:
                need[producer] = max(need[producer], need[c])
    return need[ops]


def _storage_moments(a: PlanAnalysis) -> np.ndarray:
    """:attr:`PlanAnalysis.storage_moments`."""
    p = a.profile
    need = np.full(len(p.storage_bytes), -1, dtype=np.int64)
    if not p.recompute_shared or not len(need):
        return need
    np.maximum.at(need, *_rebuilt_saves(a))
    through, through_ranks = p.arrays.rebuilt_read_pairs
    if len(through):
        np.maximum.at(need, through, _moment(through_ranks))
    np.maximum(need, a._kernel_moment, out=need)
    rerun = a.rerun_storages
    made, source = p.arrays.made_from_pairs
    chain = rerun[made] & rerun[source]  # made storages descending: every reader is done before its source
    for m, s in zip(made[chain].tolist(), source[chain].tolist()):
        if need[m] > need[s]:
            need[s] = need[m]
    _together_per_node(need, rerun, p.arrays.tuple_of)  # its sources: those of the value needed first
    return need


def _together_per_node(need: np.ndarray, rerun: np.ndarray, tuple_of: np.ndarray) -> None:
    """The re-run values of one node that makes several (a max-pool's values and its window offsets) are made
    together, where the first of them is needed: a compiled backward places the node there, and inductor lowers it
    and stores its values as it reaches it, in one kernel (ResNet-50's re-run stem keeps the offsets the max-pool's
    backward reads from the re-run of the first block on). ``need``: per storage, its moment, raised in place."""
    parts = rerun & (tuple_of >= 0)
    if not parts.any():
        return
    first = np.full(int(tuple_of.max()) + 1, -1, dtype=np.int64)
    np.maximum.at(first, tuple_of[parts], need[parts])
    need[parts] = first[tuple_of[parts]]


def _rebuilt_saves(a: PlanAnalysis) -> tuple[np.ndarray, np.ndarray]:
    """The storages a backward rank saves that the plan drops, where that rank's backward runs (its op reaches the
    output), each with the :func:`_moment` of that rank: where the re-run copy is needed by."""
    p = a.profile
    saved, ranks = p.arrays.saved_pairs
    rebuilt = a.dropped[saved] & p.reaches_output[p.node_op[ranks]]
    return saved[rebuilt], _moment(ranks[rebuilt])


def _moment(ranks: np.ndarray, late: np.ndarray | bool = False) -> np.ndarray:
    """A point of backward as one number that grows with how early it comes: a rank's backward, or (``late``) the
    part of it after it let go of what it read last. Backward runs the ranks from the highest, so the highest moment
    that needs a value is the first."""
    return 2 * ranks + 1 - np.asarray(late, dtype=np.int64)


def _late(moments: np.ndarray) -> np.ndarray:
    """Per :func:`_moment`: it is the late part of its rank."""
    return (moments >= 0) & (moments % 2 == 0)


def _kernel_start(p: GraphProfile, rerun: np.ndarray) -> np.ndarray:
    """:attr:`PlanAnalysis.kernel_start` for the storages ``rerun`` marks."""
    start = np.full(len(p.storage_bytes), -1, dtype=np.int64)
    if not p.recompute_shared or not len(p.storage_kernel_start) or not (rerun & (p.storage_kernel_start >= 0)).any():
        return start
    library = p.storage_library_made
    cut = rerun & library if len(library) else np.zeros(len(start), dtype=bool)
    made, source = p.arrays.made_from_pairs
    through = rerun[source]  # a cut passes along pairs from a re-run source only
    for m, s in zip(made[through][::-1].tolist(), source[through][::-1].tolist()):  # sources before products
        if cut[s]:
            cut[m] = True
    fused = rerun & ~cut
    start[fused] = p.storage_kernel_start[fused]
    return start


def analyse(profile: GraphProfile, plan: Plan) -> PlanAnalysis:
    """The analysis of ``plan`` on ``profile`` (see :mod:`sublinear.core.plan` for the semantics)."""
    n = profile.num_ops
    plan.validate(n)
    splits = np.asarray(plan.split_points, dtype=np.int64)
    block_of = np.searchsorted(splits, np.arange(n)) if n else np.zeros(0, dtype=np.int64)
    num_blocks = len(splits)
    recomputed = block_of != num_blocks - 1
    if plan.kept:
        recomputed[list(plan.kept)] = False
    recomputed[profile.pinned_ops] = False

    group_of = np.asarray(plan.group_of_blocks(), dtype=np.int64)
    group_of_op = group_of[block_of] if n else block_of
    last_group = int(group_of[-1]) if len(group_of) else 0
    producer = profile.storage_producer
    last_use = profile.storage_last_use
    if len(producer):
        producer_group = group_of_op[producer]
        reader_group = np.where(last_use >= n, last_group + 1, group_of_op[np.minimum(last_use, max(n - 1, 0))])
        retained = (~recomputed[producer]) | (reader_group > producer_group)
    else:
        retained = np.zeros(0, dtype=bool)
    outputs_of, storages_out = profile.arrays.op_storage_pairs
    retained[storages_out[~recomputed[outputs_of]]] = True  # a kept op's values stay, and so do the storages they view
    dropped = profile.arrays.saved_reaching & ~retained
    state = np.full(len(producer), StorageState.TRANSIENT, dtype=np.int8)
    state[retained] = StorageState.RETAINED
    state[dropped] = StorageState.REBUILT

    # Each block that saves a dropped storage (from a node that reaches the outputs) rebuilds its own copy.
    saved, ranks = profile.arrays.saved_pairs
    savers = profile.node_op[ranks]
    rebuilds = dropped[saved] & profile.reaches_output[savers]
    seed_blocks, seed_ranks = block_of[savers[rebuilds]], ranks[rebuilds]
    trigger = np.full(num_blocks, -1, dtype=np.int64)
    np.maximum.at(trigger, seed_blocks, seed_ranks)
    num_groups = int(group_of[-1]) + 1 if num_blocks else 0
    first_rebuild = np.full(num_groups, np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(first_rebuild, group_of[seed_blocks], seed_ranks)
    frame_end = np.where(first_rebuild == np.iinfo(np.int64).max, -1, first_rebuild)[group_of]
    last_split = np.zeros(num_groups, dtype=np.int64)
    np.maximum.at(last_split, group_of, splits)

    # A closure re-runs the producer of every value it reads whose storages are not all kept.
    closure_sets: list[set[int]] = [set() for _ in range(num_blocks)]
    for b, j in zip(seed_blocks.tolist(), producer[saved[rebuilds]].tolist()):
        closure_sets[b].add(j)
    kept = retained.tolist()
    inputs = profile.arrays.inputs_by_reader
    closure = []
    for members in closure_sets:
        stack = list(members)
        while stack:
            for p, s in inputs[stack.pop()]:
                if not kept[s] and p not in members:
                    members.add(p)
                    stack.append(p)
        closure.append(sorted(members))
    state[made_again_by_its_op(profile, block_of, _rerun_ops(n, closure))] = StorageState.TRANSIENT
    return PlanAnalysis(plan, block_of, group_of, recomputed, state, closure, trigger, frame_end, last_split[group_of],
                        profile)


def _rerun_ops(n: int, closure: list[list[int]]) -> np.ndarray:
    """Per op: some block's recompute closure re-runs it."""
    rerun = np.zeros(n, dtype=bool)
    rerun[list(itertools.chain.from_iterable(closure))] = True
    return rerun


def made_again_by_its_op(profile: GraphProfile, block_of: np.ndarray, rerun: np.ndarray) -> np.ndarray:
    """Per storage, for a compiled step: a value of an op the plan re-runs anyway (``rerun``, per op: in a
    recompute closure) with no buffer in forward (fused into its readers) that no backward node saves, the graph
    does not return and no re-run op of another block reads. The compiled backward makes it again where its op is
    re-run, so it is not retained even where a later block's forward reads it (a shared additive attention mask,
    made in the first layer's attention beside its scaled queries): saved instead, it would be a buffer from
    forward on, four times the boolean mask."""
    n = profile.num_ops
    if not profile.recompute_shared or not len(profile.materialized_in_forward) or not profile.storage_saved_at:
        return np.zeros(len(profile.storage_bytes), dtype=bool)
    producer = profile.storage_producer
    unsaved = np.ones(len(producer), dtype=bool)
    unsaved[profile.arrays.saved_pairs[0]] = False
    read, readers = profile.arrays.read_pairs
    elsewhere = np.zeros(len(unsaved), dtype=bool)
    elsewhere[read[rerun[readers] & (block_of[readers] != block_of[producer[read]])]] = True
    made_in_graph = (producer >= 0) & (producer < n)
    return (made_in_graph & rerun[np.clip(producer, 0, max(n - 1, 0))] & ~profile.materialized_in_forward
            & unsaved & ~elsewhere & (profile.storage_last_use < n))


def keeping(profile: GraphProfile, plan: Plan, retained: np.ndarray) -> Plan:
    """``plan`` with every op kept that makes a storage ``retained`` marks (per storage of ``profile``) and ``plan``
    does not retain on ``profile``: the plan a kept compiled code runs. Code partitioned while the caller held the
    graph's outputs saves the ones backward reads (the plan retains them there); once the caller drops them, the
    same plan would rebuild them, and keeping their ops describes the code. ``plan`` itself when nothing differs."""
    state = analyse(profile, plan).state
    lost = np.asarray(retained, dtype=bool) & (state != StorageState.RETAINED)
    if not lost.any():
        return plan
    ops = {int(o) for o in profile.storage_producer[lost] if o >= 0}
    return Plan.normal(plan.split_points, plan.kept | ops, plan.soft)
