"""What a plan means for every op, storage and node: the one reading of a plan that the simulator, the rewriter
and the reports share.

A storage's :class:`StorageState` under a plan:

- ``KEPT``: it stays in memory from its producer until its last holder lets go (forward readers, autograd, a
  block's frame, the caller). Storages produced by ops that are never recomputed (the last block, pinned ops,
  ``kept`` ops), and storages read by a later group or returned, are kept.
- ``REBUILT``: autograd saves it, but it is dropped in forward and rebuilt in backward by the recompute closure of
  every block that saves it (``rebuilt_by``).
- ``TRANSIENT``: neither kept nor saved: it dies in forward after its last reader.

The enum leaves room for further states (such as offloaded to host memory) without changing its readers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from functools import cached_property

import numpy as np

from .plan import Plan
from .profile import GraphProfile

__all__ = ["PlanAnalysis", "StorageState", "analyse"]


class StorageState(IntEnum):
    TRANSIENT = 0
    KEPT = 1
    REBUILT = 2


@dataclass(frozen=True)
class PlanAnalysis:
    plan: Plan
    block_of: np.ndarray  # per op
    group_of: np.ndarray  # per block: its group (blocks joined by soft split points share retained inputs)
    recomputed: np.ndarray  # per op: may be re-run in backward (not kept, not pinned, not in the last block)
    state: np.ndarray  # per storage: StorageState
    closure: list[list[int]]  # per block: ops re-run in backward, ascending (may reach into earlier blocks of its group)
    trigger: list[int]  # per block: rank whose backward first needs a rebuilt storage (-1: none)
    frame_end: list[int]  # per block: rank after whose backward its group's frame is released (-1: none)
    group_end: list[int]  # per block: the last op of its group
    profile: GraphProfile = field(repr=False, compare=False)

    @cached_property
    def retained(self) -> np.ndarray:
        return self.state == StorageState.KEPT

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

    @property
    def num_blocks(self) -> int:
        return len(self.plan.split_points)

    @property
    def framed(self) -> np.ndarray:
        """Per op: it belongs to a block that is not the last, so its block keeps a frame in forward."""
        return self.block_of != self.num_blocks - 1

    def recompute_seconds(self, profile: GraphProfile) -> float:
        return float(sum(profile.ops[j].forward_seconds for members in self.closure for j in members))

    def recompute_flops(self, profile: GraphProfile) -> int:
        return int(sum(profile.ops[j].flops for members in self.closure for j in members))


def analyse(profile: GraphProfile, plan: Plan) -> PlanAnalysis:
    """The analysis of ``plan`` on ``profile`` (see :mod:`sublinear.core.plan` for the semantics)."""
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
    if len(producer):
        producer_group = group_of_op[producer]
        reader_group = np.where(last_use >= n, last_group + 1, group_of_op[np.minimum(last_use, max(n - 1, 0))])
        retained = (~recomputed[producer]) | (reader_group > producer_group)
    else:
        retained = np.zeros(0, dtype=bool)
    for o in np.flatnonzero(~recomputed):  # a kept op's values stay, and so do the storages they view
        retained[list(profile.op_storages[o])] = True
    reaches = profile.reaches_output
    saved = np.array([any(reaches[o] for o in savers) for savers in profile.storage_saved_by], dtype=bool)
    dropped = saved & ~retained
    state = np.full(len(producer), StorageState.TRANSIENT, dtype=np.int8)
    state[retained] = StorageState.KEPT
    state[dropped] = StorageState.REBUILT

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
    return PlanAnalysis(plan, block_of, group_of, recomputed, state, closure, trigger, frame_end, group_end, profile)
