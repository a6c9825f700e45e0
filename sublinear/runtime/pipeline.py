"""The plan pipeline of a session: for one graph and call signature, profile → plan → executor, with the caches
that keep each stage's result, and the compile check that reads back what inductor compiled.

**Compile check.** A planned graph compiles at its first call; the compiled forward's and backward's memory is then
walked statement by statement, library calls measured on the device (:mod:`sublinear.execute.compiled.step_memory`).
The profile is taught what the compiled code held, slot by slot (:mod:`sublinear.simulation.calibration`): from then
on it predicts that plan as compiled, and every plan at least as high where the compiler added memory. When the
compiled step is above the memory budget, the plan is searched again on the taught profile (the same budget, never
cut) and compiled again, up to :data:`COMPILED_ROUNDS` times; a budget no compiled plan meets raises
:class:`~sublinear.planners.BudgetError` naming the lowest compiled peak. The taught profile's costs go to the plan
cache with the plan, so a later process predicts the compiled step before compiling.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_leaves

from sublinear.cache import PlanCache, Recent
from sublinear.capture.dynamo import CapturedGraph
from sublinear.capture.joint import JointGraph, JointTraceError, trace_joint
from sublinear.capture.shapes import Binding
from sublinear.config import SublinearMemoryConfig
from sublinear.core.analysis import analyse
from sublinear.core.objective import Candidate, Objective, Simulation
from sublinear.core.plan import Plan
from sublinear.core.profile import GraphProfile, ShardedParameters
from sublinear.core.units import format_bytes
from sublinear.execute.compiled import CompiledGraph
from sublinear.execute.eager import rewrite
from sublinear.planners import BudgetError, PlanningResult, make_plan, objective_for
from sublinear.planners.driver import step_floor
from sublinear.profiling.compiled import profile_joint
from sublinear.profiling.graph import profile
from sublinear.runtime.plans import _summarise
from sublinear.runtime.variant import _Variant
from sublinear.simulation.calibration import taught, trace_by_slot
from sublinear.simulation.timeline import simulate
from sublinear.tensors import device_of

if TYPE_CHECKING:
    from sublinear.runtime.graph import GraphRuntime

__all__ = ["COMPILED_ROUNDS", "PlanPipeline"]

log = logging.getLogger("sublinear")

COMPILED_ROUNDS = 3  # plans searched again on the taught profile when a compiled step is above its budget


@dataclasses.dataclass
class _Profiled:
    """A graph's profile at one signature, with what compiling it needs (the joint graph's forward node names and
    backward ranks; None for the eager executor), and how many times a compile check taught it."""

    profile: GraphProfile
    node_names: tuple[str, ...] | None
    backward_ranks: dict[str, int] | None
    lessons: int = 0


class PlanPipeline:
    """Profiles, plans and executors of one session's graphs (see the module docstring). ``progress`` is told when
    planning starts; ``sharding`` gives FSDP2's layout at planning time."""

    def __init__(self, config: SublinearMemoryConfig, sharding: Callable[[], ShardedParameters | None],
                 progress) -> None:
        self.config = config
        self.sharding = sharding
        self.progress = progress
        self.plans = PlanCache(config.cache_dir)  # this session's plans, then the disk's
        self.profiles = Recent()  # _Profiled by graph, signature, uses, compiler and bound
        self.joints = Recent(8)  # joint graphs by graph, signature and bound (inductor)
        self.compiled_graphs: dict[tuple, CompiledGraph] = {}  # by graph, signature, bound and partition
        self.overrides: dict[str, Plan] = {}  # graph code -> plan chosen by the user (use())
        self.prior_plans: dict[str, Plan] = {}  # graph code -> the plan of its variant forgotten last
        self.eager_only: dict[str, str] = {}  # graph code -> why inductor cannot compile it

    def runs_eagerly(self, code: str) -> bool:
        return code in self.eager_only

    def remember_prior(self, code: str, plan: Plan) -> None:
        self.prior_plans[code] = plan

    def override(self, code: str, plan: Plan) -> None:
        self.overrides[code] = plan

    def graph_codes(self) -> set[str]:
        return self.plans.graph_codes()

    # -- planning -----------------------------------------------------------------------------------------------

    def plan(self, runtime: GraphRuntime, values: Sequence[Any], key: tuple, dry_run: bool,
             bound: Binding) -> _Variant:
        """Profile and plan ``runtime``'s graph for a call with ``values`` (real or fake). Planning draws random
        numbers (measuring op costs) under a forked RNG, so the training's random stream is as in eager, and runs
        outside the caller's dispatch modes (a memory tracker around the step sees the step, not the planning)."""
        from sublinear.runtime.session import collecting_new_objects_only  # noqa: PLC0415

        self.progress.begin()
        devices = sorted({t.device.index or 0 for t in tree_leaves(list(values))
                          if isinstance(t, torch.Tensor) and t.device.type == "cuda"})
        with torch.random.fork_rng(devices=devices, device_type="cuda"), _disable_current_modes(), \
                collecting_new_objects_only():
            try:
                return self._plan(runtime, values, key, dry_run, bound)
            except JointTraceError as exc:
                self.eager_only[runtime.graph.code] = str(exc)
                log.warning("sublinear: graph %d runs on sublinear's eager executor: inductor could not trace its "
                            "forward and backward (%s)", runtime.index, exc)
                return self._plan(runtime, values, key, dry_run, bound)

    def _plan(self, runtime: GraphRuntime, values: Sequence[Any], key: tuple, dry_run: bool,
              bound: Binding) -> _Variant:
        started = time.perf_counter()
        graph, config = runtime.graph, self.config
        context, settled = runtime.session.calls.context_for(runtime, values)
        uses = runtime.session.calls.uses.get(graph.code)
        compiler = runtime.compiler(values)
        profile_key = (graph.code, key, config.cost_model, uses, compiler, tuple(sorted(bound.items())))
        disk_key = PlanCache.key(graph=graph.code, values=key, config=config.planning_key(), context=repr(context),
                                 uses=uses, compiler=compiler, bound=sorted(bound.items()))
        profiled, entry = self._profiled(runtime, values, key, bound, uses, compiler, profile_key, disk_key)
        store_key = (*profile_key, context, repr(sorted(config.planning_key().items())), profiled.lessons)
        profile_ = dataclasses.replace(profiled.profile, sharding=key[-1], step_context=context)
        budget = self.budget_for(runtime, values, dry_run, profile_)
        objective = objective_for(config, budget)
        choice = self._choose(runtime, profile_, objective, entry, store_key, disk_key, settled)
        if not choice.settling:
            self.plans.remember(store_key, (profiled, choice.plan, choice.result))
        return self._variant(runtime, values, (key, disk_key), bound, profiled, profile_, objective, budget, choice,
                             context, time.perf_counter() - started)

    def _profiled(self, runtime: GraphRuntime, values: Sequence[Any], key: tuple, bound: Binding,
                  uses: tuple[str, ...] | None, compiler: str, profile_key: tuple,
                  disk_key: str) -> tuple[_Profiled, dict | None]:
        """The graph's profile at this signature (profiled once per uses, compiler and bound; a compile check's
        lessons kept), and the disk cache's entry for it (None: none that fits)."""
        graph, config = runtime.graph, self.config
        profiled = self.profiles.get(profile_key)
        entry = self.plans.load(disk_key) if graph.code not in self.overrides else None
        at_bound = graph.sizes.stand_ins(values, bound) if bound else values  # profiled at the plan's sizes
        if compiler == "inductor" and profiled is None:
            compiled = profile_joint(self._joint(graph, values, key, bound), graph, uses)
            profiled = _Profiled(compiled.profile, compiled.node_names, compiled.backward_ranks)
        if entry is not None:
            if profiled is None:  # the eager executor's costs come from the entry: no timing runs
                estimated = profile(graph, at_bound, cost_model="estimate", uses=uses)
                entry = self.plans.check(entry, disk_key, estimated.num_ops)
                if entry is not None:
                    profiled = _Profiled(estimated.with_costs(entry["costs"]), None, None)
            else:
                entry = self.plans.check(entry, disk_key, profiled.profile.num_ops)
                if entry is not None and profiled.node_names is not None and not profiled.lessons:
                    profiled.profile = profiled.profile.with_costs(entry["costs"])  # a compile check's lessons
        if entry is not None:
            log.info("sublinear: plan cache hit (%s): search and timing runs skipped", disk_key[:12])
        if profiled is None:
            profiled = _Profiled(profile(graph, at_bound, cost_model=config.cost_model, uses=uses), None, None)
        self.profiles.put(profile_key, profiled)
        return profiled, entry

    def _joint(self, graph: CapturedGraph, values: Sequence[Any], key: tuple, bound: Binding) -> JointGraph:
        """The joint graph inductor partitions for ``graph`` at ``key``'s signature (for a dynamic graph, traced for
        every size, hinted at ``bound``), traced once: profiles for other output uses or contexts read it again."""
        joint_key = (graph.code, key, tuple(sorted(bound.items())))
        joint = self.joints.get(joint_key)
        if joint is None:
            joint = trace_joint(graph, graph.sizes.symbolic_inputs(values, bound)[0] if bound else values)
            self.joints.put(joint_key, joint)
        return joint

    # -- choosing the plan --------------------------------------------------------------------------------------

    def _choose(self, runtime: GraphRuntime, profile_: GraphProfile, objective: Objective, entry: dict | None,
                store_key: tuple, disk_key: str, settled: bool) -> _Choice:
        """The plan to run: the user's (``use()``), this session's or the disk's when it still meets the objective,
        the previous variant's when it does, else a search (stored on disk). Under a budget, a graph of an
        unsettled call that fits no plan yet runs its lowest-peak plan until the earlier graphs are planned for it."""
        code = runtime.graph.code
        cached = self.plans.recall(store_key)
        plan, result = (cached[1], cached[2]) if cached is not None else \
            ((Plan.from_dict(entry), None) if entry is not None else (None, None))
        from_cache = plan is not None and result is None
        eager = simulate(profile_, Plan.no_split(profile_.num_ops))
        prior = self.prior_plans.pop(code, None)
        if code in self.overrides:
            return _Choice(self.overrides[code], None, "use()", False)
        if plan is not None and self._still_best(objective, plan, profile_, eager):
            return _Choice(plan, result, result.origin if result is not None else "cache", from_cache)
        if plan is not None:
            log.info("sublinear: the stored plan for graph %d no longer meets %s; planning again", runtime.index,
                     objective.describe())
        elif prior is not None and prior.split_points[-1] == profile_.num_ops - 1 and \
                self._still_best(objective, prior, profile_, eager):
            # What the latest call showed (its outputs' uses, the other graphs) changed the profile; the plan
            # still meets the objective, and keeping it keeps its compiled code.
            return _Choice(prior, None, "the previous plan, which still meets the objective", False)
        try:
            result = make_plan(profile_, self.config, memory_budget=objective.memory_budget)
        except BudgetError as exc:
            if settled:
                raise
            log.info("sublinear: graph %d does not fit beside the earlier graphs' plans yet; they are planned again "
                     "for it", runtime.index)
            return _Choice(exc.lowest.plan, None, "lowest peak, until the earlier graphs are planned for it", False,
                           settling=True)
        self.plans.store(disk_key, _entry(profile_, result.plan,
                                          [[c.simulation.peak_bytes, c.simulation.time_ratio] for c in result.history]))
        return _Choice(result.plan, result, result.origin, False, searched=True)

    @staticmethod
    def _still_best(objective: Objective, plan: Plan, profile_: GraphProfile, eager: Simulation) -> bool:
        """A stored plan is used when the objective accepts it now and, under a memory budget, it is eager
        whenever eager fits (the least time that fits)."""
        if plan.split_points and plan.split_points[-1] != profile_.num_ops - 1:
            return False
        candidate = Candidate(plan, simulate(profile_, plan))
        if not objective.accepts(candidate):
            return False
        if objective.memory_budget is None:
            return True
        eager_ok = objective.accepts(Candidate(Plan.no_split(profile_.num_ops), eager))
        return not eager_ok or plan.num_blocks == 1

    def _variant(self, runtime: GraphRuntime, values: Sequence[Any], keys: tuple[tuple, str], bound: Binding,
                 profiled: _Profiled, profile_: GraphProfile, objective: Objective, budget: int | None,
                 choice: _Choice, context, seconds: float) -> _Variant:
        graph, plan, (key, disk_key) = runtime.graph, choice.plan, keys
        sim = simulate(profile_, plan)
        if profiled.node_names is not None:
            compiled = CompiledGraph(graph, analyse(profile_, plan), profiled.node_names, bound)
            compiled_key = (graph.code, key, tuple(sorted(bound.items())), compiled.partitioner.uuid())
            rewritten = self.compiled_graphs.setdefault(compiled_key, compiled)  # one compile per partition
        else:
            rewritten = rewrite(graph, profile_, plan)
        result = choice.result
        history = tuple((c.simulation.peak_bytes, c.simulation.time_ratio) for c in result.history) if result else ()
        eager = simulate(profile_, Plan.no_split(profile_.num_ops))
        summary = _summarise(runtime.index, values, graph, profile_, plan, result, sim, eager, choice.origin,
                             objective, seconds, choice.from_cache, history, bound)
        log.info("sublinear: %s %s", "planned" if choice.searched else "reused the plan for", summary)
        return _Variant(profile=profile_, plan=plan, simulation=sim, rewritten=rewritten, summary=summary,
                        auto_budget=self.config.memory_budget == "auto", objective=objective, planned_in=context,
                        uses=profile_.output_uses, budget=budget, settling=choice.settling, bound=bound,
                        lesson=_Lesson(profiled, disk_key))

    # -- budgets ------------------------------------------------------------------------------------------------

    def budget_for(self, runtime: GraphRuntime, values: Sequence[Any], dry_run: bool,
                   profile_: GraphProfile | None = None) -> int | None:
        """The memory budget in bytes for the step (the other graphs of the call are in the profile's context):
        the config's; "auto" on CUDA: the allocator's free and cached memory, less the headroom, plus what is
        already allocated that the step counts (parameters, buffers, inputs, gradients)."""
        budget = self.config.memory_budget
        if budget is None or budget != "auto":
            return budget
        device = device_of(values)
        if device.type != "cuda":
            return None
        return _cuda_auto_budget(device, runtime.graph, values, self.config.memory_headroom, dry_run)

    # -- the compile check --------------------------------------------------------------------------------------

    def compiled_within_budget(self, runtime: GraphRuntime, variant: _Variant, values: Sequence[Any],
                               key: tuple) -> _Variant:
        """Compile a new variant now, read what its compiled code holds, teach its profile; above the budget, plan
        again on the taught profile and compile again (see the module docstring)."""
        lowest: tuple[int, _Variant] | None = None
        for round_ in range(COMPILED_ROUNDS + 1):
            graph = variant.rewritten
            if not isinstance(graph, CompiledGraph) or variant.checked:
                return variant
            graph.compile(values)  # nothing to do for a partition compiled before
            variant.checked = True
            if graph.memory is None:
                return variant
            self._teach(variant, graph)
            if lowest is None or graph.memory.peak < lowest[0]:
                lowest = (graph.memory.peak, variant)
            if variant.budget is None or variant.peak_bytes <= variant.budget:
                return variant
            if round_ == COMPILED_ROUNDS:
                raise _over_budget(lowest[1])
            log.info("sublinear: graph %d as compiled holds %s, above the budget of %s (%s predicted before "
                     "compiling); planning again on what it held", runtime.index, format_bytes(variant.peak_bytes),
                     format_bytes(variant.budget), format_bytes(variant.simulation_before_compile))
            runtime.forget(variant)
            variant = runtime.variants[key] = self.plan(runtime, values, key, False, variant.bound)
        return variant

    def _teach(self, variant: _Variant, graph: CompiledGraph) -> None:
        """Teach the variant's profile (and the cached profile of its signature) what its compiled code held."""
        lesson = variant.lesson
        profiled = lesson.profiled
        memory = graph.memory
        forward, backward = trace_by_slot(((p.phase, p.live, p.nodes) for p in memory.trace),
                                          {name: profiled.profile.op_of_node[i]
                                           for i, name in enumerate(profiled.node_names)},
                                          profiled.backward_ranks, profiled.profile.num_ops)
        profiled.profile = taught(profiled.profile, variant.plan, forward, backward)
        profiled.lessons += 1
        entry = self.plans.load(lesson.disk_key)
        if entry is not None and Plan.from_dict(entry) == variant.plan:
            self.plans.store(lesson.disk_key, {**entry, "costs": profiled.profile.costs()})
        variant.note_compiled(memory.peak, dataclasses.replace(profiled.profile, sharding=variant.profile.sharding,
                                                                step_context=variant.profile.step_context))


@dataclasses.dataclass(frozen=True)
class _Choice:
    plan: Plan
    result: PlanningResult | None
    origin: str
    from_cache: bool
    settling: bool = False
    searched: bool = False


@dataclasses.dataclass(frozen=True)
class _Lesson:
    """What a compile check needs to teach a variant's profile: the profile's record, and the plan cache entry
    that keeps what it learns."""

    profiled: _Profiled
    disk_key: str


def _entry(profile_: GraphProfile, plan: Plan, history: list) -> dict:
    """A plan cache entry: the plan, its search history and the profile's costs (a compile check's lessons in)."""
    return {"num_ops": profile_.num_ops, **plan.as_dict(), "costs": profile_.costs(), "history": history}


def _over_budget(variant: _Variant) -> BudgetError:
    """The error for a compiled step no plan searched fits: the lowest compiled peak found, for the budget asked."""
    objective = dataclasses.replace(variant.objective, memory_budget=variant.budget)
    return BudgetError(objective, Candidate(variant.plan, variant.simulation), None, floor=step_floor(variant.profile),
                       compiled=True)


def _cuda_auto_budget(device: torch.device, graph: CapturedGraph, values: Sequence[Any], headroom: float,
                      dry_run: bool) -> int:
    free, _total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    resident: dict[int, int] = {}
    for kind, v in zip(graph.kinds, values):
        if not isinstance(v, torch.Tensor):
            continue
        real = not isinstance(v, torch._subclasses.fake_tensor.FakeTensor)
        if real or (dry_run and kind in ("parameter", "buffer")):  # a dry run's model lives on the device
            st = v.untyped_storage()
            resident[st._cdata if real else id(v)] = st.nbytes()
            if real and v.grad is not None:
                resident[v.grad.untyped_storage()._cdata] = v.grad.untyped_storage().nbytes()
    return int((free + cached) * (1 - headroom)) + sum(resident.values())
