"""The compile check: what inductor compiled for a planned graph, read back and taught to its profile.

A planned graph compiles at its first call; the compiled forward's and backward's memory is then walked statement
by statement, library calls measured on the device (:mod:`sublinear.execute.compiled.step_memory`). The profile is
taught what the compiled code held, slot by slot (:mod:`sublinear.simulation.calibration`): from then on it predicts
that plan as compiled, and every plan at least as high where the compiler added memory. The taught profile's costs
go to the plan cache with the plan, so a later process predicts the compiled step before compiling.

Before the first plan of a budget is built, the fastest plan the search predicted above the budget by less than
:data:`UNCERTAINTY` (where it saves at least :data:`WORTH_A_READ` of the step's time) is judged by the wrapper code
inductor generates for it without building its kernels, and runs instead where that code fits. A plan predicted less
than :data:`UNCERTAINTY` under its budget is judged first by the wrapper code inductor generates for it without
building its kernels, and is built only where that code fits (one build where the first plan would have been over:
the memory model leaves out some of inductor's fusion choices, and such plans can land either side of the budget).
When the compiled step, or that wrapper code, is above the memory budget, other plans are tried, fastest first: the
plan searched on the taught profile (the same budget, never cut), then the plans the planners found within the
budget on the profile before any lesson, then that profile's plan of the lowest peak, :data:`ALTERNATES` of them at
most. What a compiled plan held beyond its simulation depends on how inductor fuses that plan's backward (a
recompute fused into a kernel that spans many ops allocates its buffers together), so a lesson taught to every plan
over-counts some plans that fit and under-counts others; each alternate is therefore judged by the wrapper code
inductor generates for it without building its kernels
(:meth:`~sublinear.execute.compiled.CompiledGraph.memory_without_kernels`), and the first that fits is compiled. A
budget none of them meets raises :class:`~sublinear.planners.BudgetError` naming the lowest peak read back.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from sublinear.cache import PlanCache
from sublinear.capture.shapes import Binding
from sublinear.config import SublinearMemoryConfig
from sublinear.core.analysis import analyse
from sublinear.core.objective import Candidate, Simulation
from sublinear.core.plan import Plan
from sublinear.core.profile import GraphProfile, costs_of
from sublinear.core.units import format_bytes
from sublinear.execute.compiled import CompiledGraph, CompiledStepMemory
from sublinear.planners import BudgetError, lowest_plan, make_plan
from sublinear.planners.driver import step_floor
from sublinear.runtime.head_chunks import HeadChunks
from sublinear.runtime.variant import GraphVariant
from sublinear.simulation.calibration import recompute_ranks, taught, trace_by_slot
from sublinear.simulation.timeline import simulate

if TYPE_CHECKING:
    from sublinear.runtime.graph import GraphRuntime

__all__ = ["ALTERNATES", "UNCERTAINTY", "WORTH_A_READ", "CompileCheck", "Lesson", "Profiled", "faster_above",
           "may_fit_without_guessed_outputs"]

log = logging.getLogger("sublinear")

ALTERNATES = 8  # plans judged by their wrapper code when a compiled step is above its budget
# The memory model predicts the compiled step within 2 % on the benchmark sets: a plan predicted less than that
# under its budget may compile above it, and one predicted less than that above it may compile within it.
UNCERTAINTY = 0.02
WORTH_A_READ = 0.01  # the step-time ratio a plan predicted above the budget must save to be judged by its code


@dataclasses.dataclass
class Profiled:
    """A graph's profile at one signature, with what compiling it needs (the joint graph's forward node names and
    backward ranks, None for the eager executor; the convolutions' layout, and the profile in the other layout to
    plan in when no plan in this one meets the budget), how many times a compile check taught it, and the profile
    as it was before (``untaught``)."""

    profile: GraphProfile
    node_names: tuple[str, ...] | None
    backward_ranks: dict[str, int] | None
    channels_last: bool = False  # whether its convolutions are laid out channels-last (its code is compiled so)
    fallback: Profiled | None = None
    lessons: int = 0
    untaught: GraphProfile = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.untaught = self.profile

    def untaught_as(self, profile: GraphProfile) -> GraphProfile:
        """The profile before any lesson, in ``profile``'s step context and sharding."""
        return dataclasses.replace(self.untaught, sharding=profile.sharding, step_context=profile.step_context)


@dataclasses.dataclass(frozen=True)
class Lesson:
    """What a compile check needs to teach a variant's profile: the profile's record, and the plan cache entry
    that keeps what it learns."""

    profiled: Profiled
    disk_key: str
    chunks: HeadChunks | None = None  # the LM heads' chunks the variant runs (its profile: the profiled's, applied)


class CompileCheck:
    """Compiles new variants and teaches their profiles what the compiled code held; above the budget, finds and
    compiles a plan whose compiled code fits (see the module docstring). ``replan(runtime, values, key, dry_run,
    bound, fixed)`` plans a signature again on the taught profile, or, given ``fixed`` (a plan and the profile of its
    layout), runs that plan (chosen on that profile before any lesson)."""

    def __init__(self, plans: PlanCache, config: SublinearMemoryConfig,
                 replan: Callable[[GraphRuntime, Sequence[Any], tuple, bool, Binding, tuple[Plan, Profiled] | None],
                                  GraphVariant]) -> None:
        self.plans = plans
        self.config = config
        self.replan = replan

    def within_budget(self, runtime: GraphRuntime, variant: GraphVariant, values: Sequence[Any],
                      key: tuple) -> GraphVariant:
        """Compile a new variant now, read what its compiled code holds, teach its profile; above the budget,
        compile the first alternate whose compiled code fits instead. Before building it, a faster plan predicted a
        little above the budget whose wrapper code fits runs instead (:func:`_faster_fitting`), and a plan predicted
        a little under the budget whose wrapper code is over is never built (:func:`_unbuilt_over`)."""
        if not isinstance(variant.rewritten, CompiledGraph) or variant.checked:
            return variant
        faster = _faster_fitting(runtime, variant, values)
        unbuilt = _unbuilt_over(runtime, variant, values) if faster is None else None
        if faster is not None:
            runtime.forget(variant)
            variant = runtime.variants[key] = self.replan(runtime, values, key, False, variant.bound,
                                                          (faster, variant.lesson.profiled))
        if unbuilt is not None:
            self._teach(variant, unbuilt[1])
            walked = ("as inductor's wrapper code for it reads, before its kernels are built, holds "
                      f"{format_bytes(unbuilt[0])}")
        else:
            if not self._compile(variant, values, afresh=faster is not None, exact=faster is not None):
                return variant
            if variant.budget is None or variant.settling or _within(runtime, variant):
                return variant  # settling: over the budget until the call's other graphs are planned for it
            walked = f"as compiled holds {format_bytes(variant.peak_bytes)}"
        log.info("sublinear: graph %d %s, above the budget of %s (%s predicted before compiling); trying other plans",
                 runtime.index, walked, format_bytes(variant.budget), format_bytes(variant.simulation_before_compile))
        runtime.forget(variant)
        variant = runtime.variants[key] = self._alternate(runtime, variant, values, key)
        return variant

    def _compile(self, variant: GraphVariant, values: Sequence[Any], afresh: bool = False,
                 exact: bool = False) -> bool:
        """Compile ``variant``, walk its code and teach its profile (``afresh``, ``exact``: see :meth:`_teach`);
        False where the walk cannot read the code."""
        variant.rewritten.compile(values)  # nothing to do for a partition compiled before
        variant.checked = True
        memory = variant.rewritten.memory_for(variant.uses)
        if memory is not None:
            self._teach(variant, memory, afresh, exact)
        return memory is not None

    def _alternate(self, runtime: GraphRuntime, over: GraphVariant, values: Sequence[Any],
                   key: tuple) -> GraphVariant:
        """The first alternate (:meth:`_alternates`) whose wrapper code, then whose compiled code, fits the
        budget, compiled; none fitting, BudgetError with the lowest peak read back."""
        budget, lowest = over.budget, Candidate(over.plan, over.simulation)
        searched, now = self._searched(runtime, over, values, key)
        # plans of one partition: one code (``over``'s read compiled, or without its kernels where it was not built)
        walked = {_partition(over.rewritten): over.rewritten.memory_without_kernels(values, over.uses)}
        for profiled, plan in self._alternates(over, now, searched):
            if searched is not None and profiled is searched.lesson.profiled and plan == searched.plan:
                variant, profile, graph = searched, searched.profile, searched.rewritten
            else:
                variant, profile = None, profiled.untaught_as(over.profile)
                graph = _graph_for(runtime, profiled, profile, plan, over.bound)
            if _partition(graph) not in walked:
                walked[_partition(graph)] = graph.memory_without_kernels(values, over.uses)
            candidate = _read_back(runtime.index, walked[_partition(graph)], profile, plan)
            peak = candidate.simulation.peak_bytes
            if peak <= budget or may_fit_without_guessed_outputs(runtime, peak, profile, budget):
                variant = variant or self.replan(runtime, values, key, False, over.bound, (plan, profiled))
                log.info("sublinear: graph %d: compiling that plan", runtime.index)
                if not self._compile(variant, values, afresh=variant is not searched) or _within(runtime, variant):
                    return variant
                candidate = Candidate(variant.plan, variant.simulation)
            lowest = min(lowest, candidate, key=lambda c: c.simulation.peak_bytes)
        objective = dataclasses.replace(over.objective, memory_budget=budget)
        raise BudgetError(objective, lowest, None, floor=step_floor(over.profile), compiled=True)

    def _searched(self, runtime: GraphRuntime, over: GraphVariant, values: Sequence[Any],
                  key: tuple) -> tuple[GraphVariant | None, Profiled]:
        """The variant planned again on the taught profile, None where no plan there fits the budget or it is
        ``over``'s plan in ``over``'s layout; and the profile the pipeline now plans in: the fallback layout's where
        no plan in ``over``'s fits (a plan kept in the other layout compiles to other code)."""
        profiled = over.lesson.profiled
        try:
            variant = self.replan(runtime, values, key, False, over.bound, None)
        except BudgetError:
            return None, profiled.fallback or profiled
        now = variant.lesson.profiled
        new = variant.plan != over.plan or now.channels_last != profiled.channels_last
        return (variant if new and isinstance(variant.rewritten, CompiledGraph) else None), now

    def _alternates(self, over: GraphVariant, now: Profiled,
                    searched: GraphVariant | None) -> list[tuple[Profiled, Plan]]:
        """The plans to try with their layouts' profiles: those of the layout the pipeline now plans in (``now``),
        then, where ``over``'s layout has a fallback the pipeline has not turned to, the fallback's (the lesson of a
        channels-last plan may leave other channels-last plans under-counted, and a budget below every one of
        them is met as traced)."""
        first = over.lesson.profiled
        layouts = [now] + ([first.fallback] if first.fallback is not None and first.fallback is not now else [])
        pairs: list[tuple[Profiled, Plan]] = []
        for profiled in layouts:
            own = searched.plan if searched is not None and searched.lesson.profiled is profiled else None
            ran = over.plan if profiled.channels_last == first.channels_last else None
            untaught = profiled.untaught_as(over.profile)
            pairs += [(profiled, plan) for plan in _layout_alternates(self.config, over, untaught, own, ran)]
        return pairs

    def _teach(self, variant: GraphVariant, memory: CompiledStepMemory, afresh: bool = False,
               exact: bool = False) -> None:
        """Teach the variant's profile (and the cached profile of its signature) what its compiled code held;
        ``afresh``: teach the profile as it was before any compile check (the lessons of other plans put aside,
        so that the profile predicts this plan as compiled); ``exact``: the variant's peak is the compiled code's
        where that is below the taught profile's (a plan predicted above the budget that compiled within it)."""
        lesson = variant.lesson
        profiled, chunks = lesson.profiled, lesson.chunks
        if afresh:
            profiled.profile = profiled.untaught
        at_chunks = chunks.applied(profiled.profile) if chunks is not None else profiled.profile  # as the variant runs
        forward, backward = trace_by_slot(((p.phase, p.live, p.nodes, p.call) for p in memory.trace),
                                          {name: at_chunks.op_of_node[i] for i, name in enumerate(profiled.node_names)},
                                          profiled.backward_ranks, at_chunks.num_ops,
                                          recompute_ranks(at_chunks, variant.plan))
        at_chunks = taught(at_chunks, variant.plan, forward, backward)
        profiled.profile = chunks.undone(at_chunks) if chunks is not None else at_chunks
        profiled.lessons += 1
        entry = self.plans.load(lesson.disk_key)
        if entry is not None and Plan.from_dict(entry) == variant.plan:
            self.plans.store(lesson.disk_key, {**entry, "costs": costs_of(profiled.profile)})
        variant.note_compiled(memory.peak, dataclasses.replace(at_chunks, sharding=variant.profile.sharding,
                                                                      step_context=variant.profile.step_context),
                              exact)


def _layout_alternates(config: SublinearMemoryConfig, over: GraphVariant, untaught: GraphProfile,
                       searched: Plan | None, ran: Plan | None) -> list[Plan]:
    """The plans to try in one layout, fastest first: ``searched``, the plans within the objective on the
    layout's profile before any lesson (``untaught``), and that profile's plan of the lowest peak, which is
    always tried (where the plans of a budget all hold alike more than predicted, it has the most room below
    the budget); :data:`ALTERNATES` at most, ``ran`` (the plan compiled in this layout, if any) left out."""
    objective = dataclasses.replace(over.objective, memory_budget=over.budget)
    try:
        result = make_plan(untaught, config, memory_budget=over.budget)
    except BudgetError as exc:  # refused after a search for the lowest peak, whose plan the error carries
        fitting, lowest = [], exc.lowest.plan
    else:
        fitting = [c.plan for c in result.candidates if objective.accepts(c)]
        lowest = lowest_plan(untaught, config)
    plans = list(dict.fromkeys(plan for plan in ([searched] if searched else []) + fitting
                               if plan not in (ran, lowest)))
    return plans[:ALTERNATES - (lowest != ran)] + ([lowest] if lowest != ran else [])


def _faster_fitting(runtime: GraphRuntime, variant: GraphVariant, values: Sequence[Any]) -> Plan | None:
    """The fastest of ``variant``'s :attr:`~GraphVariant.faster_above` plans where the wrapper code inductor
    generates for it without building its kernels is within the budget (its profile, before any lesson, predicts it
    at most :data:`UNCERTAINTY` above); None where there is none or it does not fit."""
    if not variant.faster_above:  # none for a plan from the plan cache or a settling one: they have no search
        return None
    faster = variant.faster_above[0]
    graph = _graph_for(runtime, variant.lesson.profiled, variant.profile, faster.plan, variant.bound)
    read = _code_peak(runtime, graph, variant, faster.plan, values)
    if read is None or read[0] > variant.budget:
        return None
    log.info("sublinear: graph %d: a plan faster than the one chosen (time x%.3f against x%.3f), predicted above "
             "the budget of %s, fits it as its wrapper code reads; that plan runs instead", runtime.index,
             faster.simulation.time_ratio, variant.simulation.time_ratio, format_bytes(variant.budget))
    return faster.plan


def _unbuilt_over(runtime: GraphRuntime, variant: GraphVariant,
                  values: Sequence[Any]) -> tuple[int, CompiledStepMemory] | None:
    """The peak and memory of ``variant``'s wrapper code, read without building its kernels, where it is above the
    budget; None where the variant is not judged so or fits. Judged: a first compile whose plan the search predicts
    within :data:`UNCERTAINTY` under the budget, the band where what the memory model leaves out can take the
    compiled step over (a plan from the plan cache is predicted on costs a compile check taught, and is not
    judged)."""
    budget = variant.budget
    if budget is None or variant.settling or variant.summary.from_cache or \
            variant.simulation_before_compile < budget * (1 - UNCERTAINTY):
        return None
    read = _code_peak(runtime, variant.rewritten, variant, variant.plan, values)
    if read is None or read[0] <= budget or may_fit_without_guessed_outputs(runtime, read[0], variant.profile,
                                                                               budget):
        return None
    return read


def _code_peak(runtime: GraphRuntime, graph: CompiledGraph, variant: GraphVariant, plan: Plan,
               values: Sequence[Any]) -> tuple[int, CompiledStepMemory] | None:
    """``plan``'s step peak as the wrapper code inductor generates for ``graph`` holds it, read without building its
    kernels, beside the call's other graphs as ``variant``'s profile predicts them, and that code's memory; None
    where the walk cannot read the code."""
    memory = graph.memory_without_kernels(values, variant.uses)
    if memory is None:
        return None
    return _read_back(runtime.index, memory, variant.profile, plan).simulation.peak_bytes, memory


def faster_above(candidates: Sequence[Candidate], chosen: Simulation, budget: int) -> tuple[Candidate, ...]:
    """The candidates a search found predicted above ``budget`` by at most :data:`UNCERTAINTY` and faster than the
    chosen plan by at least :data:`WORTH_A_READ` of the step, fastest first: such a plan may compile within the
    budget, which its wrapper code tells before its kernels are built."""
    near = [c for c in candidates if budget < c.simulation.peak_bytes <= budget * (1 + UNCERTAINTY)
            and c.simulation.time_ratio <= chosen.time_ratio - WORTH_A_READ]
    return tuple(sorted(near, key=lambda c: (c.simulation.time_ratio, c.simulation.peak_bytes)))


def _graph_for(runtime: GraphRuntime, profiled: Profiled, profile: GraphProfile, plan: Plan,
               bound: Binding) -> CompiledGraph:
    """``plan`` of ``runtime``'s graph as the compiled executor runs it, in ``profiled``'s layout, not compiled yet
    (its wrapper code can be read without building its kernels)."""
    return CompiledGraph(runtime.graph, analyse(profile, plan), profiled.node_names, bound,
                         channels_last=profiled.channels_last)


def _partition(graph: CompiledGraph) -> tuple[int, str, bool]:
    """What decides a planned graph's compiled code: the captured graph, the plan's partition of it and the
    convolutions' layout."""
    return id(graph.graph), graph.partitioner.uuid(), graph.channels_last


def _read_back(index: int, memory: CompiledStepMemory | None, profile: GraphProfile, plan: Plan) -> Candidate:
    """``plan`` with the step's peak as its wrapper code holds it (``memory``, the graph alone), beside the call's
    other graphs as ``profile`` predicts them; the prediction where the walk could not read the code."""
    simulation = simulate(profile, plan)
    if memory is None:
        return Candidate(plan, simulation)
    beside = simulation.peak_bytes - simulate(dataclasses.replace(profile, step_context=None), plan).peak_bytes
    peak = memory.peak + beside
    log.info("sublinear: graph %d: a plan of %d blocks (time x%.3f, predicted %s before compiling) holds %s as "
             "inductor's wrapper code for it reads", index, len(plan.split_points), simulation.time_ratio,
             format_bytes(simulation.peak_bytes), format_bytes(peak))
    return Candidate(plan, dataclasses.replace(simulation, peak_bytes=peak))


def _within(runtime: GraphRuntime, variant: GraphVariant) -> bool:
    """Whether a compiled variant is within its budget, or may be once a call shows what the caller does with its
    outputs (it then settles: see :func:`may_fit_without_guessed_outputs`)."""
    if variant.peak_bytes <= variant.budget:
        return True
    if not may_fit_without_guessed_outputs(runtime, variant.peak_bytes, variant.profile, variant.budget):
        return False
    log.info("sublinear: graph %d as compiled holds %s, above the budget of %s only by outputs guessed held; checked "
             "again once a call shows what the caller does with them", runtime.index,
             format_bytes(variant.peak_bytes), format_bytes(variant.budget))
    variant.settling = True
    return True


def may_fit_without_guessed_outputs(runtime: GraphRuntime, peak: int, profile: GraphProfile, budget: int) -> bool:
    """Whether a step of ``runtime``'s graph peaking at ``peak`` may fit ``budget`` once a call shows what the
    caller does with its outputs: no call has yet, they are guessed held (``profile``'s held outputs), and dropping
    them could take the peak within the budget. Such a variant settles: the call that shows the outputs' uses plans
    and checks its graph again, with the compiled code kept while its plan still meets the objective (one compile
    where the guess was wrong)."""
    if runtime.session.calls.uses_seen(runtime.graph.code):
        return False
    return peak - profile.held_output_bytes <= budget
