"""Local search: hill climbing by one-edit neighbours from the best plans simulated so far.

The genetic search edits plans at random and keeps a population, so its best plan is rarely a local optimum: a
plan one edit away is often better still. This planner starts from the
:data:`START_PLANS` best distinct plans the problem has simulated (every planner's candidates and the genetic
population) and from each moves to the first neighbour the objective ranks lower, until no neighbour is (a local
optimum), within :data:`EVALUATIONS` new simulations (:data:`EVALUATIONS_PER_OP` per op on small graphs) and
:data:`TIME_LIMIT_SECONDS`.

The neighbours of a plan, each valid: a split point moved by one or two ops, a split point removed (two blocks
merged) or made soft or hard, a split point added after any op, a kept op recomputed again, and an op that a
recompute closure re-runs kept. They are visited in an order drawn from ``config.seed``, so the result is
deterministic when the time limit is not reached.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Iterator, Sequence

from sublinear.config import SublinearMemoryConfig
from sublinear.core.analysis import analyse
from sublinear.core.objective import Candidate, Objective
from sublinear.core.plan import Plan
from sublinear.planners.base import PlanningProblem, register_planner

__all__ = ["LocalSearchPlanner", "neighbours"]

START_PLANS = 4
EVALUATIONS = 3000  # new simulations per propose at most ...
EVALUATIONS_PER_OP = 10  # ... and at most this many per op of the graph
TIME_LIMIT_SECONDS = 3.0  # per propose, for graphs whose simulation is slow
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


def climb(problem: PlanningProblem, objective: Objective, start: Candidate, rng: random.Random,
          budget: Iterator[bool]) -> Candidate:
    """From ``start``, move to the first neighbour (in ``rng``'s order) that ``objective`` ranks lower, until
    none is or ``budget`` (one item per plan not simulated before) runs out."""
    current = start
    while True:
        order = neighbours(problem, current.plan)
        rng.shuffle(order)
        for plan in order:
            if plan not in problem.simulations and not next(budget, False):
                return current
            candidate = problem.candidate(plan, "local search")
            if objective(candidate) < objective(current):
                current = candidate
                break
        else:
            return current


def _budget(evaluations: int, deadline: float) -> Iterator[bool]:
    """True for each of ``evaluations`` simulations, while ``deadline`` has not passed."""
    for _ in range(evaluations):
        if time.perf_counter() > deadline:
            return
        yield True


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
        evaluations = min(EVALUATIONS, EVALUATIONS_PER_OP * problem.profile.num_ops)
        budget = _budget(evaluations, time.perf_counter() + TIME_LIMIT_SECONDS)
        rng = random.Random(problem.config.seed)
        starts = ranked[:START_PLANS]
        ends = [climb(problem, objective, start, rng, budget) for start in starts]
        return [end for start, end in zip(starts, ends) if end.plan != start.plan]


register_planner("local", LocalSearchPlanner)
