"""The compile check: what inductor compiled for a planned graph, read back and taught to its profile.

A planned graph compiles at its first call; the compiled forward's and backward's memory is then walked statement
by statement, library calls measured on the device (:mod:`sublinear.execute.compiled.step_memory`). The profile is
taught what the compiled code held, slot by slot (:mod:`sublinear.simulation.calibration`): from then on it predicts
that plan as compiled, and every plan at least as high where the compiler added memory. When the compiled step is
above the memory budget, the plan is searched again on the taught profile (the same budget, never cut) and compiled
again, up to :data:`COMPILED_ROUNDS` times (where the taught profile has no plan within the budget, the plan of
the lowest peak on the profile before any lesson is compiled and measured); a budget no compiled plan meets raises
:class:`~sublinear.planners.BudgetError` naming the lowest compiled peak. The taught profile's costs go to the plan
cache with the plan, so a later process predicts the compiled step before compiling.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from sublinear.cache import PlanCache
from sublinear.capture.shapes import Binding
from sublinear.core.objective import Candidate
from sublinear.core.plan import Plan
from sublinear.core.profile import GraphProfile, costs_of
from sublinear.core.units import format_bytes
from sublinear.execute.compiled import CompiledGraph, CompiledStepMemory
from sublinear.planners import BudgetError
from sublinear.planners.driver import step_floor
from sublinear.runtime.head_chunks import HeadChunks
from sublinear.runtime.variant import GraphVariant
from sublinear.simulation.calibration import recompute_ranks, taught, trace_by_slot

if TYPE_CHECKING:
    from sublinear.runtime.graph import GraphRuntime

__all__ = ["COMPILED_ROUNDS", "CompileCheck", "Lesson", "Profiled", "may_fit_without_guessed_outputs"]

log = logging.getLogger("sublinear")

COMPILED_ROUNDS = 3  # plans searched again on the taught profile when a compiled step is above its budget


@dataclasses.dataclass
class Profiled:
    """A graph's profile at one signature, with what compiling it needs (the joint graph's forward node names and
    backward ranks; None for the eager executor), how many times a compile check taught it, and the profile as it
    was before (``untaught``)."""

    profile: GraphProfile
    node_names: tuple[str, ...] | None
    backward_ranks: dict[str, int] | None
    lessons: int = 0
    untaught: GraphProfile = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.untaught = self.profile


@dataclasses.dataclass(frozen=True)
class Lesson:
    """What a compile check needs to teach a variant's profile: the profile's record, and the plan cache entry
    that keeps what it learns."""

    profiled: Profiled
    disk_key: str
    chunks: HeadChunks | None = None  # the LM heads' chunks the variant runs (its profile: the profiled's, applied)


class CompileCheck:
    """Compiles new variants and teaches their profiles what the compiled code held (see the module docstring).
    ``replan(runtime, values, key, dry_run, bound, lowest)`` plans a signature again on the taught profile, or,
    with ``lowest``, for the lowest peak on the profile before it was taught."""

    def __init__(self, plans: PlanCache,
                 replan: Callable[[GraphRuntime, Sequence[Any], tuple, bool, Binding, bool], GraphVariant]) -> None:
        self.plans = plans
        self.replan = replan

    def within_budget(self, runtime: GraphRuntime, variant: GraphVariant, values: Sequence[Any],
                      key: tuple) -> GraphVariant:
        """Compile a new variant now, read what its compiled code holds, teach its profile; above the budget, plan
        again on the taught profile and compile again."""
        lowest: tuple[int, GraphVariant] | None = None
        tried_lowest = False
        for round_ in range(COMPILED_ROUNDS + 1):
            graph = variant.rewritten
            if not isinstance(graph, CompiledGraph) or variant.checked:
                return variant
            graph.compile(values)  # nothing to do for a partition compiled before
            variant.checked = True
            memory = graph.memory_for(variant.uses)
            if memory is None:
                return variant
            self._teach(variant, memory, tried_lowest)
            if lowest is None or memory.peak < lowest[0]:
                lowest = (memory.peak, variant)
            if variant.budget is None or variant.settling or variant.peak_bytes <= variant.budget:
                return variant  # settling: over the budget until the call's other graphs are planned for it
            if may_fit_without_guessed_outputs(runtime, variant.peak_bytes, variant.profile, variant.budget):
                log.info("sublinear: graph %d as compiled holds %s, above the budget of %s only by outputs guessed "
                         "held; checked again once a call shows what the caller does with them", runtime.index,
                         format_bytes(variant.peak_bytes), format_bytes(variant.budget))
                variant.settling = True
                return variant
            if round_ == COMPILED_ROUNDS or tried_lowest:
                raise _over_budget(lowest[1])
            log.info("sublinear: graph %d as compiled holds %s, above the budget of %s (%s predicted before "
                     "compiling); planning again on what it held", runtime.index, format_bytes(variant.peak_bytes),
                     format_bytes(variant.budget), format_bytes(variant.simulation_before_compile))
            runtime.forget(variant)
            bound = variant.bound
            try:
                variant = self.replan(runtime, values, key, False, bound, False)
            except BudgetError:
                # What a compiled plan held beyond its simulation is taught to every plan at that op or rank, also
                # where it came from that plan's own recompute: the taught profile may find no plan where the
                # lowest plan, compiled, fits. That plan is compiled and measured before the budget is refused.
                log.info("sublinear: graph %d: no plan searched on what the compiled code held is within the "
                         "budget; compiling the plan of the lowest peak before compiling", runtime.index)
                tried_lowest = True
                variant = self.replan(runtime, values, key, False, bound, True)
            runtime.variants[key] = variant
        return variant

    def _teach(self, variant: GraphVariant, memory: CompiledStepMemory, afresh: bool = False) -> None:
        """Teach the variant's profile (and the cached profile of its signature) what its compiled code held;
        ``afresh``: teach the profile as it was before any compile check (the lessons of other plans put aside,
        so that the profile predicts this plan as compiled)."""
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
                                                                      step_context=variant.profile.step_context))


def may_fit_without_guessed_outputs(runtime: GraphRuntime, peak: int, profile: GraphProfile, budget: int) -> bool:
    """Whether a step of ``runtime``'s graph peaking at ``peak`` may fit ``budget`` once a call shows what the
    caller does with its outputs: no call has yet, they are guessed held (``profile``'s held outputs), and dropping
    them could take the peak within the budget. Such a variant settles: the call that shows the outputs' uses plans
    and checks its graph again, with the compiled code kept while its plan still meets the objective (one compile
    where the guess was wrong)."""
    if runtime.session.calls.uses_seen(runtime.graph.code):
        return False
    return peak - profile.held_output_bytes <= budget


def _over_budget(variant: GraphVariant) -> BudgetError:
    """The error for a compiled step no plan searched fits: the lowest compiled peak found, for the budget asked."""
    objective = dataclasses.replace(variant.objective, memory_budget=variant.budget)
    return BudgetError(objective, Candidate(variant.plan, variant.simulation), None, floor=step_floor(variant.profile),
                       compiled=True)
