"""Plan stage driver: grid search, then (when configured) genetic refinement, all scored by the one simulator.

Objectives:

- default (MegEngine): the lowest simulated peak; ties go to less recompute, then fewer blocks;
- ``memory_budget``: the least recompute among plans whose simulated peak fits the budget;
- ``lb_memory``: when the chosen plan's peak is below this floor, recomputed ops are kept again, most expensive
  first, while the peak stays within the floor.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace

import numpy as np

from .config import SublinearMemoryConfig
from .grid import Candidate, Objective, grid_search, score
from .plan import Plan
from .profiler import GraphProfile
from .simulator import Simulation, analyse, simulate

__all__ = ["BudgetError", "PlanningResult", "budget_score", "hand_back", "keep_variants", "make_plan",
           "pareto_front"]

log = logging.getLogger("sublinear.planner")


class BudgetError(ValueError):
    """No plan found fits the memory budget."""

    def __init__(self, budget: int, smallest: int) -> None:
        super().__init__(f"no plan fits memory_budget={budget:,} bytes ({budget / 2**30:.2f} GiB): the smallest "
                         f"predicted peak found is {smallest:,} bytes ({smallest / 2**30:.2f} GiB). Raise the budget, "
                         f"lower the batch size, or search longer (genetic_nr_iter).")
        self.budget, self.smallest = budget, smallest


@dataclass(frozen=True)
class PlanningResult:
    plan: Plan
    simulation: Simulation
    baseline: Simulation  # eager: the one-block plan
    candidates: tuple[Candidate, ...]  # every candidate evaluated, best first under the objective
    history: tuple[int, ...]  # best predicted peak after the grid, then after each genetic generation
    seconds: float


def budget_score(budget: int) -> Objective:
    """Lower is better: bytes over ``budget`` (so fitting plans come first, the others by lowest peak), then
    recompute FLOPs, then peak."""
    def rank(c: Candidate) -> tuple[int, int, int]:
        sim = c.simulation
        return max(0, sim.peak_bytes - budget), sim.recompute_flops, sim.peak_bytes
    return rank


def keep_variants(profile: GraphProfile, plan: Plan) -> list[Plan]:
    """The plan with expensive ops kept: every op with FLOPs, and only those with the most FLOPs per byte they
    output (the top half). Cheap ops with large outputs (normalisation, activations, dropout) stay recomputed."""
    a = analyse(profile, plan)
    candidates = [o for o in np.flatnonzero(a.recomputed) if profile.ops[o].flops > 0]
    if not candidates:
        return []
    out_bytes = np.zeros(profile.num_ops, dtype=np.int64)
    np.add.at(out_bytes, profile.storage_producer, profile.storage_bytes)
    density = sorted(candidates, key=lambda o: -profile.ops[o].flops / max(1, out_bytes[o]))
    return [replace(plan, kept=plan.kept | frozenset(int(o) for o in chosen))
            for chosen in (candidates, density[: max(1, len(density) // 2)])]


def hand_back(profile: GraphProfile, candidate: Candidate, floor: int) -> Candidate:
    """Keep recomputed ops, most FLOPs first, while the predicted peak stays within ``floor`` (MegEngine's
    ``lb_memory``)."""
    best = candidate
    recomputed = sorted({o for members in analyse(profile, best.plan).closure for o in members},
                        key=lambda o: -profile.ops[o].flops)
    for o in recomputed:
        if profile.ops[o].flops == 0:
            break
        trial = replace(best.plan, kept=best.plan.kept | {int(o)})
        sim = simulate(profile, trial)
        if sim.peak_bytes <= floor and sim.recompute_flops < best.simulation.recompute_flops:
            best = Candidate(trial, sim, float("nan"))
    return best


def pareto_front(candidates: Iterable[Candidate]) -> list[Candidate]:
    """The candidates no other beats on both peak and recompute FLOPs, by increasing peak."""
    front: list[Candidate] = []
    for c in sorted(candidates, key=lambda c: (c.simulation.peak_bytes, c.simulation.recompute_flops)):
        if not front or c.simulation.recompute_flops < front[-1].simulation.recompute_flops:
            front.append(c)
    return front


def make_plan(profile: GraphProfile, config: SublinearMemoryConfig | None = None) -> PlanningResult:
    """The best plan for ``profile`` under ``config``."""
    config = config or SublinearMemoryConfig()
    started = time.perf_counter()
    objective: Objective = score if config.memory_budget is None else budget_score(config.memory_budget)
    baseline = simulate(profile, Plan.no_split(profile.num_ops))
    grid = grid_search(profile, config.thresh_nr_try)
    seen = {c.plan: c for c in grid}
    for c in grid:
        for plan in keep_variants(profile, c.plan):
            seen.setdefault(plan, Candidate(plan, simulate(profile, plan), c.threshold))
    pool = sorted(seen.values(), key=objective)
    best = pool[0]
    history = [min(c.simulation.peak_bytes for c in grid)]
    log.info("grid search: %d candidates, best peak %.1f MiB in %d blocks (eager %.1f MiB)", len(grid),
             grid[0].simulation.peak_bytes / 2**20, grid[0].plan.num_blocks, baseline.peak_bytes / 2**20)
    if config.genetic_nr_iter > 0:
        from .genetic import genetic_search

        found = genetic_search(profile, [c.plan for c in pool], config, objective)
        history.extend(found.history)
        best = min(best, found.best, key=objective)
    if config.memory_budget is not None and best.simulation.peak_bytes > config.memory_budget:
        raise BudgetError(config.memory_budget, min(best.simulation.peak_bytes,
                                                    min(c.simulation.peak_bytes for c in pool)))
    if config.lb_memory and best.simulation.peak_bytes < config.lb_memory:
        best = hand_back(profile, best, config.lb_memory)
    return PlanningResult(best.plan, best.simulation, baseline, tuple(pool), tuple(history),
                          time.perf_counter() - started)
