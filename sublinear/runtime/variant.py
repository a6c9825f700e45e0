"""A graph planned for one call signature: its profile, plan, simulation and what runs it."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any

from sublinear.capture.shapes import Binding
from sublinear.core.objective import Candidate, Objective, Simulation
from sublinear.core.plan import Plan
from sublinear.core.profile import GraphProfile, StepContext
from sublinear.execute.compiled import CompiledGraph
from sublinear.execute.eager import RewrittenGraph
from sublinear.runtime.plans import GraphPlan
from sublinear.simulation.timeline import OwnTimeline, own_timeline, peak_beside, simulate, simulate_beside


@dataclass
class GraphVariant:
    """A graph planned for one call signature; ``profile`` carries the step context it is simulated in. Once its
    compiled code is read back (``checked``), ``profile`` is the profile taught what it held, so ``simulation``
    is the compiled step's; ``simulation_before_compile`` keeps the prediction made before compiling."""

    profile: GraphProfile
    plan: Plan
    simulation: Simulation
    rewritten: RewrittenGraph | CompiledGraph
    summary: GraphPlan
    auto_budget: bool
    objective: Objective
    planned_in: StepContext | None  # the context the plan was searched in
    uses: tuple[str, ...]  # what the profiled step did with each output
    budget: int | None  # the memory budget the step must fit
    settling: bool = False  # the lowest peak taken while the call's other graphs were not planned for this one
    stuck: bool = False  # settling at the same plan as at the last call: the others planned for it made no room
    bound: Binding = field(default_factory=dict)  # a dynamic graph's sizes its plan was made for (and serves below)
    checked: bool = False  # compiled, and what the compiled code holds read back
    lesson: Any = None  # what the compile check needs to teach the profile (the pipeline's record)
    simulation_before_compile: int = 0  # the plan's peak as predicted before any compile (0: simulation's)
    faster_above: tuple[Candidate, ...] = ()  # plans the search found faster, predicted a little above the budget
    held_below_prediction: int = 0  # what the compiled code holds under the taught prediction, where it is judged

    def __post_init__(self) -> None:
        self.simulation_before_compile = self.simulation_before_compile or self.simulation.peak_bytes

    @property
    def peak_bytes(self) -> int:
        """The predicted peak: simulated, and once compiled, as the compiled code holds memory (the taught profile
        never predicts less than it, and where the plan is judged by its code, less what its code holds under it)."""
        return self.simulation.peak_bytes - self.held_below_prediction

    def set_context(self, context: StepContext | None, eager_context: StepContext | None) -> None:
        """Simulate the plan beside the call's other graphs as ``context`` says, and (for the report) eager beside
        the other graphs unplanned as ``eager_context`` says: eager's peak is the same whatever the plans."""
        self.profile = dataclasses.replace(self.profile, step_context=context)
        self.simulation = (simulate_beside(self.profile, self._own_timeline, self.simulation) if self.profile.num_ops
                           else simulate(self.profile, self.plan))
        self.summary = dataclasses.replace(self.summary, predicted_peak_bytes=self.peak_bytes,
                                           baseline_peak_bytes=self.peak_beside(eager_context, eager=True))

    @functools.cached_property
    def eager_held(self) -> int:
        """What the graph would hold after its forward unplanned (its own storages: no context changes it)."""
        alone = dataclasses.replace(self.profile, step_context=None)
        return simulate(alone, Plan.no_split(alone.num_ops)).held_after_forward_bytes

    def peak_beside(self, context: StepContext | None, eager: bool = False) -> int:
        """The step's predicted peak with the call's other graphs as ``context`` says, under the plan or, with
        ``eager``, unplanned; the graph's own timeline is simulated once for every context."""
        profile = dataclasses.replace(self.profile, step_context=context)
        if profile.num_ops == 0:
            return simulate(profile, self.plan).peak_bytes
        return peak_beside(profile, self._eager_timeline if eager else self._own_timeline)

    def outputs_held_after_forward(self, eager: bool = False) -> tuple[bool, ...]:
        """Per tensor output: whether the graph itself still holds its storage when backward starts (autograd saved
        it, or the call holds it to the end), under the plan or, with ``eager``, unplanned."""
        storages = self.profile.output_storages
        if self.profile.num_ops == 0 or len(storages) != len(self.uses):  # unknown: not held (counted by readers)
            return (False,) * len(self.uses)
        held = (self._eager_timeline if eager else self._own_timeline).held_storages
        return tuple(bool(s >= 0 and held[s]) for s in storages)

    @functools.cached_property
    def _own_timeline(self) -> OwnTimeline:
        return own_timeline(self.profile, self.plan)

    @functools.cached_property
    def _eager_timeline(self) -> OwnTimeline:
        return own_timeline(self.profile, Plan.no_split(self.profile.num_ops))

    def note_compiled(self, peak_alone: int, taught: GraphProfile, judged_by_code: bool = False) -> None:
        """The compiled code holds ``peak_alone`` at its peak in a step of this graph alone; ``taught`` is the
        profile taught what it held (in this variant's context). ``judged_by_code``: the variant's peak is the
        code's where the taught profile predicts more (lessons only raise a profile's bytes)."""
        self.__dict__.pop("_own_timeline", None)  # taught: the graph's own bytes changed
        self.__dict__.pop("_eager_timeline", None)
        self.profile = taught
        self.simulation = simulate(taught, self.plan)
        if judged_by_code:
            alone = simulate(dataclasses.replace(taught, step_context=None), self.plan).peak_bytes
            self.held_below_prediction = max(0, alone - peak_alone)
        self.summary = dataclasses.replace(self.summary, predicted_peak_bytes=self.peak_bytes,
                                           compiled_peak_bytes=peak_alone,
                                           predicted_before_compile_bytes=self.simulation_before_compile)

    @property
    def accepted(self) -> bool:
        peak = dataclasses.replace(self.simulation, peak_bytes=self.peak_bytes)
        return self.objective.accepts(Candidate(self.plan, peak))
