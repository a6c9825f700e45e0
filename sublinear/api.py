"""User surface, built on one ``torch.compile`` backend (:mod:`sublinear.runtime`).

- ``torch.compile(model, backend=sublinear.backend(config))``: TorchDynamo captures the forward; every graph it
  hands the backend is profiled, planned and rewritten at each new call signature, at the first training call
  with it (on fake tensors: planning allocates no activation memory).
- ``sublinear.compile(model, example_inputs)``: a module sharing the model's parameters that runs through that
  backend, planned up front when example inputs are given (on a data-less twin, so the model is not run).
- ``sublinear.apply(model)``: the same, installed on the model itself (its ``forward``), so that a Hugging Face
  ``Trainer`` or a LightningModule that holds the model trains it planned, unchanged otherwise.
- ``@sublinear.trace``: a train function whose module arguments (and a method's ``self``'s submodules) run planned.
- ``sublinear.pareto``: the non-dominated (predicted peak, predicted time) plans, each applicable with ``use``.

In evaluation, under ``no_grad`` and in inference mode the original forward runs unchanged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import math
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils._pytree import tree_map

from sublinear.runtime import (GraphPlan, ParetoPoint, SublinearBackend, SublinearPlan, backend, compile_module,
                      plan_ahead, rewritten)
from sublinear.capture.dynamo import ModelErrorsAsEager, capture, model_error
from sublinear.config import SublinearMemoryConfig
from sublinear.core.objective import ratio_over
from sublinear.core.plan import Plan
from sublinear.core.profile import GraphProfile
from sublinear.planners import BudgetError, make_plan, pareto_front
from sublinear.profiling.graph import profile
from sublinear.sharding import fsdp_sharding, refuse_nested_fsdp

__all__ = ["GraphPlan", "ParetoPoint", "SublinearBackend", "SublinearModule", "SublinearPlan", "apply", "backend",
           "compile", "pareto", "remove", "trace"]

log = logging.getLogger("sublinear")


# ---------------------------------------------------------------------------------------------------------------
# Modules


def share_module_state(wrapper: nn.Module, original: nn.Module) -> None:
    """``wrapper`` holds ``original``'s own parameter, buffer and submodule dicts (so the same tensors, state_dict
    keys and optimizer targets) and follows its training flag; ``wrapper.original_module`` is ``original``."""
    wrapper._parameters = original._parameters
    wrapper._buffers = original._buffers
    wrapper._non_persistent_buffers_set = original._non_persistent_buffers_set
    wrapper._modules = original._modules
    wrapper.training = original.training
    object.__setattr__(wrapper, "original_module", original)


def _restore_module(module: nn.Module, config: SublinearMemoryConfig) -> SublinearModule:
    return SublinearModule(module, config)


class SublinearModule(nn.Module):
    """The compiled model.

    It shares the original module's parameter, buffer and submodule dictionaries, so ``state_dict()``,
    ``parameters()`` and optimizers see exactly the original's objects. Training calls with grad enabled run
    through TorchDynamo and the sublinear backend (planned per call signature); other calls run the original
    forward. Pickling saves the original module and the config; the loaded module plans again.
    """

    def __init__(self, module: nn.Module, config: SublinearMemoryConfig | None = None) -> None:
        super().__init__()
        refuse_nested_fsdp(module)
        share_module_state(self, module)
        backend_ = SublinearBackend(config, sharding=lambda: fsdp_sharding(self))
        object.__setattr__(self, "sublinear_backend", backend_)
        object.__setattr__(self, "_run", compile_module(module, backend_, type(module).__name__, module))

    @property
    def config(self) -> SublinearMemoryConfig:
        return self.sublinear_backend.config

    def __reduce__(self):
        return (_restore_module, (self.original_module, self.config))

    def train(self, mode: bool = True) -> SublinearModule:
        self.original_module.train(mode)
        return super().train(mode)

    @property
    def sublinear_plan(self) -> SublinearPlan | None:
        """What the latest training call ran (or, before any call, what ``example_inputs`` were planned for)."""
        return self.sublinear_backend.sublinear_plan

    @property
    def sublinear_profile(self) -> GraphProfile | None:
        """The profile of the latest call's graph, when it ran one graph."""
        latest = self.sublinear_backend.latest
        return next(iter(latest.values())).profile if len(latest) == 1 else None

    def use(self, point: ParetoPoint | Plan) -> SublinearModule:
        """Run ``point``'s plan (a :func:`pareto` point, for the same model and shapes) from the next call on."""
        self.sublinear_backend.use(point)
        return self

    def extra_repr(self) -> str:
        return f"{type(self.original_module).__name__}, {len(self.sublinear_backend.graphs)} captured graph(s)"

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not (self.training and torch.is_grad_enabled()) or torch.is_inference_mode_enabled():
            return self.original_module(*args, **kwargs)
        try:
            return _planned_call(self._run, *args, **kwargs)
        except Exception as exc:
            error = model_error(exc)  # the model's own error, found by running it eagerly: as eager raises it
            if error is None:
                raise
            raise error from None


@torch.compiler.disable
def _planned_call(run: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run a planned module's own compile. An outer ``torch.compile`` that reaches it stops its graph here (a graph
    break) and compiles the code around the module itself; the module's graphs are sublinear's, planned and compiled
    by sublinear's backend (``fullgraph=True`` cannot hold it: compile the code around the model instead)."""
    return run(*args, **kwargs)


def _examples(example_inputs: Sequence[Any] | Any) -> tuple:
    return tuple(example_inputs) if isinstance(example_inputs, (list, tuple)) else (example_inputs,)


def compile(module: nn.Module, example_inputs: Sequence[Any] | Any = None,
            example_kwargs: dict[str, Any] | None = None, config: SublinearMemoryConfig | None = None,
            plan: ParetoPoint | None = None) -> SublinearModule:
    """A module that trains like ``module`` with sublinear memory.

    With ``example_inputs``/``example_kwargs`` (real or meta tensors) every graph is planned now, on a data-less
    twin of the module, and ``.sublinear_plan`` says what was planned; otherwise planning happens at the first
    training call. Other shapes, optional arguments given or left out, and Python-level changes to the module
    are captured and planned again when they first occur. ``plan``: a :func:`pareto` point to run instead of
    searching.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"sublinear.compile needs an nn.Module, got {type(module).__name__}")
    if config is not None and not isinstance(config, SublinearMemoryConfig):
        raise TypeError(f"config must be a SublinearMemoryConfig, got {type(config).__name__}")
    if isinstance(module, (SublinearModule, DistributedDataParallel)):
        raise TypeError(f"compile the plain module, not a {type(module).__name__} (wrap the compiled module in "
                        "DistributedDataParallel afterwards)")
    compiled = SublinearModule(module, config)
    if plan is not None:
        compiled.use(plan)
    if example_inputs is not None or example_kwargs is not None:
        args = _examples(example_inputs) if example_inputs is not None else ()
        with ModelErrorsAsEager():
            plan_ahead(module, compiled.sublinear_backend, args, example_kwargs)
    return compiled


class _PlannedForward:
    """A module's ``forward`` replaced in place by :func:`apply`: training calls run through TorchDynamo and the
    sublinear backend, others run the class's forward. It shows the class forward's name, docstring and signature
    (Hugging Face's Trainer keeps only the dataset columns that signature names)."""

    def __init__(self, module: nn.Module, config: SublinearMemoryConfig) -> None:
        self._module = weakref.ref(module)
        self.config = config
        self.sublinear_backend = SublinearBackend(config)
        self._run: Callable[..., Any] | None = None
        functools.update_wrapper(self, type(module).forward, updated=())  # the function: no reference to module
        self.__signature__ = inspect.signature(type(module).forward.__get__(module))

    def __reduce__(self):
        return (_PlannedForward, (self._module(), self.config))

    @property
    def sublinear_plan(self) -> SublinearPlan | None:
        return self.sublinear_backend.sublinear_plan

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self._module()
        if not (module.training and torch.is_grad_enabled()) or torch.is_inference_mode_enabled():
            return type(module).forward(module, *args, **kwargs)
        try:
            return _planned_call(self._planned_run, *args, **kwargs)
        except Exception as exc:
            error = model_error(exc)  # the model's own error, found by running it eagerly: as eager raises it
            if error is None:
                raise
            raise error from None

    def _planned_run(self, *args: Any, **kwargs: Any) -> Any:
        if self._run is None:
            module = self._module()
            self._run = compile_module(type(module).forward.__get__(module), self.sublinear_backend,
                                       type(module).__name__, module)
        return self._run(*args, **kwargs)


def apply(module: nn.Module, config: SublinearMemoryConfig | None = None,
          example_inputs: Sequence[Any] | Any = None, example_kwargs: dict[str, Any] | None = None) -> nn.Module:
    """Make ``module`` itself train with sublinear memory: its ``forward`` is replaced in place, so every holder of
    the module (a Hugging Face ``Trainer``, a LightningModule, an optimizer, DDP) keeps using the same object, with
    the same class, parameters, state_dict and hooks. ``module.sublinear_plan`` describes what the latest training
    call ran (None before the first); ``sublinear.remove(module)`` restores the class's forward. Returns
    ``module``."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"sublinear.apply needs an nn.Module, got {type(module).__name__}")
    config = config or SublinearMemoryConfig()
    if not isinstance(config, SublinearMemoryConfig):
        raise TypeError(f"config must be a SublinearMemoryConfig, got {type(config).__name__}")
    if isinstance(module.__dict__.get("forward"), _PlannedForward):
        raise ValueError(f"sublinear.apply was already called on this {type(module).__name__}")
    refuse_nested_fsdp(module)
    planned = _PlannedForward(module, config)
    owner = weakref.ref(module)
    planned.sublinear_backend.on_plan = lambda plan: _set_plan(owner(), plan)
    _set_plan(module, None)
    if example_inputs is not None or example_kwargs is not None:
        args = _examples(example_inputs) if example_inputs is not None else ()
        with ModelErrorsAsEager():
            plan_ahead(module, planned.sublinear_backend, args, example_kwargs)
    module.forward = planned
    return module


def _set_plan(module: nn.Module | None, plan: SublinearPlan | None) -> None:
    if module is not None:
        module.__dict__["sublinear_plan"] = plan


def remove(module: nn.Module) -> nn.Module:
    """Undo :func:`apply`."""
    if isinstance(module.__dict__.get("forward"), _PlannedForward):
        del module.__dict__["forward"]
        module.__dict__.pop("sublinear_plan", None)
    return module


# ---------------------------------------------------------------------------------------------------------------
# The train-function decorator


def trace(fn: Callable | None = None, *, sublinear_memory_config: SublinearMemoryConfig | None = None) -> Callable:
    """Decorate a train function: every ``nn.Module`` it receives (positionally or by keyword; bare, inside
    ``DistributedDataParallel``, or in a list, tuple or dict) runs through a :class:`SublinearModule` for the call.
    On a method (``training_step(self, batch)``), ``self``'s direct submodules run planned instead, so
    ``self.net(x)`` and ``self(x)`` are both planned. Which modules were wrapped is logged once at INFO (a WARNING
    when there is none). The user's modules are left as they were; return values and exceptions pass through.
    ``decorated.sublinear_plan`` describes what the latest call ran (every planned module's graphs);
    ``decorated.sublinear_modules`` maps each module to the :class:`SublinearModule` that runs it."""
    if fn is None:
        return functools.partial(trace, sublinear_memory_config=sublinear_memory_config)
    if not callable(fn):
        raise TypeError(f"sublinear.trace decorates a function, got {type(fn).__name__}")
    config = sublinear_memory_config or SublinearMemoryConfig()
    if not isinstance(config, SublinearMemoryConfig):
        raise TypeError(f"sublinear_memory_config must be a SublinearMemoryConfig, got {type(config).__name__}")
    compiled: weakref.WeakKeyDictionary[nn.Module, SublinearModule] = weakref.WeakKeyDictionary()
    params = list(inspect.signature(fn).parameters)
    is_method = bool(params) and params[0] == "self"
    reported: list[bool] = []

    def compiled_for(module: nn.Module) -> SublinearModule:
        if module not in compiled:
            compiled[module] = SublinearModule(module, config)
        return compiled[module]

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        wrapped: list[str] = []
        used: list[SublinearModule] = []
        with contextlib.ExitStack() as restore:
            def swap(value: Any, name: str) -> Any:
                if isinstance(value, DistributedDataParallel):
                    # DDP keeps its hooks and reducer; only the module it forwards to is the compiled one.
                    inner = value._modules["module"]
                    value._modules["module"] = compiled_for(inner)
                    used.append(value._modules["module"])
                    restore.callback(value._modules.__setitem__, "module", inner)
                    wrapped.append(f"{name} (inside DistributedDataParallel)")
                    return value
                if isinstance(value, nn.Module) and not isinstance(value, SublinearModule):
                    wrapped.append(f"{name} ({type(value).__name__})")
                    used.append(compiled_for(value))
                    return used[-1]
                return value

            args = list(args)
            start = 0
            if is_method and args and isinstance(args[0], nn.Module):
                owner, start = args[0], 1
                for child_name, child in list(owner._modules.items()):
                    if child is not None and not isinstance(child, SublinearModule):
                        owner._modules[child_name] = swap(child, f"self.{child_name}")
                        restore.callback(owner._modules.__setitem__, child_name, child)
            for k in range(start, len(args)):
                args[k] = tree_map(lambda v, k=k: swap(v, params[k] if k < len(params) else f"argument {k}"),
                                   args[k], is_leaf=lambda v: isinstance(v, nn.Module))
            kwargs = {k: tree_map(lambda v, k=k: swap(v, k), v, is_leaf=lambda v: isinstance(v, nn.Module))
                      for k, v in kwargs.items()}
            if not reported:
                reported.append(True)
                if wrapped:
                    log.info("sublinear.trace(%s): planning %s", getattr(fn, "__qualname__", fn), ", ".join(wrapped))
                else:
                    log.warning("sublinear.trace(%s): no nn.Module among its arguments (nor, on a method, among "
                                "self's submodules), so nothing is planned: pass the model as an argument",
                                getattr(fn, "__qualname__", fn))
            try:
                return fn(*args, **kwargs)
            finally:
                wrapper.sublinear_plan = _joined([m.sublinear_plan for m in used])

    wrapper.sublinear_modules = compiled
    wrapper.sublinear_plan = None
    return wrapper


def _joined(plans: Sequence[SublinearPlan | None]) -> SublinearPlan | None:
    """One description of a call that ran several planned modules: their graphs in order, and their breaks."""
    plans = [p for p in plans if p is not None]
    if len(plans) <= 1:
        return plans[0] if plans else None
    graphs = [g for p in plans for g in p.graphs]
    return SublinearPlan(tuple(dataclasses.replace(g, graph=k) for k, g in enumerate(graphs)),
                         tuple(b for p in plans for b in p.breaks), sum(p.runs for p in plans))


# ---------------------------------------------------------------------------------------------------------------
# Trade-offs

def pareto(module: nn.Module, example_inputs: Sequence[Any] | Any = (), example_kwargs: dict[str, Any] | None = None,
           config: SublinearMemoryConfig | None = None, budgets: int = 8) -> list[ParetoPoint]:
    """The non-dominated (predicted peak, predicted step time) plans found for ``module`` at the example inputs.

    The graph is the one a module compiled with ``config`` runs (its attentions fused and LM heads chunked as the
    config says), so that ``use`` applies a point to it. One grid search (and its keep variants), then the least-time
    plan for ``budgets`` memory budgets spread between the lowest peak found and eager, each refined by the genetic
    search when ``config.genetic_nr_iter`` > 0 and seeded with every candidate so far. Sorted by increasing peak,
    hence decreasing time.
    """
    config = dataclasses.replace(config or SublinearMemoryConfig(), max_time_ratio=math.inf)
    graph = rewritten(capture(module, _examples(example_inputs), example_kwargs).graph, config)
    profile_ = profile(graph, cost_model=config.cost_model)
    first = make_plan(profile_, config, memory_budget=None)
    found = {c.plan: c for c in first.candidates}
    later = dataclasses.replace(config, planners=tuple(p for p in config.planners if p != "grid"))
    low, high = first.simulation.peak_bytes, first.baseline.peak_bytes
    for k in range(1, budgets + 1):
        budget = int(low + (high - low) * k / (budgets + 1))
        try:
            result = make_plan(profile_, later, memory_budget=budget, pool=list(found.values()))
        except BudgetError:
            continue
        for c in result.candidates:
            found.setdefault(c.plan, c)
    return [ParetoPoint(c.plan, c.simulation.peak_bytes, c.simulation.recompute_flops,
                        ratio_over(c.simulation.recompute_flops, profile_.step_flops), c.simulation.time_ratio,
                        graph.code)
            for c in pareto_front(found.values())]

