"""Min-cut plans: never recompute the ops that are expensive to re-run, and of everything else keep the fewest bytes
from which backward can rebuild what it reads. This is the choice AOTAutograd's min-cut partitioner makes, read as
plans, so that single cheap ops (pointwise chains, views, normalisations' outputs) are recomputed without the
matrix products around them.

**The cut** (:class:`CutNetwork`). For a set of *banned* ops, never recomputed, a flow network has per storage an entry
and an exit joined by an edge of the storage's bytes (keeping it costs its bytes); the source feeds the entry of
every storage a banned op makes, or an op that reads no storage (parameters and inputs are always there); the exit
of every storage an op reads feeds the entry of every storage that op makes (rebuilding a value needs what its op
reads); and the exit of every storage backward reads feeds the sink. A minimum cut's storages are the fewest bytes
to keep: every other storage backward reads is rebuilt by unbanned ops from kept storages.

**The plans** (:class:`MinCutPlanner`). The banned ops are the pinned ops, the last op and every op with FLOPs
(matrix products, convolutions, attention) whose recompute seconds per byte it makes is at least a *level*; levels
are those ops' recompute densities (:data:`MAX_LEVELS` at most, spread evenly over them) and one above all (only
pinned ops banned): lower levels recompute fewer library kernels and keep more. Per level, the cut's kept ops (the
producers of kept storages, and the banned ops) are proposed over one recomputed block of every op but the last,
where a compiled backward re-runs each op just before the first kernel that needs it, and over the block
boundaries of the :data:`BLOCK_PLANS` best plans found so far, where an eager backward re-runs a block's closure
at once. The simulator scores them all; the work is one cut per level, and no clock is read.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from sublinear.config import SublinearMemoryConfig
from sublinear.core.objective import Candidate
from sublinear.core.plan import Plan
from sublinear.core.profile import GraphProfile
from sublinear.planners.base import PlanningProblem, register_planner

__all__ = ["CutNetwork", "MinCutPlanner", "banned_at", "levels"]

MAX_LEVELS = 16
BLOCK_PLANS = 2
_CAPACITY_RANGE = 2**29  # finite capacities sum to less than this; scipy's flow takes 32-bit integers
_UNBOUNDED = 2**30


def levels(profile: GraphProfile) -> list[float]:
    """The ban levels, ascending: the distinct recompute densities of the ops with FLOPs (at most
    :data:`MAX_LEVELS`, evenly spread over them), then infinity (no op banned for its cost)."""
    density = profile.arrays.recompute_density[(profile.op_flops > 0) & (profile.op_seconds > 0)]
    distinct = np.unique(density)
    if len(distinct) > MAX_LEVELS:
        distinct = distinct[np.unique(np.linspace(0, len(distinct) - 1, MAX_LEVELS).round().astype(np.int64))]
    return [*distinct.tolist(), float("inf")]


def banned_at(profile: GraphProfile, level: float) -> np.ndarray:
    """Per op: never recomputed at ``level`` (pinned, the last op, or FLOPs at a recompute density of at least
    ``level``)."""
    banned = (profile.op_flops > 0) & (profile.op_seconds > 0) & (profile.arrays.recompute_density >= level)
    banned[profile.pinned_ops] = True
    if profile.num_ops:
        banned[-1] = True
    return banned


class CutNetwork:
    """The flow network of the module docstring for one profile, built once: its edges but the source's, which each
    set of banned ops adds (:meth:`storages`)."""

    def __init__(self, profile: GraphProfile) -> None:
        count = len(profile.storage_bytes)
        self.count, self.producer = count, profile.storage_producer
        unit = max(1, -(-int(profile.storage_bytes.sum()) // _CAPACITY_RANGE))
        storages = np.arange(count)
        read_by = [np.array([s for _, s in profile.arrays.inputs_by_reader[op]], dtype=np.int64)
                   for op in range(profile.num_ops)]
        read_storages = [read_by[op] for op in self.producer]
        lengths = np.array([len(r) for r in read_storages], dtype=np.int64)
        read_back = np.array([bool(savers) for savers in profile.storage_saved_by], dtype=bool)
        self._rows = np.concatenate([2 * storages, 2 * np.concatenate(read_storages) + 1,
                                     2 * storages[read_back] + 1]).astype(np.int64)
        self._cols = np.concatenate([2 * storages + 1, 2 * np.repeat(storages, lengths),
                                     np.full(read_back.sum(), 2 * count + 1)]).astype(np.int64)
        self._capacity = np.concatenate([np.maximum(1, profile.storage_bytes // unit),
                                         np.full(len(self._rows) - count, _UNBOUNDED)]).astype(np.int64)

    def kept(self, banned: np.ndarray) -> frozenset[int]:
        """The ops to keep: the producers of the cut's storages (:meth:`storages`), and the banned ops."""
        return frozenset(self.producer[self.storages(banned)].tolist()) | frozenset(np.flatnonzero(banned).tolist())

    def storages(self, banned: np.ndarray) -> np.ndarray:
        """The fewest bytes of storages to keep so that backward rebuilds every other storage it reads with unbanned
        ops (the network's minimum cut once the source feeds the banned ops' storages), ascending."""
        from scipy.sparse import csr_matrix
        from scipy.sparse.csgraph import breadth_first_order, maximum_flow

        count = self.count
        source, sink = 2 * count, 2 * count + 1
        fed = np.flatnonzero(banned[self.producer])
        rows = np.concatenate([self._rows, np.full(len(fed), source)])
        cols = np.concatenate([self._cols, 2 * fed])
        capacity = np.concatenate([self._capacity, np.full(len(fed), _UNBOUNDED)])
        network = csr_matrix((capacity, (rows, cols)), shape=(2 * count + 2,) * 2)
        network.sum_duplicates()
        network.data = np.minimum(network.data, _UNBOUNDED).astype(np.int32)
        residual = (network - maximum_flow(network, source, sink).flow).tocsr()
        residual.data = (residual.data > 0).astype(np.int8)
        residual.eliminate_zeros()
        reached = np.zeros(2 * count + 2, dtype=bool)
        reached[breadth_first_order(residual, source, directed=True, return_predecessors=False)] = True
        storages = np.arange(count)
        return storages[reached[2 * storages] & ~reached[2 * storages + 1]]


class MinCutPlanner:
    """Per ban level, the min cut's kept ops over one recomputed block and over the best plans' blocks (see the
    module docstring)."""

    name = "mincut"

    def enabled(self, config: SublinearMemoryConfig) -> bool:
        return True

    def propose(self, problem: PlanningProblem, pool: Sequence[Candidate]) -> list[Candidate]:
        profile = problem.profile
        n = profile.num_ops
        if n < 2 or not len(profile.storage_bytes):
            return []
        boundaries = [(n - 2, n - 1), *dict.fromkeys(c.plan.split_points for c in pool[:BLOCK_PLANS])]
        network = CutNetwork(profile)
        plans = []
        for level in levels(profile):
            kept = network.kept(banned_at(profile, level))
            plans.extend(Plan.of(points, n, kept) for points in boundaries)
        return problem.candidates(plans, "min cut")


register_planner("mincut", MinCutPlanner)
