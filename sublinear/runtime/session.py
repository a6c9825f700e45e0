"""The sublinear backend: what runs each graph TorchDynamo captures, and what it says it ran.

A :class:`SublinearBackend` is one session per compiled model. For every graph it receives it profiles, plans and
rewrites at each new call signature (shapes, dtypes, devices, autocast state, FSDP layout), keeps plans in memory
and on disk, and learns from every training call what the call did with the graph (:mod:`.step`)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_leaves

from sublinear.cache import PlanCache, Recent
from sublinear.execute.compiled import (
    CompiledGraph, JointGraph, JointTraceError, profile_joint, resolve_compiler, trace_joint,
)
from sublinear.capture.dynamo import CapturedGraph, GraphBreak, GraphOutputs, InputSignature, SharedGraph
from sublinear.config import SublinearMemoryConfig
from sublinear.core.analysis import PlanAnalysis, analyse
from sublinear.core.objective import Candidate, Objective, Simulation
from sublinear.core.plan import Plan
from sublinear.core.profile import GraphProfile, ShardedParameters, StepContext
from sublinear.core.units import format_bytes
from sublinear.planners import BudgetError, make_plan, objective_for
from sublinear.planners.driver import step_floor
from sublinear.profiling.graph import profile
from sublinear.training import DROPPED, GRADIENT, HELD
from sublinear.execute.eager import rewrite
from sublinear.progress import PlanningProgress
from sublinear.capture.shapes import Binding, SymbolicSizes, argument_dims, bucket, covers, describe_binding, join
from sublinear.tensors import autocast_state, device_of
from sublinear.simulation.timeline import simulate
from sublinear.runtime.plans import ParetoPoint, SublinearPlan, _summarise
from sublinear.runtime.step import (
    _GraphRun, _contexts_by_graph, _planned_knowing_later, _widest, output_uses, step_contexts,
)
from sublinear.runtime.variant import _Variant

log = logging.getLogger("sublinear")


_META = torch.device("meta")


def _value_key(values: Sequence[Any], model_device: str | None = None, sizes: SymbolicSizes | None = None) -> tuple:
    """What a plan depends on in a graph's inputs: every tensor's shape, stride, dtype, device and requires_grad
    (parameters included), and every other input's value. Values captured for a model on the meta device are fake
    CPU tensors that stand for meta ones (``model_device="meta"``): their key is the meta tensors', so the real
    calls find the plans made ahead. A dynamic graph's symbolic sizes are left out (one key per shape family): the
    bound its plan was made for says which sizes that plan serves."""
    key = []
    for i, v in enumerate(values):
        if sizes is not None and isinstance(sizes.inputs[i], str):
            key.append("symbol")
        elif isinstance(v, torch.Tensor):
            device = v.device
            if model_device == "meta" and device.type == "cpu":
                device = _META
            shape, stride = sizes.masked(i, v) if sizes is not None else (v.shape, v.stride())
            key.append((shape, stride, v.dtype, device, v.requires_grad))
        else:
            key.append(repr(v))
    return tuple(key)


def _any_requires_grad(values: Sequence[Any]) -> bool:
    for v in values:
        if isinstance(v, torch.Tensor):
            if v.requires_grad:
                return True
        elif isinstance(v, (list, tuple, dict)) and _any_requires_grad(tree_leaves(v)):
            return True
    return False


_UNSEEN = object()  # finish_call without the call's result (a bare torch.compile backend never sees it)
_USE_ORDER = (GRADIENT, HELD, DROPPED)  # most demanding first


class SublinearBackend:
    """A ``torch.compile`` backend: each graph TorchDynamo captures runs under a plan for each call signature.

    ``backend.sublinear_plan`` describes what the latest training call ran. ``sharding`` (a callable returning
    FSDP2's per-process layout, or None) is read at planning time.
    """

    def __init__(self, config: SublinearMemoryConfig | None = None,
                 sharding: Callable[[], ShardedParameters | None] | None = None) -> None:
        config = config or SublinearMemoryConfig()
        if not isinstance(config, SublinearMemoryConfig):
            raise TypeError(f"config must be a SublinearMemoryConfig, got {type(config).__name__}")
        self.config = config
        self.sharding = sharding or (lambda: None)
        self.graphs: list[_GraphRuntime] = []
        self.breaks: list[GraphBreak] = []
        self.latest: dict[str, _Variant] = {}  # graph code -> what the latest call ran, in the order it ran
        self.call: list[_GraphRun] = []  # the graphs the current call has run so far
        self.previous: list[_GraphRun] = []  # the graphs the last finished call ran, in order
        self.uses: dict[str, tuple[str, ...]] = {}  # graph code -> what calls do with each output
        self.explicit_calls = False  # whether begin_call/finish_call mark calls (else: the first graph starts one)
        self.plans = PlanCache(config.cache_dir)  # this session's plans, then the disk's
        self.profiles = Recent()  # profiles by graph, signature and cost model
        self.overrides: dict[str, Plan] = {}  # graph code -> plan chosen by the user (use())
        self._shared: dict[int, _GraphRuntime] = {}
        self._warned_breaks = False
        self._warned_unplanned = False
        self._warned_mode = False
        self.eager_only: dict[str, str] = {}  # graph code -> why inductor cannot compile it
        self.budget_cuts: dict[str, int] = {}  # graph code -> bytes its search aims below the budget (compiled)
        self.positional_names: tuple[str, ...] = ()  # the compiled forward's positional parameters (max_sizes)
        self.on_plan: Callable[[SublinearPlan | None], None] | None = None  # told what each finished call ran
        self.progress = PlanningProgress("the model")
        self.uncapturable: dict[InputSignature, str] = {}  # call signatures TorchDynamo cannot capture -> why
        self.prior_plans: dict[str, Plan] = {}  # graph code -> the plan of its variant forgotten last
        self.joints = Recent(8)  # joint graphs by graph, signature and bound (inductor)
        self.compiled_graphs: dict[tuple, CompiledGraph] = {}  # by graph, signature, bound and partition
        self.ran_graph = False

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        return self._add(CapturedGraph.from_dynamo(gm, example_inputs))

    def _add(self, graph: CapturedGraph) -> _GraphRuntime:
        runtime = _GraphRuntime(graph, self, len(self.graphs))
        self.graphs.append(runtime)
        log.debug("captured graph %d: %s", runtime.index, graph.describe())
        return runtime

    def run_graph(self, shared: SharedGraph, values: Sequence[Any]) -> Any:
        """Run a graph from TorchDynamo's shared cache (see :data:`sublinear.capture.dynamo.DISPATCH`) as this
        session's."""
        runtime = self._shared.get(id(shared))
        if runtime is None or runtime.graph is not shared.graph:
            runtime = self._shared[id(shared)] = self._add(shared.graph)
        self.ran_graph = True
        return runtime(*values)

    def __reduce__(self):
        return (SublinearBackend, (self.config,))

    @property
    def sublinear_plan(self) -> SublinearPlan | None:
        """What the latest training call ran. A bare ``torch.compile`` backend sees no call end (a call ends when
        the next one starts), so there it is the graphs run since the latest call began."""
        variants, runs = self.latest, len(self.previous)
        if not self.explicit_calls and self.call:
            variants, runs = {run.runtime.graph.code: run.variant for run in self.call}, len(self.call)
        if not variants:
            return None
        graphs = tuple(dataclasses.replace(v.summary, graph=k) for k, v in enumerate(variants.values()))
        return SublinearPlan(graphs, tuple(self.breaks), runs)

    def begin_call(self) -> None:
        """A new training call starts: :attr:`sublinear_plan` will describe the graphs it runs."""
        self.call = []

    def finish_call(self, returned: Any = _UNSEEN) -> list[_GraphRuntime]:
        """The call ended, returning ``returned``: give each graph the context of the call's other graphs
        (:class:`StepContext`), make :attr:`sublinear_plan` describe the call, and return the graphs to plan again:
        those profiled with a backward that differs from this call's (which outputs get gradients), those whose
        plan no longer meets the objective beside the others, and those planned before the later graphs were
        known."""
        runs, self.call = self.call, []
        if not runs:
            return []
        self.previous = runs
        stale = self._learn_output_uses(runs, returned)
        contexts = _contexts_by_graph(runs, eager=False)
        eager_contexts: dict[str, StepContext] | None = None  # made when a context changed: eager's, for the report
        self.latest = {}
        for run in runs:
            code, variant = run.runtime.graph.code, run.variant
            if code in self.latest:
                continue
            self.latest[code] = variant
            context = contexts.get(code)
            planned_in = variant.profile.step_context
            if variant.bound and context is not None and planned_in is not None:
                # A family's plan serves calls of every size up to its bound: what the other graphs hold at a
                # smaller call is no reason to plan again; what they hold beyond the context planned in is.
                context = _widest(planned_in, context)
            if run.runtime in stale or (context == variant.profile.step_context and not variant.settling):
                continue
            if eager_contexts is None:
                eager_contexts = _contexts_by_graph(runs, eager=True)
            variant.set_context(context, eager_contexts.get(code))
            unknown_later = variant.objective.memory_budget is not None and not _planned_knowing_later(variant, context)
            if variant.settling or not variant.accepted or unknown_later:
                run.runtime.forget(variant)
                stale.append(run.runtime)
        if stale:
            log.info("sublinear: planning %d graph(s) again for the step as this call ran it (%s)", len(stale),
                     "; ".join(str(self.latest[r.graph.code].profile.step_context) for r in stale))
        if self.on_plan is not None:
            self.on_plan(self.sublinear_plan)
        return stale

    def context_for(self, runtime: _GraphRuntime, values: Sequence[Any]) -> tuple[StepContext | None, bool]:
        """The context of ``runtime``'s graph about to run next in the current call: this call's earlier graphs as
        they ran, the later ones as the previous call ran them (None when it runs alone); and whether the call is
        settled: every earlier graph of it was planned knowing the later ones. A graph planned in an unsettled
        call may yet fit once the earlier graphs are planned for it."""
        position, earlier, previous = len(self.call), self.call, self.previous
        same_place = len(previous) > position and previous[position].runtime.graph.code == runtime.graph.code
        later = previous[position + 1:] if same_place else []
        settled = all(r.variant is not None and r.variant.planned_in is not None
                      and r.variant.planned_in.later_beyond_held is not None for r in earlier)
        if not earlier and not later:
            return None, settled
        upcoming = _GraphRun.of(runtime, None, values)
        if same_place:  # the later runs read its outputs as the previous call made them
            upcoming.outputs = previous[position].outputs
        runs = [*earlier, upcoming, *later]
        return step_contexts(runs, first=position)[position], settled

    def _learn_output_uses(self, runs: Sequence[_GraphRun], returned: Any) -> list[_GraphRuntime]:
        """Record what the call did with each graph's outputs; forget the variants profiled otherwise and return
        their graphs. A graph that runs several times gets, per output, the most demanding use of its runs."""
        if returned is _UNSEEN:
            return []
        learned: dict[str, tuple[str, ...]] = {}
        for run, uses in zip(runs, output_uses(runs, returned)):
            code = run.runtime.graph.code
            old = learned.get(code, uses)
            learned[code] = tuple(min(a, b, key=_USE_ORDER.index) for a, b in zip(old, uses))
        stale = []
        for run in runs:
            code = run.runtime.graph.code
            if run.variant.uses != learned[code] and run.runtime not in stale:
                self.uses[code] = learned[code]
                run.runtime.forget(run.variant)
                stale.append(run.runtime)
        return stale

    def use(self, point: ParetoPoint | Plan) -> None:
        """Run ``point``'s plan for its graph from the next call on; a bare :class:`Plan` applies to the only graph
        captured or planned so far."""
        if isinstance(point, ParetoPoint):
            plan, code = point.plan, point.graph_code
        elif isinstance(point, Plan):
            codes = self.plans.graph_codes() | {r.graph.code for r in self.graphs}
            if len(codes) != 1:
                raise ValueError(f"use(plan) applies a bare Plan to the only graph, and {len(codes)} graphs were "
                                 "captured; pass a ParetoPoint from sublinear.pareto for the graph you mean")
            plan, code = point, codes.pop()
        else:
            raise TypeError(f"use() takes a ParetoPoint or a Plan, got {type(point).__name__}")
        self.overrides[code] = plan
        for runtime in self.graphs:
            runtime.variants.clear()

    def note_breaks(self, breaks: Sequence[GraphBreak]) -> None:
        """Record graph breaks (each place and reason once)."""
        self.breaks.extend(b for b in dict.fromkeys(breaks) if b not in self.breaks)

    def say_breaks(self, what: str) -> None:
        """Once the first call that broke into graphs is over, say at WARNING, once, into how many graphs and at
        which breaks, with every reason: the same counts as :attr:`sublinear_plan`."""
        plan = self.sublinear_plan
        if self._warned_breaks or not self.breaks or plan is None:
            return
        self._warned_breaks = True
        log.warning("sublinear: TorchDynamo split %s into %d graphs%s at %d graph break(s); the code at each break "
                    "runs eagerly, unplanned:\n%s", what, len(plan.graphs),
                    f" ({plan.runs} graph runs per call)" if plan.runs > len(plan.graphs) else "", len(plan.breaks),
                    "\n".join(f"  {b}" for b in plan.breaks))

    # -- planning ------------------------------------------------------------------------------------------------

    def plan_graph(self, runtime: _GraphRuntime, values: Sequence[Any], key: tuple, dry_run: bool,
                   bound: Binding) -> _Variant:
        """Profile and plan ``runtime``'s graph for a call with ``values`` (real or fake). Planning draws random
        numbers (measuring op costs) under a forked RNG, so the training's random stream is as in eager, and runs
        outside the caller's dispatch modes (a memory tracker around the step sees the step, not the planning)."""
        self.progress.begin()
        devices = sorted({t.device.index or 0 for t in tree_leaves(list(values))
                          if isinstance(t, torch.Tensor) and t.device.type == "cuda"})
        with torch.random.fork_rng(devices=devices, device_type="cuda"), _disable_current_modes(), \
                collecting_new_objects_only():
            try:
                return self._plan_graph(runtime, values, key, dry_run, bound)
            except JointTraceError as exc:
                self.eager_only[runtime.graph.code] = str(exc)
                log.warning("sublinear: graph %d runs on sublinear's eager executor: inductor could not trace its "
                            "forward and backward (%s)", runtime.index, exc)
                return self._plan_graph(runtime, values, key, dry_run, bound)

    def _plan_graph(self, runtime: _GraphRuntime, values: Sequence[Any], key: tuple, dry_run: bool,
                    bound: Binding) -> _Variant:
        started = time.perf_counter()
        graph, config = runtime.graph, self.config
        sharding = key[-1]
        context, settled = self.context_for(runtime, values)
        uses = self.uses.get(graph.code)
        compiler = runtime.compiler(values)
        profile_key = (graph.code, key, config.cost_model, uses, compiler, tuple(sorted(bound.items())))
        cut = self.budget_cuts.get(graph.code, 0)
        store_key = (*profile_key, context, repr(sorted(config.planning_key().items())), cut)
        cached = self.plans.recall(store_key)
        override = self.overrides.get(graph.code)
        disk_key = PlanCache.key(graph=graph.code, values=key, config=config.planning_key(),
                                 context=repr(context), uses=uses, compiler=compiler, cut=cut,
                                 bound=sorted(bound.items()))
        at_bound = graph.sizes.stand_ins(values, bound) if bound else values  # profiled at the plan's sizes
        if cached is not None:
            profile_, node_names, plan, result = cached
        else:
            profiled = self.profiles.get(profile_key)  # a graph planned again in a new context is not profiled again
            entry = self.plans.load(disk_key) if override is None else None
            if compiler == "inductor":
                if profiled is None:
                    compiled = profile_joint(self._joint(graph, values, key, bound), graph, uses)
                    profiled = compiled.profile, compiled.node_names
                if entry is not None:
                    entry = self.plans.check(entry, disk_key, profiled[0].num_ops)
            elif entry is not None:
                estimated = profiled or (profile(graph, at_bound, cost_model="estimate", uses=uses), None)
                entry = self.plans.check(entry, disk_key, estimated[0].num_ops)
                if entry is not None and profiled is None:
                    profiled = estimated[0].with_costs(entry["costs"]), None
            if entry is not None:
                log.info("sublinear: plan cache hit (%s): search and timing runs skipped", disk_key[:12])
            if profiled is None:
                profiled = profile(graph, at_bound, cost_model=config.cost_model, uses=uses), None
            self.profiles.put(profile_key, profiled)
            profile_ = dataclasses.replace(profiled[0], sharding=sharding, step_context=context)
            node_names = profiled[1]
            plan, result = (Plan.from_dict(entry), None) if entry is not None else (None, None)
        budget = self.budget_for(runtime, profile_, values, dry_run)
        objective = objective_for(config, None if budget is None else max(budget - cut, 1))
        eager = simulate(profile_, Plan.no_split(profile_.num_ops))
        origin, from_cache, history = "cache", plan is not None and result is None, ()
        prior = self.prior_plans.pop(graph.code, None)
        if override is not None:
            plan, origin = override, "use()"
        elif plan is not None and not self._still_best(objective, plan, profile_, eager):
            log.info("sublinear: the stored plan for graph %d no longer meets %s; planning again", runtime.index,
                     objective.describe())
            plan = result = None
        elif plan is None and prior is not None and prior.split_points[-1] == profile_.num_ops - 1 \
                and self._still_best(objective, prior, profile_, eager):
            # What the latest call showed (its outputs' uses, the other graphs) changed the profile; the plan
            # still meets the objective, and keeping it keeps its compiled code.
            plan, origin = prior, "the previous plan, which still meets the objective"
        settling, searched = False, plan is None
        if plan is None:
            try:
                result = make_plan(profile_, config, memory_budget=objective.memory_budget)
            except BudgetError as exc:
                if settled:
                    raise
                plan, settling = exc.lowest.plan, True
                origin = "lowest peak, until the earlier graphs are planned for it"
                log.info("sublinear: graph %d does not fit beside the earlier graphs' plans yet; they are planned "
                         "again for it", runtime.index)
            else:
                plan, origin = result.plan, result.origin
                searched_history = [[c.simulation.peak_bytes, c.simulation.time_ratio] for c in result.history]
                self.plans.store(disk_key, {"num_ops": profile_.num_ops, **plan.as_dict(), "costs": profile_.costs(),
                                            "history": searched_history})
        elif result is not None:
            origin = result.origin
        if result is not None:
            history = tuple((c.simulation.peak_bytes, c.simulation.time_ratio) for c in result.history)
        if not settling:
            self.plans.remember(store_key, (profile_, node_names, plan, result))
        sim = simulate(profile_, plan)
        rewritten = (self._compiled(graph, key, bound, analyse(profile_, plan), node_names) if node_names is not None
                     else rewrite(graph, profile_, plan))
        summary = _summarise(runtime.index, values, graph, profile_, plan, result, sim, eager, origin, objective,
                             time.perf_counter() - started, from_cache, history, bound)
        log.info("sublinear: %s %s", "planned" if searched else "reused the plan for", summary)
        return _Variant(profile=profile_, plan=plan, simulation=sim, rewritten=rewritten, summary=summary,
                        auto_budget=config.memory_budget == "auto", objective=objective, planned_in=context,
                        uses=profile_.output_uses, budget=budget, settling=settling, bound=bound)

    def _joint(self, graph: CapturedGraph, values: Sequence[Any], key: tuple, bound: Binding) -> JointGraph:
        """The joint graph inductor partitions for ``graph`` at ``key``'s signature (for a dynamic graph, traced for
        every size, hinted at ``bound``), traced once: profiles for other output uses or contexts read it again."""
        joint_key = (graph.code, key, tuple(sorted(bound.items())))
        joint = self.joints.get(joint_key)
        if joint is None:
            joint = trace_joint(graph, graph.sizes.symbolic_inputs(values, bound)[0] if bound else values)
            self.joints.put(joint_key, joint)
        return joint

    def _compiled(self, graph: CapturedGraph, key: tuple, bound: Binding, analysis: PlanAnalysis,
                  node_names: Sequence[str]) -> CompiledGraph:
        """The graph compiled under ``analysis``'s plan: one compile per partition, however many times the graph is
        planned again to the same partition."""
        compiled = CompiledGraph(graph, analysis, node_names, bound)
        compiled_key = (graph.code, key, tuple(sorted(bound.items())), compiled.partitioner.uuid())
        return self.compiled_graphs.setdefault(compiled_key, compiled)

    @staticmethod
    def _still_best(objective: Objective, plan: Plan, profile_: GraphProfile, eager: Simulation) -> bool:
        """A stored plan is used when the objective accepts it now and, under a memory budget, it is eager
        whenever eager fits (the least time that fits)."""
        candidate = Candidate(plan, simulate(profile_, plan))
        if not objective.accepts(candidate):
            return False
        if objective.memory_budget is None:
            return True
        eager_ok = objective.accepts(Candidate(Plan.no_split(profile_.num_ops), eager))
        return not eager_ok or plan.num_blocks == 1

    def budget_for(self, runtime: _GraphRuntime, profile_: GraphProfile, values: Sequence[Any],
                   dry_run: bool) -> int | None:
        """The memory budget in bytes for the step (the other graphs of the call are in the profile's context):
        the config's; "auto" on CUDA: the allocator's free and cached memory, less the headroom, plus what the
        profile counts that is already allocated (parameters, buffers, inputs, gradients)."""
        budget = self.config.memory_budget
        if budget is None:
            return None
        if budget != "auto":
            return budget
        device = device_of(values)
        if device.type != "cuda":
            return None
        return _cuda_auto_budget(device, runtime.graph, values, self.config.memory_headroom, dry_run)


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


class _GraphRuntime:
    """What Dynamo calls in place of one graph: plain eager without grad, the planned graph otherwise."""

    def __init__(self, graph: CapturedGraph, backend_: SublinearBackend, index: int) -> None:
        self.graph = graph
        self.backend = backend_
        self.index = index
        self.variants: dict[tuple, _Variant] = {}
        self.seen: Binding = {}  # a dynamic graph's largest sizes so far

    def key(self, values: Sequence[Any]) -> tuple:
        return (_value_key(values, self.graph.model_device, self.graph.sizes), autocast_state(),
                self.backend.sharding())

    def compiler(self, values: Sequence[Any]) -> str:
        """What runs the graph for ``values``: inductor or sublinear's eager executor (see
        :func:`sublinear.execute.compiled.resolve_compiler`); a graph inductor cannot trace runs eagerly."""
        if self.graph.code in self.backend.eager_only:
            return "eager"
        # a model on the meta device is captured with fake CPU values; it is planned for the meta device
        device_type = torch.device(self.graph.model_device).type if self.graph.model_device else device_of(values).type
        compiler = resolve_compiler(self.backend.config.compiler, device_type)
        if compiler == "inductor" and self.backend.sharding() is not None:
            _say_fsdp_runs_eagerly()
            return "eager"
        return compiler

    def variant_for(self, values: Sequence[Any], dry_run: bool = False) -> _Variant:
        """The variant that runs a call with ``values``: planned before for the call's signature (and, for a dynamic
        graph, for sizes at or above the call's), or planned now."""
        key = self.key(values)
        variant = self.variants.get(key)
        sizes = self.graph.sizes
        binding = sizes.sizing(sizes.binding(values)) if sizes is not None else {}
        self.seen = join(self.seen, binding)
        if variant is not None and not covers(variant.bound, binding):
            log.info("sublinear: graph %d runs at sizes beyond those its plan was made for (%s); planning again for "
                     "%s", self.index, describe_binding(variant.bound), describe_binding(self.bound_for(self.seen)))
            self.forget(variant)
            variant = None
        if variant is not None and variant.auto_budget and not dry_run and device_of(values).type == "cuda":
            budget = self.backend.budget_for(self, variant.profile, values, dry_run=False)
            if budget is not None and variant.simulation.peak_bytes > budget:
                log.info("sublinear: graph %d's plan (%s) no longer fits the device's free memory (%s); planning "
                         "again", self.index, format_bytes(variant.simulation.peak_bytes), format_bytes(budget))
                variant = None
        if variant is None:
            variant = self.variants[key] = self._plan_family(values, key, dry_run, self.seen)
        if not dry_run:
            variant = self._compiled_within_budget(variant, values, key)
        return variant

    def _plan_family(self, values: Sequence[Any], key: tuple, dry_run: bool, seen: Binding) -> _Variant:
        """Plan for ``values``; a dynamic graph for its sizes' bucket (:func:`sublinear.capture.shapes.bucket`), or,
        when
        no plan fits the budget there, for the largest sizes seen."""
        if not seen:
            return self.backend.plan_graph(self, values, key, dry_run, {})
        bound = self.bound_for(seen)
        try:
            return self.backend.plan_graph(self, values, key, dry_run, bound)
        except BudgetError:
            if bound == seen:
                raise
            log.info("sublinear: graph %d: no plan fits the budget at %s; planning for the sizes seen (%s)",
                     self.index, describe_binding(bound), describe_binding(seen))
            return self.backend.plan_graph(self, values, key, dry_run, seen)

    def bound_for(self, seen: Binding) -> Binding:
        """The sizes to plan a dynamic graph for, having seen ``seen``: the config's ``max_sizes`` for a symbol that
        sizes an argument it names, else the power-of-two bucket of the value seen."""
        bound = bucket(seen)
        limits = dict(self.backend.config.max_sizes or ())
        for symbol in bound:
            for name, dim in argument_dims(self.graph.sizes.sources.get(symbol, ()), self.backend.positional_names):
                limit = limits.get(name, ())
                if dim < len(limit) and limit[dim] is not None:
                    bound[symbol] = max(limit[dim], seen[symbol])
                    break
        return bound

    def _compiled_within_budget(self, variant: _Variant, values: Sequence[Any], key: tuple) -> _Variant:
        """Compile a new variant now and read what its compiled graphs hold; when that is above the budget, plan
        again aiming below it by the excess (a few rounds), so that the compiled step fits."""
        for round_ in range(COMPILED_ROUNDS + 1):
            graph = variant.rewritten
            if not isinstance(graph, CompiledGraph) or variant.checked:
                return variant
            graph.compile(values)  # nothing to do for a partition compiled before
            variant.checked = True
            if graph.peak_bytes is None:
                return variant
            variant.note_compiled(graph.peak_bytes)
            if variant.budget is None or variant.peak_bytes <= variant.budget:
                return variant
            if round_ == COMPILED_ROUNDS:
                raise _over_budget(variant, variant.plan, variant.simulation)
            code = self.graph.code  # aim below the budget by at least what compiling added to this plan
            cut = self.backend.budget_cuts.get(code, 0)
            self.backend.budget_cuts[code] = max(cut + variant.peak_bytes - variant.budget, variant.compiled_excess)
            log.info("sublinear: graph %d compiled holds %s, above the budget: planning again %s lower", self.index,
                     format_bytes(variant.peak_bytes), format_bytes(self.backend.budget_cuts[code]))
            self.forget(variant)
            try:
                variant = self.variants[key] = self.backend.plan_graph(self, values, key, False, variant.bound)
            except BudgetError as exc:
                raise _over_budget(variant, exc.lowest.plan, exc.lowest.simulation) from None
        return variant

    def forget(self, variant: _Variant) -> None:
        """Plan this signature again at its next run (where its plan still meets the objective, it is kept)."""
        self.variants = {k: v for k, v in self.variants.items() if v is not variant}
        self.backend.prior_plans[self.graph.code] = variant.plan

    def __call__(self, *values: Any) -> Any:
        if not torch.is_grad_enabled() or not _any_requires_grad(values):
            return self.graph.graph_module(*values)
        backend_ = self.backend
        if not backend_.explicit_calls and backend_.call and backend_.call[0].runtime.graph.code == self.graph.code:
            backend_.finish_call()  # used as a bare backend, no call boundary is seen: the first graph starts a call
        variant = self.variant_for(values)
        if not backend_.explicit_calls:  # no call end is seen: planning ends with the graph's
            backend_.progress.end(lambda: str(variant.summary))
        run = _GraphRun.of(self, variant, values)
        out = variant.rewritten(*values)
        run.record(GraphOutputs.of(out))
        backend_.call.append(run)
        return out


def _over_budget(variant: _Variant, plan: Plan, simulation: Simulation) -> BudgetError:
    """The error for a compiled step that cannot fit ``variant``'s budget: the lowest plan found (``plan``, simulated
    as ``simulation``) with what compiling holds beyond its simulation, said for the budget asked for."""
    objective = dataclasses.replace(variant.objective, memory_budget=variant.budget)
    peak = simulation.peak_bytes + variant.compiled_excess
    return BudgetError(objective, Candidate(plan, dataclasses.replace(simulation, peak_bytes=peak)), None,
                       floor=step_floor(variant.profile))


@functools.cache
def _say_fsdp_runs_eagerly() -> None:
    log.warning("sublinear: under FSDP2 the planned graphs run on sublinear's eager executor, whose recompute FSDP's "
                "gather and reduce-scatter hooks are tested with; the compiled executor is not applied there")


COMPILED_ROUNDS = 3  # plans searched again below the budget when the compiled graphs hold more than simulated


@contextlib.contextmanager
def collecting_new_objects_only() -> Iterator[None]:
    """Garbage collections inside scan only the objects made inside: the process's older objects are frozen
    (``gc.freeze``) and go back to the oldest generation at the end. Capture and profiling make enough objects to
    set off full collections, and one over a long-running process's heap (seconds, after some dozens of compiles)
    would land inside the planning's wall time. A heap the process froze itself is left as it is."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def backend(config: SublinearMemoryConfig | None = None) -> SublinearBackend:
    """The ``torch.compile`` backend: ``torch.compile(model, backend=sublinear.backend(config))``."""
    return SublinearBackend(config)
