"""Grid search: greedy blocks for a byte threshold, over MegEngine's threshold grid (REFERENCE §1).

Two greedy measures are walked for every threshold, and every resulting plan is a candidate:

- ``rebuild`` (Chen et al. 2016, Alg. 1): bytes produced in the current block that autograd saves, i.e. what the
  block's recompute must rebuild. Blocks of equal rebuild cost.
- ``live`` (MegEngine): bytes produced in the current block minus those whose last reader has run.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .plan import Plan
from .profiler import GraphProfile
from .simulator import Simulation, simulate

__all__ = ["Candidate", "greedy_plan", "grid_search", "score"]

_MIN_THRESHOLD = 1024


@dataclass(frozen=True)
class Candidate:
    plan: Plan
    simulation: Simulation
    threshold: float  # the greedy threshold that produced it (inf: one block; nan: not from the grid)


Objective = Callable[[Candidate], tuple[int, int, int]]  # lower is better; every planner ranks plans with one


def score(candidate: Candidate) -> tuple[int, int, int]:
    """Lower is better: simulated peak, then recompute FLOPs, then fewer blocks."""
    return candidate.simulation.peak_bytes, candidate.simulation.recompute_flops, candidate.plan.num_blocks


MEASURES = ("rebuild", "live")


def greedy_plan(profile: GraphProfile, threshold: float, measure: str = "rebuild") -> Plan:
    """Walk the ops summing the current block's bytes under ``measure``; end the block where the sum reaches
    ``threshold``."""
    if measure not in MEASURES:
        raise ValueError(f"measure must be one of {MEASURES}; got {measure!r}")
    n = profile.num_ops
    saved = np.array([bool(ops) for ops in profile.storage_saved_by], dtype=bool)
    weight = profile.storage_bytes * saved if measure == "rebuild" else profile.storage_bytes
    produced = np.zeros(n, dtype=np.int64)
    np.add.at(produced, profile.storage_producer, weight)
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


def grid_search(profile: GraphProfile, thresh_nr_try: int = 10) -> list[Candidate]:
    """Every candidate of the grid, best first (by :func:`score`), duplicates removed."""
    seen: dict[Plan, Candidate] = {}

    def consider(threshold: float) -> Candidate:
        for measure in MEASURES:
            plan = greedy_plan(profile, threshold, measure)
            if plan not in seen:
                seen[plan] = Candidate(plan, simulate(profile, plan), threshold)
        return seen[greedy_plan(profile, threshold)]

    baseline = consider(math.inf)
    total = max(int(profile.storage_bytes.sum()), _MIN_THRESHOLD)
    threshold = float(total)
    while threshold >= _MIN_THRESHOLD:
        consider(threshold)
        threshold /= 2
    peak = baseline.simulation.peak_bytes
    for k in range(1, thresh_nr_try + 1):
        consider(peak * k / thresh_nr_try)
    best = min(seen.values(), key=score)
    if thresh_nr_try >= 1 and math.isfinite(best.threshold) and best.threshold > 0:
        low, high = best.threshold / 2, best.threshold * 2
        steps = max(thresh_nr_try - 1, 1)
        for k in range(thresh_nr_try):
            consider(low + (high - low) * k / steps)
    return sorted(seen.values(), key=score)
