"""User surface: ``sublinear.compile`` and the ``@sublinear.trace`` train-function decorator.

Both run the pipeline capture → profile → plan (grid, genetic, cached) → rewrite on data-less copies of the model
and hand back a :class:`SublinearModule`, which shares the user's parameters, buffers and submodules.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils._pytree import tree_map

from .cache import PlanCache, cache_dir
from .config import SublinearMemoryConfig
from .grid import Candidate
from .plan import Plan
from .planner import BudgetError, PlanningResult, make_plan, pareto_front
from .profiler import GraphProfile, profile
from .rewriter import CheckpointedModule, rewrite, share_module_state
from .sharding import ShardedParameters, fsdp_sharding, refuse_nested_fsdp
from .simulator import simulate
from .tracer import CapturedGraph, capture, input_signature

__all__ = ["ParetoPoint", "SublinearModule", "SublinearPlan", "compile", "pareto", "trace"]

log = logging.getLogger("sublinear")


@dataclass(frozen=True)
class SublinearPlan:
    """The plan a compiled module runs, with its predictions at the inputs it was planned for (bytes, FLOPs)."""

    split_points: tuple[int, ...]
    kept_ops: tuple[int, ...]
    soft_points: tuple[int, ...]  # split points whose boundary is rebuilt (nested blocks)
    num_ops: int
    predicted_peak_bytes: int
    baseline_peak_bytes: int
    recompute_flops: int
    forward_flops: int
    step_flops: int  # eager forward + backward
    history: tuple[int, ...]
    planning_seconds: float  # capture + profile + search
    search_seconds: float  # grid (+ genetic) search alone; 0 when the plan came from the cache
    capture_method: str
    from_cache: bool

    @property
    def num_blocks(self) -> int:
        return len(self.split_points)

    @property
    def flops_ratio(self) -> float:
        """Step FLOPs (forward, recompute, backward) relative to eager's."""
        return 1 + self.recompute_flops / self.step_flops if self.step_flops else 1.0

    def to_plan(self) -> Plan:
        return Plan(self.split_points, frozenset(self.kept_ops), frozenset(self.soft_points))

    def __str__(self) -> str:
        mib = 2**20
        nested = f" ({len(self.soft_points)} nested)" if self.soft_points else ""
        return (f"{self.num_blocks} blocks{nested} over {self.num_ops} ops: predicted peak "
                f"{self.predicted_peak_bytes / mib:.1f} MiB vs eager {self.baseline_peak_bytes / mib:.1f} MiB, "
                f"recompute {self.recompute_flops / 1e9:.2f} GFLOP (step FLOPs x{self.flops_ratio:.3f})")


def plan_module(module: nn.Module, args: Sequence[Any], kwargs: dict[str, Any] | None,
                config: SublinearMemoryConfig, sharding: ShardedParameters | None = None) -> CheckpointedModule:
    """Capture, profile and plan ``module`` for this call (on data-less copies) and rewrite it.

    ``sharding``: how FSDP2 holds the parameters and gradients on this rank; None for full ones.
    """
    kwargs = dict(kwargs or {})
    started = time.perf_counter()
    with _training(module):
        captured = capture(module, args, kwargs)
        graph_profile = dataclasses.replace(profile(captured, args, kwargs), sharding=sharding)
    result, from_cache = _search(captured, graph_profile, args, kwargs, config)
    compiled = rewrite(captured, graph_profile, result.plan)
    compiled.sublinear_plan = SublinearPlan(
        split_points=result.plan.split_points, kept_ops=tuple(sorted(result.plan.kept)),
        soft_points=tuple(sorted(result.plan.soft)), num_ops=graph_profile.num_ops, predicted_peak_bytes=result.simulation.peak_bytes,
        baseline_peak_bytes=result.baseline.peak_bytes, recompute_flops=result.simulation.recompute_flops,
        forward_flops=graph_profile.forward_flops, step_flops=graph_profile.step_flops, history=result.history,
        planning_seconds=time.perf_counter() - started, search_seconds=result.seconds,
        capture_method=captured.method, from_cache=from_cache)
    compiled.sublinear_profile = graph_profile
    compiled.sublinear_config = config
    log.info("planned %s for %s: %s", type(module).__name__, captured.example.describe(), compiled.sublinear_plan)
    return compiled


def _search(captured: CapturedGraph, graph_profile: GraphProfile, args, kwargs,
            config: SublinearMemoryConfig) -> tuple[PlanningResult, bool]:
    cache = PlanCache(cache_dir(config.cache_dir))
    key = PlanCache.key(captured.graph_module.code,
                        repr(input_signature(args, kwargs)) + _autocast_key() + repr(graph_profile.sharding),
                        config.planning_key(), graph_profile.num_ops)
    entry = cache.load(key, graph_profile.num_ops)
    if entry is not None:
        plan = Plan.from_dict(entry)
        log.info("plan cache hit (%s): search skipped", key[:12])
        return PlanningResult(plan, simulate(graph_profile, plan),
                              simulate(graph_profile, Plan.no_split(graph_profile.num_ops)), (),
                              tuple(entry["history"]), 0.0), True
    result = make_plan(graph_profile, config)
    cache.store(key, {"num_ops": graph_profile.num_ops, **result.plan.as_dict(), "history": list(result.history)})
    return result, False


def _autocast_key() -> str:
    return repr([(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")])


@contextlib.contextmanager
def _training(module: nn.Module):
    """Capture and profile the training graph; restore every submodule's mode afterwards."""
    modes = [(m, m.training) for m in module.modules()]
    module.train()
    try:
        yield
    finally:
        for m, mode in modes:
            m.training = mode


def _fingerprint(module: nn.Module) -> tuple:
    """What a plan depends on and a captured graph holds on to: the submodule objects (and their classes, which
    wrappers such as fully_shard swap) and the parameters' shapes and dtypes."""
    return (tuple((name, id(m), type(m)) for name, m in module.named_modules()),
            tuple((name, tuple(p.shape), p.dtype) for name, p in module.named_parameters()))


class SublinearModule(nn.Module):
    """The compiled model.

    It shares the original module's parameter, buffer and submodule dictionaries, so ``state_dict()``,
    ``parameters()`` and optimizers see exactly the original's objects. In training with grad enabled it runs a
    plan for the call's input signature (shapes, dtypes, devices and non-tensor arguments); otherwise it calls the
    original forward unchanged. With ``replan=True`` every new signature is planned; otherwise a plan is reused for
    any signature its captured graph serves (symbolic_trace graphs serve every batch size). A change of submodules
    or parameter shapes after planning is detected at the next call, logged, and planned anew. After
    ``fully_shard`` (FSDP2) the next call plans for the rank's FSDP layout of parameters and gradients.
    """

    def __init__(self, module: nn.Module, config: SublinearMemoryConfig, replan: bool) -> None:
        super().__init__()
        share_module_state(self, module)
        object.__setattr__(self, "config", config)
        object.__setattr__(self, "replan", replan)
        object.__setattr__(self, "_variants", {})
        object.__setattr__(self, "_latest", None)
        object.__setattr__(self, "_fingerprint", _fingerprint(module))

    def train(self, mode: bool = True) -> SublinearModule:
        self.original_module.train(mode)
        return super().train(mode)

    @property
    def sublinear_plan(self) -> SublinearPlan | None:
        """The plan of the latest planned (or used) signature."""
        return None if self._latest is None else self._latest.sublinear_plan

    @property
    def sublinear_profile(self) -> GraphProfile | None:
        return None if self._latest is None else self._latest.sublinear_profile

    def extra_repr(self) -> str:
        return f"{type(self.original_module).__name__}, {len(self._variants)} planned signature(s)"

    def plan_for(self, args: Sequence[Any], kwargs: dict[str, Any] | None = None) -> CheckpointedModule:
        """The rewritten module for this call signature, planning it (on meta copies) when needed."""
        kwargs = dict(kwargs or {})
        current = _fingerprint(self.original_module)
        sharding = fsdp_sharding(self)
        if current != self._fingerprint:
            # FSDP gathers parameters at its MixedPrecisionPolicy's dtype: expected, not a user change
            report = log.info if sharding is not None else log.warning
            report("%s changed since it was planned (submodules, parameter shapes or dtypes); planning again",
                   type(self.original_module).__name__)
            self._variants.clear()
            object.__setattr__(self, "_fingerprint", current)
        key = (input_signature(args, kwargs), tuple(m.training for m in self.original_module.modules()), sharding)
        variant = self._variants.get(key)
        if variant is None and not self.replan:
            variant = next((v for (sig, modes, layout), v in self._variants.items() if modes == key[1]
                            and layout == sharding and v._captured.shape_generic
                            and sig.constants == key[0].constants), None)
        if variant is None:
            refuse_nested_fsdp(self)
            if sharding is not None:
                log.info("planning %s for its FSDP layout: %s", type(self.original_module).__name__, sharding)
            if sharding is not None and sharding.casts_inputs:
                log.warning("FSDP's MixedPrecisionPolicy casts the inputs before sublinear sees them: the plan counts "
                            "the cast copies, not the originals the caller still holds (leave their bytes free)")
            meta_args, meta_kwargs = tree_map(_to_meta, (tuple(args), kwargs))
            variant = plan_module(self.original_module, meta_args, meta_kwargs, self.config, sharding)
        self._variants[key] = variant
        object.__setattr__(self, "_latest", variant)
        return variant

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not (self.training and torch.is_grad_enabled()) or torch.is_inference_mode_enabled():
            return self.original_module(*args, **kwargs)
        return self.plan_for(args, kwargs)(*args, **kwargs)


def _to_meta(value: Any) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    meta = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    return meta.requires_grad_(value.requires_grad) if value.is_floating_point() else meta


def compile(module: nn.Module, example_inputs: Sequence[Any] | Any = (), example_kwargs: dict[str, Any] | None = None,
            config: SublinearMemoryConfig | None = None) -> SublinearModule:
    """Plan ``module`` at the example inputs (real or meta tensors) and return a module that recomputes per plan.

    ``.sublinear_plan`` describes the plan. The module accepts other batch sizes: graphs that symbolic_trace
    captured serve any shape with the same plan; shape-specialised captures are planned again for new shapes.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"sublinear.compile needs an nn.Module, got {type(module).__name__}")
    if config is not None and not isinstance(config, SublinearMemoryConfig):
        raise TypeError(f"config must be a SublinearMemoryConfig, got {type(config).__name__}")
    if isinstance(module, (SublinearModule, DistributedDataParallel)):
        raise TypeError(f"compile the plain module, not a {type(module).__name__} (wrap the compiled module in "
                        "DistributedDataParallel afterwards)")
    example_inputs = tuple(example_inputs) if isinstance(example_inputs, (list, tuple)) else (example_inputs,)
    compiled = SublinearModule(module, config or SublinearMemoryConfig(), replan=False)
    compiled.plan_for(example_inputs, example_kwargs)
    return compiled


def trace(fn: Callable | None = None, *, sublinear_memory_config: SublinearMemoryConfig | None = None) -> Callable:
    """Decorate a train function: every ``nn.Module`` it receives (positionally or by keyword, bare or inside
    ``DistributedDataParallel``) runs through a :class:`SublinearModule`, planned at its first call's shapes,
    dtypes, device and autocast state, and planned again when that signature changes. The user's modules are
    left as they were; return values and exceptions pass through."""
    if fn is None:
        return functools.partial(trace, sublinear_memory_config=sublinear_memory_config)
    if not callable(fn):
        raise TypeError(f"sublinear.trace decorates a function, got {type(fn).__name__}")
    config = sublinear_memory_config or SublinearMemoryConfig()
    if not isinstance(config, SublinearMemoryConfig):
        raise TypeError(f"sublinear_memory_config must be a SublinearMemoryConfig, got {type(config).__name__}")
    compiled: weakref.WeakKeyDictionary[nn.Module, SublinearModule] = weakref.WeakKeyDictionary()

    def compiled_for(module: nn.Module) -> SublinearModule:
        if module not in compiled:
            compiled[module] = SublinearModule(module, config, replan=True)
        return compiled[module]

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with contextlib.ExitStack() as restore:
            def swap(value: Any) -> Any:
                if isinstance(value, DistributedDataParallel):
                    # DDP keeps its hooks and reducer; only the module it forwards to is the compiled one.
                    inner = value._modules["module"]
                    value._modules["module"] = compiled_for(inner)
                    restore.callback(value._modules.__setitem__, "module", inner)
                    return value
                if isinstance(value, nn.Module) and not isinstance(value, SublinearModule):
                    return compiled_for(value)
                return value

            args = tuple(swap(a) for a in args)
            kwargs = {k: swap(v) for k, v in kwargs.items()}
            return fn(*args, **kwargs)

    wrapper.sublinear_modules = compiled
    return wrapper


@dataclass(frozen=True)
class ParetoPoint:
    plan: Plan
    peak_bytes: int
    recompute_flops: int
    flops_ratio: float  # step FLOPs relative to eager


def pareto(module: nn.Module, example_inputs: Sequence[Any] | Any = (), example_kwargs: dict[str, Any] | None = None,
           config: SublinearMemoryConfig | None = None, budgets: int = 8) -> list[ParetoPoint]:
    """The non-dominated (predicted peak, recompute FLOPs) plans found for ``module`` at the example inputs.

    Candidates: every grid plan and its keep variants, plus the least-recompute plan for ``budgets`` memory
    budgets spread between the lowest peak found and eager (each refined by the genetic search when
    ``config.genetic_nr_iter`` > 0). Sorted by increasing peak, hence decreasing recompute.
    """
    config = config or SublinearMemoryConfig()
    example_inputs = tuple(example_inputs) if isinstance(example_inputs, (list, tuple)) else (example_inputs,)
    with _training(module):
        captured = capture(module, example_inputs, example_kwargs)
        graph_profile = profile(captured, example_inputs, example_kwargs)
    first = make_plan(graph_profile, config)
    found = list(first.candidates) + [Candidate(first.plan, first.simulation, float("nan"))]
    low, high = first.simulation.peak_bytes, first.baseline.peak_bytes
    for k in range(1, budgets + 1):
        budget = int(low + (high - low) * k / (budgets + 1))
        try:
            result = make_plan(graph_profile, dataclasses.replace(config, memory_budget=budget))
        except BudgetError:
            continue
        found.append(Candidate(result.plan, result.simulation, float("nan")))
    step = graph_profile.step_flops or 1
    return [ParetoPoint(c.plan, c.simulation.peak_bytes, c.simulation.recompute_flops,
                        1 + c.simulation.recompute_flops / step) for c in pareto_front(found)]

