"""The plan pipeline of a session: for one graph and call signature, profile → plan → executor, with the caches
that keep each stage's result. A new variant's compiled code is checked against the memory budget by
:class:`~sublinear.runtime.compile_check.CompileCheck`, which teaches the cached profile what it held.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_leaves

from sublinear.cache import PlanCache, Recent
from sublinear.capture.dynamo import CapturedGraph
from sublinear.capture.joint import JointGraph, JointTraceError, trace_joint
from sublinear.capture.lm_head import with_chunk_rows
from sublinear.capture.lm_head_op import LINEAR_CROSS_ENTROPY, chunked_linear_cross_entropy
from sublinear.capture.shapes import Binding
from sublinear.config import SublinearMemoryConfig
from sublinear.core.analysis import analyse, keeping
from sublinear.core.objective import Candidate, Objective, Simulation
from sublinear.core.plan import Plan
from sublinear.core.profile import GraphProfile, costs_of, with_costs
from sublinear.execute.compiled import CompiledGraph
from sublinear.execute.eager import RewrittenGraph, rewrite
from sublinear.planners import BudgetError, PlanningResult, make_plan, objective_for
from sublinear.profiling.compiled import CompiledProfile, profile_compiled_step
from sublinear.profiling.graph import profile
from sublinear.runtime.calls import upcoming_context
from sublinear.runtime.compile_check import (
    CompileCheck, Lesson, Profiled, faster_above, may_fit_without_guessed_outputs,
)
from sublinear.runtime.head_chunks import HeadChunks, grown_head_chunks
from sublinear.runtime.plans import summarise_plan
from sublinear.runtime.variant import GraphVariant
from sublinear.simulation.timeline import simulate
from sublinear.tensors import device_of

if TYPE_CHECKING:
    from sublinear.runtime.graph import GraphRuntime

__all__ = ["PlanPipeline", "Prior"]

log = logging.getLogger("sublinear")


class PlanPipeline:
    """Profiles, plans and executors of one session's graphs (see the module docstring). ``progress`` is told when
    planning starts."""

    def __init__(self, config: SublinearMemoryConfig, progress) -> None:
        self.config = config
        self.progress = progress
        self.plans = PlanCache(config.cache_dir)  # this session's plans, then the disk's
        self.profiles = _Profiles(config, self.plans)
        self.executors = _Executors()
        self.choices = _Choices(config, self.plans)
        self.eager_only: dict[str, str] = {}  # graph code -> why inductor cannot compile it
        self.compile_check = CompileCheck(self.plans, config, self.plan)

    def graph_codes(self) -> set[str]:
        return self.plans.graph_codes()

    # -- planning -----------------------------------------------------------------------------------------------

    def plan(self, runtime: GraphRuntime, values: Sequence[Any], key: tuple, dry_run: bool,
             bound: Binding, fixed: tuple[Plan, Profiled] | None = None) -> GraphVariant:
        """Profile and plan ``runtime``'s graph for a call with ``values`` (real or fake). Planning draws random
        numbers (measuring op costs) under a forked RNG, so the training's random stream is as in eager, and runs
        outside the caller's dispatch modes (a memory tracker around the step sees the step, not the planning).
        ``fixed``: run that plan in that profile's layout, which the compile check chose on the profile as it was
        before it taught it."""
        from sublinear.runtime.session import collecting_new_objects_only  # noqa: PLC0415

        self.progress.begin()
        devices = sorted({t.device.index or 0 for t in tree_leaves(list(values))
                          if isinstance(t, torch.Tensor) and t.device.type == "cuda"})
        with torch.random.fork_rng(devices=devices, device_type="cuda"), _disable_current_modes(), \
                collecting_new_objects_only():
            try:
                return self._plan(runtime, values, key, dry_run, bound, fixed)
            except JointTraceError as exc:
                self.eager_only[runtime.graph.code] = str(exc)
                log.warning("sublinear: graph %d runs on sublinear's eager executor: inductor could not trace its "
                            "forward and backward (%s)", runtime.index, exc)
                return self._plan(runtime, values, key, dry_run, bound, fixed)

    def _plan(self, runtime: GraphRuntime, values: Sequence[Any], key: tuple, dry_run: bool,
              bound: Binding, fixed: tuple[Plan, Profiled] | None = None) -> GraphVariant:
        started = time.perf_counter()
        graph, config = runtime.graph, self.config
        context, settled = upcoming_context(runtime.session.calls, runtime, values)
        uses = runtime.session.calls.uses.get(graph.code)
        compiler, why_eager = runtime.compiler(values)
        executor = "inductor" if compiler == "inductor" else f"sublinear's eager executor ({why_eager})"
        profile_key = (graph.code, key, config.cost_model, uses, compiler, tuple(sorted(bound.items())))
        disk_key = PlanCache.key(graph=graph.code, values=key, config=config.planning_key(), context=repr(context),
                                 uses=uses, compiler=compiler, bound=sorted(bound.items()))
        entry = self.plans.load(disk_key) if not self.choices.overridden(graph.code) else None
        budget = self.budget_for(runtime, values, dry_run)
        profiled, entry = self.profiles.lookup(graph, values, key, bound, uses, compiler, profile_key, disk_key, entry,
                                               budget is not None)
        chosen = fixed[0] if fixed is not None else None
        if fixed is not None:  # the layout the compile check chose the plan in is the one planned in from now on
            profiled = fixed[1]
            self.profiles.profiled.put(profile_key, profiled)
        # not keyed by the profile's lessons: a plan remembered before a compile check taught the profile is reused
        # only while it meets the objective on the taught profile (a graph captured again keeps its compiled code)
        store_key = (*profile_key, context, repr(sorted(config.planning_key().items())))
        # a plan the compile check chose is predicted and (by the compile check) taught on the profile before any
        # lesson, as it was chosen
        profile_ = dataclasses.replace(profiled.untaught if chosen is not None else profiled.profile,
                                       sharding=key[-1], step_context=context)
        objective = objective_for(config, budget)
        if chosen is not None:  # stored, so that a later process reuses it (its compile check teaches its costs)
            self.plans.store(disk_key, _entry(profile_, chosen, [], profiled.channels_last))
            choice = _Choice(chosen, None, "the compile check: the fastest plan tried whose compiled code is within "
                             "the budget", False, searched=True)
        else:
            try:
                choice = self.choices.choose(runtime, profile_, objective, entry, (store_key, disk_key, key, bound),
                                             settled, profiled)
            except BudgetError:
                if profiled.fallback is None:
                    raise
                log.info("sublinear: no plan of graph %d with channels-last convolutions meets %s; planning it with "
                         "the layouts as traced", runtime.index, objective.describe())
                self.profiles.profiled.put(profile_key, profiled.fallback)
                return self._plan(runtime, values, key, dry_run, bound)
        if not choice.settling:
            self.plans.remember(store_key, (profiled, choice.plan, choice.result))
        chunks = None if chosen is not None or choice.settling else \
            self._head_chunks(graph, values, key, bound, profiled, profile_, choice, budget)
        return self._variant(runtime, values, (key, disk_key), bound, profiled, profile_, objective, budget, choice,
                             context, time.perf_counter() - started, executor, chunks)

    def _head_chunks(self, graph: CapturedGraph, values: Sequence[Any], key: tuple, bound: Binding,
                     profiled: Profiled, profile_: GraphProfile, choice: _Choice,
                     budget: int | None) -> HeadChunks | None:
        """The chunked LM heads' chunks grown into the memory the plan leaves under the budget
        (:mod:`sublinear.runtime.head_chunks`); a kept prior's, whose compiled code runs them."""
        if choice.prior is not None:
            return choice.prior.chunks
        if budget is None or not any(head.chunked for head in graph.lm_heads):
            return None
        if profiled.node_names is None:  # the eager executor's profile: the captured graph's nodes
            nodes, target = list(graph.graph_module.graph.nodes), chunked_linear_cross_entropy
        else:  # inductor's: the joint graph's forward
            nodes, target = self.profiles.joint(graph, values, key, bound).forward, LINEAR_CROSS_ENTROPY
        op_of_node = profile_.op_of_node
        head_ops = [op_of_node[i] for i, node in enumerate(nodes) if node.target is target and i in op_of_node]
        return grown_head_chunks(graph.lm_heads, head_ops, profile_, choice.plan, budget, graph.sizes, bound)

    def _variant(self, runtime: GraphRuntime, values: Sequence[Any], keys: tuple[tuple, str], bound: Binding,
                 profiled: Profiled, profile_: GraphProfile, objective: Objective, budget: int | None,
                 choice: _Choice, context, seconds: float, executor: str, chunks: HeadChunks | None) -> GraphVariant:
        graph, plan, (key, disk_key) = runtime.graph, choice.plan, keys
        if chunks is not None:
            graph, profile_ = with_chunk_rows(graph, chunks.rows), chunks.applied(profile_)
        sim = simulate(profile_, plan)
        rewritten = self.executors.for_plan(graph, key, bound, profiled, profile_, plan, choice.prior)
        result = choice.result
        history = tuple((c.simulation.peak_bytes, c.simulation.time_ratio) for c in result.history) if result else ()
        eager = simulate(profile_, Plan.no_split(profile_.num_ops))
        summary = summarise_plan(runtime.index, values, graph, profile_, plan, result, sim, eager, choice.origin,
                                 objective, seconds, choice.from_cache, history, bound)
        summary = dataclasses.replace(summary, executor=executor)
        log.info("sublinear: %s %s", "planned" if choice.searched else "reused the plan for", summary)
        return GraphVariant(profile=profile_, plan=plan, simulation=sim, rewritten=rewritten, summary=summary,
                            auto_budget=self.config.memory_budget == "auto", objective=objective, planned_in=context,
                            uses=profile_.output_uses, budget=budget, settling=choice.settling, stuck=choice.stuck,
                            bound=bound, lesson=Lesson(profiled, disk_key, chunks),
                            simulation_before_compile=_before_compiling(profiled, profile_, plan, sim, chunks),
                            faster_above=() if chunks is not None or result is None or budget is None else
                            faster_above(result.candidates, sim, budget))

    # -- budgets ------------------------------------------------------------------------------------------------

    def budget_for(self, runtime: GraphRuntime, values: Sequence[Any], dry_run: bool) -> int | None:
        """The memory budget in bytes for a step of ``runtime``'s graph (:func:`_memory_budget`)."""
        return _memory_budget(self.config, runtime.graph, values, dry_run)

    # -- the compile check --------------------------------------------------------------------------------------

    def compiled_within_budget(self, runtime: GraphRuntime, variant: GraphVariant, values: Sequence[Any],
                               key: tuple) -> GraphVariant:
        """``variant`` compiled, its profile taught what the compiled code held, planned again while above the
        budget (:class:`~sublinear.runtime.compile_check.CompileCheck`). Outside the caller's dispatch modes, as
        planning is: a memory tracker around the first call sees the step, not the kernels measured for the check."""
        with _disable_current_modes():
            return self.compile_check.within_budget(runtime, variant, values, key)


class _Profiles:
    """Each graph's profile by signature, uses, compiler and bound, profiled once (a compile check's lessons kept),
    and the joint graphs inductor partitions, traced once per graph, signature and bound."""

    def __init__(self, config: SublinearMemoryConfig, plans: PlanCache) -> None:
        self.config = config
        self.plans = plans
        self.profiled = Recent()  # Profiled by graph, signature, uses, compiler and bound
        self.joints = Recent(8)  # joint graphs by graph, signature and bound (inductor)

    def lookup(self, graph: CapturedGraph, values: Sequence[Any], key: tuple, bound: Binding,
               uses: tuple[str, ...] | None, compiler: str, profile_key: tuple, disk_key: str,
               entry: dict | None, budgeted: bool) -> tuple[Profiled, dict | None]:
        """The graph's profile at this signature (``budgeted``: under a memory budget), and the disk cache's
        ``entry`` for it when it still fits the profile (else None). An entry planned in the fallback layout (no
        plan in the first met the budget) takes the fallback's profile; one of another layout is planned again."""
        config = self.config
        profiled = self.profiled.get(profile_key)
        at_bound = graph.sizes.stand_ins(values, bound) if bound else values  # profiled at the plan's sizes
        if compiler == "inductor" and profiled is None:
            profiled = _profiled(profile_compiled_step(self.joint(graph, values, key, bound), graph, uses,
                                                       config.channels_last, budgeted))
        if entry is not None and profiled is not None and entry.get("channels_last") != profiled.channels_last:
            fallback = profiled.fallback
            profiled, entry = (fallback, entry) if fallback is not None and \
                entry.get("channels_last") == fallback.channels_last else (profiled, None)
        if entry is not None:
            if profiled is None:  # the eager executor's costs come from the entry: no timing runs
                estimated = profile(graph, at_bound, cost_model="estimate", uses=uses)
                entry = self.plans.check(entry, disk_key, estimated.num_ops)
                if entry is not None:
                    profiled = Profiled(with_costs(estimated, entry["costs"]), None, None)
            else:
                entry = self.plans.check(entry, disk_key, profiled.profile.num_ops)
                if entry is not None and profiled.node_names is not None and not profiled.lessons:
                    profiled.profile = with_costs(profiled.profile, entry["costs"])  # a compile check's lessons
        if entry is not None:
            log.info("sublinear: plan cache hit (%s): search and timing runs skipped", disk_key[:12])
        if profiled is None:
            profiled = Profiled(profile(graph, at_bound, cost_model=config.cost_model, uses=uses), None, None)
        self.profiled.put(profile_key, profiled)
        return profiled, entry

    def joint(self, graph: CapturedGraph, values: Sequence[Any], key: tuple, bound: Binding) -> JointGraph:
        """The joint graph inductor partitions for ``graph`` at ``key``'s signature (for a dynamic graph, traced for
        every size, hinted at ``bound``), traced once: profiles for other output uses or contexts read it again."""
        joint_key = (graph.code, key, tuple(sorted(bound.items())))
        joint = self.joints.get(joint_key)
        if joint is None:
            joint = trace_joint(graph, graph.sizes.symbolic_inputs(values, bound)[0] if bound else values)
            self.joints.put(joint_key, joint)
        return joint


class _Executors:
    """What runs each plan: inductor's code for a graph profiled from its joint graph, compiled once per graph,
    signature, bound, partition and convolution layout (variants with the same partition and layout share it); else
    sublinear's eager executor."""

    def __init__(self) -> None:
        self.compiled: dict[tuple, CompiledGraph] = {}  # by graph, signature, bound, partition, heads and layout

    def for_plan(self, graph: CapturedGraph, key: tuple, bound: Binding, profiled: Profiled, profile_: GraphProfile,
                 plan: Plan, prior: Prior | None = None) -> RewrittenGraph | CompiledGraph:
        """``prior``: the graph's variant forgotten last, when its plan is kept. Its compiled code is kept too: the
        plan's partition differs only where the outputs' uses or the step's context changed, and the compile
        check walks that code under the new uses (planning again if it is above the budget)."""
        if profiled.node_names is None:
            return rewrite(graph, profile_, plan)
        if prior is not None and prior.keeps_code(key, bound, profiled.channels_last):
            return prior.rewritten
        compiled = CompiledGraph(graph, analyse(profile_, plan), profiled.node_names, bound,
                                 channels_last=profiled.channels_last)
        compiled_key = (graph.code, key, tuple(sorted(bound.items())), compiled.partitioner.uuid(),
                        tuple(head.rows for head in graph.lm_heads), profiled.channels_last)
        return self.compiled.setdefault(compiled_key, compiled)


class _Choices:
    """Which plan a graph runs: the user's (``use()``), a remembered one, its forgotten variant's, or a search."""

    def __init__(self, config: SublinearMemoryConfig, plans: PlanCache) -> None:
        self.config = config
        self.plans = plans
        self.overrides: dict[str, Plan] = {}  # graph code -> plan chosen by the user (use())
        self.priors: dict[str, Prior] = {}  # graph code -> its variant forgotten last

    def remember_prior(self, code: str, prior: Prior) -> None:
        self.priors[code] = prior

    def override(self, code: str, plan: Plan) -> None:
        self.overrides[code] = plan

    def overridden(self, code: str) -> bool:
        return code in self.overrides

    def choose(self, runtime: GraphRuntime, profile_: GraphProfile, objective: Objective, entry: dict | None,
               keys: tuple[tuple, str, tuple, Binding], settled: bool, profiled: Profiled) -> _Choice:
        """The plan to run: the user's (``use()``), this session's or the disk's when it still meets the objective,
        the previous variant's when it does, else a search (stored on disk). Under a budget, a graph of an
        unsettled call that fits no plan yet runs its lowest-peak plan until the call's other graphs are planned for
        it, as does one whose outputs are guessed held (no call has shown what the caller does with them) where
        dropping them could bring the lowest peak within the budget; one with a fallback layout raises the
        ``BudgetError`` at once, for the fallback to be planned."""
        code, (store_key, disk_key, key, bound) = runtime.graph.code, keys
        cached = self.plans.recall(store_key)
        plan, result = (cached[1], cached[2]) if cached is not None else \
            ((Plan.from_dict(entry), None) if entry is not None else (None, None))
        from_cache = plan is not None and result is None
        eager = simulate(profile_, Plan.no_split(profile_.num_ops))
        prior = self.priors.pop(code, None)
        if prior is not None and not prior.laid_out_as(profiled.channels_last):
            self.priors[code] = prior  # kept for the other layout's round, which a BudgetError here starts
            prior = None
        if code in self.overrides:
            return _Choice(self.overrides[code], None, "use()", False)
        if plan is not None and _still_best(objective, plan, profile_, eager):
            return _Choice(plan, result, result.origin if result is not None else "cache", from_cache)
        if plan is not None:
            log.info("sublinear: the stored plan for graph %d no longer meets %s; planning again", runtime.index,
                     objective.describe())
        elif prior is not None and prior.plan.split_points[-1] == profile_.num_ops - 1:
            # What the latest call showed (its outputs' uses, the other graphs) changed the profile; the plan (as its
            # compiled code, which is kept, runs under the new profile) still meets the objective.
            at_chunks = prior.chunks.applied(profile_) if prior.chunks else profile_
            kept = prior.running(at_chunks, key, bound, profiled.channels_last)
            if _still_best(objective, kept, at_chunks, eager):
                return _Choice(kept, None, "the previous plan, which still meets the objective", False, prior=prior)
        try:
            result = make_plan(profile_, self.config, memory_budget=objective.memory_budget)
        except BudgetError as exc:
            context = profile_.step_context
            below_floor = context is not None and exc.budget < context.floor_bytes  # no plan of any graph helps
            if profiled.fallback is not None or below_floor or \
                    (settled and not may_fit_without_guessed_outputs(runtime, exc.smallest, profile_, exc.budget)):
                raise
            until = ("a call shows whether the caller keeps the outputs it is guessed to hold" if settled else
                     "the call's other graphs are planned for it")
            log.info("sublinear: graph %d does not fit %s yet; it runs its lowest peak until %s", runtime.index,
                     objective.describe(), until)
            # The same lowest plan again, searched beside the other graphs as the last call planned them: they made
            # it no room, and the call no longer waits on it (a graph that still does not fit beside it is refused).
            stuck = not settled and prior is not None and prior.settling and prior.plan == exc.lowest.plan
            return _Choice(exc.lowest.plan, None, f"lowest peak, until {until}", False, settling=True, stuck=stuck)
        self.plans.store(disk_key, _entry(profile_, result.plan,
                                          [[c.simulation.peak_bytes, c.simulation.time_ratio] for c in result.history],
                                          profiled.channels_last))
        return _Choice(result.plan, result, result.origin, False, searched=True)


@dataclasses.dataclass(frozen=True)
class Prior:
    """A graph's variant forgotten (its outputs' uses or the step's context changed): its plan and executor, for
    the signature ``key`` and the sizes ``bound``."""

    plan: Plan
    rewritten: RewrittenGraph | CompiledGraph
    key: tuple | None
    bound: Binding
    chunks: HeadChunks | None = None  # the LM heads' chunks its executor runs (None: as captured)
    settling: bool = False  # it ran its lowest peak until the call's other graphs were planned for it

    def keeps_code(self, key: tuple, bound: Binding, channels_last: bool) -> bool:
        """Whether a variant at ``key`` and ``bound``, its convolutions laid out as ``channels_last`` says, runs this
        variant's compiled code rather than compiling again: code compiled for the other layout is another program
        (the profiles of the two layouts differ in storages, the layout copies)."""
        return isinstance(self.rewritten, CompiledGraph) and self.rewritten.compiled and \
            (self.key, self.bound) == (key, bound) and self.laid_out_as(channels_last)

    def laid_out_as(self, channels_last: bool) -> bool:
        """Whether this variant's code lays convolutions out as ``channels_last`` says (any layout: not compiled)."""
        return not isinstance(self.rewritten, CompiledGraph) or self.rewritten.channels_last == channels_last

    def running(self, profile_: GraphProfile, key: tuple, bound: Binding, channels_last: bool) -> Plan:
        """The plan that describes what runs on ``profile_`` at ``key`` and ``bound`` (convolutions laid out as
        ``channels_last`` says): where the compiled code is kept, the plan with the ops kept whose storages that code
        saves (:func:`keeping`), so that the variant simulates, reports and budgets the partition that runs, not one
        its uses would give afresh."""
        if not self.keeps_code(key, bound, channels_last):
            return self.plan
        return keeping(profile_, self.plan, self.rewritten.analysis.retained)


@dataclasses.dataclass(frozen=True)
class _Choice:
    plan: Plan
    result: PlanningResult | None
    origin: str
    from_cache: bool
    settling: bool = False
    stuck: bool = False  # settling at the plan it settled at last call (see _Choices.choose)
    searched: bool = False
    prior: Prior | None = None  # the forgotten variant whose plan this is


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


def _before_compiling(profiled: Profiled, profile: GraphProfile, plan: Plan, simulation: Simulation,
                      chunks: HeadChunks | None) -> int:
    """The peak predicted for ``plan`` before any compile check taught the profile (``profile``'s context and
    chunks): a variant planned again after its graph compiled (the call that shows what the caller does with the
    outputs, or the compile check's alternate) is simulated on the taught profile, which predicts compiled code."""
    if not profiled.lessons:
        return simulation.peak_bytes
    untaught = profiled.untaught_as(profile)
    return simulate(chunks.applied(untaught) if chunks is not None else untaught, plan).peak_bytes


def _entry(profile_: GraphProfile, plan: Plan, history: list, channels_last: bool) -> dict:
    """A plan cache entry: the plan, its search history, the profile's costs (a compile check's lessons in) and
    the convolutions' layout they are the costs of."""
    return {"num_ops": profile_.num_ops, **plan.as_dict(), "costs": costs_of(profile_), "history": history,
            "channels_last": channels_last}


def _profiled(compiled: CompiledProfile) -> Profiled:
    fallback = _profiled(compiled.fallback) if compiled.fallback is not None else None
    return Profiled(compiled.profile, compiled.node_names, compiled.backward_ranks, compiled.channels_last, fallback)


def _memory_budget(config: SublinearMemoryConfig, graph: CapturedGraph, values: Sequence[Any],
                   dry_run: bool) -> int | None:
    """The config's memory budget (the other graphs of the call are in the profile's step context); "auto" on
    CUDA: the allocator's free and cached memory, less the headroom, plus what is already allocated that the step
    counts (parameters, buffers, inputs, gradients)."""
    budget = config.memory_budget
    if budget is None or budget != "auto":
        return budget
    device = device_of(values)
    if device.type != "cuda":
        return None
    return _cuda_auto_budget(device, graph, values, config.memory_headroom, dry_run)


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
