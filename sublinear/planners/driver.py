"""Plan stage driver: run the configured planners in order over one problem and keep the best candidate.

Every planner sees the candidates found before it (the genetic search is seeded with them all), and every
candidate is scored by the one simulator under the config's objective (:class:`sublinear.core.objective.Objective`).
With no memory budget, the plan is then the knee of the front found (:func:`knee`): the lowest peak reached
while each step along the front buys at least ``min_memory_per_time`` of eager's peak per unit of time, eager where
the plan would save under :data:`MIN_SAVING` of eager's peak. Afterwards ``lb_memory`` hands memory back: when the
chosen plan's peak is below this floor, recomputed ops are kept again, most recompute time first, while the peak
stays within the floor. The plan depends only on the profile, the config (its seed included) and the pool: every
planner bounds its search by counted work, never by the clock.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from sublinear.config import SublinearMemoryConfig
from sublinear.core.analysis import analyse
from sublinear.core.objective import Candidate, Objective, Simulation
from sublinear.core.plan import Plan
from sublinear.core.profile import GraphProfile
from sublinear.core.units import format_bytes
from sublinear.planners.base import PLANNERS, PlanningProblem

__all__ = ["MIN_SAVING", "BudgetError", "PlanningResult", "StepFloor", "hand_back", "knee", "lowest_plan",
           "make_plan", "objective_for", "pareto_front", "step_floor"]

log = logging.getLogger("sublinear.planners")

MIN_SAVING = 0.05  # with no budget, a plan that saves less than this fraction of eager's peak runs as eager


@dataclass(frozen=True)
class StepFloor:
    """What a step holds whatever the plan, part by part: no plan's predicted peak is below :attr:`total`."""

    parts: tuple[tuple[str, int], ...]  # (what, bytes)

    @property
    def total(self) -> int:
        return sum(nbytes for _, nbytes in self.parts)

    def __str__(self) -> str:
        return f"{', '.join(f'{what} {format_bytes(n)}' for what, n in self.parts)} = {format_bytes(self.total)}"


def step_floor(profile: GraphProfile) -> StepFloor:
    """The largest of the simulator's plan-independent lower bounds on a step's peak: when the step ends, its
    parameters, buffers, inputs, library workspaces and gradients are live beside whatever the plan keeps (under
    FSDP2, the shards; and through the forward, the gathered parameters), and beside them what the other graphs of
    the call hold; later graphs of the call reach their own peak beside this one."""
    context = profile.step_context
    state = (("buffers", profile.buffer_bytes), ("inputs", profile.input_bytes))
    if profile.workspace_bytes:
        state += (("cuBLAS workspaces", profile.workspace_bytes),)
    s = profile.sharding
    if s is None:
        bounds = [(("parameters", profile.parameter_bytes), *state, ("gradients", profile.gradient_bytes))]
    else:
        bounds = [(("parameter shards", s.sharded_bytes), *state, ("gradient shards", s.sharded_gradient_bytes)),
                  (("parameter shards", s.sharded_bytes), ("gathered parameters", s.unsharded_bytes),
                   ("all-gather buffer", s.all_gather_bytes), *state)]
    if context is not None:
        bounds[0] += (("other graphs of the call", context.beside_backward),)
        if s is not None:
            bounds[1] += (("other graphs of the call", context.beside_forward),)
        if context.later_beyond_held is not None:
            bounds.append((("later graphs of the call, at their peak", context.later_beyond_held),))
        if context.floor_bytes:
            bounds.append((("the call's parameters, inputs and gradients, or its eager code's backward",
                            context.floor_bytes),))
    return max((StepFloor(parts) for parts in bounds), key=lambda floor: floor.total)


class BudgetError(ValueError):
    """No plan found meets the memory budget within the time cap. ``floor``: what the step holds whatever the plan
    (:func:`step_floor`), when known; a budget below it is out of every plan's reach, and the message says so.
    ``compiled``: the smallest peak is a compiled step's (read back from the compiled code), not a prediction.
    ``later_graphs_unknown``: raised before any call finished, so ``smallest`` is this graph's alone, a lower bound
    of the step's where graph breaks split it (:meth:`note_later_graphs_unknown`)."""

    def __init__(self, objective: Objective, smallest: Candidate, fastest_fitting: Candidate | None, *,
                 floor: StepFloor | None = None, compiled: bool = False) -> None:
        budget = objective.memory_budget or 0
        peak = smallest.simulation.peak_bytes
        what = "lowest peak of the plans compiled" if compiled else "smallest predicted peak found"
        found = f"{peak:,} bytes ({format_bytes(peak)}, time x{smallest.simulation.time_ratio:.2f})"
        if floor is not None and budget < floor.total:
            text = (f"no plan fits memory_budget: the budget ({format_bytes(budget)}) is below what the step holds "
                    f"whatever the plan: {floor} (optimizer state, if any, comes on top). The {what} is "
                    f"{found}: raise the budget to at least that, or lower the batch size.")
        else:
            text = (f"no plan fits memory_budget={format_bytes(budget)} within max_time_ratio="
                    f"{objective.max_time_ratio:g}: the {what} is {found}")
            if fastest_fitting is not None and not objective.within_time(fastest_fitting):
                text += (f"; the fastest plan that fits needs time x{fastest_fitting.simulation.time_ratio:.2f}: "
                         f"raise max_time_ratio to allow it")
            text += ". Raise the budget, lower the batch size, or search longer (genetic_nr_iter)."
        super().__init__(text)
        self.budget, self.smallest, self.floor, self.compiled = budget, peak, floor, compiled
        self.lowest = smallest  # the candidate with the smallest peak within the time cap
        self.later_graphs_unknown = False

    def note_later_graphs_unknown(self) -> None:
        """Say that no call has finished yet: graphs after this one, not captured yet, may hold memory beside it."""
        if self.later_graphs_unknown:
            return
        self.later_graphs_unknown = True
        self.args = (f"{self.args[0]} No call has finished yet: where graph breaks split the step, its later "
                     f"graphs are not captured yet and hold memory beside this one, so the step's lowest peak may be "
                     f"higher than this graph's.",)


@dataclass(frozen=True)
class PlanningResult:
    plan: Plan
    simulation: Simulation
    baseline: Simulation  # eager: the one-block plan
    objective: Objective
    candidates: tuple[Candidate, ...]  # every candidate the planners returned, best first under the objective
    history: tuple[Candidate, ...]  # the best candidate so far after each planner and each genetic generation
    seconds: float
    origin: str  # the planner whose candidate won


def objective_for(config: SublinearMemoryConfig, memory_budget: int | None) -> Objective:
    """The config's objective with its memory budget resolved to bytes (``"auto"`` is resolved by the caller)."""
    return Objective(memory_budget, config.max_time_ratio,
                     config.min_memory_per_time if memory_budget is None else 0.0)


_FROM_CONFIG = object()


def make_plan(profile: GraphProfile, config: SublinearMemoryConfig | None = None, *,
              memory_budget: int | None | object = _FROM_CONFIG, pool: Sequence[Candidate] = ()) -> PlanningResult:
    """The best plan for ``profile`` under ``config``.

    ``memory_budget``: the budget in bytes (None: no budget); by default the config's when it is a number of
    bytes, and none for ``"auto"`` (which the caller resolves on the device). ``pool``: candidates found earlier
    for the same profile (they seed the planners and compete)."""
    config = config or SublinearMemoryConfig()
    unknown = [name for name in config.planners if name not in PLANNERS]
    if unknown:
        raise ValueError(f"unknown planner(s) {unknown} in SublinearMemoryConfig.planners; registered: "
                         f"{', '.join(sorted(PLANNERS))}")
    if memory_budget is _FROM_CONFIG:
        memory_budget = config.memory_budget if isinstance(config.memory_budget, int) else None
    problem = PlanningProblem(profile, objective_for(config, memory_budget), config)
    eager = problem.candidate(Plan.no_split(profile.num_ops), "eager")
    found: dict[Plan, Candidate] = {eager.plan: eager}
    for c in pool:
        problem.simulations.setdefault(c.plan, c.simulation)
        found.setdefault(c.plan, c)
    _search(problem, found, eager)
    if memory_budget not in (None, 1) and not problem.objective.accepts(problem.best(found.values())):
        # Planners aimed at the least time within a budget may miss the plan of the lowest peak: a budget is refused
        # only when the search for the lowest peak finds none within it either. That search is ``memory_budget=1``'s,
        # from eager alone and nothing simulated (the local search climbs from every plan simulated so far: from the
        # budget's, it settles elsewhere), so a budget above the peak that ``memory_budget=1`` names is met.
        lowest = {eager.plan: eager}
        _search(PlanningProblem(profile, objective_for(config, 1), config), lowest, eager)
        for plan, c in lowest.items():
            found.setdefault(plan, c)
    ranked = sorted(found.values(), key=problem.objective)
    best = ranked[0]
    if not problem.objective.accepts(best):
        fitting = [c for c in ranked if problem.objective.fits(c)]
        # the smallest peak within the time cap (eager always is): what a budget can be raised to and be met
        capped = [c for c in ranked if problem.objective.within_time(c)] or ranked
        raise BudgetError(problem.objective, min(capped, key=lambda c: c.simulation.peak_bytes),
                          min(fitting, key=lambda c: c.simulation.recompute_seconds) if fitting else None,
                          floor=step_floor(profile))
    if problem.objective.min_memory_per_time > 0:
        best = knee([c for c in ranked if problem.objective.accepts(c)], eager, problem.objective.min_memory_per_time)
    if config.lb_memory and best.simulation.peak_bytes < config.lb_memory:
        best = hand_back(problem, best, config.lb_memory)
    history = _running_best(problem.history, problem.objective)
    return PlanningResult(best.plan, best.simulation, eager.simulation, problem.objective, tuple(ranked),
                          history, problem.seconds, best.origin)


def lowest_plan(profile: GraphProfile, config: SublinearMemoryConfig) -> Plan:
    """The plan of the lowest predicted peak on ``profile`` within the config's time cap."""
    try:
        return make_plan(profile, config, memory_budget=1).plan
    except BudgetError as exc:  # no plan fits one byte: the error carries the lowest one found
        return exc.lowest.plan


def _search(problem: PlanningProblem, found: dict[Plan, Candidate], eager: Candidate) -> None:
    """Run the config's planners in turn on ``problem``, each seeded with the candidates ``found`` so far (ranked by
    the problem's objective), adding what they propose to ``found``."""
    for name in problem.config.planners:
        planner = PLANNERS[name]()
        if not planner.enabled(problem.config):
            continue
        ranked = sorted(found.values(), key=problem.objective)
        with _no_cycle_collection():
            proposed = planner.propose(problem, ranked)
        for c in proposed:
            found.setdefault(c.plan, c)
        best = problem.best(found.values())
        problem.history.append(best)
        log.info("%s: %d candidates, best peak %s at predicted time x%.3f (eager %s), %.2f s", name, len(found),
                 format_bytes(best.simulation.peak_bytes), best.simulation.time_ratio,
                 format_bytes(eager.simulation.peak_bytes), problem.seconds)


@contextlib.contextmanager
def _no_cycle_collection() -> Iterator[None]:
    """Planners allocate many short-lived objects, and a full collection of a long-running process's heap (0.2-0.4 s
    after a few compiles, growing with the heap) landing inside one would add its time to planning; the plan does
    not depend on it, as planners count work, not time. Inside, memory is freed by reference counting; reference
    cycles wait until the planner returns."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _running_best(history: Iterable[Candidate], objective: Objective) -> tuple[Candidate, ...]:
    out: list[Candidate] = []
    for c in history:
        out.append(c if not out or objective(c) < objective(out[-1]) else out[-1])
    return tuple(out)


def hand_back(problem: PlanningProblem, candidate: Candidate, floor: int) -> Candidate:
    """Keep recomputed ops, most recompute time first, while the predicted peak stays within ``floor`` (MegEngine's
    ``lb_memory``)."""
    profile = problem.profile
    best = candidate
    recomputed = sorted({o for members in analyse(profile, best.plan).closure for o in members},
                        key=lambda o: -profile.op_seconds[o])
    for o in recomputed:
        if profile.op_seconds[o] <= 0:
            break
        plan = Plan.normal(best.plan.split_points, best.plan.kept | {int(o)}, best.plan.soft)
        trial = problem.candidate(plan, "lb_memory hand-back")
        if (trial.simulation.peak_bytes <= floor
                and trial.simulation.recompute_seconds < best.simulation.recompute_seconds):
            best = trial
    return best


def knee(candidates: Sequence[Candidate], eager: Candidate, rate: float) -> Candidate:
    """The plan that buys memory, not time: from eager, step along the lower convex hull of the candidates' front
    (peak as a fraction of eager's, against the step-time ratio) while the next hull vertex saves at least ``rate``
    of eager's peak per unit of time ratio it adds; eager when that plan saves under :data:`MIN_SAVING` of eager's
    peak."""
    base = eager.simulation.peak_bytes
    front = pareto_front([*candidates, eager])
    current = eager
    while True:
        steepest, following = rate, None
        for c in front:
            saved = (current.simulation.peak_bytes - c.simulation.peak_bytes) / base
            spent = c.simulation.time_ratio - current.simulation.time_ratio
            if saved <= 0:
                continue
            slope = saved / spent if spent > 0 else float("inf")
            if slope >= steepest:
                steepest, following = slope, c
        if following is None:
            break
        current = following
    return current if base - current.simulation.peak_bytes >= MIN_SAVING * base else eager


def pareto_front(candidates: Iterable[Candidate]) -> list[Candidate]:
    """The candidates no other beats on both peak and predicted time, by increasing peak."""
    front: list[Candidate] = []
    for c in sorted(candidates, key=lambda c: (c.simulation.peak_bytes, c.simulation.recompute_seconds)):
        if not front or c.simulation.recompute_seconds < front[-1].simulation.recompute_seconds:
            front.append(c)
    return front


