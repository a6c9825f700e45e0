"""Modules through the backend: :func:`compile_module` runs a module's forward under TorchDynamo with call
boundaries, and :func:`plan_ahead` plans a module's graphs on a data-less twin before training."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch._dynamo.exc import TorchDynamoException
from torch.utils._python_dispatch import _disable_current_modes, any_torch_dispatch_mode_on_stack

from sublinear.capture.dynamo import (CaptureError, NeedsData, capture, capture_error, compile_entry,
                      eager_or_model_error, graph_breaks, input_signature, receiving)
from sublinear.config import SublinearMemoryConfig
from sublinear.core.objective import Candidate
from sublinear.planners import BudgetError
from sublinear.planners.driver import step_floor
from sublinear.sharding import refuse_nested_fsdp
from sublinear.tensors import device_of
from sublinear.runtime.session import SublinearBackend, collecting_new_objects_only
from sublinear.runtime.step import GraphRun

log = logging.getLogger("sublinear")


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
            if session.first_time("dispatch mode"):
                log.warning("sublinear: %s ran under a TorchDispatchMode (such as FlopCounterMode or MemTracker) "
                            "that TorchDynamo cannot compile under: this call runs the original forward, unplanned",
                            name)
            return module(*args, **kwargs)
        if session.uncapturable and input_signature(args, kwargs) in session.uncapturable:
            return module(*args, **kwargs)
        mark_max_sizes(session.config, session.positional_names, args, kwargs)
        session.ran_graph = False
        session.calls.explicit = True
        if not session.graphs:  # the first call captures and plans: its progress counts from here
            session.progress.begin()
            session.prepare_compiler(device_of((args, kwargs)).type)
            if not session.latest and _has_budget(session.config, args, kwargs):
                # Under a budget the call's graphs are planned together, on a data-less twin, before the first of
                # them runs: planned one by one as they run, the first ones would not know the later ones.
                try:
                    plan_ahead(owner, session, args, kwargs)
                except CaptureError as exc:
                    log.warning("sublinear: %s could not be planned ahead on a data-less copy (%s); its graphs are "
                                "planned one by one as they run, so the first call may exceed the budget", name, exc)
        session.begin_call((args, kwargs))
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
        if not session.ran_graph and session.first_time("unplanned"):
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
    runtimes = [backend_.add_graph(graph) for graph in captured.graphs]
    backend_.calls.ahead = True  # what these calls show of the outputs' uses is a guess the real calls replace
    try:
        for _round in range(PLAN_AHEAD_ROUNDS):
            backend_.begin_call()
            for runtime in runtimes:
                run = GraphRun.of(runtime, runtime.variant_for(runtime.graph.example_values, dry_run=True),
                                  runtime.graph.example_values)
                run.record(runtime.graph.example_outputs)
                backend_.calls.record(run)
            if not backend_.finish_call(captured.returned):
                break
    finally:
        backend_.calls.ahead = False
    backend_.note_breaks(captured.breaks)
    backend_.say_breaks(type(module).__name__)
    # A graph still taking its lowest peak (its outputs' uses only guessed) is planned again by the real calls.
    unfit = [v for v in backend_.latest.values() if not v.accepted and not v.settling]
    if unfit:  # the graphs were planned for each other and the step still misses the budget
        worst = max(unfit, key=lambda v: v.simulation.peak_bytes)
        raise BudgetError(worst.objective, Candidate(worst.plan, worst.simulation), None,
                          floor=step_floor(worst.profile))
    backend_.forget_graphs()  # the real calls capture their own graphs; the plans wait in the store
