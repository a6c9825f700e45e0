"""The sublinear backend: what runs each graph TorchDynamo captures, and what it says it ran.

A :class:`SublinearBackend` is one session per compiled model, made of three parts: the graphs it was handed
(:class:`~sublinear.runtime.graph.GraphRuntime`, one per captured graph), the training calls it saw
(:class:`~sublinear.runtime.calls.CallTracker`) and the plan pipeline that profiles, plans and compiles each graph
with its caches and compile check (:class:`~sublinear.runtime.pipeline.PlanPipeline`)."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from sublinear.capture.dynamo import CapturedGraph, GraphBreak, InputSignature, SharedGraph
from sublinear.capture.attention import with_attention_fused
from sublinear.capture.lm_head import device_type, with_lm_heads_chunked
from sublinear.config import SublinearMemoryConfig
from sublinear.core.plan import Plan
from sublinear.core.profile import ShardedParameters
from sublinear.execute.compiled import resolve_compiler, start_isa_probe
from sublinear.profiling.costs import device_rates
from sublinear.progress import PlanningProgress
from sublinear.runtime.calls import UNSEEN, CallTracker
from sublinear.runtime.graph import GraphRuntime
from sublinear.runtime.pipeline import PlanPipeline
from sublinear.runtime.step import argument_storages
from sublinear.runtime.plans import ParetoPoint, SublinearPlan
from sublinear.runtime.variant import GraphVariant

__all__ = ["SublinearBackend", "backend", "collecting_new_objects_only", "named_backend", "rewritten"]

log = logging.getLogger("sublinear")


def rewritten(graph: CapturedGraph, config: SublinearMemoryConfig) -> CapturedGraph:
    """``graph`` as a session of ``config`` plans and runs it: its attentions fused (``fuse_attention``) and its LM
    heads chunked (``chunk_lm_heads``); each setting, where None, is on where inductor runs the graph or it is
    planned on meta."""
    device = device_type(graph)
    default = device == "meta" or resolve_compiler(config.compiler, device)[0] == "inductor"
    if default if config.fuse_attention is None else config.fuse_attention:
        graph = with_attention_fused(graph)
    if default if config.chunk_lm_heads is None else config.chunk_lm_heads:
        rates = device_rates(device)  # meta: the reference GPU's
        graph = with_lm_heads_chunked(
            graph, lambda itemsize: rates.matmul_flops_per_second(itemsize) / rates.bytes_per_second)
    return graph


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
        self.graphs: list[GraphRuntime] = []
        self.breaks: list[GraphBreak] = []
        self.calls = CallTracker()
        self.progress = PlanningProgress("the model")
        self.pipeline = PlanPipeline(config, self.progress)
        self.positional_names: tuple[str, ...] = ()  # the compiled forward's positional parameters (max_sizes)
        self.on_plan: Callable[[SublinearPlan | None], None] | None = None  # told what each finished call ran
        self.uncapturable: dict[InputSignature, str] = {}  # call signatures TorchDynamo cannot capture -> why
        self.ran_graph = False
        self._shared: dict[int, tuple[CapturedGraph, GraphRuntime]] = {}  # by graph: the captured one, its runtime
        self._warned: set[str] = set()

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        return self.add_graph(CapturedGraph.from_dynamo(gm, example_inputs))

    def add_graph(self, graph: CapturedGraph) -> GraphRuntime:
        """A captured graph this session runs from now on, as :func:`rewritten` for its config."""
        self.prepare_compiler(device_type(graph))
        runtime = GraphRuntime(rewritten(graph, self.config), self, len(self.graphs))
        self.graphs.append(runtime)
        self.calls.captures += 1
        log.debug("captured graph %d: %s", runtime.index, runtime.graph.describe())
        return runtime

    def prepare_compiler(self, device: str) -> None:
        """Where inductor will compile this session's graphs on ``device``, start its one-time probe of the toolchain
        in the background (:mod:`sublinear.execute.compiled.toolchain`)."""
        if resolve_compiler(self.config.compiler, device)[0] == "inductor":
            start_isa_probe(device)

    def forget_graphs(self) -> None:
        """Drop the captured graphs (the plans stay in the pipeline's store for the graphs captured next)."""
        self.graphs.clear()

    def run_graph(self, shared: SharedGraph, values: Sequence[Any]) -> Any:
        """Run a graph from TorchDynamo's shared cache (see :data:`sublinear.capture.dynamo.DISPATCH`) as this
        session's."""
        captured, runtime = self._shared.get(id(shared), (None, None))
        if runtime is None or captured is not shared.graph:
            runtime = self.add_graph(shared.graph)
            self._shared[id(shared)] = (shared.graph, runtime)
        self.ran_graph = True
        return runtime(*values)

    def __reduce__(self):
        return (SublinearBackend, (self.config,))

    def first_time(self, what: str) -> bool:
        """True the first time it is asked about ``what`` (a warning said once per session)."""
        if what in self._warned:
            return False
        self._warned.add(what)
        return True

    @property
    def latest(self) -> dict[str, GraphVariant]:
        """Per graph (by code), the variant the latest finished training call ran, in the order it ran."""
        return self.calls.latest

    @property
    def sublinear_plan(self) -> SublinearPlan | None:
        """What the latest training call ran. A bare ``torch.compile`` backend sees no call end (a call ends when
        the next one starts), so there it is the graphs run since the latest call began."""
        variants, runs = self.calls.latest, len(self.calls.previous)
        if not self.calls.explicit and self.calls.current:
            variants, runs = self.calls.running(), len(self.calls.current)
        if not variants:
            return None
        graphs = tuple(dataclasses.replace(v.summary, graph=k) for k, v in enumerate(variants.values()))
        return SublinearPlan(graphs, tuple(self.breaks), runs)

    def begin_call(self, arguments: Any = None) -> None:
        """A new training call starts, passed ``arguments`` (None: unknown): :attr:`sublinear_plan` will describe
        the graphs it runs."""
        self.calls.begin(None if arguments is None else argument_storages(arguments))

    def finish_call(self, returned: Any = UNSEEN) -> list[GraphRuntime]:
        """The call ended, returning ``returned``: :attr:`sublinear_plan` describes it; returns the graphs to plan
        again (:meth:`CallTracker.finish <sublinear.runtime.calls.CallTracker.finish>`)."""
        stale = self.calls.finish(returned)
        if self.on_plan is not None:
            self.on_plan(self.sublinear_plan)
        return stale

    def use(self, point: ParetoPoint | Plan) -> None:
        """Run ``point``'s plan for its graph from the next call on; a bare :class:`Plan` applies to the only graph
        captured or planned so far."""
        if isinstance(point, ParetoPoint):
            plan, code = point.plan, point.graph_code
        elif isinstance(point, Plan):
            codes = self.pipeline.graph_codes() | {r.graph.code for r in self.graphs}
            if len(codes) != 1:
                raise ValueError(f"use(plan) applies a bare Plan to the only graph, and {len(codes)} graphs were "
                                 "captured; pass a ParetoPoint from sublinear.pareto for the graph you mean")
            plan, code = point, codes.pop()
        else:
            raise TypeError(f"use() takes a ParetoPoint or a Plan, got {type(point).__name__}")
        self.pipeline.choices.override(code, plan)
        for runtime in self.graphs:
            runtime.variants.clear()

    def note_breaks(self, breaks: Sequence[GraphBreak]) -> None:
        """Record graph breaks (each place and reason once)."""
        self.breaks.extend(b for b in dict.fromkeys(breaks) if b not in self.breaks)

    def say_breaks(self, what: str) -> None:
        """Once the first call that broke into graphs is over, say at WARNING, once, into how many graphs and at
        which breaks, with every reason: the same counts as :attr:`sublinear_plan`."""
        plan = self.sublinear_plan
        if not self.breaks or plan is None or not self.first_time("breaks"):
            return
        log.warning("sublinear: TorchDynamo split %s into %d graphs%s at %d graph break(s); the code at each break "
                    "runs eagerly, unplanned:\n%s", what, len(plan.graphs),
                    f" ({plan.runs} graph runs per call)" if plan.runs > len(plan.graphs) else "", len(plan.breaks),
                    "\n".join(f"  {b}" for b in plan.breaks))


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


_NAMED_SESSIONS: dict[str, SublinearBackend] = {}


def named_backend(gm: torch.fx.GraphModule, example_inputs: list[Any], mode: str | None = None,
                  options: dict[str, Any] | None = None) -> Callable[..., Any]:
    """The backend named "sublinear" (the ``torch_dynamo_backends`` entry point), for tools that choose a backend
    by name: ``torch.compile(model, backend="sublinear", options={"memory_budget": "8GiB"})``. ``options`` are
    :class:`~sublinear.config.SublinearMemoryConfig` fields by either name; graphs compiled with equal options share
    one session (a name carries no model). ``mode`` is inductor's and has no meaning here. accelerate (and with it
    the Hugging Face Trainer's ``torch_compile_backend``) accepts only the backend names of its own list."""
    key = repr(sorted((options or {}).items()))
    session = _NAMED_SESSIONS.get(key)
    if session is None:
        session = _NAMED_SESSIONS[key] = SublinearBackend(SublinearMemoryConfig(**(options or {})))
    return session(gm, example_inputs)


named_backend.reset = _NAMED_SESSIONS.clear  # torch._dynamo.reset() forgets the sessions with its caches
