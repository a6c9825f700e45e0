"""Grid search: greedy blocks for a byte threshold, over MegEngine's threshold grid.

MegEngine evaluates the threshold T = infinity (one block: eager), then T halved repeatedly down to 1 KiB, then
``thresh_nr_try`` evenly spaced values up to the eager peak, then ``thresh_nr_try`` values in [best/2, 2*best].
Two greedy measures are walked for every threshold, and every resulting plan is a candidate:

- ``rebuild`` (Chen et al. 2016, Alg. 1): bytes produced in the current block that autograd saves, i.e. what the
  block's recompute must rebuild. Blocks of equal rebuild cost.
- ``live`` (MegEngine): bytes produced in the current block minus those whose last reader has run.

Each grid plan also comes with *keep variants*: the same blocks with expensive ops kept rather than recomputed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from sublinear.config import SublinearMemoryConfig
from sublinear.core.analysis import analyse
from sublinear.core.objective import Candidate
from sublinear.core.plan import Plan
from sublinear.core.profile import GraphProfile
from sublinear.planners.base import PlanningProblem, register_planner

__all__ = ["GridPlanner", "greedy_plan", "grid_plans", "keep_variants"]

_MIN_THRESHOLD = 1024
MEASURES = ("rebuild", "live")


def greedy_plan(profile: GraphProfile, threshold: float, measure: str = "rebuild") -> Plan:
    """Walk the ops summing the current block's bytes under ``measure``; end the block where the sum reaches
    ``threshold``."""
    if measure not in MEASURES:
        raise ValueError(f"measure must be one of {MEASURES}; got {measure!r}")
    n = profile.num_ops
    produced = profile.arrays.rebuild_bytes if measure == "rebuild" else profile.arrays.output_bytes
    released: list[list[int]] = [[] for _ in range(n)]
    if measure == "live":
        for s, last in enumerate(profile.storage_last_use):
            if last < n:
                released[int(last)].append(s)
    points, total, block_start = [], 0, 0
    for o in range(n):
        total += int(produced[o])
        for s in released[o]:
            if profile.storage_producer[s] >= block_start:
                total -= int(profile.storage_bytes[s])
        if total >= threshold:
            points.append(o)
            total, block_start = 0, o + 1
    return Plan.of(points, n)


def grid_plans(problem: PlanningProblem) -> list[Candidate]:
    """Every plan of MegEngine's threshold grid, best first under the problem's objective."""
    profile, tries = problem.profile, problem.config.thresh_nr_try
    found: dict[Plan, tuple[Candidate, float]] = {}

    def consider(threshold: float) -> None:
        for measure in MEASURES:
            plan = greedy_plan(profile, threshold, measure)
            if plan not in found:
                found[plan] = (problem.candidate(plan, "grid"), threshold)

    consider(math.inf)
    threshold = float(max(int(profile.storage_bytes.sum()), _MIN_THRESHOLD))
    while threshold >= _MIN_THRESHOLD:
        consider(threshold)
        threshold /= 2
    peak = problem.simulate(Plan.no_split(profile.num_ops)).peak_bytes
    for k in range(1, tries + 1):
        consider(peak * k / tries)
    best, best_threshold = min(found.values(), key=lambda entry: problem.objective(entry[0]))
    if tries >= 1 and math.isfinite(best_threshold) and best_threshold > 0:
        low, high = best_threshold / 2, best_threshold * 2
        steps = max(tries - 1, 1)
        for k in range(tries):
            consider(low + (high - low) * k / steps)
    return sorted((c for c, _ in found.values()), key=problem.objective)


def keep_variants(profile: GraphProfile, plan: Plan) -> list[Plan]:
    """The plan with expensive ops kept: every op with FLOPs (matmuls, convolutions), and the half of all recomputed
    ops with the most recompute time per byte they output. Cheap ops with large outputs (normalisation,
    activations, dropout) stay recomputed."""
    a = analyse(profile, plan)
    recomputed = [int(o) for o in np.flatnonzero(a.recomputed)]
    if not recomputed:
        return []
    density = sorted(recomputed, key=lambda o: -profile.arrays.recompute_density[o])
    choices = ([o for o in recomputed if profile.ops[o].flops > 0], density[: max(1, len(density) // 2)])
    return [Plan.normal(plan.split_points, plan.kept | frozenset(chosen), plan.soft) for chosen in choices if chosen]


class GridPlanner:
    """MegEngine's threshold grid, with keep variants of every grid plan."""

    name = "grid"

    def enabled(self, config: SublinearMemoryConfig) -> bool:
        return True

    def propose(self, problem: PlanningProblem, pool: Sequence[Candidate]) -> list[Candidate]:
        grid = grid_plans(problem)
        variants = [p for c in grid for p in keep_variants(problem.profile, c.plan)]
        return grid + problem.candidates(variants, "grid, keep variant")


register_planner("grid", GridPlanner)
