"""Local search: hill climbing by one-edit neighbours from the best plans simulated so far.

The genetic search edits plans at random and keeps a population, so its best plan is rarely a local optimum: a
plan one edit away is often better still. This planner starts from the
:data:`START_PLANS` best distinct plans the problem has simulated (every planner's candidates and the genetic
population) and from each moves to the first neighbour the objective ranks lower, until no neighbour is (a local
optimum) or its work budget is spent. The budget counts work, never time: at most :data:`EVALUATIONS` new
simulations, :data:`EVALUATIONS_PER_OP` per op of the graph and :data:`SIMULATED_OPS` ops simulated (a simulation's
time grows with the ops); and a neighbourhood is built only while the neighbour plans built so far hold fewer than
:data:`NEIGHBOUR_ENTRIES` entries (split points, kept ops, soft points), as its time grows with its plans' size.

The neighbours of a plan, each valid: a split point moved by one or two ops, a split point removed (two blocks
merged) or made soft or hard, a split point added after any op, a kept op recomputed again, and an op that a
recompute closure re-runs kept. They are visited in an order drawn from ``config.seed``, so the plans proposed
depend only on the profile, the config and the seed.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass

from sublinear.config import SublinearMemoryConfig
from sublinear.core.analysis import analyse
from sublinear.core.objective import Candidate, Objective
from sublinear.core.plan import Plan
from sublinear.planners.base import PlanningProblem, register_planner

__all__ = ["LocalSearchPlanner", "WorkLeft", "climb", "neighbours"]

START_PLANS = 4
EVALUATIONS = 3000  # new simulations per propose at most ...
EVALUATIONS_PER_OP = 10  # ... at most this many per op of the graph ...
SIMULATED_OPS = 1_200_000  # ... and at most this many ops simulated (3000 simulations of 400 ops)
NEIGHBOUR_ENTRIES = 8_000_000  # entries of neighbour plans built per propose (a plan costs time in its entries)
BOUNDARY_STEPS = (-2, -1, 1, 2)


def neighbours(problem: PlanningProblem, plan: Plan) -> list[Plan]:
    """The distinct plans one edit away from ``plan`` (see the module docstring), ``plan`` itself excluded."""
    n = problem.profile.num_ops
    points, kept, soft = list(plan.split_points), plan.kept, plan.soft
    found: list[Plan] = []
    for i, point in enumerate(points[:-1]):
        low = points[i - 1] if i else -1
        for step in BOUNDARY_STEPS:
            moved = point + step
            if low < moved < points[i + 1]:
                found.append(Plan.of([*points[:i], moved, *points[i + 1:]], n, kept,
                                     {moved if s == point else s for s in soft}))
        found.append(Plan.of([*points[:i], *points[i + 1:]], n, kept, soft - {point}))
        found.append(Plan.of(points, n, kept, soft ^ {point}))
    found.extend(Plan.of(points, n, kept - {o}, soft) for o in sorted(kept))
    pinned = set(problem.profile.pinned_ops.tolist())
    rerun = sorted(set(itertools.chain.from_iterable(analyse(problem.profile, plan).closure)) - pinned)
    found.extend(Plan.of(points, n, kept | {o}, soft) for o in rerun if o not in kept)
    splits = set(points)
    found.extend(Plan.of([*points, o], n, kept, soft) for o in range(n - 1) if o not in splits)
    return [p for p in dict.fromkeys(found) if p != plan]


@dataclass
class WorkLeft:
    """What a propose may still spend: new simulations and entries of neighbour plans built."""

    simulations: int
    entries: int


def climb(problem: PlanningProblem, objective: Objective, start: Candidate, rng: random.Random,
          work: WorkLeft) -> Candidate:
    """From ``start``, move to the first neighbour (in ``rng``'s order) that ``objective`` ranks lower, until
    none is or ``work`` runs out: a neighbourhood is built while entries are left, and a plan not simulated before
    is simulated while simulations are left."""
    current = start
    while work.entries > 0:
        order = neighbours(problem, current.plan)
        work.entries -= len(order) * _entries(current.plan)
        rng.shuffle(order)
        for plan in order:
            if plan not in problem.simulations:
                if work.simulations <= 0:
                    return current
                work.simulations -= 1
            candidate = problem.candidate(plan, "local search")
            if objective(candidate) < objective(current):
                current = candidate
                break
        else:
            return current
    return current


def _entries(plan: Plan) -> int:
    return len(plan.split_points) + len(plan.kept) + len(plan.soft)


class LocalSearchPlanner:
    """Hill climbing from the best plans found (see the module docstring)."""

    name = "local"

    def enabled(self, config: SublinearMemoryConfig) -> bool:
        return True

    def propose(self, problem: PlanningProblem, pool: Sequence[Candidate]) -> list[Candidate]:
        if problem.profile.num_ops < 2:
            return []
        objective = problem.objective
        ranked = sorted((Candidate(plan, sim) for plan, sim in problem.simulations.items()), key=objective)
        n = problem.profile.num_ops
        work = WorkLeft(min(EVALUATIONS, EVALUATIONS_PER_OP * n, SIMULATED_OPS // n), NEIGHBOUR_ENTRIES)
        rng = random.Random(problem.config.seed)
        starts = ranked[:START_PLANS]
        ends = [climb(problem, objective, start, rng, work) for start in starts]
        return [end for start, end in zip(starts, ends) if end.plan != start.plan]


register_planner("local", LocalSearchPlanner)
