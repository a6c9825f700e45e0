"""Plan stage driver: grid search, then (when configured) genetic refinement, all scored by the one simulator."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from .config import SublinearMemoryConfig
from .grid import Candidate, grid_search, score
from .plan import Plan
from .profiler import GraphProfile
from .simulator import Simulation, simulate

__all__ = ["PlanningResult", "make_plan"]

log = logging.getLogger("sublinear.planner")


@dataclass(frozen=True)
class PlanningResult:
    plan: Plan
    simulation: Simulation
    baseline: Simulation  # eager: the one-block plan
    candidates: tuple[Candidate, ...]  # every grid candidate, best first
    history: tuple[int, ...]  # best predicted peak after the grid, then after each genetic generation
    seconds: float


def make_plan(profile: GraphProfile, config: SublinearMemoryConfig | None = None) -> PlanningResult:
    """The best plan for ``profile`` under ``config``."""
    config = config or SublinearMemoryConfig()
    started = time.perf_counter()
    baseline = simulate(profile, Plan.no_split(profile.num_ops))
    candidates = grid_search(profile, config.thresh_nr_try)
    best = candidates[0]
    history = [best.simulation.peak_bytes]
    log.info("grid search: %d candidates, best peak %.1f MiB in %d blocks (eager %.1f MiB)", len(candidates),
             best.simulation.peak_bytes / 2**20, best.plan.num_blocks, baseline.peak_bytes / 2**20)
    if config.genetic_nr_iter > 0:
        from .genetic import genetic_search

        found = genetic_search(profile, [c.plan for c in candidates], config)
        history.extend(found.history)
        best = min(best, found.best, key=score)
    return PlanningResult(best.plan, best.simulation, baseline, tuple(candidates), tuple(history),
                          time.perf_counter() - started)
