"""The sublinear backend: what runs each graph TorchDynamo captures, and what it says it ran.

A :class:`SublinearBackend` is one session per compiled model. For every graph it receives it profiles, plans and
rewrites at each new call signature (shapes, dtypes, devices, autocast state, FSDP layout), keeps plans in memory
and on disk, and learns from every training call what the call did with the graph: what the call's other graphs
hold beside it (:class:`~sublinear.core.profile.StepContext`) and which outputs get gradients, are kept or dropped.
:func:`compile_module` runs a module through it with call boundaries; :func:`plan_ahead` plans a module's graphs on a
data-less twin before training. :class:`SublinearPlan` describes the latest call's plans for people.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import inspect
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._dynamo.exc import TorchDynamoException
from torch.utils._python_dispatch import _disable_current_modes, any_torch_dispatch_mode_on_stack
from torch.utils._pytree import tree_leaves

from .cache import PlanCache, cache_dir
from .compiled import CompiledGraph, JointGraph, JointTraceError, profile_joint, resolve_compiler, trace_joint
from .capture import (BUFFER, INPUT, PARAMETER, CapturedGraph, CaptureError, GraphBreak, GraphOutputs, InputSignature,
                      NeedsData, SharedGraph, capture, capture_error, compile_entry,
                      eager_or_model_error, graph_breaks, input_signature, receiving)
from .config import SublinearMemoryConfig
from .core.analysis import PlanAnalysis, analyse
from .core.objective import Candidate, Objective, Simulation, ratio_over
from .core.plan import Plan
from .core.profile import GraphProfile, ShardedParameters, StepContext
from .core.units import format_bytes
from .planners import BudgetError, PlanningResult, make_plan, objective_for
from .planners.driver import step_floor
from .profiler import DROPPED, GRADIENT, KEPT, profile
from .rewriter import RewrittenGraph, rewrite
from .progress import PlanningProgress
from .shapes import Binding, SymbolicSizes, argument_dims, bucket, covers, describe_binding, join
from .sharding import refuse_nested_fsdp
from .tensors import autocast_state, device_of
from .simulator import simulate

__all__ = ["BlockSummary", "GraphPlan", "ParetoPoint", "SublinearBackend", "SublinearPlan", "backend",
           "compile_module", "output_uses", "plan_ahead", "step_contexts"]

log = logging.getLogger("sublinear")


# ---------------------------------------------------------------------------------------------------------------
# What a plan says, for people


@dataclass(frozen=True)
class ParetoPoint:
    plan: Plan
    peak_bytes: int
    recompute_flops: int
    flops_ratio: float  # step FLOPs relative to eager
    time_ratio: float  # predicted step time relative to eager
    graph_code: str  # the graph the plan belongs to (for SublinearModule.use)


@dataclass(frozen=True)
class BlockSummary:
    """One block of a plan, by op names (module path and node)."""

    index: int
    first_op: str
    last_op: str
    recomputed_ops: tuple[str, ...]  # re-run in backward
    kept_ops: tuple[str, ...]  # inside the block but never recomputed (chosen or pinned)
    kept_bytes: int  # storages the block keeps for backward or later blocks
    recompute_seconds: float
    soft_end: bool  # the boundary is rebuilt, not kept (nested blocks)

    def __str__(self) -> str:
        parts = [f"block {self.index}: {self.first_op} .. {self.last_op}; keeps {format_bytes(self.kept_bytes)}"]
        if self.recomputed_ops:
            parts.append(f"recomputes {len(self.recomputed_ops)} ops ({self.recompute_seconds * 1e3:.2f} ms)")
        if self.kept_ops:
            parts.append("kept ops: " + ", ".join(self.kept_ops[:4]) + (" ..." if len(self.kept_ops) > 4 else ""))
        if self.soft_end:
            parts.append("soft end: what crosses it is rebuilt, not kept")
        return "; ".join(parts)


@dataclass(frozen=True)
class GraphPlan:
    """The plan one captured graph runs at one call signature, with its predictions."""

    graph: int  # position of the graph among those the call ran
    signature: str  # the graph's non-parameter inputs: shape, dtype, device
    plan: Plan
    num_ops: int
    blocks: tuple[BlockSummary, ...]
    predicted_peak_bytes: int
    baseline_peak_bytes: int  # eager
    recompute_seconds: float
    eager_seconds: float
    recompute_flops: int
    step_flops: int
    objective: str
    origin: str  # the planner whose plan won (or "cache", "use()")
    cost_source: str
    history: tuple[tuple[int, float], ...]  # best (peak bytes, time ratio) so far after each planner/generation
    planning_seconds: float  # profile + search
    search_seconds: float  # the search alone; 0 for a cache hit
    from_cache: bool
    compiled_peak_bytes: int | None = None  # the graph alone, as its compiled forward and backward hold memory

    @property
    def num_blocks(self) -> int:
        return self.plan.num_blocks

    @property
    def time_ratio(self) -> float:
        return ratio_over(self.recompute_seconds, self.eager_seconds)

    @property
    def flops_ratio(self) -> float:
        return ratio_over(self.recompute_flops, self.step_flops)

    def __str__(self) -> str:
        nested = f" ({len(self.plan.soft)} nested)" if self.plan.soft else ""
        compiled = " (as compiled)" if self.compiled_peak_bytes is not None else ""
        return (f"graph {self.graph} at {self.signature}: {self.num_blocks} blocks{nested} over {self.num_ops} ops, "
                f"predicted peak {format_bytes(self.predicted_peak_bytes)}{compiled} vs eager "
                f"{format_bytes(self.baseline_peak_bytes)}, step time x{self.time_ratio:.3f} (FLOPs "
                f"x{self.flops_ratio:.3f}); {self.objective}; by {self.origin}{' (cache)' if self.from_cache else ''}")

    def describe(self) -> str:
        return "\n".join([str(self), *(f"  {b}" for b in self.blocks)])


@dataclass(frozen=True)
class SublinearPlan:
    """What the latest training call ran: one :class:`GraphPlan` per captured graph, and the graph breaks (each
    distinct place and reason once). ``runs``: how many times the call ran a graph (a graph in a loop runs several
    times; 0 when not known)."""

    graphs: tuple[GraphPlan, ...]
    breaks: tuple[GraphBreak, ...] = ()
    runs: int = 0

    @property
    def num_blocks(self) -> int:
        return sum(g.num_blocks for g in self.graphs)

    @property
    def num_ops(self) -> int:
        return sum(g.num_ops for g in self.graphs)

    @property
    def predicted_peak_bytes(self) -> int:
        return max((g.predicted_peak_bytes for g in self.graphs), default=0)

    @property
    def baseline_peak_bytes(self) -> int:
        return max((g.baseline_peak_bytes for g in self.graphs), default=0)

    @property
    def time_ratio(self) -> float:
        return ratio_over(sum(g.recompute_seconds for g in self.graphs), sum(g.eager_seconds for g in self.graphs))

    @property
    def recompute_flops(self) -> int:
        return sum(g.recompute_flops for g in self.graphs)

    @property
    def flops_ratio(self) -> float:
        return ratio_over(self.recompute_flops, sum(g.step_flops for g in self.graphs))

    @property
    def from_cache(self) -> bool:
        return bool(self.graphs) and all(g.from_cache for g in self.graphs)

    def to_plan(self) -> Plan:
        """The plan of the only graph."""
        if len(self.graphs) != 1:
            raise ValueError(f"the model runs {len(self.graphs)} graphs; pick one from .graphs")
        return self.graphs[0].plan

    @property
    def headline(self) -> str:
        """Graphs, blocks, predicted peak against eager's, predicted step time: one line."""
        runs = f" ({self.runs} graph runs)" if self.runs > len(self.graphs) else ""
        breaks = f" at {len(self.breaks)} graph break(s)" if self.breaks else ""
        return (f"{len(self.graphs)} graph(s){runs}{breaks}, {self.num_blocks} blocks: predicted peak "
                f"{format_bytes(self.predicted_peak_bytes)} vs eager {format_bytes(self.baseline_peak_bytes)}, "
                f"step time x{self.time_ratio:.3f} (FLOPs x{self.flops_ratio:.3f})")

    def __str__(self) -> str:
        if len(self.graphs) == 1 and not self.breaks:
            return str(self.graphs[0])
        lines = [self.headline, *(f"  {g}" for g in self.graphs)]
        lines += [f"  graph break at {b}" for b in self.breaks]
        return "\n".join(lines)

    def describe(self) -> str:
        """Every block of every graph: which layers end blocks, which are recomputed and which are kept."""
        return "\n".join([*(g.describe() for g in self.graphs), *(f"graph break at {b}" for b in self.breaks)])


def _summarise(index: int, values: Sequence[Any], graph: CapturedGraph, profile_: GraphProfile, plan: Plan,
               result: PlanningResult | None, sim: Simulation, eager: Simulation, origin: str, objective: Objective,
               planning_seconds: float, from_cache: bool, history: tuple[tuple[int, float], ...],
               bound: Binding) -> GraphPlan:
    a = analyse(profile_, plan)
    blocks = []
    for b, ops in enumerate(plan.blocks()):
        recomputed = tuple(profile_.ops[o].name for o in a.closure[b])
        kept = tuple(profile_.ops[o].name for o in ops if not a.recomputed[o] and b != plan.num_blocks - 1)
        mask = a.retained & (a.block_of[profile_.storage_producer] == b) if len(profile_.storage_producer) else []
        blocks.append(BlockSummary(index=b, first_op=profile_.ops[ops[0]].name, last_op=profile_.ops[ops[-1]].name,
                                   recomputed_ops=recomputed, kept_ops=kept,
                                   kept_bytes=int(profile_.storage_bytes[mask].sum()) if len(mask) else 0,
                                   recompute_seconds=float(profile_.op_seconds[a.closure[b]].sum()),
                                   soft_end=ops[-1] in plan.soft))
    inputs = [v for k, v in zip(graph.kinds, values) if k == "input"]
    signature = input_signature(inputs).describe(graph.model_device)
    if bound:
        signature += f" (a dynamic graph planned for {describe_binding(bound)})"
    return GraphPlan(graph=index, signature=signature, plan=plan, num_ops=profile_.num_ops, blocks=tuple(blocks),
                     predicted_peak_bytes=sim.peak_bytes, baseline_peak_bytes=eager.peak_bytes,
                     recompute_seconds=sim.recompute_seconds, eager_seconds=sim.eager_seconds,
                     recompute_flops=sim.recompute_flops, step_flops=profile_.step_flops,
                     objective=objective.describe(), origin=origin, cost_source=profile_.cost_source,
                     history=history, planning_seconds=planning_seconds,
                     search_seconds=result.seconds if result is not None and not from_cache else 0.0,
                     from_cache=from_cache)


# ---------------------------------------------------------------------------------------------------------------
# The backend: one session per compiled model


@dataclass
class _Variant:
    """A graph planned for one call signature; ``profile`` carries the step context it is simulated in."""

    profile: GraphProfile
    plan: Plan
    simulation: Simulation
    rewritten: RewrittenGraph | CompiledGraph
    summary: GraphPlan
    auto_budget: bool
    objective: Objective
    planned_in: StepContext | None  # the context the plan was searched in
    uses: tuple[str, ...]  # what the profiled step did with each output
    budget: int | None  # the memory budget the step must fit (the search may have aimed lower)
    settling: bool = False  # the lowest peak taken while earlier graphs of the call were not planned for this one
    compiled_excess: int = 0  # what the compiled graphs hold beyond the simulation, once compiled
    bound: Binding = field(default_factory=dict)  # a dynamic graph's sizes its plan was made for (and serves below)
    checked: bool = False  # compiled, and what the compiled graphs hold read

    @property
    def peak_bytes(self) -> int:
        """The predicted peak: simulated, and once compiled, as the compiled forward and backward hold memory."""
        return self.simulation.peak_bytes + self.compiled_excess

    def set_context(self, context: StepContext | None, eager_context: StepContext | None) -> None:
        """Simulate the plan beside the call's other graphs as ``context`` says, and (for the report) eager beside
        the other graphs unplanned as ``eager_context`` says: eager's peak is the same whatever the plans."""
        self.profile = dataclasses.replace(self.profile, step_context=context)
        self.simulation = simulate(self.profile, self.plan)
        eager = simulate(dataclasses.replace(self.profile, step_context=eager_context),
                         Plan.no_split(self.profile.num_ops))
        self.summary = dataclasses.replace(self.summary, predicted_peak_bytes=self.peak_bytes,
                                           baseline_peak_bytes=eager.peak_bytes)

    @functools.cached_property
    def eager_held(self) -> int:
        """What the graph would hold after its forward unplanned (its own storages: no context changes it)."""
        alone = dataclasses.replace(self.profile, step_context=None)
        return simulate(alone, Plan.no_split(alone.num_ops)).held_after_forward_bytes

    def note_compiled(self, peak_alone: int) -> None:
        """The compiled graphs hold ``peak_alone`` at their peak in a step of this graph alone."""
        alone = simulate(dataclasses.replace(self.profile, step_context=None), self.plan).peak_bytes
        self.compiled_excess = max(0, peak_alone - alone)
        self.summary = dataclasses.replace(self.summary, predicted_peak_bytes=self.peak_bytes,
                                           compiled_peak_bytes=peak_alone)

    @property
    def accepted(self) -> bool:
        return self.objective.accepts(Candidate(self.plan, self.simulation))


def _storages(values: Any) -> dict[int, int]:
    """Storage key -> bytes of every tensor among ``values`` (real or fake), each storage once."""
    found: dict[int, int] = {}
    for t in tree_leaves(values):
        if isinstance(t, torch.Tensor):
            storage = t.untyped_storage()
            found[storage._cdata] = storage.nbytes()
    return found


@dataclass
class _GraphRun:
    """One graph's run in a training call: its variant and the storages it read and produced."""

    runtime: _GraphRuntime
    variant: _Variant | None  # None: the run of a graph about to be planned
    state: dict[int, int]  # parameter and buffer storages -> bytes
    parameters: dict[int, int]  # parameter storages (backward gives each a gradient of its size)
    inputs: dict[int, int]  # the other tensor inputs
    outputs: dict[int, int] = field(default_factory=dict)  # storages it returned that it made (activations)
    returned: GraphOutputs | None = None  # every tensor output, watched until the call ends

    @property
    def held(self) -> int:
        """What the run holds after its forward (0 for a graph about to be planned)."""
        return self.variant.simulation.held_after_forward_bytes if self.variant is not None else 0

    @property
    def held_eager(self) -> int:
        """What the run would hold after its forward unplanned."""
        return self.variant.eager_held if self.variant is not None else 0

    @staticmethod
    def of(runtime: _GraphRuntime, variant: _Variant | None, values: Sequence[Any]) -> _GraphRun:
        kinds = runtime.graph.kinds

        def of_kind(*wanted: str) -> dict[int, int]:
            return _storages([v for k, v in zip(kinds, values) if k in wanted])

        return _GraphRun(runtime, variant, of_kind(PARAMETER, BUFFER), of_kind(PARAMETER), of_kind(INPUT))

    def record(self, outputs: GraphOutputs) -> None:
        """What the run returned."""
        self.returned = outputs
        self.outputs = {s: b for s, b in zip(outputs.storages, outputs.nbytes)
                        if s not in self.state and s not in self.inputs}


def _sum_except(storages: dict[int, int], excluded: dict[int, int]) -> int:
    return sum(b for s, b in storages.items() if s not in excluded)


def step_contexts(runs: Sequence[_GraphRun], first: int = 0, eager: bool = False) -> list[StepContext]:
    """Per run of one call, what the other runs keep live beside it, with every run at its current plan (``eager``:
    with every run unplanned, the step eager runs); complete for the runs from ``first`` on (the later runs need
    plans, the earlier ones do not).

    Runs go forward in order and backward in reverse order. Beside run i: every parameter and buffer of the call
    and every input the caller passed (held by the caller through the call) that i does not read, and what each
    earlier run holds after its forward (less the outputs i reads, which its own profile counts as inputs); beside
    its backward also the gradients of later runs' parameters. The later runs' highest peak includes what run i
    holds, so it is given relative to that: a context does not depend on the run's own plan.
    """
    everything: dict[int, int] = {}
    produced: dict[int, int] = {}
    for r in runs:
        everything |= r.state
        produced |= r.outputs
    for r in runs:
        everything |= {s: b for s, b in r.inputs.items() if s not in produced}
    contexts = []
    held_before, earlier_outputs = 0, {}
    for i, r in enumerate(runs):
        later_parameters: dict[int, int] = {}
        for later in runs[i + 1:]:
            later_parameters |= later.parameters
        beside_forward = (_sum_except(everything, r.state | r.inputs) + held_before
                          - sum(b for s, b in r.inputs.items() if s in earlier_outputs))
        contexts.append(StepContext(beside_forward, beside_forward + _sum_except(later_parameters, r.state)))
        held_before += r.held_eager if eager else r.held
        earlier_outputs |= r.outputs
    later_peak = None
    for i in range(len(runs) - 1, first - 1, -1):
        held = runs[i].held_eager if eager else runs[i].held
        contexts[i] = dataclasses.replace(contexts[i], later_beyond_held=None if later_peak is None
                                          else later_peak - held)
        if i > first:
            profile_ = runs[i].variant.profile
            plan = Plan.no_split(profile_.num_ops) if eager else runs[i].variant.plan
            peak = simulate(dataclasses.replace(profile_, step_context=contexts[i]), plan).peak_bytes
            later_peak = peak if later_peak is None else max(later_peak, peak)
    return contexts


def _contexts_by_graph(runs: Sequence[_GraphRun], eager: bool) -> dict[str, StepContext]:
    """Per graph of a call of several runs, its :func:`step_contexts`; a graph run several times gets the widest."""
    found: dict[str, StepContext] = {}
    if len(runs) > 1:
        for run, context in zip(runs, step_contexts(runs, eager=eager)):
            code = run.runtime.graph.code
            found[code] = _widest(found[code], context) if code in found else context
    return found


def output_uses(runs: Sequence[_GraphRun], returned: Any) -> list[tuple[str, ...]]:
    """Per run of one call that returned ``returned``, per tensor output: what the step did with it (see
    :func:`sublinear.profiler.profile`). A later run reads it, or it is the loss: the scalars among what the call
    returned when there are any (a loss computed in forward), else every floating tensor it returned; those get a
    gradient. Of the others, what is still alive after the call was kept (a KV cache, a module attribute) and the
    rest was dropped when the graph returned."""
    returned = [t for t in tree_leaves(returned)
                if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()]
    losses = {t.untyped_storage()._cdata for t in ([t for t in returned if t.dim() == 0] or returned)}
    uses = []
    for i, run in enumerate(runs):
        read_later = set().union(*(later.inputs for later in runs[i + 1:]))
        uses.append(tuple(GRADIENT if s in read_later or s in losses else KEPT if alive else DROPPED
                          for s, alive in zip(run.returned.storages, run.returned.alive())))
    return uses


def _planned_knowing_later(variant: _Variant, context: StepContext | None) -> bool:
    """Whether ``variant`` was planned knowing the graphs after it, where ``context`` says there are some."""
    return context is None or context.later_beyond_held is None or (
        variant.planned_in is not None and variant.planned_in.later_beyond_held is not None)


def _widest(a: StepContext, b: StepContext) -> StepContext:
    """A context covering both (a graph that runs several times in a call is planned for its worst run)."""
    later = [v for v in (a.later_beyond_held, b.later_beyond_held) if v is not None]
    return StepContext(max(a.beside_forward, b.beside_forward), max(a.beside_backward, b.beside_backward),
                       max(later) if later else None)


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
            device = "meta" if model_device == "meta" and v.device.type == "cpu" else str(v.device)
            shape, stride = sizes.masked(i, v) if sizes is not None else (tuple(v.shape), tuple(v.stride()))
            key.append((shape, stride, str(v.dtype), device, v.requires_grad))
        else:
            key.append(repr(v))
    return tuple(key)


def _any_requires_grad(values: Sequence[Any]) -> bool:
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in tree_leaves(list(values)))


class _PlanStore:
    """A small least-recently-used store of what one session planned (a dry run's plans serve the real calls)."""

    def __init__(self, size: int = 64) -> None:
        self.entries: OrderedDict[tuple, tuple[GraphProfile, Plan, PlanningResult | None]] = OrderedDict()
        self.size = size

    def get(self, key: tuple):
        entry = self.entries.get(key)
        if entry is not None:
            self.entries.move_to_end(key)
        return entry

    def put(self, key: tuple, value) -> None:
        self.entries[key] = value
        while len(self.entries) > self.size:
            self.entries.popitem(last=False)


_UNSEEN = object()  # finish_call without the call's result (a bare torch.compile backend never sees it)
_USE_ORDER = (GRADIENT, KEPT, DROPPED)  # most demanding first


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
        self.store = _PlanStore()  # plans by graph, signature, context and config
        self.profiles = _PlanStore()  # profiles by graph, signature and cost model
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
        self.joints = _PlanStore(8)  # joint graphs by graph, signature and bound (inductor)
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
        """Run a graph from TorchDynamo's shared cache (see :data:`sublinear.capture.DISPATCH`) as this session's."""
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
            codes = {key[0] for key in self.store.entries} | {r.graph.code for r in self.graphs}
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
        cached = self.store.get(store_key)
        override = self.overrides.get(graph.code)
        disk = PlanCache(cache_dir(config.cache_dir))
        disk_key = PlanCache.key(graph=graph.code, values=key, config=config.planning_key(),
                                 context=repr(context), uses=uses, compiler=compiler, cut=cut,
                                 bound=sorted(bound.items()))
        at_bound = graph.sizes.stand_ins(values, bound) if bound else values  # profiled at the plan's sizes
        if cached is not None:
            profile_, node_names, plan, result = cached
        else:
            profiled = self.profiles.get(profile_key)  # a graph planned again in a new context is not profiled again
            entry = disk.load(disk_key) if override is None else None
            if compiler == "inductor":
                if profiled is None:
                    compiled = profile_joint(self._joint(graph, values, key, bound), graph, uses)
                    profiled = compiled.profile, compiled.node_names
                if entry is not None:
                    entry = disk.check(entry, disk_key, profiled[0].num_ops)
            elif entry is not None:
                estimated = profiled or (profile(graph, at_bound, cost_model="estimate", uses=uses), None)
                entry = disk.check(entry, disk_key, estimated[0].num_ops)
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
                disk.store(disk_key, {"num_ops": profile_.num_ops, **plan.as_dict(), "costs": profile_.costs(),
                                      "history": [[c.simulation.peak_bytes, c.simulation.time_ratio]
                                                  for c in result.history]})
        elif result is not None:
            origin = result.origin
        if result is not None:
            history = tuple((c.simulation.peak_bytes, c.simulation.time_ratio) for c in result.history)
        if not settling:
            self.store.put(store_key, (profile_, node_names, plan, result))
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
        :func:`sublinear.compiled.resolve_compiler`); a graph inductor cannot trace runs eagerly."""
        if self.graph.code in self.backend.eager_only:
            return "eager"
        compiler = resolve_compiler(self.backend.config.compiler, device_of(values).type)
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
        """Plan for ``values``; a dynamic graph for its sizes' bucket (:func:`sublinear.shapes.bucket`), or, when
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


def backend(config: SublinearMemoryConfig | None = None) -> SublinearBackend:
    """The ``torch.compile`` backend: ``torch.compile(model, backend=sublinear.backend(config))``."""
    return SublinearBackend(config)


# ---------------------------------------------------------------------------------------------------------------
# Running modules through the backend


MIN_RECOMPILE_LIMIT = 64


def _ensure_recompile_room() -> None:
    """TorchDynamo compiles a forward again for each new parameter shape, type or guarded Python value, and past
    ``recompile_limit`` (8 by default) runs it eagerly. Sublinear's graphs are cheap to keep, so the limit is
    raised to at least 64 (and the accumulated limit to at least 8 times that)."""
    config = torch._dynamo.config
    if config.recompile_limit < MIN_RECOMPILE_LIMIT:
        log.debug("raising torch._dynamo.config.recompile_limit from %d to %d", config.recompile_limit,
                  MIN_RECOMPILE_LIMIT)
        config.recompile_limit = MIN_RECOMPILE_LIMIT
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 8 * MIN_RECOMPILE_LIMIT)


# ---------------------------------------------------------------------------------------------------------------
# Modules


def compile_module(module: nn.Module | Callable[..., Any], session: SublinearBackend, name: str,
                    owner: nn.Module) -> Callable[..., Any]:
    """``module`` (or a forward) under TorchDynamo with the shared backend, its graphs run under ``session``;
    graph breaks are noted at the first call, and a training call that ran no graph is reported. ``owner`` is the
    user's module, checked for FSDP units inside it at every call (their hooks would be bypassed)."""
    _ensure_recompile_room()
    session.progress.what = name
    compiled = compile_entry(module, name, dynamic=None)
    session.positional_names = _positional_names(module)

    def run(*args: Any, **kwargs: Any) -> Any:
        refuse_nested_fsdp(owner)
        if any_torch_dispatch_mode_on_stack():
            # TorchDynamo refuses to compile under such a mode and then skips the forward's code for good.
            if not session._warned_mode:
                session._warned_mode = True
                log.warning("sublinear: %s ran under a TorchDispatchMode (such as FlopCounterMode or MemTracker) "
                            "that TorchDynamo cannot compile under: this call runs the original forward, unplanned",
                            name)
            return module(*args, **kwargs)
        if session.uncapturable and input_signature(args, kwargs) in session.uncapturable:
            return module(*args, **kwargs)
        mark_max_sizes(session.config, session.positional_names, args, kwargs)
        session.ran_graph = False
        session.explicit_calls = True
        if not session.graphs:  # the first call captures and plans: its progress counts from here
            session.progress.begin()
            if not session.latest and _has_budget(session.config, args, kwargs):
                # Under a budget the call's graphs are planned together, on a data-less twin, before the first of
                # them runs: planned one by one as they run, the first ones would not know the later ones.
                try:
                    plan_ahead(owner, session, args, kwargs)
                except CaptureError as exc:
                    log.warning("sublinear: %s could not be planned ahead on a data-less copy (%s); its graphs are "
                                "planned one by one as they run, so the first call may exceed the budget", name, exc)
        session.begin_call()
        try:
            with receiving(session):
                try:
                    if session.graphs:
                        out = compiled(*args, **kwargs)
                    else:
                        with graph_breaks() as breaks:
                            out = compiled(*args, **kwargs)
                        session.note_breaks(breaks)
                except TorchDynamoException as exc:
                    what = f"{name}.forward"
                    if session.ran_graph:  # a graph of this call ran, with its side effects: no second run
                        raise capture_error(exc, what) from exc
                    out = eager_or_model_error(module, args, kwargs)
                    reason = session.uncapturable[input_signature(args, kwargs)] = str(capture_error(exc, what))
                    log.warning("sublinear: %s; this call and later ones with its input shapes run eagerly, "
                                "unplanned (exact, with eager's memory)", reason)
                    return out
            session.finish_call(out)
            session.say_breaks(name)
        finally:
            session.progress.end(lambda: session.sublinear_plan.headline if session.sublinear_plan else "no graph")
        if not session.ran_graph and not session._warned_unplanned:
            session._warned_unplanned = True
            log.warning("sublinear: this training call of %s ran no captured graph (TorchDynamo captured nothing, "
                        "or reached its recompile limit and ran the forward eagerly): it was not planned", name)
        return out

    return run


def mark_max_sizes(config: SublinearMemoryConfig, positional: Sequence[str], args: Sequence[Any],
                   kwargs: dict[str, Any]) -> None:
    """Make the dimensions ``config.max_sizes`` names symbolic for TorchDynamo from the first call on
    (``maybe_mark_dynamic``), so one dynamic graph, planned for those sizes, serves every smaller shape."""
    for name, sizes in config.max_sizes or ():
        value = kwargs.get(name, args[positional.index(name)] if name in positional[:len(args)] else None)
        if isinstance(value, torch.Tensor):
            for dim, size in enumerate(sizes[:value.dim()]):
                if size is not None:
                    torch._dynamo.maybe_mark_dynamic(value, dim)


def _has_budget(config: SublinearMemoryConfig, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """Whether calls with these arguments are planned under a memory budget ("auto": on CUDA)."""
    if config.memory_budget == "auto":
        return device_of([args, kwargs]).type == "cuda"
    return config.memory_budget is not None


def _positional_names(forward: Callable[..., Any]) -> tuple[str, ...]:
    """The names of ``forward``'s positional parameters, in order (a module's: its ``forward``'s, without self)."""
    target = forward.forward if isinstance(forward, nn.Module) else forward
    try:
        parameters = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):
        return ()
    return tuple(p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


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


COMPILED_ROUNDS = 3  # plans searched again below the budget when the compiled graphs hold more than simulated
PLAN_AHEAD_ROUNDS = 3  # a graph planned again beside the others changes what they run beside: a few rounds settle


@collecting_new_objects_only()
def plan_ahead(module: nn.Module, backend_: SublinearBackend, args: Sequence[Any],
               kwargs: dict[str, Any] | None) -> None:
    """Plan every graph of ``module(*args, **kwargs)`` now, on a data-less twin (the module is not run), each for the
    whole step (in a few rounds when the call has several graphs); :class:`BudgetError` when the step cannot fit.
    A model whose eager code between graphs needs tensor values is planned at its first training call instead."""
    backend_.positional_names = _positional_names(module)
    mark_max_sizes(backend_.config, backend_.positional_names, args, kwargs or {})
    backend_.progress.what = type(module).__name__
    backend_.progress.begin()
    try:
        with _disable_current_modes():  # a memory tracker around the step sees the step, not its planning
            _plan_captured(module, backend_, args, kwargs)
    finally:
        backend_.progress.end(lambda: backend_.sublinear_plan.headline if backend_.sublinear_plan else "no graph")


def _plan_captured(module: nn.Module, backend_: SublinearBackend, args: Sequence[Any],
                   kwargs: dict[str, Any] | None) -> None:
    try:
        captured = capture(module, args, kwargs)
    except NeedsData as exc:
        log.warning("sublinear: cannot plan %s ahead, so .sublinear_plan stays None until the first training call "
                    "plans it: %s", type(module).__name__, exc)
        return
    runtimes = []
    for graph in captured.graphs:
        runtime = _GraphRuntime(graph, backend_, len(backend_.graphs))
        backend_.graphs.append(runtime)
        runtimes.append(runtime)
    for _round in range(PLAN_AHEAD_ROUNDS):
        backend_.begin_call()
        for runtime in runtimes:
            run = _GraphRun.of(runtime, runtime.variant_for(runtime.graph.example_values, dry_run=True),
                               runtime.graph.example_values)
            run.record(runtime.graph.example_outputs)
            backend_.call.append(run)
        if not backend_.finish_call(captured.returned):
            break
    backend_.note_breaks(captured.breaks)
    backend_.say_breaks(type(module).__name__)
    unfit = [v for v in backend_.latest.values() if not v.accepted]
    if unfit:  # the graphs were planned for each other and the step still misses the budget
        worst = max(unfit, key=lambda v: v.simulation.peak_bytes)
        raise BudgetError(worst.objective, Candidate(worst.plan, worst.simulation), None,
                          floor=step_floor(worst.profile))
    backend_.graphs.clear()  # the real calls capture their own graphs; the plans wait in the store
