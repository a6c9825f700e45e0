"""Optimal flat plans: the least predicted recompute time among plans without soft split points whose predicted
peak fits a memory budget, by dynamic programming over block boundaries, for a few fixed kept sets. Time and memory
of each block come from the flat model (:class:`~sublinear.simulation.flat.FlatModel`): its time is the
simulator's, its peak an upper bound on the simulator's that is exact on chains.

**Search** (:func:`solve`). A label at op ``i`` is a prefix of blocks ending at ``i - 1`` with its carried bytes
``P`` and recompute seconds ``T``; labels at ``i`` that another label there beats on both are dropped. Ops are
processed in order: a label extends by block ``[i..j]`` when ``P + L([i..j]) <= budget`` (``L``: the flat model's
local peak) and finishes with the last block ``[i..n-1]`` when ``P + L_last(i) <= budget``; block ends are
scanned while a lower bound on ``L``, non-decreasing in ``j``, leaves room, and labels no faster than the best
finish are dropped. When the search completes, its plan has the least recompute time among plans whose model peak
fits the budget. The local peaks of all block ends of one start are computed together, as arrays of block ends by
backward ranks and by recomputed ops.

**Work** (no clock is read). A search counts units of work, roughly proportional to its running time (0.03-0.07 µs
a unit on a 2-core x86_64 CPU): one per label extended; one per cell of the local-peak arrays, i.e. block ends
evaluated for the first time times the backward ranks and ops of the longest of them; :data:`START_WORK_PER_OP`
per op of the graph for a block start's arrays, with its first block ends; and :data:`VISIT_WORK` per op whose
labels are extended. Before each op with labels, a search that has spent the work it was given stops, with the best
plan found and a lower bound on the time any plan that fits needs. Its plan therefore depends only on the profile,
the config and the work given, never on how busy the machine is.

**Planner** (:class:`OptimalPlanner`). Kept sets searched (:func:`kept_sets`): none (the flat optimum), every op
with FLOPs, and the half of the ops with the most forward time per output byte. Each propose may spend
:data:`WORK_PER_PROPOSE` units; the kept sets' first searches take turns, each with half the work left (the last
with all of it). Under a budget, each kept set's least-time plan is proposed; on graphs of more than
:data:`EXACT_OPS` ops the search runs first over every stride-th boundary (:data:`COARSE_BOUNDARIES` boundaries),
then over all boundaries for a faster plan with the work left. Without a budget (lowest peak within
``max_time_ratio``), budgets are bisected to :data:`PEAK_TOLERANCE` of the eager peak, each solved with plans over
the time cap excluded (over every stride-th boundary on large graphs). Each candidate's origin says what was proven:
the optimum under the model, or the best plan found before the work budget ran out with a lower bound on the time
any flat plan needs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from sublinear.config import SublinearMemoryConfig
from sublinear.core.objective import Candidate
from sublinear.core.plan import Plan
from sublinear.core.profile import GraphProfile
from sublinear.core.units import format_bytes
from sublinear.simulation.flat import NEVER, FlatModel
from sublinear.planners.base import PlanningProblem, register_planner

__all__ = ["OptimalPlanner", "Solution", "kept_sets", "solve"]

WORK_PER_PROPOSE = 64_000_000  # units of work (module docstring) per propose: 3-4 s on a 2-core x86_64 CPU;
# ResNet-50 and BERT-base need at most 51M, 29M of it in the first kept set's search (given half)
VISIT_WORK = 8_000  # per op whose labels a search extends: the fixed cost of one step
START_WORK_PER_OP = 80  # per op of the graph, for the arrays of one block start
EXACT_OPS = 300  # larger graphs are first solved over every stride-th boundary
COARSE_BOUNDARIES = 300  # boundaries the first search over a larger graph may use
PEAK_TOLERANCE = 1e-3  # without a budget: the lowest peak is bracketed to this fraction of the eager peak
RELAXED_RETRIES = 2  # where the model over-counts a plan, re-solve with the budget raised by the excess


@dataclass(frozen=True)
class Solution:
    """One search's outcome: its plan (None: no plan fits the model's budget, or none was found with the work
    given), the plan's recompute seconds and model peak, and a lower bound on the least recompute seconds of a plan
    that fits (the plan's own when ``proven``). ``stride`` > 1: split points were restricted to every stride-th op.
    ``work``: the units of work the search spent."""

    plan: Plan | None
    seconds: float
    model_peak: int
    bound: float
    proven: bool
    stride: int = 1
    work: int = 0


def solve(model: FlatModel, budget: int, *, work: float = math.inf, time_cap: float = math.inf, stride: int = 1,
          faster_than: float = math.inf) -> Solution:
    """The plan of least recompute time whose model peak fits ``budget``, among those whose split points are
    every ``stride``-th op and whose recompute time is at most ``time_cap`` and below ``faster_than`` (see the
    module docstring), searched until it has spent ``work`` units. Local peaks that ``model`` keeps from earlier
    searches are not counted again, so on one model the same sequence of searches spends the same work."""
    n = model.n
    if model.floor > budget:
        return Solution(None, math.inf, 0, math.inf, True, stride)
    if n == 0:
        return Solution(Plan.no_split(0), 0.0, model.floor, 0.0, True, stride)
    # Labels reaching op i (their blocks end at i - 1): carried bytes, seconds, parent op, parent label.
    pending: list[list[tuple[np.ndarray, ...]]] = [[] for _ in range(n)]
    pending[0].append((np.zeros(1, dtype=np.int64), np.zeros(1), -1, np.full(1, -1)))
    fronts: list[tuple[np.ndarray, ...] | None] = [None] * n
    best, best_seconds = None, faster_than
    below_cap = math.nextafter(time_cap, math.inf)
    spent = 0
    for i in range(n):
        if not pending[i]:
            continue
        if spent >= work:
            waiting = [float(part[1].min()) for entries in pending[i:] for part in entries]
            return _found(model, fronts, best, best_seconds, min(waiting + [best_seconds]), False, stride, spent)
        front = _pareto(pending[i], min(best_seconds, below_cap))
        pending[i] = []
        if front is None:
            continue
        spent += VISIT_WORK
        fronts[i] = front
        carried, seconds = front[0], front[1]  # carried ascending, seconds descending
        fits = int(np.searchsorted(carried, budget - model.last_block(i), side="right"))
        if fits and seconds[fits - 1] < best_seconds:
            best, best_seconds = (i, fits - 1), float(seconds[fits - 1])
        alive = int(np.searchsorted(-seconds, -best_seconds, side="right"))  # labels faster than the best
        if i == n - 1 or alive == len(carried):
            continue
        start = model.start(i)
        last = min(model.n - 2, i - 1 + int(np.searchsorted(start.lower, budget - int(carried[alive]), side="right")),
                   i - 1 + int(np.searchsorted(start.seconds, best_seconds - seconds[-1], side="left")),
                   i - 1 + int(np.searchsorted(start.seconds, time_cap - seconds[-1], side="right")))
        ends = np.arange(i, last + 1)
        ends = ends[(ends + 1) % stride == 0]
        if not len(ends):
            continue
        spent += _evaluation_work(model, i, ends)
        start.evaluate(ends)
        fit = np.searchsorted(carried, budget - start.local[ends - i], side="right")
        counts = np.maximum(fit - alive, 0)
        total = int(counts.sum())
        spent += total
        if not total:
            continue
        block = np.repeat(ends - i, counts)
        label = alive + np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
        new_carried = carried[label] + start.carried[block]
        new_seconds = seconds[label] + start.seconds[block]
        bounds = np.cumsum(counts).tolist()
        for k in np.flatnonzero(counts).tolist():
            a, b = bounds[k] - int(counts[k]), bounds[k]
            pending[int(ends[k]) + 1].append((new_carried[a:b], new_seconds[a:b], i, label[a:b]))
    return _found(model, fronts, best, best_seconds, best_seconds, True, stride, spent)


def _evaluation_work(model: FlatModel, i: int, ends: np.ndarray) -> int:
    """The units of work of evaluating the local peaks of blocks ``[i..j]``, ``j`` in ``ends``: the blocks not
    evaluated before times the backward ranks and ops of the longest, and the start's arrays with its first blocks."""
    start = model.start(i)
    new = ends[~start.done[ends - i]]
    if not len(new):
        return 0
    cells = len(new) * (int(model.rank_hi[new[-1]]) - int(model.rank_lo[i]) + 2 + int(new[-1]) - i + 2)
    return cells + (0 if start.done.any() else START_WORK_PER_OP * model.n)


def _pareto(entries: list[tuple[np.ndarray, ...]], below: float) -> tuple[np.ndarray, ...] | None:
    """The labels no other beats on both carried bytes and seconds, faster than ``below``; carried ascending
    (so seconds descending)."""
    if not entries:
        return None
    carried, seconds, parents, labels = zip(*entries)
    carried, seconds, label = np.concatenate(carried), np.concatenate(seconds), np.concatenate(labels)
    parent = np.repeat(parents, [len(x) for x in labels])
    order = np.lexsort((seconds, carried))
    carried, seconds = carried[order], seconds[order]
    faster = seconds < np.minimum.accumulate(np.concatenate([[below], seconds[:-1]]))
    if not faster.any():
        return None
    return carried[faster], seconds[faster], parent[order][faster], label[order][faster]


def _found(model: FlatModel, fronts: list, best: tuple[int, int] | None, seconds: float, bound: float,
           proven: bool, stride: int, work: int) -> Solution:
    if best is None:
        return Solution(None, math.inf, 0, bound, proven, stride, work)
    points, (i, label) = [model.n - 1], best
    while fronts[i][2][label] >= 0:
        points.append(i - 1)
        i, label = int(fronts[i][2][label]), int(fronts[i][3][label])
    plan = model.plan(points)
    return Solution(plan, seconds, model.peak(plan), bound, proven, stride, work)


def kept_sets(profile: GraphProfile) -> list[tuple[str, frozenset[int]]]:
    """The kept sets searched, named: none; every op with FLOPs (matmuls, convolutions); and the half of the ops
    with the most forward time per byte they output (the grid's keep variants, over the whole graph)."""
    ops = [op for op in profile.ops if not op.pinned and op.forward_seconds > 0]
    dense = sorted(ops, key=lambda op: -profile.arrays.recompute_density[op.index])[:len(ops) // 2]
    sets = [("", frozenset()), ("ops with FLOPs kept", frozenset(op.index for op in ops if op.flops > 0)),
            ("densest half kept", frozenset(op.index for op in dense))]
    return [(name, kept) for k, (name, kept) in enumerate(sets)
            if not k or kept and kept not in [other for _, other in sets[:k]]]


class OptimalPlanner:
    """Plans optimal under the memory model for each kept set of :func:`kept_sets` (see the module docstring),
    re-scored by the simulator; within :data:`WORK_PER_PROPOSE` units of work per propose."""

    name = "optimal"

    def enabled(self, config: SublinearMemoryConfig) -> bool:
        return True

    def propose(self, problem: PlanningProblem, pool: Sequence[Candidate]) -> list[Candidate]:
        profile = problem.profile
        if profile.num_ops == 0:
            return []
        work = _WorkLeft(WORK_PER_PROPOSE)
        stride = 1 if profile.num_ops <= EXACT_OPS else math.ceil(profile.num_ops / COARSE_BOUNDARIES)
        models = [(f"optimal (flat{', ' + name if name else ''}: ", FlatModel(profile, kept))
                  for name, kept in kept_sets(profile)]
        if problem.objective.memory_budget is None:
            return _lowest_peak(problem, models, stride, work)
        return _least_time(problem, models, problem.objective.memory_budget, stride, work)


@dataclass
class _WorkLeft:
    """The units of work a propose has left; every search it runs spends from them."""

    units: int

    def share(self, parts: int) -> int:
        """The work of the next of ``parts`` searches: half of what is left, all of it for the last (the first
        kept set, with none kept, keeps the most labels and needs the most)."""
        return max(0, self.units) // min(parts, 2)

    def spend(self, solution: Solution) -> Solution:
        self.units -= solution.work
        return solution


def _out_of_work(stride_text: str) -> str:
    return f"best found before the work budget ({WORK_PER_PROPOSE:,} units) ran out{stride_text}"


def _least_time(problem: PlanningProblem, models: list[tuple[str, FlatModel]], budget: int, stride: int,
                work: _WorkLeft) -> list[Candidate]:
    """Per kept set, the least-time plan under the budget: over every stride-th boundary first, then, best kept set
    first, over all boundaries for a faster plan with the work left. Where the model counts more than the simulator
    for a plan, the least-time plans under the budget raised by that excess are proposed too (they may fit). When
    no plan fits the model, the lowest-peak plans (:func:`_lowest_peak`), so that the driver names the least peak
    found."""
    solutions = [work.spend(solve(model, budget, work=work.share(len(models) - k), stride=stride))
                 for k, (_, model) in enumerate(models)]
    if all(s.plan is None and s.proven for s in solutions):
        return _lowest_peak(problem, models, stride, work)
    bounds = [s.bound if stride == 1 else 0.0 for s in solutions]  # on the time of any plan that fits
    if stride > 1:
        for k in sorted(range(len(models)), key=lambda k: solutions[k].seconds):
            full = work.spend(solve(models[k][1], budget, work=work.units, faster_than=solutions[k].seconds))
            bounds[k] = full.bound
            if full.plan is not None or full.proven:
                solutions[k] = full if full.plan is not None else Solution(
                    solutions[k].plan, solutions[k].seconds, solutions[k].model_peak, full.bound, True)
    eager = problem.profile.step_seconds
    found: list[Candidate] = []
    for (label, model), solution, bound in zip(models, solutions, bounds):
        raised = 0
        for _ in range(1 + RELAXED_RETRIES):
            if solution.plan is None or any(c.plan == solution.plan for c in found):
                break
            if solution.proven and solution.stride == 1:
                what = "least recompute under the memory model"
            else:
                what = _out_of_work(f", optimal over every {solution.stride}th boundary" if solution.proven else "")
                if eager > 0:
                    what += f"; a flat plan needs time >= x{1 + bound / eager:.3f}"
            raise_text = f", model budget +{format_bytes(raised)}" if raised else ""
            candidate = problem.candidate(solution.plan, f"{label}{what}{raise_text})")
            found.append(candidate)
            excess = solution.model_peak - candidate.simulation.peak_bytes
            if excess <= 0:
                break
            raised += excess
            solution = work.spend(solve(model, budget + raised, work=work.units, stride=stride))
    return found


def _lowest_peak(problem: PlanningProblem, models: list[tuple[str, FlatModel]], stride: int,
                 work: _WorkLeft) -> list[Candidate]:
    """Per kept set, bisect budgets for the lowest model peak of a plan within the time cap, below the lowest
    simulated peak found so far; every plan found is a candidate."""
    profile = problem.profile
    cap = (problem.objective.max_time_ratio - 1.0) * profile.step_seconds
    cap_text = "" if math.isinf(cap) else f" within x{problem.objective.max_time_ratio:g} eager"
    over = f" over every {stride}th boundary" if stride > 1 else ""
    found: list[Candidate] = []
    for k, (label, model) in enumerate(models):
        share = work.share(len(models) - k)
        below = min((c.simulation.peak_bytes for c in found if problem.objective.within_time(c)), default=NEVER)
        high = model.peak(model.plan([profile.num_ops - 1]))  # eager fits its own peak
        low = model.floor - 1  # no plan's model peak is below the floor
        tolerance = max(1, int(PEAK_TOLERANCE * high))
        proven, plans = True, []
        probe = min(below - 1, (low + high) // 2)
        while high - low > tolerance:
            solution = work.spend(solve(model, probe, work=share, time_cap=cap, stride=stride))
            share -= solution.work
            proven &= solution.proven
            if solution.plan is not None:
                high = solution.model_peak
                plans.append(solution.plan)
            elif solution.proven and probe < below - 1:
                low = probe
            else:  # out of work, or nothing below the peak found already
                break
            probe = (low + high) // 2
        what = f"lowest model peak{cap_text}{over}, to {PEAK_TOLERANCE:.1%} of eager" if proven else _out_of_work(over)
        found += problem.candidates(plans, f"{label}{what})")
    return found


register_planner("optimal", OptimalPlanner)
