"""Genetic refinement of checkpoint plans (MegEngine's search), written with DEAP.

A genome is a plan: the sorted split points (the last op always ends a block), the ``kept`` ops and the ``soft``
split points (nested blocks). The population starts from every seed plan (the grid's candidates), the eager plan,
plans of k equal blocks (:func:`uniform_plans`) and the best 16 of those cut into nested pieces
(:func:`nested_plans`), padded to the pool size with mutated copies when fewer. Each generation keeps
``genetic_pool_size`` survivors (80 % the best, the rest drawn at random from the others) and each survivor makes
two children: one by two random mutations (split a block, merge two blocks, move a boundary, toggle a kept op,
toggle a soft point, or nothing, equally likely), one by one-point crossover with a random survivor. Every operator
returns a valid plan.

Fitness is the problem's :class:`~sublinear.core.objective.Objective` over the simulated candidate (MegEngine's is
the simulated peak alone; ours also weighs predicted time under a cap, or time under a memory budget). There are
no invalid plans to penalise: every plan the rewriter can run is exact (random ops replay their RNG state, state
writes are redirected, pinned ops are never recomputed). The best plan ever seen is kept apart in a hall of fame,
so the result is never worse than the best seed.

The uniform seeds are our addition to MegEngine's search: on graphs of repeated layers (BERT) the threshold grid's
plans straddle layer boundaries, and mutations that move one boundary at a time rarely fix that within 20
generations, while k equal blocks start close to a per-layer split. The nested seeds are the other addition:
one soft point at a time rarely pays, a block cut evenly into nested pieces does.

Deterministic: DEAP's tools draw from Python's global ``random``, which is seeded from ``config.seed`` for the
search and restored afterwards. Scoring runs in ``config.workers`` processes (identical results), and every plan
is simulated once. Cost: the seeds plus at most two children per survivor and generation.
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from deap import base, creator, tools

from sublinear.config import SublinearMemoryConfig
from sublinear.core.objective import Candidate, Simulation
from sublinear.core.plan import Plan
from sublinear.core.profile import GraphProfile
from sublinear.simulation.timeline import simulate
from sublinear.planners.base import PlanningProblem, register_planner

__all__ = ["GeneticPlanner", "GeneticResult", "crossover", "genetic_search", "merge_blocks", "move_boundary",
           "split_block", "toggle_kept", "toggle_soft", "uniform_plans"]

log = logging.getLogger("sublinear.genetic")

ELITE_FRACTION = 0.8  # of the survivors, the best; the rest are drawn at random from the others
MUTATIONS_PER_CHILD = 2
NESTED_SEEDS = 16  # the best flat starting plans also start the search nested (nested_plans)

if not hasattr(creator, "SublinearFitness"):
    creator.create("SublinearFitness", base.Fitness, weights=(-1.0, -1.0, -1.0, -1.0))  # minimise the objective
if not hasattr(creator, "SublinearIndividual"):
    creator.create("SublinearIndividual", list, fitness=creator.SublinearFitness, kept=frozenset, soft=frozenset)


@dataclass(frozen=True)
class GeneticResult:
    best: Candidate
    history: tuple[Candidate, ...]  # the best candidate so far after each generation
    evaluations: int  # distinct plans simulated
    logbook: tools.Logbook  # gen (0: initial population), evals so far, best and median peak bytes of the population


# ---------------------------------------------------------------------------------------------------------------
# Operators: valid Plan(s) -> valid Plan over the same ops. One that cannot apply returns the plan unchanged.


def split_block(plan: Plan, rng: random.Random) -> Plan:
    """Insert a split point inside a random block of at least two ops."""
    blocks = [b for b in plan.blocks() if len(b) >= 2]
    if not blocks:
        return plan
    block = rng.choice(blocks)
    point = rng.randrange(block.start, block.stop - 1)
    return Plan.normal(sorted((*plan.split_points, point)), plan.kept, plan.soft)


def merge_blocks(plan: Plan, rng: random.Random) -> Plan:
    """Remove a random split point other than the last (merge a block with the next)."""
    points = list(plan.split_points)
    if len(points) < 2:
        return plan
    del points[rng.randrange(len(points) - 1)]
    return Plan.normal(points, plan.kept, plan.soft)


def move_boundary(plan: Plan, rng: random.Random) -> Plan:
    """Move a random split point (not the last) to any other position strictly between its neighbours."""
    points = list(plan.split_points)
    movable = [i for i in range(len(points) - 1) if points[i + 1] - (points[i - 1] if i else -1) > 2]
    if not movable:
        return plan
    i = rng.choice(movable)
    low = points[i - 1] + 1 if i else 0
    target = rng.randrange(low, points[i + 1] - 1)  # one slot fewer than the range: skip the current position
    old, points[i] = points[i], target if target < points[i] else target + 1
    soft = plan.soft - {old} | ({points[i]} if old in plan.soft else set())
    return Plan.normal(points, plan.kept, frozenset(soft))


def toggle_kept(plan: Plan, rng: random.Random, pinned: frozenset[int] = frozenset()) -> Plan:
    """Add or remove one op of ``plan.kept``, among ops that are not pinned and not in the last block."""
    last_start = plan.split_points[-2] + 1 if plan.num_blocks > 1 else 0
    eligible = [o for o in range(last_start) if o not in pinned]
    if not eligible:
        return plan
    return Plan.normal(plan.split_points, plan.kept ^ {rng.choice(eligible)}, plan.soft)


def toggle_soft(plan: Plan, rng: random.Random) -> Plan:
    """Make a random split point soft (its boundary rebuilt, nesting the next block) or hard again; never the
    last block's boundary or the last op."""
    eligible = plan.split_points[:-2]
    if not eligible:
        return plan
    return Plan.normal(plan.split_points, plan.kept, plan.soft ^ {rng.choice(eligible)})


def crossover(a: Plan, b: Plan, rng: random.Random) -> Plan:
    """One-point crossover of two plans over the same ops: ``a``'s split points and kept ops before a random cut,
    ``b``'s from it on."""
    if not a.split_points:
        return a
    cut = rng.randrange(a.split_points[-1] + 1)
    points = [p for p in a.split_points if p < cut] + [p for p in b.split_points if p >= cut]
    kept = {k for k in a.kept if k < cut} | {k for k in b.kept if k >= cut}
    soft = {p for p in a.soft if p < cut} | {p for p in b.soft if p >= cut}
    return Plan.normal(points, frozenset(kept), frozenset(soft))


def uniform_plans(profile: GraphProfile) -> list[Plan]:
    """Plans of k blocks of equal size, for k = 2..2*sqrt(num_ops), sizes measured three ways: ops, bytes the
    block's recompute rebuilds and forward FLOPs. Seeds that the threshold grid misses on graphs of repeated
    layers."""
    n = profile.num_ops
    plans = []
    for weight in (np.ones(n), profile.arrays.rebuild_bytes, profile.op_flops.astype(float)):
        cumulative = np.cumsum(weight)
        if not n or cumulative[-1] <= 0:
            continue
        for k in range(2, min(n, 2 * math.isqrt(n) + 1) + 1):
            points = np.searchsorted(cumulative, cumulative[-1] * np.arange(1, k) / k)
            plans.append(Plan.of(points.tolist(), n))
    return plans


def nested_plans(profile: GraphProfile, plans: Sequence[Plan], parts: Sequence[int] = (2, 3, 4)) -> list[Plan]:
    """Each plan with every block but the last cut into m pieces of equal rebuild bytes by soft split points:
    the same kept boundaries, a smaller block to rebuild at a time (Chen's recursive plan, two levels)."""
    n = profile.num_ops
    cumulative = np.cumsum(profile.arrays.rebuild_bytes)
    nested = []
    for plan in plans:
        for m in parts:
            points, soft = set(plan.split_points), set()
            for block in plan.blocks()[:-1]:
                low = cumulative[block.start - 1] if block.start else 0.0
                inner = np.searchsorted(cumulative, low + (cumulative[block.stop - 1] - low) * np.arange(1, m) / m)
                inner = {int(p) for p in inner if block.start <= p < block.stop - 1}
                points |= inner
                soft |= inner
            nested.append(Plan.of(points, n, plan.kept, soft))
    return nested


def _unchanged(plan: Plan) -> Plan:
    return plan


def _mutate(plan: Plan, mutations: Sequence[Callable[[Plan], Plan]], times: int, rng: random.Random) -> Plan:
    """Apply ``times`` mutations, each drawn with equal probability (``_unchanged`` among them)."""
    for _ in range(times):
        plan = rng.choice(mutations)(plan)
    return plan


# ---------------------------------------------------------------------------------------------------------------
# Scoring, serial or in worker processes that receive the profile once.

_worker_profile: GraphProfile | None = None


def _init_worker(profile: GraphProfile) -> None:
    global _worker_profile
    _worker_profile = profile


def _simulate_in_worker(plan: Plan) -> Simulation:
    return simulate(_worker_profile, plan)


def _simulate_here(profile: GraphProfile) -> Callable[[Plan], Simulation]:
    return lambda plan: simulate(profile, plan)


def _individual(plan: Plan):
    """DEAP's view of a plan: the split points as the list, the kept ops as an attribute."""
    ind = creator.SublinearIndividual(plan.split_points)
    ind.kept, ind.soft = plan.kept, plan.soft
    return ind


def _plan_of(ind) -> Plan:
    return Plan.normal(ind, ind.kept, ind.soft)


# ---------------------------------------------------------------------------------------------------------------
# The search


def genetic_search(problem: PlanningProblem, seeds: Sequence[Plan]) -> GeneticResult:
    """Refine ``seeds`` for ``config.genetic_nr_iter`` generations; the plan ever simulated that the objective ranks
    lowest wins."""
    config = problem.config
    caller_state = random.getstate()
    random.setstate(random.Random(config.seed).getstate())
    try:
        if config.workers > 1:
            context = multiprocessing.get_context(
                "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
            with context.Pool(config.workers, _init_worker, (problem.profile,)) as pool:
                return _search(problem, seeds, pool.map)
        return _search(problem, seeds, map)
    finally:
        random.setstate(caller_state)


def _search(problem: PlanningProblem, seeds: Sequence[Plan], map_: Callable) -> GeneticResult:
    profile, config, objective = problem.profile, problem.config, problem.objective
    pool_size = config.genetic_pool_size
    pinned = frozenset(profile.pinned_ops.tolist())
    toolbox = base.Toolbox()
    toolbox.register("map", map_)
    toolbox.register("evaluate", _simulate_in_worker if map_ is not map else _simulate_here(profile))
    # Every operator draws from the global generator, the one DEAP's tools use (seeded by genetic_search).
    toolbox.register("split_block", split_block, rng=random)
    toolbox.register("merge_blocks", merge_blocks, rng=random)
    toolbox.register("move_boundary", move_boundary, rng=random)
    toolbox.register("toggle_kept", toggle_kept, rng=random, pinned=pinned)
    toolbox.register("toggle_soft", toggle_soft, rng=random)
    mutations = (toolbox.split_block, toolbox.merge_blocks, toolbox.move_boundary, toolbox.toggle_kept,
                 toolbox.toggle_soft, _unchanged)
    toolbox.register("mutate", _mutate, mutations=mutations, times=MUTATIONS_PER_CHILD, rng=random)
    toolbox.register("mate", crossover, rng=random)

    cache = problem.simulations
    evaluations = 0

    def evaluated(plans: Sequence[Plan]) -> list:
        """Individuals for ``plans`` with fitness, distinct plans only, simulating each new plan once."""
        nonlocal evaluations
        unique = list(dict.fromkeys(plans))
        new = [p for p in unique if p not in cache]
        cache.update(zip(new, toolbox.map(toolbox.evaluate, new)))
        evaluations += len(new)
        individuals = []
        for plan in unique:
            ind = _individual(plan)
            ind.fitness.values = objective(Candidate(plan, cache[plan]))
            individuals.append(ind)
        return individuals

    def select(population: list) -> list:
        """The best ELITE_FRACTION of the pool, the rest drawn at random (with replacement) from the others."""
        elite = tools.selBest(population, min(len(population), math.ceil(ELITE_FRACTION * pool_size)))
        chosen = {id(ind) for ind in elite}
        others = [ind for ind in population if id(ind) not in chosen]
        return elite + (tools.selRandom(others, pool_size - len(elite)) if others else [])

    starts = evaluated(list(dict.fromkeys([*seeds, Plan.no_split(profile.num_ops), *uniform_plans(profile)])))
    best_flat = [_plan_of(ind) for ind in tools.selBest([i for i in starts if not i.soft], NESTED_SEEDS)]
    starts = [*map(_plan_of, starts), *nested_plans(profile, best_flat)]
    plans = dict.fromkeys(starts)
    for attempt in range(10 * pool_size):  # bounded: a tiny graph may have fewer distinct plans than the pool
        if len(plans) >= pool_size:
            break
        plans.setdefault(toolbox.mutate(starts[attempt % len(starts)]))
    population = evaluated(list(plans))

    hall = tools.HallOfFame(1, similar=lambda a, b: _plan_of(a) == _plan_of(b))
    hall.update(population)
    stats = tools.Statistics(key=lambda ind: cache[_plan_of(ind)].peak_bytes)
    stats.register("best", min)
    stats.register("median", np.median)
    logbook = tools.Logbook()
    logbook.record(gen=0, evals=evaluations, **stats.compile(population))
    history = []
    started = time.perf_counter()
    for generation in range(1, config.genetic_nr_iter + 1):
        survivors = select(population)
        children = []
        for ind in survivors:
            plan = _plan_of(ind)
            children.append(toolbox.mutate(plan))
            children.append(toolbox.mate(plan, _plan_of(random.choice(survivors))))
        population = evaluated([*map(_plan_of, survivors), *children])
        hall.update(population)
        best = problem.candidate(_plan_of(hall[0]), "genetic")
        history.append(best)
        record = stats.compile(population)
        logbook.record(gen=generation, evals=evaluations, **record)
        log.info("genetic generation %d/%d: best peak %.1f MiB at predicted time x%.3f (population median %.1f "
                 "MiB), %d plans simulated, %.1f s", generation, config.genetic_nr_iter,
                 best.simulation.peak_bytes / 2**20, best.simulation.time_ratio, record["median"] / 2**20,
                 evaluations, time.perf_counter() - started)
    best = _plan_of(hall[0])
    return GeneticResult(problem.candidate(best, "genetic"), tuple(history), evaluations, logbook)


class GeneticPlanner:
    """MegEngine's genetic refinement, seeded with every candidate found so far."""

    name = "genetic"

    def enabled(self, config: SublinearMemoryConfig) -> bool:
        return config.genetic_nr_iter > 0

    def propose(self, problem: PlanningProblem, pool: Sequence[Candidate]) -> list[Candidate]:
        found = genetic_search(problem, [c.plan for c in pool])
        problem.history.extend(found.history)
        return [found.best]


register_planner("genetic", GeneticPlanner)
